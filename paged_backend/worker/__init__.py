"""The device side: step inputs, model runner, attention, KV cache, model loading and support checks, tensor
parallelism. Nothing here imports the engine, the scheduler or a front."""
