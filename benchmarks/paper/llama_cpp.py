"""llama.cpp's own server (`llama-server`), built from the llama.cpp sources that the PyPI source distribution of
`llama-cpp-python` carries, and our offline models converted to GGUF with llama.cpp's own converter: the CPU
user's alternative, as a peer in the serving benchmark.

Everything lands under the cache dir (`$PAGED_BACKEND_CACHE`, default ~/.cache/paged_backend) in
`llama.cpp-VERSION/`: the sdist and its sources once, one build per CPU (`-DGGML_NATIVE=ON` compiles for the
instruction sets of the machine that builds it, so the build folder is named by a hash of the CPU's flags), and
GGUF files per model and precision. Nothing is rebuilt or reconverted when present. `make bench` builds it
(`python -m paged_backend.benchmarks.paper.llama_cpp`); tests never do. `PAGED_BENCH_LLAMA_SERVER=/path` uses
an existing `llama-server` instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional

from paged_backend.benchmarks.paper.guidellm_env import _locked

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GGUF_TYPES = ("f32", "f16", "bf16")
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DBUILD_SHARED_LIBS=OFF"]
_DONE = ".paged-backend-complete"


def root() -> Path:
    from paged_backend.worker.loader import cache_dir

    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def _run(argv: List[str], log: Path, cwd: Optional[Path] = None, timeout: float = 3600,
         env: Optional[dict] = None) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})})
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed with exit code {done.returncode}; log {log}:\n{tail}")


def sources() -> Path:
    """llama.cpp's source tree from the sdist (downloaded with pip and unpacked once)."""
    target = root() / "src"
    if (target / _DONE).exists():
        return target / "llama.cpp"
    with _locked(root() / ".sources.lock"):
        if (target / _DONE).exists():
            return target / "llama.cpp"
        download = root() / "sdist"
        download.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--no-binary",
              ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(download)],
             root() / "download.log", timeout=1800)
        archive = next(download.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
        shutil.rmtree(target, ignore_errors=True)
        unpacked = Path(tempfile.mkdtemp(prefix="unpack.", dir=root()))
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        vendored = unpacked / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        target.mkdir(parents=True)
        vendored.rename(target / "llama.cpp")
        shutil.rmtree(unpacked, ignore_errors=True)
        (target / _DONE).touch()
    return target / "llama.cpp"


def cpu_key() -> str:
    """What a -DGGML_NATIVE=ON build depends on: the machine and its CPU's feature flags (hashed)."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:12]


def build_dir() -> Path:
    return root() / f"build-{cpu_key()}"


def server_path() -> Optional[Path]:
    """The built `llama-server` for this CPU ($PAGED_BENCH_LLAMA_SERVER if set), or None if not built yet."""
    given = os.environ.get("PAGED_BENCH_LLAMA_SERVER")
    if given:
        return Path(given)
    binary = build_dir() / "bin" / "llama-server"
    return binary if (build_dir() / _DONE).exists() and binary.exists() else None


def build_server(jobs: Optional[int] = None) -> Path:
    """Build `llama-server` for this CPU (once; 10-20 minutes on 2 cores) and return its path."""
    found = server_path()
    if found is not None:
        return found
    src = sources()
    with _locked(root() / ".build.lock"):
        found = server_path()
        if found is not None:
            return found
        folder = build_dir()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        log = folder / "build.log"
        _run(["cmake", "-S", str(src), "-B", str(folder), *CMAKE_FLAGS], log, timeout=1800)
        _run(["ninja", "-C", str(folder), f"-j{jobs or os.cpu_count() or 1}", "llama-server"], log, timeout=7200)
        (folder / _DONE).touch()
    return folder / "bin" / "llama-server"


def gguf_path(model_dir: Path, outtype: str) -> Path:
    """Where the GGUF of a Hugging Face directory at `outtype` goes (named by the directory and its config)."""
    digest = hashlib.sha256(str(Path(model_dir).resolve()).encode()
                            + (Path(model_dir) / "config.json").read_bytes()).hexdigest()[:12]
    return root() / "gguf" / f"{Path(model_dir).name}-{digest}-{outtype}.gguf"


def convert(model_dir: Path, outtype: str) -> Path:
    """`model_dir` as a GGUF of `outtype` (f32, f16, bf16), by llama.cpp's `convert_hf_to_gguf.py` (once)."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"outtype must be one of {GGUF_TYPES}, got {outtype!r}")
    target = gguf_path(model_dir, outtype)
    if target.exists():
        return target
    src = sources()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
              "--outfile", str(tmp)], target.parent / "convert.log", timeout=1800,
             env={"PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"})
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="build llama.cpp's server and convert the benchmark model (once)")
    parser.add_argument("--model", default="smollm2", help="model preset or HF directory to convert")
    parser.add_argument("--outtypes", default="f32,f16,bf16", help="GGUF precisions to convert")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    args = parser.parse_args(argv)
    from paged_backend.benchmarks.paper.serving_systems import served_model_dir

    print(f"llama-server: {build_server(args.jobs)}")
    for outtype in filter(None, args.outtypes.split(",")):
        print(f"{outtype} GGUF: {convert(served_model_dir(args.model), outtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
