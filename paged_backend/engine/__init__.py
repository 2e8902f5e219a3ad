"""The engine loop: `LLMEngine`, `AsyncLLMEngine`, `LLM`, request intake, token processing, outputs, metrics."""
