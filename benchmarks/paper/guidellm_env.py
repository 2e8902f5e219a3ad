"""guidellm (the vLLM project's load generator) in a virtual environment of its own inside the project's
`.venv` (`.venv/guidellm-VERSION`), built by `make install` (`python -m paged_backend.benchmarks.paper.guidellm_env`)
and reused until `make clean`. It cannot share the project's environment: guidellm pulls numpy 2, and Triton's
Python-backend stub needs numpy<2 (its string tensors break silently under numpy 2). The same CPU torch as ours
is pinned there, so pip can neither upgrade it nor pull a CUDA build.

`PAGED_BENCH_GUIDELLM=/path/to/guidellm` uses an existing guidellm executable instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

GUIDELLM_VERSION = "0.8.1"
_MARKER = ".paged-backend-complete"


def venv_dir() -> Path:
    """Where the guidellm environment lives: beside this interpreter's packages, in its virtual environment."""
    return Path(sys.prefix) / f"guidellm-{GUIDELLM_VERSION}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock, so two benchmark runs never build the same environment at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _torch_pin() -> str:
    import torch

    return f"torch=={torch.__version__}"   # e.g. 2.13.0+cpu: only the CPU build satisfies it


def _pip(venv: Path, args: List[str], log: Path) -> None:
    with open(log, "a") as out:
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                               *args], stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"installing guidellm's environment failed (pip {' '.join(args)}); log {log}:\n{tail}")


def _build(venv: Path) -> None:
    if venv.exists():
        shutil.rmtree(venv)  # a half-built environment from an interrupted run
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    log = venv / "install.log"
    pin = _torch_pin()
    constraints = venv / "constraints.txt"
    constraints.write_text(pin + "\n")
    _pip(venv, ["-c", str(constraints), pin], log)
    _pip(venv, ["-c", str(constraints), f"guidellm=={GUIDELLM_VERSION}"], log)
    (venv / _MARKER).write_text(f"guidellm=={GUIDELLM_VERSION}\n{pin}\n")


def ensure_environment() -> Path:
    """Build guidellm's environment unless it is complete (minutes, from the package index); its folder."""
    venv = venv_dir()
    with _locked(venv.parent / f".guidellm-{GUIDELLM_VERSION}.lock"):
        if not (venv / _MARKER).exists():
            print(f"building guidellm {GUIDELLM_VERSION}'s environment in {venv} (once)", flush=True)
            _build(venv)
    return venv


def guidellm_executable() -> Path:
    """The guidellm command to run: $PAGED_BENCH_GUIDELLM, else the environment `make install` built."""
    override = os.environ.get("PAGED_BENCH_GUIDELLM")
    if override:
        path = Path(override)
        if not path.is_file():
            raise ValueError(f"PAGED_BENCH_GUIDELLM={override} is not a file")
        return path
    venv = venv_dir()
    if not (venv / _MARKER).exists():
        raise RuntimeError(f"guidellm is not installed in {venv}: `make install` builds it (or run `python -m "
                           f"paged_backend.benchmarks.paper.guidellm_env`, or set PAGED_BENCH_GUIDELLM to a guidellm)")
    return venv / "bin" / "guidellm"


if __name__ == "__main__":
    print(f"guidellm {GUIDELLM_VERSION}: {ensure_environment() / 'bin' / 'guidellm'}")
