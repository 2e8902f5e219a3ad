"""Hugging Face `generate` served by the paged engine, as a drop-in.

    attach(model, tokenizer=tok, block_size=16, kv_cache_memory="512MiB")   # engine options as in LLM(...)
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=40)
    for event in model.generate_stream(**inputs, max_new_tokens=40): ...   # TokenEvents, no thread
    detach(model)                                                            # original generate back, KV freed

    model = PagedModelForCausalLM.from_pretrained("smollm2", kv_cache_memory="256MiB")  # load + attach

One `LLMEngine` per attached model, reused by every call; a call adds one request per prompt row and
steps them together (continuous batching). Arguments resolve exactly as in transformers; anything the
engine cannot reproduce raises a ValueError naming it. See docs/hf.md.

Files: `attach.py` (attach, detach, PagedModelForCausalLM), `attachment.py` (an attached model's state),
`generate.py` (one call), `generation_config.py` (transformers' arguments -> vLLM's parameter names ->
SamplingParams), `prompts.py`, `runner.py` (the engine loop in transformers' lockstep view), `outputs.py`
(transformers' output classes), `streaming.py` (`generate_stream`, streamers).
"""

from .attach import PagedModelForCausalLM, attach, detach
from .attachment import is_attached
from .streaming import GenerationStream, TokenEvent

__all__ = ["attach", "detach", "is_attached", "PagedModelForCausalLM", "GenerationStream", "TokenEvent"]
