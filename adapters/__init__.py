"""Framework adapters over the public engine API: Hugging Face generate, HTTP (TGI/OpenAI), Triton."""
