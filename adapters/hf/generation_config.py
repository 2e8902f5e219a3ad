"""Resolve `generate(...)` arguments into a `GenerationConfig` exactly as transformers 5.x does, refuse
what the paged engine cannot reproduce, and derive the lengths and special tokens transformers would use.

Resolution order (transformers' `GenerationMixin._prepare_generation_config`): the `generation_config`
argument (or an empty one), then the model's `generation_config` for fields still unset, then
transformers' global defaults (`max_length=20`, `top_k=50`, ...), then the keyword arguments.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from transformers import GenerationConfig

# transformers' defaults for fields left unset everywhere (GenerationConfig._get_default_generation_params, 5.x);
# used only if that private helper ever disappears.
_GLOBAL_DEFAULTS: Dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "use_cache": True, "early_stopping": False,
    "num_beams": 1, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
    "num_return_sequences": 1, "output_scores": False, "return_dict_in_generate": False,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4, "assistant_lookbehind": 10,
    "target_lookbehind": 10, "num_beam_groups": 1, "diversity_penalty": 0.0,
}

# `generate` parameters of transformers that the paged backend cannot honour (refused unless None / False).
UNSUPPORTED_GENERATE_ARGS = ("synced_gpus", "negative_prompt_ids",
                             "negative_prompt_attention_mask", "custom_generate", "assistant_tokenizer",
                             "trust_remote_code")
# Model inputs the adapter understands; any other model keyword argument is refused.
MODEL_INPUTS = ("input_ids", "attention_mask")


def _active(value, neutral=(None,)) -> bool:
    return not any(value is n or value == n for n in neutral)


# (field, when it changes what transformers generates) for GenerationConfig features the engine lacks.
_UNSUPPORTED_FIELDS = (
    ("guidance_scale", lambda c: _active(c.guidance_scale, (None, 1, 1.0))),
    ("encoder_repetition_penalty", lambda c: _active(c.encoder_repetition_penalty, (None, 1.0))),
    ("encoder_no_repeat_ngram_size", lambda c: bool(c.encoder_no_repeat_ngram_size)),
    ("forced_bos_token_id", lambda c: c.forced_bos_token_id is not None),
    ("forced_eos_token_id", lambda c: c.forced_eos_token_id is not None),
    ("remove_invalid_values", lambda c: c.remove_invalid_values is True),
    ("exponential_decay_length_penalty", lambda c: c.exponential_decay_length_penalty is not None),
    ("renormalize_logits", lambda c: c.renormalize_logits is True),
    ("watermarking_config", lambda c: c.watermarking_config is not None),
    ("top_h", lambda c: c.do_sample is True and c.top_h is not None),
    ("typical_p", lambda c: c.do_sample is True and c.typical_p is not None and c.typical_p < 1.0),
    ("epsilon_cutoff", lambda c: c.do_sample is True and c.epsilon_cutoff is not None and 0 < c.epsilon_cutoff < 1),
    ("eta_cutoff", lambda c: c.do_sample is True and c.eta_cutoff is not None and 0 < c.eta_cutoff < 1),
    ("constraints", lambda c: c.constraints is not None),
    ("force_words_ids", lambda c: c.force_words_ids is not None),
    ("num_beam_groups", lambda c: _active(c.num_beam_groups, (None, 1))),
    ("diversity_penalty", lambda c: _active(c.diversity_penalty, (None, 0, 0.0))),
    ("penalty_alpha", lambda c: _active(c.penalty_alpha, (None, 0, 0.0))),
    ("dola_layers", lambda c: c.dola_layers is not None),
    ("low_memory", lambda c: c.low_memory is True),
    ("token_healing", lambda c: c.token_healing is True),
    ("assistant_early_exit", lambda c: c.assistant_early_exit is not None),
    ("use_mtp", lambda c: bool(c.use_mtp)),
    ("is_assistant", lambda c: c.is_assistant is True),
    ("output_attentions", lambda c: c.output_attentions is True),
    ("output_hidden_states", lambda c: c.output_hidden_states is True),
)


@dataclass
class ResolvedConfig:
    """A resolved generation config plus what transformers derives from it before decoding."""

    config: GenerationConfig
    model_kwargs: Dict[str, Any]
    has_default_max_length: bool
    has_default_min_length: bool

    @property
    def use_beam_search(self) -> bool:
        return (self.config.num_beams or 1) > 1

    @property
    def num_return_sequences(self) -> int:
        return self.config.num_return_sequences or 1


def _global_defaults() -> Dict[str, Any]:
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(getter()) if getter is not None else dict(_GLOBAL_DEFAULTS)


def resolve_generation_config(model, generation_config: Optional[GenerationConfig],
                              kwargs: Dict[str, Any]) -> ResolvedConfig:
    """The config transformers' `generate` would run with (before its length preparation) and the
    leftover model keyword arguments."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, "
                         f"got {type(generation_config).__name__}")
    model_config = model.generation_config
    has_default_max_length = (kwargs.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model_config.max_length is None)
    has_default_min_length = (kwargs.get("min_length") is None
                              and (generation_config is None or generation_config.min_length is None)
                              and model_config.min_length is None)
    if generation_config is None:
        legacy = getattr(model.config, "_get_generation_parameters", lambda: {})()
        if legacy:
            raise ValueError("You have modified the pretrained model configuration to control generation; this is "
                             f"not supported anymore (found {legacy}). Use `model.generation_config` instead.")
        generation_config = GenerationConfig()
    config = copy.deepcopy(generation_config)
    config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**_global_defaults(), defaults_only=True)
    model_kwargs = config.update(**kwargs)
    if config.cache_implementation == "hybrid":
        config.cache_implementation = None
    return ResolvedConfig(config, model_kwargs, has_default_max_length, has_default_min_length)


def check_supported(resolved: ResolvedConfig) -> None:
    """ValueError naming every requested feature the paged engine cannot reproduce."""
    config = resolved.config
    unsupported = [name for name, active in _UNSUPPORTED_FIELDS if active(config)]
    if unsupported:
        raise ValueError(f"the paged backend does not support these generation options: {', '.join(unsupported)}")
    extra = sorted(k for k, v in resolved.model_kwargs.items() if v is not None and k not in MODEL_INPUTS)
    if extra:
        raise ValueError(f"the paged backend does not support these generate arguments: {', '.join(extra)} "
                         f"(model inputs other than {', '.join(MODEL_INPUTS)} and typos end up here)")
    if resolved.use_beam_search and config.do_sample is True:
        raise ValueError("beam sampling (num_beams > 1 with do_sample=True) is not supported by the paged backend")
    if config.do_sample is True and (config.temperature is None or not config.temperature > 0):
        raise ValueError(f"`temperature` (={config.temperature}) has to be a strictly positive float when "
                         f"do_sample=True, otherwise your next token scores will be invalid")
    if config.do_sample is True and config.top_p is not None and not 0.0 <= config.top_p <= 1.0:
        raise ValueError(f"`top_p` has to be a float >= 0 and <= 1, but is {config.top_p}")
    if config.do_sample is True and config.min_p is not None and not 0.0 <= config.min_p <= 1.0:
        raise ValueError(f"`min_p` has to be a float >= 0 and <= 1, but is {config.min_p}")
    if config.do_sample is True and config.top_k is not None and config.top_k < 0:
        raise ValueError(f"`top_k` has to be a non-negative integer, but is {config.top_k}")
    if config.repetition_penalty is not None and not config.repetition_penalty > 0:
        raise ValueError(f"`penalty` has to be a strictly positive float, but is {config.repetition_penalty}")


def special_tokens(config: GenerationConfig) -> Tuple[Optional[List[int]], Optional[int]]:
    """(eos ids or None, pad id or None) as transformers' `_prepare_special_tokens` resolves them."""
    eos = config.eos_token_id
    eos_ids = None if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    if eos_ids is not None and any(e < 0 for e in eos_ids):
        raise ValueError(f"eos_token_id must be non-negative token ids, got {eos}")
    pad = config.pad_token_id
    if pad is None and eos_ids:
        pad = eos_ids[0]
    return eos_ids, None if pad is None else int(pad)


def prepare_lengths(resolved: ResolvedConfig, input_len: int, max_position_embeddings: Optional[int]) -> None:
    """transformers' `_prepare_generated_length` and `_validate_generated_length`: make `max_length` and
    `min_length` absolute (they count the padded prompt) and refuse impossible ones."""
    config = resolved.config
    if config.max_new_tokens is not None:
        config.max_length = config.max_new_tokens + input_len
    elif resolved.has_default_max_length:
        config.max_length = config.max_length + input_len
        if max_position_embeddings is not None:
            config.max_length = min(config.max_length, max_position_embeddings)
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + input_len
    if resolved.has_default_max_length and config.max_new_tokens is None:
        warnings.warn(f"Using the model-agnostic default `max_length` (={config.max_length}) to control the "
                      f"generation length. We recommend setting `max_new_tokens` to control the maximum length "
                      f"of the generation.", UserWarning)
    if input_len >= config.max_length:
        raise ValueError(f"Input length of input_ids is {input_len}, but `max_length` is set to {config.max_length}. "
                         f"This can lead to unexpected behavior. You should consider increasing `max_length` or, "
                         f"better yet, setting `max_new_tokens`.")


def min_new_tokens(config: GenerationConfig, input_len: int, eos_ids: Optional[List[int]]) -> int:
    """Tokens during which EOS is masked: transformers' MinLength and MinNewTokens processors together."""
    if not eos_ids:
        return 0
    from_min_length = max(0, (config.min_length or 0) - input_len)
    return max(from_min_length, config.min_new_tokens or 0)


def sampling_params(resolved: ResolvedConfig, input_len: int, eos_ids: Optional[List[int]], seed: Optional[int],
                    output_scores: bool, logits_processors: Optional[List[Any]] = None):
    """The engine's `SamplingParams` for one prompt row, equivalent to transformers' processors and criteria:
    transformers' names translated onto vLLM's, read by the engine's one mapping (`request_params`).
    `logits_processors` (logits_processing.py) carry transformers' own processor list, repetition penalty
    and minimum lengths included, so the engine's are turned off for such a row."""
    from paged_backend import sampling_params_from_dict

    config = resolved.config
    max_tokens = config.max_length - input_len
    in_list = bool(logits_processors)
    values: Dict[str, Any] = dict(
        n=resolved.num_return_sequences, max_tokens=max_tokens,
        min_tokens=0 if in_list else min(min_new_tokens(config, input_len, eos_ids), max_tokens),
        repetition_penalty=1.0 if in_list else float(config.repetition_penalty or 1.0),
        stop_token_ids=list(eos_ids or []),
        ignore_eos=True,  # transformers' EOS ids are the stop_token_ids above
        detokenize=False)  # stop strings are matched on token ids, as transformers does
    if resolved.use_beam_search:
        values.update(temperature=0.0, beam_width=config.num_beams, length_penalty=float(config.length_penalty),
                      early_stopping=config.early_stopping)
    elif config.do_sample is not True:
        values.update(temperature=0.0)
    else:
        top_k = config.top_k or 0  # 0 disables top-k in both
        top_p = 1.0 if config.top_p is None else float(config.top_p)
        if top_p == 0.0:  # transformers keeps the single most likely token
            top_k, top_p = 1, 1.0
        values.update(temperature=float(config.temperature), top_k=top_k, top_p=top_p,
                      min_p=float(config.min_p or 0.0), seed=seed)
    return sampling_params_from_dict(values, output_scores=output_scores, logits_processors=logits_processors)
