"""One `generate` / `generate_stream` call of an attached model: refuse what the engine cannot reproduce,
resolve the arguments as transformers does, and run the prompt rows through the engine."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch

from .attachment import Attachment, attachment_of
from .generation_config import (UNSUPPORTED_GENERATE_ARGS, ResolvedConfig, check_supported, prepare_lengths,
                                resolve_generation_config, sampling_params, special_tokens)
from .logits_processing import (TransformersRowProcessors, asks_for_processors, check_user_processors,
                                row_processor_list)
from .outputs import UNMATCHED_ROWS_WARNING, OutputOptions
from .prompts import prepare_prompts
from .runner import BeamRun, Plan, SamplingRun
from .streaming import GenerationStream

_SUPPORTED_MODES = ("greedy_search", "sample", "beam_search")


# ---- one call ----------------------------------------------------------------------------------------
def _refuse_unsupported_arguments(kwargs: Dict[str, Any], logits_processor, prefix_allowed_tokens_fn,
                                  stopping_criteria) -> None:
    given = [name for name in UNSUPPORTED_GENERATE_ARGS
             if kwargs.get(name) is not None and not (name == "synced_gpus" and kwargs[name] is False)]
    if given:
        raise ValueError(f"the paged backend does not support these generate arguments: {', '.join(given)}")
    for name in UNSUPPORTED_GENERATE_ARGS:
        kwargs.pop(name, None)
    check_user_processors(logits_processor)
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise ValueError(f"prefix_allowed_tokens_fn must be a callable (batch_id, input_ids) -> allowed token ids, "
                         f"got {type(prefix_allowed_tokens_fn).__name__}")
    if stopping_criteria is not None:
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        for criterion in stopping_criteria:
            if isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
                raise ValueError(f"pass max_length / max_new_tokens / eos_token_id instead of a "
                                 f"{type(criterion).__name__} in stopping_criteria")
            if not callable(criterion):
                raise ValueError(f"stopping_criteria items must be callables, got {type(criterion).__name__}")


def speculative_config(config, assistant_model) -> Optional[Dict[str, Any]]:
    """transformers' assisted generation as the engine's speculative decoding (vLLM's `speculative_config`):
    `prompt_lookup_num_tokens=N` is prompt lookup of N tokens with n-grams of up to `max_matching_ngram_size`
    (transformers' default 2), `assistant_model=draft` a draft model proposing `num_assistant_tokens` tokens;
    None when the call asks for neither."""
    lookup = config.prompt_lookup_num_tokens
    if lookup is not None and assistant_model is not None:
        raise ValueError("give either prompt_lookup_num_tokens or assistant_model, not both")
    if lookup is not None:
        return {"method": "ngram", "num_speculative_tokens": int(lookup), "prompt_lookup_min": 1,
                "prompt_lookup_max": int(config.max_matching_ngram_size or 2)}
    if assistant_model is not None:
        if not isinstance(assistant_model, torch.nn.Module):
            raise ValueError(f"assistant_model must be a model, got {type(assistant_model).__name__}")
        return {"method": "draft_model", "model": assistant_model,
                "num_speculative_tokens": int(config.num_assistant_tokens or 20)}
    return None


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


def _row_processors(resolved: ResolvedConfig, batch, eos_ids, logits_processor, prefix_allowed_tokens_fn,
                    device) -> List[Optional[list]]:
    """Per prompt row, the engine logits processor running transformers' list (None when the call needs none)."""
    if not asks_for_processors(resolved.config, logits_processor, prefix_allowed_tokens_fn):
        return [None] * batch.batch_size
    rows = []
    for b, prompt in enumerate(batch.prompts):
        padding = batch.padded_len - len(prompt)
        processors = row_processor_list(resolved.config, b, batch.padded_len, padding, eos_ids, logits_processor,
                                        prefix_allowed_tokens_fn, device)
        rows.append([TransformersRowProcessors(processors, batch.input_ids[b].tolist())])
    return rows


def _plan(model, state: Attachment, inputs, generation_config, logits_processor, stopping_criteria,
          prefix_allowed_tokens_fn, streamer, kwargs: Dict[str, Any]) -> Plan:
    kwargs = dict(kwargs)
    assistant_model = kwargs.pop("assistant_model", None)
    _refuse_unsupported_arguments(kwargs, logits_processor, prefix_allowed_tokens_fn, stopping_criteria)
    tokenizer = kwargs.pop("tokenizer", None)
    tokenizer = state.tokenizer if tokenizer is None else tokenizer
    resolved = resolve_generation_config(model, generation_config, kwargs)
    speculation = speculative_config(resolved.config, assistant_model)
    resolved.config.prompt_lookup_num_tokens = None   # assisted generation is the engine's speculation here
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
    engine = state.running_engine()
    max_tokens = config.max_length - batch.padded_len
    for row, prompt in enumerate(batch.prompts):
        if len(prompt) + max_tokens > engine.max_model_len:
            raise ValueError(f"row {row}: {len(prompt)} prompt tokens + {max_tokens} new tokens exceed the engine's "
                             f"context of {engine.max_model_len} tokens (max_model_len)")
    options = OutputOptions(bool(config.return_dict_in_generate), bool(config.output_scores),
                            bool(config.output_logits))
    base_seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if config.do_sample is True else None
    processors = _row_processors(resolved, batch, eos_ids, logits_processor, prefix_allowed_tokens_fn, engine.device)
    params = [sampling_params(resolved, batch.padded_len, eos_ids, None if base_seed is None else base_seed + b,
                              options.records, processors[b]) for b in range(batch.batch_size)]
    criteria = None if resolved.use_beam_search else _criteria(resolved, stopping_criteria, tokenizer)
    return Plan(batch, params, resolved.num_return_sequences, config.num_beams or 1, eos_ids, pad_id, options,
                criteria, speculation)


def generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
             stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None,
             streamer=None, **kwargs):
    """transformers' `generate`, served by the paged engine (same arguments, in transformers' order, same
    outputs; see docs/hf.md)."""
    state = attachment_of(model)
    kwargs.update(synced_gpus=synced_gpus, assistant_model=assistant_model)
    plan = _plan(model, state, inputs, generation_config, logits_processor, stopping_criteria,
                 prefix_allowed_tokens_fn, streamer, kwargs)
    if plan.num_beams > 1:
        with state.session() as session:
            run = BeamRun(plan)
            output = run.run(session)
    else:
        run = GenerationStream(SamplingRun(plan), streamer, state.tokenizer,
                               lambda: state.session(plan.speculation))
        output = run.finish()
    if run.filled_rows and plan.options.records:
        warnings.warn(UNMATCHED_ROWS_WARNING, UserWarning, stacklevel=3)
    return output


def generate_stream(model, inputs: Optional[torch.Tensor] = None, generation_config=None, logits_processor=None,
                    stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None,
                    streamer=None, **kwargs) -> GenerationStream:
    """Like `generate`, but returns a `GenerationStream`: iterate it for one `TokenEvent` per new token of
    every row (no thread needed); afterwards `stream.output` is what `generate` returns."""
    state = attachment_of(model)
    kwargs.update(synced_gpus=synced_gpus, assistant_model=assistant_model)
    plan = _plan(model, state, inputs, generation_config, logits_processor, stopping_criteria,
                 prefix_allowed_tokens_fn, streamer, kwargs)
    if plan.num_beams > 1:
        raise ValueError("generate_stream does not support beam search: beams are only final at the end")
    return GenerationStream(SamplingRun(plan), streamer, state.tokenizer, lambda: state.session(plan.speculation))
