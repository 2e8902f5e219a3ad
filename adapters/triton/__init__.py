"""NVIDIA Triton Inference Server Python-backend model over `AsyncLLMEngine`."""
