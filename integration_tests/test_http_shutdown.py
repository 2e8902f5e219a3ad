"""Graceful shutdown of `paged-backend serve` on SIGTERM / SIGINT, and refusal of bad command lines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from http_helpers import sse_events
from http_server_process import ServerProcess


def _stream_in_background(url: str, started: threading.Event, result: dict) -> threading.Thread:
    def run() -> None:
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 400, "details": True}}
        lines = []
        try:
            with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data:"):
                        started.set()
        except httpx.HTTPError as exc:  # the server may cut the stream when it aborts the request
            result["error"] = exc
        finally:
            started.set()
            result["events"] = sse_events(lines)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_or_aborts_in_flight_and_frees_blocks(sig):
    server = ServerProcess(["tiny-llama", "--num-blocks", "32", "--shutdown-timeout", "1", "--log-level", "info"])
    try:
        url = server.wait_ready()
        started, result = threading.Event(), {}
        thread = _stream_in_background(url, started, result)
        assert started.wait(60)
        returncode = server.stop(sig)
        thread.join(60)
    finally:
        server.stop(signal.SIGKILL)
    assert returncode == 0, server.output
    assert "shut down. KV cache: 32 blocks of 16 tokens, 32 free; swap 32/32 free" in server.output
    assert "Traceback" not in server.output
    events = result["events"]
    assert events and "error" not in result, "the stream should end cleanly"
    last = events[-1]
    if "error" in last:  # aborted after the grace period: says so in TGI's error shape
        assert last["error_type"] == "incomplete_generation" and "shutting down" in last["error"]
        assert "aborted 1 request(s)" in server.output
    else:  # finished within the grace period
        assert last["details"]["generated_tokens"] == 400


def test_serve_refuses_an_unknown_model():
    proc = subprocess.run([sys.executable, "-m", "paged_backend.cli", "serve", "no-such-model", "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 2 and "unknown model 'no-such-model'" in proc.stderr


def test_serve_refuses_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "paged_backend.cli", "serve", "tiny-llama", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
