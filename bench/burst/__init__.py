"""The burst experiment: a planned workload (`workload`, `mixes`) played against simulated vLLM
nodes through each arm (no gateway, a FIFO limit, kvgate, vLLM's priority scheduling), judged on
the seven criteria (`criteria`, `goodput`) and written up (`report`, `plot`); `experiment` runs one
draw, `matrix` runs seeds x mixes x sizes, and `baseline_replay`, `capacity` and `frontier` replay
a schedule offline."""
