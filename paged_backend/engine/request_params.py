"""vLLM's sampling-parameter names -> `SamplingParams`: the one mapping every front uses.

The input is the dict that vLLM's `SamplingParams` and Triton's vllm_backend accept (`sampling_parameters`);
values may also be strings ("0.7", "16", "true", a JSON list) and None means the default. Every value is
read by its rule in `SAMPLING_PARAMETERS` and checked by `SamplingParams`, so the same input gets the same
result and the same error (an `InvalidParameter` naming the field) on every front. TGI's and transformers'
names are translated onto these by their fronts. A new parameter is one entry in the table.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping

from paged_backend.engine.coerce import to_bool, to_float, to_float_map, to_int, to_int_list, to_str_list
from paged_backend.errors import InvalidParameter, UnsupportedParameter
from paged_backend.sampling_params import SamplingParams
from paged_backend.structured.params import structured_outputs_from

Reader = Callable[[str, Any], Any]


def _logprobs(name: str, value: Any) -> Any:
    """vLLM takes a count; OpenAI chat sends a boolean (true: the chosen token's logprob only)."""
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false")):
        return 0 if to_bool(name, value) else None
    return to_int(name, value)


def _early_stopping(name: str, value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == "never":
        return "never"
    return to_bool(name, value)


def _structured(name: str, value: Any) -> Any:
    """A structured-output constraint: `StructuredOutputsParams`, or its fields as an object or a JSON string
    (Triton's vLLM backend sends `structured_outputs` as a string, `guided_decoding` as either)."""
    try:
        return structured_outputs_from(value)
    except InvalidParameter:
        raise
    except ValueError as exc:
        raise InvalidParameter(str(exc), param=name) from None


def _unsupported(why: str) -> Reader:
    """A vLLM parameter this engine does not implement: any value but null is refused."""
    def read(name: str, value: Any) -> Any:
        raise UnsupportedParameter(f"{name}={value!r} is not supported: {why}", param=name)
    return read


def _only_default(default: Any, read: Reader, why: str) -> Reader:
    """A vLLM parameter this engine implements only at its default value."""
    def read_default(name: str, value: Any) -> Any:
        if read(name, value) != default:
            raise UnsupportedParameter(f"{name}={value!r} is not supported: {why}", param=name)
        return default
    return read_default


# name -> how its value is read; the SamplingParams field of the same name gets it. Names SamplingParams
# lacks ("use_beam_search", "top_logprobs", "prompt_logprobs", "spaces_between_special_tokens") are vLLM's
# older or unsupported spellings, folded into the others by `_fold`.
SAMPLING_PARAMETERS: Dict[str, Reader] = {
    "n": to_int, "best_of": to_int,
    "temperature": to_float, "top_p": to_float, "top_k": to_int, "min_p": to_float,
    "repetition_penalty": to_float, "presence_penalty": to_float, "frequency_penalty": to_float,
    "seed": to_int,
    "stop": to_str_list, "stop_token_ids": to_int_list, "include_stop_str_in_output": to_bool,
    "ignore_eos": to_bool, "max_tokens": to_int, "min_tokens": to_int,
    "logprobs": _logprobs, "top_logprobs": to_int,
    "detokenize": to_bool, "skip_special_tokens": to_bool, "truncate_prompt_tokens": to_int,
    "logit_bias": to_float_map, "allowed_token_ids": to_int_list, "bad_words": to_str_list,
    "beam_width": to_int, "length_penalty": to_float, "early_stopping": _early_stopping,
    "use_beam_search": to_bool,
    "structured_outputs": _structured, "guided_decoding": _structured,
    "prompt_logprobs": _unsupported("prompt logprobs are not computed (the engine runs the model head only on "
                                    "the positions it samples from)"),
    "spaces_between_special_tokens": _only_default(True, to_bool, "special tokens are always decoded as the "
                                                                  "tokenizer spells them"),
}


def _fold(kwargs: Dict[str, Any]) -> None:
    """Turn vLLM's older spellings into SamplingParams fields (in place)."""
    kwargs.pop("prompt_logprobs", None)
    kwargs.pop("spaces_between_special_tokens", None)
    top = kwargs.pop("top_logprobs", None)
    if top is not None:
        if kwargs.get("logprobs") not in (None, 0, top):
            raise InvalidParameter(f"give logprobs or top_logprobs, not both ({kwargs['logprobs']} and {top})",
                                   param="top_logprobs")
        kwargs["logprobs"] = top
    if kwargs.pop("use_beam_search", False) and "beam_width" not in kwargs:
        # vLLM's older switch: the beam width is best_of, which defaults to n
        width = kwargs.pop("best_of", None) or kwargs.get("n", 1)
        if width < 2:
            raise InvalidParameter(f"use_beam_search needs best_of (the beam width; n when unset) > 1, got {width}",
                                   param="best_of")
        kwargs["beam_width"] = width
    if isinstance(kwargs.get("beam_width"), int) and kwargs["beam_width"] > 1:
        kwargs.setdefault("temperature", 0.0)  # beam search is deterministic


def supported_names() -> str:
    return ", ".join(sorted(SAMPLING_PARAMETERS))


def sampling_params_from_dict(values: Mapping[str, Any], **engine_fields: Any) -> SamplingParams:
    """SamplingParams from a mapping of vLLM names (values may be strings; None means the default).
    `engine_fields` are SamplingParams fields the caller sets itself (never from a request's JSON:
    `output_kind`, `logits_processors`, `output_scores`, ...). Raises `InvalidParameter`."""
    if not isinstance(values, Mapping):
        raise InvalidParameter(f"sampling parameters must be a JSON object, got {type(values).__name__}")
    kwargs: Dict[str, Any] = {}
    for name, value in values.items():
        read = SAMPLING_PARAMETERS.get(name)
        if read is None:
            raise InvalidParameter(f"unsupported sampling parameter {name!r}; supported: {supported_names()}",
                                   param=str(name))
        if value is not None:
            kwargs[name] = read(name, value)
    _fold(kwargs)
    kwargs.update(engine_fields)
    return SamplingParams(**kwargs)
