"""Micro-benchmarks and profilers: engine overhead, step profile, attention and sampler on the CPU, busy threads,
recompute policies, the cost of structured outputs, the HF drop-in's speed."""
