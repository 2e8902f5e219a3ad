"""Hugging Face `generate` served by the paged engine, as a drop-in.

    attach(model, tokenizer=tok, block_size=16, kv_cache_memory="512MiB")   # engine options as in LLM(...)
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=40)
    for event in model.generate_stream(**inputs, max_new_tokens=40): ...   # TokenEvents, no thread
    detach(model)                                                            # original generate back, KV freed

    model = PagedModelForCausalLM.from_pretrained("smollm2", kv_cache_memory="256MiB")  # load + attach

One `LLMEngine` per attached model, reused by every call; a call adds one request per prompt row and
steps them together (continuous batching). Arguments resolve exactly as in transformers; anything the
engine cannot reproduce raises a ValueError naming it. See docs/hf.md.
"""

from __future__ import annotations

import gc
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import torch

from paged_backend import LLMEngine

from .hf_config import (UNSUPPORTED_GENERATE_ARGS, ResolvedConfig, check_supported, prepare_lengths,
                        resolve_generation_config, sampling_params, special_tokens)
from .hf_inputs import prepare_prompts
from .hf_outputs import UNMATCHED_ROWS_WARNING, OutputOptions
from .hf_runner import BeamRun, Plan, SamplingRun
from .hf_streaming import GenerationStream, TokenEvent

__all__ = ["attach", "detach", "is_attached", "PagedModelForCausalLM", "GenerationStream", "TokenEvent"]

_STATE = "_paged_backend_attachment"
_SUPPORTED_MODES = ("greedy_search", "sample", "beam_search")


class _Attachment:
    """The engine of one attached model and the lock that serializes its generate calls."""

    def __init__(self, engine: LLMEngine, tokenizer) -> None:
        self.engine: Optional[LLMEngine] = engine
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._owner: Optional[int] = None

    @contextmanager
    def guard(self) -> Iterator[LLMEngine]:
        if self._owner == threading.get_ident():
            raise RuntimeError("a generate call on this model is still running in this thread (an unfinished "
                               "generate_stream?): exhaust or close() it first")
        with self._lock:
            if self.engine is None:
                raise RuntimeError("the model was detached from the paged backend")
            self._owner = threading.get_ident()
            try:
                yield self.engine
            finally:
                self._owner = None


def _attachment(model) -> _Attachment:
    state = model.__dict__.get(_STATE)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not attached to the paged backend: call attach(model) first")
    return state


def is_attached(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get(_STATE), _Attachment)


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
    engine = LLMEngine(model, tokenizer=tokenizer, **engine_options)
    state = _Attachment(engine, tokenizer)
    model.__dict__[_STATE] = state
    model.__dict__["paged_engine"] = engine
    model.__dict__["generate"] = _bind(model, _generate)
    model.__dict__["generate_stream"] = _bind(model, _generate_stream)
    return model


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Restore transformers' own generate and release the engine and its KV cache."""
    state = _attachment(model)
    with state.guard() as engine:
        state.engine = None
        for name in (_STATE, "paged_engine", "generate", "generate_stream"):
            model.__dict__.pop(name, None)
        engine.shutdown()
    del engine, state
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


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

        from paged_backend.loader import PRESETS, load_model

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


# ---- one call ----------------------------------------------------------------------------------------
def _refuse_unsupported_arguments(kwargs: Dict[str, Any], logits_processor, stopping_criteria) -> None:
    given = [name for name in UNSUPPORTED_GENERATE_ARGS
             if kwargs.get(name) is not None and not (name == "synced_gpus" and kwargs[name] is False)]
    if given:
        raise ValueError(f"the paged backend does not support these generate arguments: {', '.join(given)}")
    for name in UNSUPPORTED_GENERATE_ARGS:
        kwargs.pop(name, None)
    if logits_processor is not None and len(logits_processor) > 0:
        raise ValueError("custom logits_processor is not supported by the paged backend: its sampler runs "
                         "batched inside the engine; use the equivalent generate arguments instead")
    if stopping_criteria is not None:
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        for criterion in stopping_criteria:
            if isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
                raise ValueError(f"pass max_length / max_new_tokens / eos_token_id instead of a "
                                 f"{type(criterion).__name__} in stopping_criteria")
            if not callable(criterion):
                raise ValueError(f"stopping_criteria items must be callables, got {type(criterion).__name__}")


def _criteria(resolved: ResolvedConfig, user_criteria, tokenizer):
    """Stop strings, max_time and the user's criteria, merged as transformers merges them (a user criterion
    replaces a default one of the same type); None when there is nothing to run."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList, StopStringCriteria

    config = resolved.config
    defaults = StoppingCriteriaList()
    if config.max_time is not None:
        defaults.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("There are one or more stop strings, either in the arguments to `generate` or in the "
                             "model's generation config, but we could not locate a tokenizer. When generating with "
                             "stop strings, you must pass the model's tokenizer to the `tokenizer` argument of "
                             "`generate`.")
        defaults.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    custom = list(user_criteria or [])
    merged = StoppingCriteriaList()
    for default in defaults:
        merged.append(next((c for c in custom if type(c) is type(default)), default))
    for criterion in custom:
        if criterion not in merged:
            merged.append(criterion)
    return merged if len(merged) else None


def _plan(model, state: _Attachment, inputs, generation_config, logits_processor, stopping_criteria, streamer,
          kwargs: Dict[str, Any]) -> Plan:
    kwargs = dict(kwargs)
    _refuse_unsupported_arguments(kwargs, logits_processor, stopping_criteria)
    tokenizer = kwargs.pop("tokenizer", None)
    tokenizer = state.tokenizer if tokenizer is None else tokenizer
    resolved = resolve_generation_config(model, generation_config, kwargs)
    check_supported(resolved)
    config = resolved.config
    mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
    if mode not in _SUPPORTED_MODES:
        raise ValueError(f"generation mode {mode!r} is not supported by the paged backend "
                         f"(supported: greedy search, sampling, beam search)")
    if resolved.use_beam_search:
        if streamer is not None:
            raise ValueError("`streamer` cannot be used with beam search (yet!). Make sure that `num_beams` is set to 1.")
        if config.stop_strings is not None or config.max_time is not None or (stopping_criteria and len(stopping_criteria)):
            raise ValueError("stop_strings, max_time and stopping_criteria are not supported with beam search "
                             "by the paged backend")
    eos_ids, pad_id = special_tokens(config)
    batch = prepare_prompts(inputs, resolved.model_kwargs, config, eos_ids, pad_id)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    prepare_lengths(resolved, batch.padded_len, getattr(text_config, "max_position_embeddings", None))
    engine = state.engine
    max_tokens = config.max_length - batch.padded_len
    for row, prompt in enumerate(batch.prompts):
        if len(prompt) + max_tokens > engine.max_model_len:
            raise ValueError(f"row {row}: {len(prompt)} prompt tokens + {max_tokens} new tokens exceed the engine's "
                             f"context of {engine.max_model_len} tokens (max_model_len)")
    options = OutputOptions(bool(config.return_dict_in_generate), bool(config.output_scores),
                            bool(config.output_logits))
    base_seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if config.do_sample is True else None
    params = [sampling_params(resolved, batch.padded_len, eos_ids, None if base_seed is None else base_seed + b,
                              options.records) for b in range(batch.batch_size)]
    criteria = None if resolved.use_beam_search else _criteria(resolved, stopping_criteria, tokenizer)
    return Plan(batch, params, resolved.num_return_sequences, config.num_beams or 1, eos_ids, pad_id, options,
                criteria)


def _generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
              stopping_criteria=None, streamer=None, **kwargs):
    """transformers' `generate`, served by the paged engine (same arguments, same outputs; see docs/hf.md)."""
    state = _attachment(model)
    plan = _plan(model, state, inputs, generation_config, logits_processor, stopping_criteria, streamer, kwargs)
    if plan.num_beams > 1:
        with state.guard() as engine:
            run = BeamRun(engine, plan)
            output = run.run()
    else:
        run = GenerationStream(SamplingRun(state.engine, plan), streamer, state.tokenizer, state.guard)
        output = run.finish()
    if run.filled_rows and plan.options.records:
        warnings.warn(UNMATCHED_ROWS_WARNING, UserWarning, stacklevel=3)
    return output


def _generate_stream(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
                     stopping_criteria=None, streamer=None, **kwargs) -> GenerationStream:
    """Like `generate`, but returns a `GenerationStream`: iterate it for one `TokenEvent` per new token of
    every row (no thread needed); afterwards `stream.output` is what `generate` returns."""
    state = _attachment(model)
    plan = _plan(model, state, inputs, generation_config, logits_processor, stopping_criteria, streamer, kwargs)
    if plan.num_beams > 1:
        raise ValueError("generate_stream does not support beam search: beams are only final at the end")
    return GenerationStream(SamplingRun(state.engine, plan), streamer, state.tokenizer, state.guard)
