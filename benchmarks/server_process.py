"""Start an HTTP server as a child process on 127.0.0.1, wait for its ready banner, stop it cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

_READY = re.compile(r"ready on (http://\S+)")


@dataclass
class ServerProcess:
    """A running server child; `log` keeps the last lines it printed."""

    proc: subprocess.Popen
    base_url: str = ""
    log: Deque[str] = field(default_factory=lambda: deque(maxlen=200))
    ready: threading.Event = field(default_factory=threading.Event)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(list(self.log)[-lines:])

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL if it lingers; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def _pump(server: ServerProcess) -> None:
    for line in server.proc.stdout:
        line = line.rstrip("\n")
        server.log.append(line)
        match = _READY.search(line)
        if match and not server.ready.is_set():
            server.base_url = match.group(1)
            server.ready.set()


def start_server(args: List[str], env: Optional[Dict[str, str]] = None, ready_timeout: float = 300.0) -> ServerProcess:
    """Run `python -m <args...>` and wait until it prints 'ready on http://HOST:PORT'."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env)
    server = ServerProcess(proc)
    threading.Thread(target=_pump, args=(server,), daemon=True).start()
    deadline = time.monotonic() + ready_timeout
    while not server.ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server {' '.join(args[:2])} did not get ready (exit {proc.returncode}):\n"
                               f"{server.tail()}")
    return server


def paged_server_args(model: str, kv_slots: int, block_size: int, max_model_len: int) -> List[str]:
    """`paged-backend serve` (our engine) with a KV budget of `kv_slots` token slots."""
    return ["paged_backend.cli", "serve", model, "--port", "0", "--log-level", "warning",
            "--block-size", str(block_size), "--num-blocks", str(kv_slots // block_size),
            "--max-model-len", str(max_model_len)]


def baseline_server_args(model: str, policy: str, kv_slots: int, max_model_len: int,
                         allocator: str = "first-fit") -> List[str]:
    """The reservation baseline behind the same HTTP app, with single-slot blocks."""
    return ["paged_backend.benchmarks.baseline_server", model, "--policy", policy, "--allocator", allocator,
            "--block-size", "1", "--num-blocks", str(kv_slots), "--max-model-len", str(max_model_len)]
