"""`model.json`: a Triton model's engine arguments under vLLM's names (`AsyncEngineArgs`), so that a
repository written for Triton's vLLM backend loads unchanged; values may be strings ("0.5", "true").

Three kinds of keys besides `model`:
- with a meaning here, read and passed on with vLLM's meaning (`dtype: "auto"` is the checkpoint's dtype,
  `gpu_memory_utilization` a share of the device's memory, `swap_space` GiB, ...), plus this engine's own
  sizing and scheduling options (`num_blocks`, `kv_cache_memory`, `num_swap_blocks`, `preemption_mode`, `watermark`,
  `admission_backoff_steps`);
- with no meaning here (CUDA graphs, Ray, request logging, download folders, ...): accepted, logged once;
- implemented only at vLLM's default (pipeline parallelism, quantization, ...): other values refused.
`enable_lora` (with `max_loras`, `max_lora_rank`, `max_cpu_loras`) serves the adapters of `multi_lora.json`.
Unknown keys, and bad values, raise a ValueError naming them, which fails the model's loading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from paged_backend import (EngineConfig, KV_CACHE_DTYPES, SpeculativeConfig, compile_mode, parse_memory, to_bool,
                           to_float, to_int, to_str)

MODEL_JSON = "model.json"
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "fp64": "float64", "double": "float64", "float": "float32"}
_GIB = 2 ** 30


def _optional(read: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else read(name, value)


def _memory(name: str, value: Any) -> Union[int, None]:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return parse_memory(value, name)


def _gib(name: str, value: Any) -> int:
    """vLLM's swap_space: GiB as a number ("4", 0.5); a size with a unit ("512MiB") is read as written."""
    if isinstance(value, str) and not value.strip().replace(".", "", 1).isdigit():
        return parse_memory(value, name)
    gib = to_float(name, value)
    if gib < 0:
        raise ValueError(f"{name} must be >= 0 GiB, got {value!r}")
    return int(gib * _GIB)


def _preemption(name: str, value: Any) -> Optional[str]:
    if value in ("recompute", "swap"):
        return value
    raise ValueError(f"{name} must be 'recompute' or 'swap' (or null for the engine's choice), got {value!r}")


def _kv_cache_dtype(name: str, value: Any) -> str:
    text = to_str(name, value).strip().lower()
    if text not in KV_CACHE_DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
    return text


def _dtype(name: str, value: Any) -> str:
    text = str(value).strip().lower()
    text = _DTYPE_ALIASES.get(text.removeprefix("torch."), text.removeprefix("torch."))
    if text not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return text


def _compile(name: str, value: Any) -> str:
    """This engine's `compile`: true/false or a mode ("off", "background", "blocking")."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no", "on"):
        value = to_bool(name, value)
    return compile_mode(value.strip().lower() if isinstance(value, str) else value)


def _device(name: str, value: Any) -> str:
    text = to_str(name, value).strip().lower()
    if text not in ("auto", "cpu", "cuda") and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise ValueError(f"{name} must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return text


def _speculative(name: str, value: Any) -> Dict[str, Any]:
    """vLLM's `speculative_config`: a JSON object (or its text) of SpeculativeConfig fields."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object, got {value!r}: {exc}") from None
    SpeculativeConfig.of(value)
    return dict(value)


# vLLM name -> (reader, EngineConfig option it sets)
_ENGINE_ARGS: Dict[str, tuple] = {
    "block_size": (to_int, "block_size"), "max_num_seqs": (to_int, "max_num_seqs"),
    "max_num_batched_tokens": (to_int, "max_num_batched_tokens"), "max_model_len": (_optional(to_int), "max_model_len"),
    "enable_prefix_caching": (to_bool, "enable_prefix_caching"),
    "tensor_parallel_size": (to_int, "tensor_parallel_size"), "seed": (to_int, "seed"),
    "gpu_memory_utilization": (_optional(to_float), "gpu_memory_utilization"),
    "swap_space": (_optional(_gib), "swap_space"), "max_logprobs": (to_int, "max_logprobs"),
    "num_gpu_blocks_override": (_optional(to_int), "num_blocks"),
    "kv_cache_memory_bytes": (_optional(_memory), "kv_cache_memory"),
    "preemption_mode": (_optional(_preemption), "preemption_mode"),
    "kv_cache_dtype": (_kv_cache_dtype, "kv_cache_dtype"),
    "async_scheduling": (to_bool, "async_scheduling"),
    "enforce_eager": (to_bool, "enforce_eager"),   # on CUDA: no decode CUDA graphs
    "speculative_config": (_optional(_speculative), "speculative_config"),   # vLLM's JSON object
    # this engine's own sizing options
    "num_blocks": (_optional(to_int), "num_blocks"), "kv_cache_memory": (_optional(_memory), "kv_cache_memory"),
    "num_swap_blocks": (_optional(to_int), "num_swap_blocks"), "watermark": (to_float, "watermark"),
    "admission_backoff_steps": (_optional(to_int), "admission_backoff_steps"),
    "compile": (_compile, "compile"),   # the compiled forward (off unless asked; vLLM's enforce_eager is the default)
    # LoRA adapters (multi_lora.json)
    "enable_lora": (to_bool, "enable_lora"), "max_loras": (to_int, "max_loras"),
    "max_lora_rank": (to_int, "max_lora_rank"), "max_cpu_loras": (_optional(to_int), "max_cpu_loras"),
}
# the model and how it is loaded and reported
_MODEL_ARGS: Dict[str, Callable[[str, Any], Any]] = {
    "model": to_str, "tokenizer": _optional(to_str), "dtype": _dtype, "device": _device,
    "trust_remote_code": to_bool, "disable_log_stats": to_bool,
}
# vLLM arguments with no meaning for this engine: accepted and logged once
NO_MEANING_HERE = frozenset({
    "max_seq_len_to_capture", "max_context_len_to_capture", "cuda_graph_sizes",
    "compilation_config", "disable_custom_all_reduce", "distributed_executor_backend", "worker_use_ray",
    "engine_use_ray", "ray_workers_use_nsight", "disable_log_requests", "enable_log_requests",
    "aggregate_engine_logging", "use_v2_block_manager", "num_scheduler_steps", "multi_step_stream_outputs",
    "disable_async_output_proc", "enable_chunked_prefill", "max_num_partial_prefills",
    "max_long_partial_prefills", "long_prefill_token_threshold", "scheduler_delay_factor", "download_dir",
    "revision", "tokenizer_revision", "code_revision", "tokenizer_mode", "served_model_name",
    "max_parallel_loading_workers", "tokenizer_pool_size",
    "prefix_caching_hash_algo", "disable_frontend_multiprocessing",
    # structured outputs always compile with xgrammar here, whatever backend vLLM would pick
    "guided_decoding_backend",
    # the model's attention runs as its config defines it: sliding windows stay on (no cap of max_model_len)
    "disable_sliding_window",
    # vLLM applies generation_config.json's sampling defaults in its OpenAI server only, not to engine requests
    # such as the vLLM backend's; EOS ids are read from the model's generation config here anyway
    "generation_config",
    # LoRA adapters never add tokens here (an adapter with new embeddings is refused when it is read)
    "lora_extra_vocab_size",
})
# vLLM arguments this engine implements only at their default value
ONLY_DEFAULT: Dict[str, tuple] = {
    "pipeline_parallel_size": (1, "pipeline parallelism is not implemented (use tensor_parallel_size)"),
    "quantization": (None, "quantized weights are not supported"),
    "lora_dtype": ("auto", "LoRA weights run in the model's dtype"),
    "fully_sharded_loras": (False, "LoRA with tensor parallelism is not supported"),
    "long_lora_scaling_factors": (None, "long-context LoRA is not supported"),
    "speculative_model": (None, "name the draft model in speculative_config "
                                "({\"method\": \"draft_model\", \"model\": ...})"),
    "cpu_offload_gb": (0, "weights are not offloaded"),
    "skip_tokenizer_init": (False, "the engine needs its tokenizer"),
    "load_format": ("auto", "weights are loaded with transformers' from_pretrained"),
    "task": ("auto", "this engine generates text (task 'auto' or 'generate')"),
}
OPTION_NAMES = tuple(sorted(set(_ENGINE_ARGS) | set(_MODEL_ARGS) | NO_MEANING_HERE | set(ONLY_DEFAULT)))


@dataclass
class ModelOptions:
    """The validated contents of `model.json`."""

    model: str = "smollm2"
    tokenizer: Optional[str] = None
    dtype: str = "auto"          # vLLM's default: the checkpoint's dtype
    device: str = "auto"         # vLLM's default: the accelerator if there is one
    trust_remote_code: bool = False
    disable_log_stats: bool = False
    engine: Dict[str, Any] = field(default_factory=dict)
    ignored: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        values = {"model": self.model, "dtype": self.dtype, "device": self.device}
        if self.tokenizer is not None:
            values["tokenizer"] = self.tokenizer
        if self.trust_remote_code:
            values["trust_remote_code"] = True
        if self.disable_log_stats:
            values["disable_log_stats"] = True
        inverse = {target: name for name, (_, target) in _ENGINE_ARGS.items()}
        values.update({inverse.get(k, k): v for k, v in self.engine.items()})
        if "swap_space" in values and values["swap_space"] is not None:
            values["swap_space"] = values["swap_space"] / _GIB
        return {**values, **self.ignored}


def _only_default(name: str, value: Any) -> None:
    default, why = ONLY_DEFAULT[name]
    normal = value
    if name == "task" and isinstance(value, str) and value.strip().lower() == "generate":
        return  # the same as "auto" for a generative model
    if isinstance(default, bool):
        normal = to_bool(name, value)
    elif isinstance(default, int):
        normal = to_int(name, value)
    elif isinstance(value, str) and value.strip().lower() in ("none", "null"):
        normal = None
    if normal != default:
        raise ValueError(f"{name}={value!r} is not supported: {why}")


def parse_model_options(values: Dict[str, Any]) -> ModelOptions:
    """Validate a `model.json` mapping: unknown names and bad values raise a ValueError."""
    if not isinstance(values, dict):
        raise ValueError(f"{MODEL_JSON} must hold a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} in {MODEL_JSON}; known options: "
                         f"{', '.join(OPTION_NAMES)}")
    options = ModelOptions()
    for name, value in values.items():
        if name in _MODEL_ARGS:
            setattr(options, name, _MODEL_ARGS[name](name, value))
        elif name in _ENGINE_ARGS:
            read, target = _ENGINE_ARGS[name]
            if target in options.engine:
                raise ValueError(f"{name} and another option in {MODEL_JSON} both set {target}; give one")
            options.engine[target] = read(name, value)
        elif name in ONLY_DEFAULT:
            _only_default(name, value)
        else:
            options.ignored[name] = value
    options.engine = {k: v for k, v in options.engine.items() if v is not None}
    if options.engine.get("compile", "off") != "off" and options.engine.get("enforce_eager"):
        raise ValueError(f"{MODEL_JSON} sets both compile={options.engine['compile']!r} and enforce_eager=true; give one")
    if not options.model.strip():
        raise ValueError(f"model in {MODEL_JSON} must name a preset or a model directory")
    EngineConfig.from_kwargs(**dict(options.engine))  # validates ranges, raises ValueError
    return options


def load_model_options(version_dir: Union[str, Path]) -> ModelOptions:
    """Read and validate `model.json` from a model's version folder."""
    path = Path(version_dir) / MODEL_JSON
    if not path.is_file():
        raise ValueError(f"{path} not found: the model's version folder needs a {MODEL_JSON} "
                         f"with the engine options (write one with `paged-backend triton-repo`)")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return parse_model_options(values)
