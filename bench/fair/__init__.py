"""The fairness experiment: noisy neighbours in one tier, FIFO against fair release, with a
scheduler failover and a weighted case (`python -m bench.fair.experiment`)."""
