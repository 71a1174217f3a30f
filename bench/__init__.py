"""The lab (not shipped): `sim` simulates vLLM nodes, `burst` runs the burst experiment, `perf`
runs the performance benchmarks, `common` holds what they and the tests share."""
