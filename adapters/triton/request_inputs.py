"""Request parsing for the Triton model: input tensors and `sampling_parameters` JSON -> a validated request.

Follows Triton's vLLM backend: `text_input` (STRING), optional `stream`, `sampling_parameters` (a JSON
object of vLLM's sampling parameters, values possibly strings), `exclude_input_in_output` and the
`return_*` switches. When no `sampling_parameters` tensor is sent, the request's own parameters (Triton's
generate endpoint puts the JSON `parameters` object and unknown top-level keys there) are used instead.
TensorRT-LLM-style tensors (`max_tokens`, `temperature`, `stop_words`, ..., what Triton's OpenAI frontend
sends to backends not named "vllm"; trtllm_inputs.py) are the third way; such requests get only the new
text unless `exclude_input_in_output` says otherwise. Every tensor may come as [1] or with a batch
dimension ([1, 1]); a batched request gets batched outputs.
The sampling parameters go through the engine's one mapping (`paged_backend.engine.request_params`). No Triton
import here, so the rules are testable without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from paged_backend import (MAX_SCHEMA_DEPTH, LoRARequest, RequestOutputKind, SamplingParams, load_json,
                           sampling_params_from_dict, to_bool)
from paged_backend.errors import InvalidParameter, UnsupportedParameter

from .multi_lora import adapter_for
from .trtllm_inputs import has_trtllm_inputs, trtllm_values

RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")
FLAG_INPUTS = ("stream", "exclude_input_in_output") + RETURN_FLAGS
REFUSED_INPUTS = {"image": "images are not supported: the engine serves text-only models",
                  "embedding_request": "embedding requests are not supported: the engine generates text"}
VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which Triton's vLLM backend inherits


def parse_json_object(text: Any, what: str = "sampling_parameters") -> Dict[str, Any]:
    """A JSON object from a string (or bytes); a clear ValueError for anything else."""
    if isinstance(text, bytes):
        text = _decode(what, text)
    if text is None or (isinstance(text, str) and text.strip() == ""):
        return {}
    if isinstance(text, dict):
        return dict(text)
    value = load_json(text, what, MAX_SCHEMA_DEPTH + 2)  # a schema inside gets its own, clearer check
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object such as {{\"max_tokens\": 16}}, got {type(value).__name__}")
    return value


def parse_sampling_parameters(text: Any, stream: bool = False) -> SamplingParams:
    """SamplingParams from the `sampling_parameters` JSON string (what Triton's vLLM backend accepts):
    the engine reports deltas when streaming, else only the final output."""
    return _sampling_params(parse_json_object(text), stream)


def _sampling_params(values: Dict[str, Any], stream: bool) -> SamplingParams:
    adapter_for(values.pop("lora_name", None), None)   # a JSON string alone names no model's adapters: refused
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return sampling_params_from_dict(values, output_kind=kind)


@dataclass
class GenerateRequest:
    """One parsed Triton request: the prompt, how to answer, and which extra outputs to return."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    prepend_input: bool = True
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    batched: bool = False  # the inputs came with a batch dimension ([1, 1] shapes): outputs get one too
    # whether the request set `logprobs` (None: whether `params` has it; params may carry a 0 that only makes the
    # engine report cumulative_logprob)
    logprobs_requested: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.logprobs_requested is None:
            self.logprobs_requested = self.params.logprobs is not None
    lora_request: Optional[LoRARequest] = None  # the adapter `lora_name` picked (multi_lora.json)


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


def _merged(values: Dict[str, Any], tensors: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON sampling parameters with the TensorRT-LLM-style tensors' values (Triton's generate endpoint
    turns `parameters` keys that name an input into tensors, so one request may carry both); a parameter given
    both ways is refused."""
    both = sorted(set(values) & set(tensors))
    if both:
        raise ValueError(f"{', '.join(both)} given both as an input tensor and in the sampling parameters; give "
                         f"each once")
    return {**values, **tensors}


def _strings(name: str, array: Any) -> List[str]:
    """The strings of a STRING tensor (one request's list, e.g. shape [1, k] or [k])."""
    items = array.reshape(-1).tolist() if hasattr(array, "reshape") else list(array)
    return [_decode(name, item) if isinstance(item, bytes) else str(item) for item in items]


def _flag(name: str, inputs: Mapping[str, Any], fallback: Mapping[str, Any]) -> Optional[bool]:
    if inputs.get(name) is not None:
        return to_bool(name, _single(name, inputs[name]))
    if fallback.get(name) is not None:
        return to_bool(name, fallback[name])
    return None


def parse_generate_request(inputs: Mapping[str, Any], request_parameters: Any = None,
                           adapters: Optional[Mapping[str, LoRARequest]] = None) -> GenerateRequest:
    """Validate one request: `inputs` maps tensor names to numpy arrays (absent ones missing or None);
    `request_parameters` is the request's parameters JSON (used when no `sampling_parameters` is sent);
    `adapters` the model's LoRA adapters (multi_lora.json; None: LoRA is off), which `lora_name` picks from."""
    for name, why in REFUSED_INPUTS.items():
        if inputs.get(name) is not None:
            raise UnsupportedParameter(f"input tensor {name!r}: {why}", param=name)
    if inputs.get("text_input") is None:
        raise InvalidParameter("missing required input tensor 'text_input' (the prompt, a STRING tensor of shape [1])",
                               param="text_input")
    prompt = _single("text_input", inputs["text_input"])
    if not isinstance(prompt, str):
        raise InvalidParameter(f"text_input must be a string, got {type(prompt).__name__}", param="text_input")
    extra = parse_json_object(request_parameters, "request parameters")
    flags = {name: extra.pop(name, None) for name in FLAG_INPUTS}
    stream = bool(_flag("stream", inputs, flags))
    if inputs.get("sampling_parameters") is not None:
        values = parse_json_object(_single("sampling_parameters", inputs["sampling_parameters"]))
    else:
        values = extra
    lora = adapter_for(values.pop("lora_name", None), adapters)   # vllm_backend's own key
    params = _sampling_params(_merged(values, trtllm_values(inputs, _single, _strings)), stream)
    batched = getattr(inputs["text_input"], "ndim", 1) >= 2
    exclude = _flag("exclude_input_in_output", inputs, flags)
    # TensorRT-LLM's convention (Triton's OpenAI frontend): only the new text unless the request asks otherwise
    prepend_input = (not exclude) if exclude is not None else not (stream or batched or has_trtllm_inputs(inputs))
    if stream and prepend_input:
        raise ValueError("exclude_input_in_output=false is not allowed when streaming "
                         "(streamed responses carry only the new text)")
    if stream and params.best_of > params.n and not params.use_beam_search:
        raise ValueError(f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best "
                         f"sequences are only known at the end")
    returns = {name: bool(_flag(name, inputs, flags)) for name in RETURN_FLAGS}
    logprobs_requested = params.logprobs is not None
    if returns["return_cumulative_logprob"] and not params.reports_logprobs:
        params = params.replace(logprobs=0)   # the engine reports cumulative_logprob only for requests that ask
    return GenerateRequest(prompt=prompt, params=params, stream=stream, prepend_input=prepend_input,
                           batched=batched, lora_request=lora, logprobs_requested=logprobs_requested, **returns)
