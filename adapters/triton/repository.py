"""Triton model repositories for paged-backend, and the Python-based backend they run on.

Two layouts (`write_model_repository(..., layout=...)`):
- "backend" (the default, as for Triton's vLLM backend): `NAME/config.pbtxt` holds only
  `backend: "paged_backend"`, the instance group and the metrics switch (the tensors, the decoupled policy
  and `max_batch_size: 0` are filled in by the model's `auto_complete_config`), and `NAME/1/model.json` the
  engine arguments. The server needs the backend installed: `BACKENDS/paged_backend/model.py`
  (`install_backend`), beside the Python backend in `BACKENDS/python`.
- "python": a classic Python-backend model, `backend: "python"` with every tensor spelled out and a
  `NAME/1/model.py` that imports the model; no backend to install.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .model_json import MODEL_JSON, parse_model_options
from .multi_lora import MULTI_LORA_JSON

BACKEND_NAME = "paged_backend"
LAYOUTS = ("backend", "python")

# (name, Triton data type, dims, optional) of the inputs and outputs: the tensors of Triton's vLLM backend.
INPUTS: List[Tuple[str, str, List[int], bool]] = [
    ("text_input", "TYPE_STRING", [1], False),
    ("stream", "TYPE_BOOL", [1], True),
    ("image", "TYPE_STRING", [-1], True),
    ("sampling_parameters", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("return_logprobs", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
    ("embedding_request", "TYPE_STRING", [1], True),
]
OUTPUTS: List[Tuple[str, str, List[int]]] = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("logprobs", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_UINT32", [1]),
    ("num_output_tokens", "TYPE_UINT32", [-1]),
]

MODEL_PY = '''"""Triton Python entry point: the model lives in paged-backend (its engine arguments: model.json)."""

from paged_backend.adapters.triton.model import TritonPythonModel  # noqa: F401
'''

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def input_configs() -> List[Dict[str, Any]]:
    return [dict(name=n, data_type=t, dims=d, optional=o) for n, t, d, o in INPUTS]


def output_configs() -> List[Dict[str, Any]]:
    return [dict(name=n, data_type=t, dims=d) for n, t, d in OUTPUTS]


def _tensor_block(kind: str, entries: List[Dict[str, Any]]) -> str:
    items = []
    for entry in entries:
        lines = [f'    name: "{entry["name"]}"', f'    data_type: {entry["data_type"]}',
                 f'    dims: [ {", ".join(str(d) for d in entry["dims"])} ]']
        if entry.get("optional"):
            lines.append("    optional: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"


def config_pbtxt(name: str, instance_count: int = 1, report_metrics: bool = True, layout: str = "backend",
                 kind: str = "KIND_CPU", max_batch_size: int = 0) -> str:
    """The model configuration. "backend": the backend's name and the instance group (the rest comes from
    auto-completion; `max_batch_size` 1 takes the [1, 1] TensorRT-LLM-style tensors Triton's OpenAI frontend
    sends); "python": the Python backend with every tensor, decoupled, no Triton batching."""
    if max_batch_size not in (0, 1):
        raise ValueError(f"max_batch_size must be 0 (vLLM's format) or 1 (also TensorRT-LLM's, [1, 1] tensors), "
                         f"got {max_batch_size!r}")
    if max_batch_size and layout != "backend":
        raise ValueError("max_batch_size 1 needs the backend layout (its auto-completion adds the TensorRT-LLM "
                         "inputs)")
    metrics = "true" if report_metrics else "false"
    instances = f"instance_group [\n  {{\n    count: {instance_count}\n    kind: {kind}\n  }}\n]\n"
    parameters = f'parameters {{\n  key: "REPORT_CUSTOM_METRICS"\n  value: {{ string_value: "{metrics}" }}\n}}\n'
    if layout == "backend":
        batch = f"max_batch_size: {max_batch_size}\n" if max_batch_size else ""
        return f'name: "{name}"\nbackend: "{BACKEND_NAME}"\n' + batch + instances + parameters
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            + _tensor_block("input", input_configs()) + _tensor_block("output", output_configs())
            + instances + parameters)


def write_model_repository(out_dir: Union[str, Path], name: str = "paged_llm",
                           options: Union[Dict[str, Any], None] = None, version: int = 1,
                           report_metrics: bool = True, validate: bool = True, layout: str = "backend",
                           instance_count: int = 1, kind: str = "KIND_CPU", max_batch_size: int = 0,
                           lora_modules: Optional[Dict[str, str]] = None) -> Path:
    """Write (or overwrite) model `name` under `out_dir`; returns the model folder.

    `options` is the content of model.json (vLLM's engine arguments); it is validated first unless
    `validate=False` (used to write a deliberately broken model for tests). `lora_modules` (adapter name ->
    directory) becomes `multi_lora.json`, as Triton's vLLM backend reads it (model.json must set enable_lora).
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"model name {name!r} must use only letters, digits, '_', '-' and '.'")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    values = dict(options or {})
    if validate:
        values = parse_model_options(values).to_json()
    model_dir = Path(out_dir) / name
    version_dir = model_dir / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    config = config_pbtxt(name, instance_count, report_metrics, layout, kind, max_batch_size)
    (model_dir / "config.pbtxt").write_text(config)
    if layout == "python":
        (version_dir / "model.py").write_text(MODEL_PY)
    else:
        (version_dir / "model.py").unlink(missing_ok=True)
    (version_dir / MODEL_JSON).write_text(json.dumps(values, indent=2) + "\n")
    if lora_modules:
        if validate and not parse_model_options(values).engine.get("enable_lora"):
            raise ValueError("LoRA modules need enable_lora in model.json")
        (version_dir / MULTI_LORA_JSON).write_text(json.dumps(lora_modules, indent=2) + "\n")
    else:
        (version_dir / MULTI_LORA_JSON).unlink(missing_ok=True)
    return model_dir


def install_backend(backends_dir: Union[str, Path]) -> Path:
    """Install the Python-based backend `paged_backend` into a Triton backends folder (beside `python/`):
    one `model.py` importing the model from this package. Returns the backend's folder."""
    folder = Path(backends_dir) / BACKEND_NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_PY)
    return folder
