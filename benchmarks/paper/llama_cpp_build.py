"""llama.cpp's own server (`llama-server`), built from the llama.cpp sources that the PyPI source distribution of
`llama-cpp-python` carries (vendor/llama.cpp): the CPU user's alternative, a peer in the serving benchmark.

Everything lives under the cache dir ($PAGED_BACKEND_CACHE, default ~/.cache/paged_backend) in
`llama.cpp-VERSION/`, never in the repository: the sdist and its unpacked sources once, and one build per CPU
(`-DGGML_NATIVE=ON` compiles for the instruction sets of the machine that builds it, so the build folder is named
by a hash of the CPU's flags). An interrupted build resumes where it stopped (cmake and ninja are incremental).
`PAGED_BENCH_LLAMA_SERVER=/path` uses an existing `llama-server` instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from paged_backend.benchmarks.paper.guidellm_env import _locked

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CMAKE_FLAGS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DGGML_CCACHE=OFF")
SERVER_TARGET = "llama-server"
DONE = ".paged-backend-complete"


def root() -> Path:
    """The folder of everything llama.cpp: sdist, sources, builds, converter environment, GGUF files."""
    from paged_backend.worker.loader import cache_dir

    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def run_logged(argv: List[str], log: Path, cwd: Optional[Path] = None, timeout: float = 3600,
               env: Optional[Dict[str, str]] = None) -> None:
    """Run a build step with its output appended to `log`; a failure raises with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})})
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed with exit code {done.returncode}; log {log}:\n{tail}")


def sdist_command(download_dir: Path) -> List[str]:
    """pip's download of the llama-cpp-python source distribution (no wheel, no dependencies)."""
    return [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--no-binary",
            ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(download_dir)]


def sources() -> Path:
    """llama.cpp's source tree from the sdist (downloaded with pip and unpacked once)."""
    target = root() / "src"
    if (target / DONE).exists():
        return target / "llama.cpp"
    with _locked(root() / ".sources.lock"):
        if not (target / DONE).exists():
            _unpack(_download(), target)
    return target / "llama.cpp"


def _download() -> Path:
    folder = root() / "sdist"
    found = list(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        run_logged(sdist_command(folder), root() / "download.log", timeout=1800)
        found = list(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    return found[0]


def _unpack(archive: Path, target: Path) -> None:
    """The sdist's vendor/llama.cpp into `target`."""
    shutil.rmtree(target, ignore_errors=True)
    unpacked = Path(tempfile.mkdtemp(prefix="unpack.", dir=root()))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        top = unpacked / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
        target.mkdir(parents=True)
        (top / "vendor" / "llama.cpp").rename(target / "llama.cpp")
        (target / DONE).touch()
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def llama_cpp_commit(changelog: str) -> Optional[str]:
    """The llama.cpp commit a llama-cpp-python release vendors, from its CHANGELOG's entry for that release."""
    entry = re.search(rf"^## \[{re.escape(LLAMA_CPP_PYTHON_VERSION)}\]\s*$(.*?)(?=^## |\Z)", changelog, re.M | re.S)
    commit = entry and re.search(r"ggml-org/llama\.cpp@([0-9a-f]{7,40})", entry.group(1))
    return commit.group(1) if commit else None


def vendored_commit() -> Optional[str]:
    """The llama.cpp commit our sdist carries (read from the sdist's CHANGELOG), for the benchmark record."""
    with tarfile.open(_download()) as tar:
        member = tar.extractfile(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/CHANGELOG.md")
        return llama_cpp_commit(member.read().decode()) if member else None


def cpu_key(cpuinfo: Optional[str] = None, machine: Optional[str] = None) -> str:
    """What a -DGGML_NATIVE=ON build depends on: the machine and its CPU's feature flags, hashed."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(((machine or platform.machine()) + flags).encode()).hexdigest()[:12]


def build_dir() -> Path:
    return root() / f"build-{cpu_key()}"


def cmake_command(src: Path, build: Path) -> List[str]:
    return ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS]


def ninja_command(build: Path, jobs: int) -> List[str]:
    return ["ninja", "-C", str(build), f"-j{jobs}", SERVER_TARGET]


def server_path() -> Optional[Path]:
    """The `llama-server` to run ($PAGED_BENCH_LLAMA_SERVER if set), or None if this CPU's build is not done."""
    given = os.environ.get("PAGED_BENCH_LLAMA_SERVER")
    if given:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"PAGED_BENCH_LLAMA_SERVER={given} is not an executable file")
        return path
    binary = build_dir() / "bin" / SERVER_TARGET
    return binary if (build_dir() / DONE).exists() and binary.is_file() else None


def build_server(jobs: Optional[int] = None) -> Path:
    """Build `llama-server` for this CPU (once: 15-30 minutes on 2 cores) and return its path."""
    found = server_path()
    if found is not None:
        return found
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs `{tool}` on PATH (e.g. apt-get install cmake ninja-build)")
    src = sources()
    with _locked(root() / ".build.lock"):
        folder = build_dir()
        if not (folder / DONE).exists():
            print(f"building llama.cpp's {SERVER_TARGET} in {folder} (once per CPU; 15-30 minutes on 2 cores)",
                  flush=True)
            log = folder / "build.log"
            run_logged(cmake_command(src, folder), log, timeout=1800)
            run_logged(ninja_command(folder, jobs or os.cpu_count() or 1), log, timeout=7200)
            (folder / DONE).touch()
    return folder / "bin" / SERVER_TARGET
