"""Run the real `tritonserver` shipped in the `nvidia-pytriton` wheel on a model repository.

The set-up the wheel needs on a plain machine: a backend folder holding the Python backend with the
stub for the running interpreter's version (and paged-backend's own Python-based backend beside it), the
running interpreter's libpython first on LD_LIBRARY_PATH (so the stub loads the same build as the
standard library it imports), and this environment's `bin` first on PATH (so the model imports this
environment's packages).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from paged_backend.adapters.ports import free_port

PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"


@dataclass
class TritonDistribution:
    """Where the wheel keeps the server binary, the Python backend and the per-version stubs."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def bundled_libs(self) -> Path:
        return self.root.parent.parent / "nvidia_pytriton.libs"

    def stub(self, version: str) -> Path:
        return self.root / "python_backend_stubs" / version / STUB_NAME


def find_distribution() -> TritonDistribution:
    """The tritonserver inside the installed `nvidia-pytriton` wheel, without importing pytriton."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the nvidia-pytriton wheel is not installed: pip install 'nvidia-pytriton==0.7.0' "
                           "(or `pip install -e '.[tritonserver]'`)")
    dist = TritonDistribution(Path(list(spec.submodule_search_locations)[0]) / "tritonserver")
    if not dist.binary.is_file():
        raise RuntimeError(f"no tritonserver binary at {dist.binary}")
    return dist


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backend_dir(dist: TritonDistribution, target: Path) -> Path:
    """A backend folder: `target/python` (the Python backend and the stub for this interpreter) and
    `target/paged_backend` (paged-backend's Python-based backend)."""
    from .repository import install_backend

    stub = dist.stub(python_version())
    if not stub.is_file():
        raise RuntimeError(f"the wheel has no Python-backend stub for Python {python_version()} ({stub})")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        shutil.copy2(dist.python_backend / name, python_dir / name)
    shutil.copy2(stub, python_dir / STUB_NAME)
    os.chmod(python_dir / STUB_NAME, 0o755)
    install_backend(target)
    return target


def server_env(dist: TritonDistribution, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for tritonserver and its stubs: this interpreter's libpython and venv first.

    The wheel's own libraries (`nvidia_pytriton.libs`) follow, since the copied stub no longer finds
    them through its relative RPATH.
    """
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = (libdir, str(dist.bundled_libs), env.get("LD_LIBRARY_PATH", ""))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@dataclass
class ServerConfig:
    """How to start one tritonserver; ports of 0 are replaced by free ones at start."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    allow_metrics: bool = True
    metrics_interval_ms: int = 500
    exit_timeout_secs: int = 5
    log_verbose: int = 0
    model_control_mode: Optional[str] = None        # None (load everything) or "explicit"
    load_models: Sequence[str] = ()
    extra_args: List[str] = field(default_factory=list)


class TritonServer:
    """A tritonserver child process on loopback ports; `stop()` sends SIGTERM and waits."""

    def __init__(self, config: ServerConfig, workdir: Optional[Path] = None) -> None:
        self.config = config
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="paged-triton-"))
        self._own_workdir = workdir is None
        self.shm_prefix = f"paged_triton_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.log_path = self.workdir / "tritonserver.log"
        self.process: Optional[subprocess.Popen] = None
        self._log_file = None

    # ---- addresses ---------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.config.host}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.host}:{self.config.metrics_port}/metrics"

    # ---- life cycle --------------------------------------------------------------------------
    def command(self, backend_dir: Path) -> List[str]:
        cfg = self.config
        cmd = [str(find_distribution().binary), f"--model-repository={Path(cfg.model_repository).resolve()}",
               f"--backend-directory={backend_dir}", f"--exit-timeout-secs={cfg.exit_timeout_secs}",
               f"--http-address={cfg.host}", f"--http-port={cfg.http_port}",
               f"--grpc-address={cfg.host}", f"--grpc-port={cfg.grpc_port}",
               f"--allow-metrics={str(cfg.allow_metrics).lower()}", "--allow-gpu-metrics=false",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               f"--log-verbose={cfg.log_verbose}"]
        if cfg.allow_metrics:
            cmd += [f"--metrics-address={cfg.host}", f"--metrics-port={cfg.metrics_port}",
                    f"--metrics-interval-ms={cfg.metrics_interval_ms}"]
        if cfg.model_control_mode:
            cmd.append(f"--model-control-mode={cfg.model_control_mode}")
        cmd += [f"--load-model={name}" for name in cfg.load_models]
        return cmd + list(cfg.extra_args)

    def start(self) -> "TritonServer":
        """Start the server process (returns at once; see `wait_ready`)."""
        cfg = self.config
        for name in ("http_port", "grpc_port", "metrics_port"):
            if getattr(cfg, name) == 0:
                setattr(cfg, name, free_port(cfg.host))
        dist = find_distribution()
        backend_dir = prepare_backend_dir(dist, self.workdir / "backends")
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command(backend_dir), env=server_env(dist), stdout=self._log_file,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        return self

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until the server reports ready; raise with the log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode if self.process else None}:"
                                   f"\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver was not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, wait for a clean exit (models finalized, stubs gone); SIGKILL the group if stuck."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=10)
            code = self.process.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        return code

    def cleanup(self) -> None:
        """Remove the work folder (with the log) if this object created it."""
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- inspection --------------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def child_pids(self) -> List[int]:
        """Processes whose parent is the server (its Python-backend stubs)."""
        if self.process is None:
            return []
        return children_of(self.process.pid)

    def shm_regions(self) -> List[str]:
        """This server's shared-memory regions in /dev/shm."""
        shm = Path("/dev/shm")
        return sorted(p.name for p in shm.iterdir() if p.name.startswith(self.shm_prefix)) if shm.is_dir() else []

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def children_of(pid: int) -> List[int]:
    """Pids whose parent is `pid` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM the server if the process that started it dies (no orphaned servers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
