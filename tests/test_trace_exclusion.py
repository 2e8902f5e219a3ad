"""The gate between model forwards and dynamo's traces (paged_backend/worker/trace_exclusion.py), with threads."""

from __future__ import annotations

import threading
import time

import paged_backend.worker.trace_exclusion as trace_exclusion
from paged_backend.worker.trace_exclusion import TraceExclusion


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_forwards_run_side_by_side_and_a_trace_waits_for_them():
    gate, events = TraceExclusion(), []
    first_in, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def forward(entered):
        with gate.forward():
            entered.set()
            release.wait(5)
            events.append("forward done")

    def trace():
        with gate.trace():
            events.append("trace")

    a, b = _started(lambda: forward(first_in)), _started(lambda: forward(second_in))
    assert first_in.wait(5) and second_in.wait(5)   # two forwards at once
    t = _started(trace)
    time.sleep(0.2)
    assert events == []                             # the trace waits for both
    release.set()
    for thread in (a, b, t):
        thread.join(5)
    assert events == ["forward done", "forward done", "trace"]


def test_a_waiting_trace_lets_no_new_forward_in_and_the_backend_lets_them_through():
    gate, events = TraceExclusion(), []
    traced, in_backend, leave_backend = threading.Event(), threading.Event(), threading.Event()

    def trace():
        with gate.trace():
            traced.set()
            time.sleep(0.2)
            events.append("traced")
            with gate.backend_runs():
                in_backend.set()
                leave_backend.wait(5)
            events.append("guards")

    def forward(name):
        with gate.forward():
            events.append(name)

    t = _started(trace)
    assert traced.wait(5)
    f = _started(lambda: forward("forward during the trace"))
    assert in_backend.wait(5)
    f.join(5)                                        # let in once the backend runs
    g = _started(lambda: forward("forward during the backend"))
    g.join(5)
    leave_backend.set()
    t.join(5)
    assert events == ["traced", "forward during the trace", "forward during the backend", "guards"]


def test_back_from_the_backend_a_trace_waits_for_a_running_forward_at_most_the_drain_timeout(monkeypatch):
    monkeypatch.setattr(trace_exclusion, "DRAIN_TIMEOUT_S", 0.3)
    gate = TraceExclusion()
    in_backend, forward_in, release = threading.Event(), threading.Event(), threading.Event()
    took = []

    def trace():
        with gate.trace():
            with gate.backend_runs():
                in_backend.set()
                forward_in.wait(5)
            took.append(time.monotonic())

    def forward():
        with gate.forward():
            forward_in.set()
            release.wait(5)   # a forward that would wait for the tracing thread (dynamo's compile lock)

    t = _started(trace)
    assert in_backend.wait(5)
    began = time.monotonic()
    f = _started(forward)
    t.join(5)
    assert not t.is_alive() and 0.25 <= took[0] - began < 3
    release.set()
    f.join(5)
    with gate.forward():   # the gate is open again
        pass


def test_backend_runs_outside_a_trace_changes_nothing():
    gate = TraceExclusion()
    with gate.backend_runs():
        with gate.forward():
            pass
