"""Loopback ports for servers we start (tritonserver, benchmark peers) that cannot report a port they chose."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path
from typing import Tuple

_GIVEN: set = set()
_LOCK = threading.Lock()


def ephemeral_range() -> Tuple[int, int]:
    """The ports the kernel numbers sockets from by itself (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` free now, outside the ephemeral range and not given before in this process. A server binds
    its port seconds after it is chosen (after loading a model, compiling, joining a process group); a port of the
    ephemeral range could meanwhile become any socket's that the kernel numbers itself (a client's connection,
    gloo's listeners), and two servers started side by side must not get the same one."""
    low, high = ephemeral_range()
    candidates = range(10000, low) if low > 11000 else range(high + 1, 65536)
    if len(candidates) < 1000:   # the ephemeral range covers nearly every port: take one of it, as bind(0) does
        candidates = range(max(low, 1024), min(high, 65535) + 1)
    with _LOCK:
        for _ in range(1000):
            port = random.choice(candidates)
            if port in _GIVEN:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1}")
