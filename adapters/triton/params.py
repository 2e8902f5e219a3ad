"""Request parsing for the Triton model: input tensors and `sampling_parameters` JSON -> a validated request.

Follows Triton's vLLM backend: `text_input` (STRING), optional `stream`, `sampling_parameters` (a JSON
object whose values may be strings), `exclude_input_in_output` and the `return_*` switches. When no
`sampling_parameters` tensor is sent, the request's own parameters (Triton's generate endpoint puts the
JSON `parameters` object and unknown top-level keys there) are used instead. No Triton import here, so
the rules are testable without a server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from paged_backend import SamplingParams

from .coerce import to_bool, to_float, to_int, to_int_list, to_str_list

RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_num_input_tokens",
                "return_num_output_tokens")
FLAG_INPUTS = ("stream", "exclude_input_in_output") + RETURN_FLAGS


def _logprobs(name: str, value: Any) -> Optional[int]:
    """vLLM takes a count; OpenAI chat sends a boolean (true: the chosen token's log-prob only)."""
    if isinstance(value, bool):
        return 0 if value else None
    return to_int(name, value)


def _early_stopping(name: str, value: Any):
    if isinstance(value, str) and value.strip().lower() == "never":
        return "never"
    return to_bool(name, value)


# SamplingParams field -> how to read it from JSON.
_FIELDS: Dict[str, Callable[[str, Any], Any]] = {
    "n": to_int, "best_of": to_int, "temperature": to_float, "top_p": to_float, "top_k": to_int,
    "min_p": to_float, "repetition_penalty": to_float, "presence_penalty": to_float,
    "frequency_penalty": to_float, "seed": to_int, "stop": to_str_list, "stop_token_ids": to_int_list,
    "include_stop_str_in_output": to_bool, "ignore_eos": to_bool, "max_tokens": to_int, "min_tokens": to_int,
    "logprobs": _logprobs, "skip_special_tokens": to_bool, "beam_width": to_int, "length_penalty": to_float,
    "early_stopping": _early_stopping,
}
SUPPORTED_SAMPLING_PARAMETERS = tuple(sorted(_FIELDS)) + ("use_beam_search",)


def sampling_params_from_dict(values: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams from a mapping of vLLM names; values may be strings; None means the default."""
    kwargs: Dict[str, Any] = {}
    use_beam_search = False
    for key, value in values.items():
        if value is None:
            continue
        if key == "use_beam_search":  # vLLM's older switch: the beam width is best_of (or n)
            use_beam_search = to_bool(key, value)
        elif key in _FIELDS:
            kwargs[key] = _FIELDS[key](key, value)
        else:
            raise ValueError(f"unsupported sampling parameter {key!r}; supported: "
                             f"{', '.join(SUPPORTED_SAMPLING_PARAMETERS)}")
    if use_beam_search and "beam_width" not in kwargs:
        kwargs["beam_width"] = max(kwargs.get("best_of") or 1, kwargs.get("n", 1), 2)
        kwargs.pop("best_of", None)
        kwargs.setdefault("temperature", 0.0)
    if kwargs.get("beam_width", 1) > 1:
        kwargs.setdefault("temperature", 0.0)
    return SamplingParams(**kwargs)


def parse_json_object(text: Any, what: str = "sampling_parameters") -> Dict[str, Any]:
    """A JSON object from a string (or bytes); a clear ValueError for anything else."""
    if isinstance(text, bytes):
        text = _decode(what, text)
    if text is None or (isinstance(text, str) and text.strip() == ""):
        return {}
    if isinstance(text, dict):
        return dict(text)
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object such as {{\"max_tokens\": 16}}, got {type(value).__name__}")
    return value


def parse_sampling_parameters(text: Any) -> SamplingParams:
    """SamplingParams from the `sampling_parameters` JSON string (what Triton's vLLM backend accepts)."""
    return sampling_params_from_dict(parse_json_object(text))


@dataclass
class GenerateRequest:
    """One parsed Triton request: the prompt, how to answer, and which extra outputs to return."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    prepend_input: bool = True
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _decode(name: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8: {exc}") from None


def _single(name: str, array: Any) -> Any:
    """The one element of an input tensor (shape [1] or [1, 1]); batches are not accepted."""
    items = array.reshape(-1).tolist() if hasattr(array, "reshape") else [array]
    if len(items) != 1:
        raise ValueError(f"{name} must hold exactly one element, got {len(items)} (send one request per prompt)")
    item = items[0]
    return _decode(name, item) if isinstance(item, bytes) else item


def _flag(name: str, inputs: Mapping[str, Any], fallback: Mapping[str, Any]) -> Optional[bool]:
    if inputs.get(name) is not None:
        return to_bool(name, _single(name, inputs[name]))
    if fallback.get(name) is not None:
        return to_bool(name, fallback[name])
    return None


def parse_generate_request(inputs: Mapping[str, Any], request_parameters: Any = None) -> GenerateRequest:
    """Validate one request: `inputs` maps tensor names to numpy arrays (absent ones missing or None);
    `request_parameters` is the request's parameters JSON (used when no `sampling_parameters` is sent)."""
    if inputs.get("text_input") is None:
        raise ValueError("missing required input tensor 'text_input' (the prompt, a STRING tensor of shape [1])")
    prompt = _single("text_input", inputs["text_input"])
    if not isinstance(prompt, str):
        raise ValueError(f"text_input must be a string, got {type(prompt).__name__}")
    extra = parse_json_object(request_parameters, "request parameters")
    flags = {name: extra.pop(name, None) for name in FLAG_INPUTS}
    if inputs.get("sampling_parameters") is not None:
        params = parse_sampling_parameters(_single("sampling_parameters", inputs["sampling_parameters"]))
    else:
        params = sampling_params_from_dict(extra)
    stream = bool(_flag("stream", inputs, flags))
    exclude = _flag("exclude_input_in_output", inputs, flags)
    prepend_input = (not exclude) if exclude is not None else not stream
    if stream and prepend_input:
        raise ValueError("exclude_input_in_output=false is not allowed when streaming "
                         "(streamed responses carry only the new text)")
    if stream and params.best_of > params.n and not params.use_beam_search:
        raise ValueError(f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best "
                         f"sequences are only known at the end")
    returns = {name: bool(_flag(name, inputs, flags)) for name in RETURN_FLAGS}
    return GenerateRequest(prompt=prompt, params=params, stream=stream, prepend_input=prepend_input, **returns)
