"""Start an HTTP server as a child process on 127.0.0.1, wait for its ready line, sample its CPU time, stop it."""

from __future__ import annotations

import bisect
import os
import re
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Pattern, Tuple

OUR_READY = re.compile(r"ready on (http://\S+)")          # paged-backend serve and the baseline server
UVICORN_READY = re.compile(r"Uvicorn running on (http://\S+)")


@dataclass
class ServerProcess:
    """A running server child; `log` keeps the last lines it printed."""

    proc: subprocess.Popen
    ready_pattern: Pattern
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
        match = server.ready_pattern.search(line)
        if match and not server.ready.is_set():
            server.base_url = match.group(1).rstrip("/")
            server.ready.set()


def launch(argv: List[str], ready_pattern: Pattern = OUR_READY, env: Optional[Dict[str, str]] = None
           ) -> ServerProcess:
    """Start `argv` (stdout and stderr read line by line); does not wait (see `wait_ready`)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    server = ServerProcess(proc, ready_pattern)
    threading.Thread(target=_pump, args=(server,), daemon=True).start()
    return server


def wait_ready(server: ServerProcess, ready_timeout: float = 300.0) -> ServerProcess:
    """Wait until the server prints its ready line; stops it and raises if it exits or takes too long."""
    deadline = time.monotonic() + ready_timeout
    while not server.ready.wait(0.2):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server {' '.join(server.proc.args[:4])} did not get ready "
                               f"(exit {server.proc.returncode}):\n{server.tail()}")
    return server


def start_server(argv: List[str], env: Optional[Dict[str, str]] = None, ready_timeout: float = 300.0,
                 ready_pattern: Pattern = OUR_READY) -> ServerProcess:
    """Start a server and wait until it is ready."""
    return wait_ready(launch(argv, ready_pattern, env), ready_timeout)


def _own_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU time of one process (all its threads) from /proc; None where it cannot be read."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> List[int]:
    """The live child processes of `pid` (/proc/PID/task/TID/children of each of its threads)."""
    children: List[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(child) for child in f.read().split()]
    except OSError:
        pass
    return children


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU time of a process and its live descendants (a server may run its model in a process it
    spawned, as transformers 5.25's `serve` does) from /proc; None where the process cannot be read."""
    total = _own_cpu_seconds(pid)
    if total is None:
        return None
    pending = _children(pid)
    while pending:
        child = pending.pop()
        total += _own_cpu_seconds(child) or 0.0
        pending += _children(child)
    return total


def busy_ticks(line: str) -> Optional[int]:
    """Clock ticks of work in /proc/stat's all-cores `cpu` line: user, nice, system, irq and softirq (guest time is
    inside user; idle, iowait and steal, the hypervisor's time elsewhere, are not work here); None for any other
    line."""
    fields = line.split()
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[1:8])
    return user + nice + system + irq + softirq


def machine_cpu_seconds() -> Optional[float]:
    """CPU seconds every process of the machine has used since boot, all cores together; None where /proc/stat
    cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = busy_ticks(f.readline())
    except OSError:
        return None
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """Samples a process's CPU seconds, and the whole machine's, against wall-clock time in a thread, so the cores
    each kept busy in any window (e.g. one guidellm benchmark) can be read afterwards: what the machine used
    beyond the server is its load generator's and anything else running."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: List[Tuple[float, float]] = []
        self.machine: List[Tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            cpu, machine = cpu_seconds(self.pid), machine_cpu_seconds()
            now = time.time()
            if cpu is not None:
                self.samples.append((now, cpu))
            if machine is not None:
                self.machine.append((now, machine))
            if self._stop.wait(self.interval_s):
                return

    def busy_cores(self, start: float, end: float) -> Optional[float]:
        """The process's CPU seconds per wall second between two epoch times (interpolated between samples)."""
        return _rate(self.samples, start, end)

    def machine_busy_cores(self, start: float, end: float) -> Optional[float]:
        """The whole machine's CPU seconds per wall second between two epoch times (at most its core count)."""
        return _rate(self.machine, start, end)


def _rate(samples: List[Tuple[float, float]], start: float, end: float) -> Optional[float]:
    """Growth per second of a sampled counter between two times, interpolated; None outside the samples."""
    if end <= start or len(samples) < 2:
        return None
    times = [t for t, _ in samples]
    if start < times[0] or end > times[-1]:
        return None
    return (_at(samples, times, end) - _at(samples, times, start)) / (end - start)


def _at(samples: List[Tuple[float, float]], times: List[float], when: float) -> float:
    i = min(max(bisect.bisect_left(times, when), 1), len(times) - 1)
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)
