"""TensorRT-LLM-style input tensors -> vLLM's sampling-parameter names.

Triton's OpenAI frontend (triton-inference-server/server, python/openai) sends requests in TensorRT-LLM's
format to every model whose backend is not named "vllm": `text_input` [[prompt]], `stream` [[bool]],
`max_tokens` INT32 [[n]], `stop_words` [[words...]], `top_p`, `temperature`, `frequency_penalty`,
`presence_penalty` FP32 [[x]], `seed` UINT64 [[s]], `exclude_input_in_output` [[bool]] (completions with
`echo`), `guided_decoding_guide_type` / `guided_decoding_guide` [["json_schema"]] / [[schema]] (a tool
choice), `return_num_input_tokens` / `return_num_output_tokens`. TensorRT-LLM's own models take more of the
same kind (`top_k`, `repetition_penalty`, `bad_words`, `beam_width`, `num_return_sequences`, ...). Each tensor
here is read as the vLLM parameter it means, so it goes through the engine's one mapping and checks.
No Triton import here.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from paged_backend.errors import InvalidParameter, UnsupportedParameter

# tensor name -> (vLLM's name, Triton data type, dims); dims [1] (or [-1] for word lists) after the batch
# dimension that TensorRT-LLM-style clients put first ([1, 1] shapes; see docs/triton.md for the config).
TRTLLM_TENSORS: Dict[str, Tuple[str, str, List[int]]] = {
    "max_tokens": ("max_tokens", "TYPE_INT32", [1]),
    "min_tokens": ("min_tokens", "TYPE_INT32", [1]),
    "temperature": ("temperature", "TYPE_FP32", [1]),
    "top_p": ("top_p", "TYPE_FP32", [1]),
    "top_k": ("top_k", "TYPE_INT32", [1]),
    "repetition_penalty": ("repetition_penalty", "TYPE_FP32", [1]),
    "presence_penalty": ("presence_penalty", "TYPE_FP32", [1]),
    "frequency_penalty": ("frequency_penalty", "TYPE_FP32", [1]),
    "seed": ("seed", "TYPE_UINT64", [1]),
    "random_seed": ("seed", "TYPE_UINT64", [1]),   # the name in TensorRT-LLM's ensemble models
    "beam_width": ("beam_width", "TYPE_INT32", [1]),
    "length_penalty": ("length_penalty", "TYPE_FP32", [1]),
    "num_return_sequences": ("n", "TYPE_INT32", [1]),
    "stop_words": ("stop", "TYPE_STRING", [-1]),
    "bad_words": ("bad_words", "TYPE_STRING", [-1]),
    "guided_decoding_guide_type": ("structured_outputs", "TYPE_STRING", [1]),
    "guided_decoding_guide": ("structured_outputs", "TYPE_STRING", [1]),
}
WORD_LISTS = ("stop_words", "bad_words")
# TensorRT-LLM's guide types -> the StructuredOutputsParams field each one fills
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}

Single = Callable[[str, Any], Any]
Strings = Callable[[str, Any], List[str]]


def trtllm_input_configs() -> List[Dict[str, Any]]:
    """The tensors above as model-config inputs (all optional). The model adds them only when its config.pbtxt
    sets `max_batch_size`: under 0, Triton's generate endpoint would turn `parameters` keys of these names into
    typed tensors, refusing the strings ("0.7") the vLLM backend accepts."""
    return [dict(name=name, data_type=kind, dims=dims, optional=True)
            for name, (_, kind, dims) in TRTLLM_TENSORS.items()]


def has_trtllm_inputs(inputs: Mapping[str, Any]) -> bool:
    """Whether a request carries any TensorRT-LLM-style sampling tensor."""
    return any(inputs.get(name) is not None for name in TRTLLM_TENSORS)


def _guide(guide_type: Optional[str], guide: Optional[str]) -> Optional[Dict[str, Any]]:
    """The structured_outputs value for TensorRT-LLM's guided-decoding pair."""
    if guide_type is None and guide is None:
        return None
    if guide_type is None:
        raise InvalidParameter("guided_decoding_guide needs guided_decoding_guide_type (one of "
                               f"{', '.join(GUIDE_TYPES)})", param="guided_decoding_guide_type")
    if guide_type not in GUIDE_TYPES:
        raise UnsupportedParameter(f"guided_decoding_guide_type={guide_type!r} is not supported; use one of "
                                   f"{', '.join(GUIDE_TYPES)}", param="guided_decoding_guide_type")
    field = GUIDE_TYPES[guide_type]
    if field == "json_object":
        return {"json_object": True}
    if guide is None:
        raise InvalidParameter(f"guided_decoding_guide_type={guide_type!r} needs guided_decoding_guide",
                               param="guided_decoding_guide")
    return {field: guide}


def trtllm_values(inputs: Mapping[str, Any], single: Single, strings: Strings) -> Dict[str, Any]:
    """The request's TensorRT-LLM-style tensors under vLLM's names (what `sampling_params_from_dict` reads).
    Empty words in `stop_words` / `bad_words` are dropped (TensorRT-LLM clients often send [""])."""
    values: Dict[str, Any] = {}
    if not has_trtllm_inputs(inputs):
        return values
    for tensor, (name, _, _) in TRTLLM_TENSORS.items():
        if inputs.get(tensor) is None or name == "structured_outputs":
            continue
        if name in values:
            raise InvalidParameter(f"give {tensor} or the tensor of the same meaning, not both", param=tensor)
        if tensor in WORD_LISTS:
            values[name] = [word for word in strings(tensor, inputs[tensor]) if word] or None
        else:
            values[name] = single(tensor, inputs[tensor])
    guide_type, guide = (single(t, inputs[t]) if inputs.get(t) is not None else None
                         for t in ("guided_decoding_guide_type", "guided_decoding_guide"))
    structured = _guide(guide_type, guide)
    if structured is not None:
        values["structured_outputs"] = structured
    return values
