"""CUDA graph capture beside a dead engine: does a garbage collection inside a capture invalidate it, and does the
engine's own capture hold collections off (issue 22; `worker/cuda_graphs.py`, `_no_collection`)?

Run on a CUDA machine: `python -m paged_backend.benchmarks.gpu.gpu_capture --output DIR`. (1) For a dead engine
with CUDA graphs and one without (tiny-llama, float32, one request run, shut down and left in a reference cycle so
that only a collection frees it), a one-operation graph is captured with a collection inside the capture: does
CUDA invalidate it? (2) `--rounds` times, a dead engine with graphs left in a cycle, then a new engine with graphs:
its capture's error and retry (none expected), and whether the dead engine was freed.
Importable without a GPU; `main` refuses to run without one. Writes `gpu_capture.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import weakref
from pathlib import Path
from typing import Optional, Sequence

import torch

from paged_backend import LLMEngine, SamplingParams
from paged_backend.worker.loader import load_model


def _engine(model, graphs: bool) -> LLMEngine:
    return LLMEngine(model, device="cuda", num_blocks=64, block_size=16, max_num_seqs=8, enforce_eager=not graphs)


def _dead_engine(model, graphs: bool) -> weakref.ref:
    """An engine that ran one request and was shut down, in a reference cycle: freed only by a collection."""
    engine = _engine(model, graphs)
    engine.add_request("0", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    engine.dead_cycle = engine
    return weakref.ref(engine)


def collection_inside_a_capture(model, graphs: bool) -> dict:
    """Capture `x * 2 + 1` with a collection between the two operations, a dead engine waiting to be freed."""
    gc.collect()
    dead = _dead_engine(model, graphs)
    x = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    graph, error = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            y = x * 2
            gc.collect()
            y = y + 1
    except Exception as exc:  # noqa: BLE001 - the outcome being measured
        error = f"{type(exc).__name__}: {exc}"[:300]
    torch.cuda.synchronize()
    return {"dead_engine_graphs": graphs, "dead_engine_freed": dead() is None, "capture_error": error}


def capture_beside_a_dead_engine(model) -> dict:
    """A new engine's capture while an engine with graphs waits in a cycle to be freed."""
    gc.collect()
    dead = _dead_engine(model, True)
    engine = _engine(model, True)
    stats = engine.runner.graphs.stats
    row = {"error": stats.error, "retried_after": stats.retried_after, "buckets": len(stats.buckets),
           "dead_engine_freed": dead() is None}
    engine.shutdown()
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="folder for gpu_capture.json")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_capture needs a CUDA GPU (none found); nothing was run.", file=sys.stderr)
        return 2
    model, _ = load_model("tiny-llama", dtype=torch.float32, device="cuda")
    _engine(model, True).shutdown()   # Triton compiles and cuBLAS warms up before anything is observed
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "collection_inside_a_capture": [collection_inside_a_capture(model, g) for g in (True, False)],
              "engine_capture_beside_a_dead_engine": [capture_beside_a_dead_engine(model) for _ in range(args.rounds)]}
    print(json.dumps(result, indent=1))
    if args.output:
        folder = Path(args.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu_capture.json").write_text(json.dumps(result, indent=2))
    rounds = result["engine_capture_beside_a_dead_engine"]
    return 0 if all(r["error"] is None and r["retried_after"] is None and r["dead_engine_freed"] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
