"""The paper's measurements and their baselines: memory waste, throughput at equal KV memory, sharing, serving."""
