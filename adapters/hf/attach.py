"""Attach the paged engine to a transformers model (`attach` / `detach`), or load and attach in one call
(`PagedModelForCausalLM.from_pretrained`): the model's `generate` then runs through the engine, and it
gains `generate_stream`.

What attaching adds lives in the model's instance `__dict__` and nowhere else, so `detach` restores the model
exactly; `training` flags are left as they were. An attached model stays copyable and picklable: its state
(`__getstate__`, which `copy`, `copy.deepcopy`, `pickle` and `torch.save` use) leaves the attachment out, so
a copy is the plain transformers model (attach it again to serve it).
"""

from __future__ import annotations

import gc

import torch

from paged_backend import LLMEngine

from .attachment import STATE, Attachment, attachment_of, is_attached, restore_training, training_flags
from .generate import generate, generate_stream

ATTACHED_NAMES = (STATE, "paged_engine", "generate", "generate_stream", "__getstate__")


def attach(model: torch.nn.Module, tokenizer=None, **engine_options) -> torch.nn.Module:
    """Serve `model.generate` (and add `model.generate_stream`) through a paged engine built for this model.
    `engine_options` are LLM(...)'s (block_size, num_blocks, kv_cache_memory, max_num_seqs, ...)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generation_config"):
        raise ValueError(f"attach needs a transformers model with a generation_config, got {type(model).__name__}")
    if is_attached(model):
        raise ValueError("this model is already attached to the paged backend; detach(model) first")
    for name in ("dtype", "device"):
        if name in engine_options:
            raise ValueError(f"{name!r} is not an attach option: the engine runs the model as it is "
                             f"(move or cast the model before attaching)")
    flags = training_flags(model)
    try:
        engine = LLMEngine(model, tokenizer=tokenizer, **engine_options)  # runs the model in eval mode
    finally:
        restore_training(flags)
    state = Attachment(model, engine, tokenizer)
    model.__dict__[STATE] = state
    model.__dict__["paged_engine"] = engine
    model.__dict__["generate"] = _bind(model, generate)
    model.__dict__["generate_stream"] = _bind(model, generate_stream)
    model.__dict__["__getstate__"] = _state_without_attachment(model)
    return model


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Restore transformers' own generate and release the engine and its KV cache (calls still running on it
    fail with an error)."""
    engine = attachment_of(model).detach()
    for name in ATTACHED_NAMES:
        model.__dict__.pop(name, None)
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


def _state_without_attachment(model: torch.nn.Module):
    """The model's own `__getstate__`, minus what attaching added (locks, the engine, bound methods)."""
    def state() -> dict:
        own = type(model).__getstate__(model)
        return {name: value for name, value in own.items() if name not in ATTACHED_NAMES}

    return state


def _bind(model, function):
    def bound(*args, **kwargs):
        return function(model, *args, **kwargs)

    bound.__name__ = function.__name__.lstrip("_")
    bound.__doc__ = function.__doc__
    return bound


class PagedModelForCausalLM:
    """A factory like transformers' Auto classes: returns the loaded transformers model, already attached."""

    @classmethod
    def from_pretrained(cls, path_or_preset: str, tokenizer=None, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", trust_remote_code: bool = False, **engine_options) -> torch.nn.Module:
        """Load a preset ("smollm2", "tiny-llama", ...) or a local Hugging Face directory (straight onto
        `device` through accelerate's device map), then `attach` it with `engine_options`. The tokenizer is
        `model.paged_engine.tokenizer`."""
        from pathlib import Path

        from paged_backend import PRESETS, load_model

        name = str(path_or_preset)
        if name in PRESETS or torch.device(device).type == "cpu" or not Path(name).is_dir():
            model, loaded_tokenizer = load_model(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=str(device),
                                                         local_files_only=True, trust_remote_code=trust_remote_code)
            loaded_tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True,
                                                             trust_remote_code=trust_remote_code)
        return attach(model.eval(), tokenizer=tokenizer if tokenizer is not None else loaded_tokenizer,
                      **engine_options)
