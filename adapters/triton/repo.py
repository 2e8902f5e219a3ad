"""Write a Triton model repository that serves a model through paged-backend.

Layout: `OUT_DIR/NAME/config.pbtxt` (Python backend, decoupled, the vLLM backend's tensors),
`OUT_DIR/NAME/1/model.py` (a thin import of `paged_backend.adapters.triton.model`) and
`OUT_DIR/NAME/1/model.json` (the model and engine options, validated before anything is written).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

from .options import MODEL_JSON, parse_model_options

# (name, Triton data type, dims, optional) of the inputs and outputs: the tensors of Triton's vLLM backend.
INPUTS: List[Tuple[str, str, List[int], bool]] = [
    ("text_input", "TYPE_STRING", [1], False),
    ("stream", "TYPE_BOOL", [1], True),
    ("sampling_parameters", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
]
OUTPUTS: List[Tuple[str, str, List[int]]] = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("num_input_tokens", "TYPE_UINT32", [1]),
    ("num_output_tokens", "TYPE_UINT32", [-1]),
]

MODEL_PY = '''"""Triton Python-backend entry point: the model lives in paged-backend (see model.json for its options)."""

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


def config_pbtxt(name: str, instance_count: int = 1, report_metrics: bool = True) -> str:
    """The model configuration: Python backend, decoupled (streaming), no Triton batching."""
    metrics = "true" if report_metrics else "false"
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            + _tensor_block("input", input_configs()) + _tensor_block("output", output_configs())
            + f"instance_group [\n  {{\n    count: {instance_count}\n    kind: KIND_CPU\n  }}\n]\n"
            + f'parameters {{\n  key: "REPORT_CUSTOM_METRICS"\n  value: {{ string_value: "{metrics}" }}\n}}\n')


def write_model_repository(out_dir: Union[str, Path], name: str = "paged_llm",
                           options: Union[Dict[str, Any], None] = None, version: int = 1,
                           report_metrics: bool = True, validate: bool = True) -> Path:
    """Write (or overwrite) model `name` under `out_dir`; returns the model folder.

    `options` is the content of model.json (`model`, `dtype`, engine options); it is validated first
    unless `validate=False` (used to write a deliberately broken model for tests).
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"model name {name!r} must use only letters, digits, '_', '-' and '.'")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}")
    values = dict(options or {})
    if validate:
        values = parse_model_options(values).to_json()
    model_dir = Path(out_dir) / name
    version_dir = model_dir / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(name, report_metrics=report_metrics))
    (version_dir / "model.py").write_text(MODEL_PY)
    (version_dir / MODEL_JSON).write_text(json.dumps(values, indent=2) + "\n")
    return model_dir
