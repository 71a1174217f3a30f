"""The performance benchmarks: what a gateway adds (`gateway_overhead`, `latency`), how gateways
scale on one Redis (`scale`, `redis_cost`), token estimation (`estimator`, `tokens`), scheduler
releases (`scheduler_release`, `release`), memory (`memory`, `queue_memory`), the admission core
alone (`core`) and client retry storms (`retry_storm`); `performance` runs the suite's sections
and writes one report."""
