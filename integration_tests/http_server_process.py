"""Start `paged-backend serve` as a subprocess on a free loopback port and stop it (no orphans)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

import httpx

READY = re.compile(r"ready on (http://\S+)")
HTTP_API_KEY = "test-key-123"
HTTP_MODEL = "tiny-llama"
# 48 blocks of 16 tokens = 768 tokens: less than the model's 1024-token context, so "too long for the
# KV cache" and "too long for the context" are different failures, and 64 concurrent requests preempt.
HTTP_NUM_BLOCKS = 48
AUTH = {"Authorization": f"Bearer {HTTP_API_KEY}"}


class ServerProcess:
    """`python -m paged_backend.cli serve ARGS --port 0`; the port is read from the ready line."""

    def __init__(self, args: List[str]) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paged_backend.cli", "serve", *args, "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: List[str] = []
        self.url: Optional[str] = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 180.0) -> str:
        """The base URL once the server answers /health; raises with its output if it dies or hangs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output}")
            if self.url is None:
                for line in list(self.lines):
                    match = READY.search(line)
                    if match:
                        self.url = match.group(1)
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait for it; kill it if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode
