"""TGI- and OpenAI-compatible HTTP server over `AsyncLLMEngine` (`paged-backend serve`)."""
