"""paged-backend: a PagedAttention LLM serving engine behind familiar fronts.

The names below are the public API: users and the fronts in `paged_backend.adapters` import them from here
(and typed errors from `paged_backend.errors`). They load on first use, so that importing one part (a
tensor-parallel worker process imports `paged_backend.worker...`) does not import the engine.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Dict, Tuple, Union

__version__ = "0.1.0"


def _leave_the_checkout_off_the_path() -> None:
    """Run from a checkout (an editable install), drop the checkout's root from the import path: a Python started
    there with `-m` or `-c`, and Triton's Python stub started there, put it first, and its folders kernels/ and
    adapters/ (this package's `paged_backend.kernels` and `.adapters`) then shadow PyPI packages of those names;
    transformers >= 5.25 imports Hugging Face's `kernels` whenever it is installed. Nothing is imported from the
    root itself (this package is found through the install); an installed wheel has no such root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "kernels", "cpu_attention.cpp")) and "kernels" not in sys.modules:
        sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != root]


_leave_the_checkout_off_the_path()

# public name -> module that defines it (or (module, its name there))
_PUBLIC: Dict[str, Union[str, Tuple[str, str]]] = {
    # the engine API (vLLM's names)
    "LLM": "paged_backend.engine.llm",
    "LLMEngine": "paged_backend.engine.llm_engine",
    "AsyncLLMEngine": "paged_backend.engine.async_llm_engine",
    "EngineConfig": "paged_backend.config",
    "SpeculativeConfig": "paged_backend.config",
    "SamplingParams": "paged_backend.sampling_params",
    "LoRARequest": "paged_backend.engine.lora_request",
    "RequestOutputKind": "paged_backend.sampling_params",
    "StructuredOutputsParams": "paged_backend.structured.params",
    "GuidedDecodingParams": "paged_backend.structured.params",
    "CompletionOutput": "paged_backend.engine.outputs",
    "RequestOutput": "paged_backend.engine.outputs",
    "Logprob": "paged_backend.sampling.logprob",
    "ValidatedRequest": "paged_backend.engine.request_intake",
    "EngineStats": "paged_backend.engine.metrics",
    # what every front shares: the request-parameter table, typed readers, streaming text, metrics
    "sampling_params_from_dict": "paged_backend.engine.request_params",
    "SAMPLING_PARAMETERS": "paged_backend.engine.request_params",
    "CONSTRAINT_FIELDS": "paged_backend.structured.params",
    "MAX_SCHEMA_DEPTH": "paged_backend.structured.params",
    "load_json": ("paged_backend.structured.bounded_json", "loads"),
    "check_json_depth": ("paged_backend.structured.bounded_json", "check_depth"),
    "ranked_logprobs": ("paged_backend.engine.outputs", "ranked"),
    "to_bool": "paged_backend.engine.coerce",
    "to_int": "paged_backend.engine.coerce",
    "to_float": "paged_backend.engine.coerce",
    "to_str": "paged_backend.engine.coerce",
    "IncrementalText": "paged_backend.engine.streaming",
    "METRICS": "paged_backend.engine.metrics_table",
    "MetricSpec": "paged_backend.engine.metrics_table",
    "COUNTER": "paged_backend.engine.metrics_table",
    "GAUGE": "paged_backend.engine.metrics_table",
    "HISTOGRAM": "paged_backend.engine.metrics_table",
    "INFO": "paged_backend.engine.metrics_table",
    "STATE": "paged_backend.engine.metrics_table",
    "state_value": "paged_backend.engine.metrics_table",
    "info_labels": "paged_backend.engine.metrics_table",
    "HISTOGRAM_BUCKETS": "paged_backend.engine.metrics",
    "histogram": "paged_backend.engine.metrics_table",
    "labelled_values": "paged_backend.engine.metrics_table",
    "value": "paged_backend.engine.metrics_table",
    # engine options and models, as the command line and the fronts' configs name them
    "KV_CACHE_DTYPES": "paged_backend.config",
    "compile_mode": "paged_backend.config",
    "parse_memory": "paged_backend.config",
    "add_engine_args": "paged_backend.cli",
    "engine_kwargs": "paged_backend.cli",
    "format_stats": "paged_backend.cli",
    "load_model": "paged_backend.worker.loader",
    "PRESETS": "paged_backend.worker.loader",
    "total_memory": "paged_backend.worker.sizing",
    "maybe_run_worker_loop": "paged_backend.worker.tp_runner",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'paged_backend' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__
