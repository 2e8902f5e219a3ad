"""CUDA graph capture against the garbage collector and transient failures (no CUDA here: the capture of one
bucket is a stand-in; what is tested is what `_capture_all` does around it).

On an H100 (2026-12-05) one engine's capture failed with cudaErrorStreamCaptureInvalidated right after another
engine of the process was shut down, and every decode step of it ran eagerly (3.7x slower). A collection of the
dead engine's reference cycles inside a capture frees CUDA objects (graphs and their memory pools, events,
pinned buffers) in the capturing thread, which a capture in CUDA's global mode does not allow.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from paged_backend.worker.cuda_graphs import DecodeGraphs, GraphStats


class _Finalized:
    """A reference cycle whose collection is observable (as a dead engine's CUDA objects would be)."""

    collected = 0

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        type(self).collected += 1


def _graphs(monkeypatch, capture) -> DecodeGraphs:
    """A DecodeGraphs with three buckets whose per-bucket capture is `capture(bucket)`; CUDA calls stubbed."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs = object.__new__(DecodeGraphs)
    graphs.device, graphs.buckets, graphs.graphs, graphs.outputs = torch.device("cpu"), [1, 2, 4], {}, {}
    graphs.stats = GraphStats(True)

    def one(bucket, pool):
        capture(bucket)
        graphs.graphs[bucket] = graphs.outputs[bucket] = bucket

    graphs._capture = one
    return graphs


def test_dead_cycles_are_collected_before_capture_and_none_during_it(monkeypatch):
    seen = []
    graphs = _graphs(monkeypatch, lambda bucket: seen.append((bucket, gc.isenabled(), _Finalized.collected)))
    _Finalized.collected = 0
    _Finalized()   # garbage only a collection frees
    assert gc.isenabled()
    graphs._capture_all()
    assert seen == [(4, False, 1), (2, False, 1), (1, False, 1)]
    assert gc.isenabled()   # given back afterwards
    assert graphs.stats.error is None and graphs.stats.buckets == [1, 2, 4]


def test_collection_is_given_back_when_capture_fails_and_left_off_when_it_was_off(monkeypatch):
    def fail(bucket):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    graphs = _graphs(monkeypatch, fail)
    graphs._capture_all()
    assert "operation not permitted" in graphs.stats.error and graphs.graphs == {} and gc.isenabled()
    gc.disable()
    try:
        _graphs(monkeypatch, lambda bucket: None)._capture_all()
        assert not gc.isenabled()   # a caller that turned collection off keeps it off
    finally:
        gc.enable()


def test_a_capture_invalidated_once_is_retried(monkeypatch):
    calls = []

    def once_invalidated(bucket):
        calls.append(bucket)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    graphs = _graphs(monkeypatch, once_invalidated)
    graphs._capture_all()
    assert calls == [4, 2, 4, 2, 1]   # the second attempt starts over: no graph of the first is kept
    assert graphs.stats.error is None and graphs.stats.buckets == [1, 2, 4]
    assert "previous error during capture" in graphs.stats.retried_after
    assert graphs.stats.as_dict()["retried_after"] == graphs.stats.retried_after


def test_a_capture_that_fails_twice_runs_eagerly(monkeypatch):
    calls = []

    def failing(bucket):
        calls.append(bucket)
        raise RuntimeError(f"capture failure {len(calls)}")

    graphs = _graphs(monkeypatch, failing)
    graphs._capture_all()
    assert calls == [4, 4]   # two attempts, no more
    assert graphs.stats.error == "RuntimeError: capture failure 2" and graphs.graphs == {} and graphs.outputs == {}
    assert graphs.stats.buckets == []
