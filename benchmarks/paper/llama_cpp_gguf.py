"""Our offline models as GGUF files, converted by llama.cpp's own `convert_hf_to_gguf.py` from the Hugging Face
directory every other server loads, at f32, f16 or bf16 (no quantization: the serving benchmark compares equal
precisions).

The converter runs in a virtual environment of its own under the cache dir (`llama.cpp-VERSION/convert-env`):
its `gguf` package (the sources' gguf-py) wants numpy 2 and it imports sentencepiece, while the project's
environment keeps numpy<2 for Triton's Python-backend stub. The pins are llama.cpp's own
(requirements/requirements-convert_hf_to_gguf.txt) except two, pinned to ours: torch, so pip can neither upgrade
it nor pull a CUDA build, and transformers, because the directory was saved by ours (its tokenizer_config names
the class `TokenizersBackend`, which the transformers 4.57.6 llama.cpp names does not know). GGUF files are named
by the model directory and its config, and reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import List

from paged_backend.benchmarks.paper.guidellm_env import _locked
from paged_backend.benchmarks.paper.llama_cpp_build import DONE, root, run_logged, sources

GGUF_TYPES = ("f32", "f16", "bf16")
# llama.cpp's requirements for convert_hf_to_gguf.py (and gguf-py's own), torch and transformers aside
CONVERTER_PINS = ("numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0", "protobuf>=4.21.0,<5.0.0", "tqdm>=4.27",
                  "pyyaml>=5.1", "requests>=2.25")


def _torch_pin() -> str:
    return f"torch=={version('torch')}"        # e.g. 2.13.0+cpu: only the CPU build satisfies it


def converter_pins() -> List[str]:
    """Every requirement of the converter's environment: llama.cpp's, with our torch and transformers."""
    return [_torch_pin(), f"transformers=={version('transformers')}", *CONVERTER_PINS]


def converter_env() -> Path:
    """The converter's virtual environment, keyed by its pins (built once, minutes, from the package index)."""
    return root() / f"convert-env-{hashlib.sha256(' '.join(converter_pins()).encode()).hexdigest()[:8]}"


def ensure_converter_env() -> Path:
    """Build the converter's environment unless it is complete; its python."""
    venv = converter_env()
    with _locked(root() / ".convert-env.lock"):
        if not (venv / DONE).exists():
            print(f"building llama.cpp's converter environment in {venv} (once)", flush=True)
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
            constraints = venv / "constraints.txt"
            constraints.write_text(_torch_pin() + "\n")
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-c",
                   str(constraints)]
            run_logged([*pip, _torch_pin()], venv / "install.log", timeout=1800)
            run_logged([*pip, *converter_pins()[1:]], venv / "install.log", timeout=1800)
            (venv / DONE).write_text("\n".join(converter_pins()) + "\n")
    return venv / "bin" / "python"


def gguf_path(model_dir: Path, outtype: str) -> Path:
    """Where the GGUF of a Hugging Face directory at `outtype` goes (named by the directory and its config)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(str(model_dir.resolve()).encode() + (model_dir / "config.json").read_bytes())
    return root() / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:12]}-{outtype}.gguf"


def convert_command(python: Path, src: Path, model_dir: Path, outtype: str, outfile: Path) -> List[str]:
    """llama.cpp's converter on a Hugging Face directory, at one precision, into one file."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF precision must be one of {', '.join(GGUF_TYPES)}, got {outtype!r}")
    return [str(python), str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype, "--outfile",
            str(outfile)]


def convert(model_dir: Path, outtype: str) -> Path:
    """`model_dir` as a GGUF of `outtype` (f32, f16, bf16), converted once by llama.cpp's converter."""
    target = gguf_path(model_dir, outtype)
    if target.exists():
        return target
    src = sources()
    python = ensure_converter_env()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp")
    try:
        run_logged(convert_command(python, src, Path(model_dir), outtype, tmp), target.parent / "convert.log",
                   timeout=1800, env={"PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"})
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
