"""The compute thread (paged_backend/worker/compute_thread.py): an overlapped engine builds itself and runs every
forward there, so a process has one OpenMP team; an engine without overlap runs where it is called, and
`AsyncLLMEngine` steps such an engine on the compute thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import AsyncLLMEngine, LLMEngine, SamplingParams
from paged_backend.worker import compute_thread


def record_threads(engine, seen: list) -> None:
    """Wrap the runner's forward so that every call notes its thread."""
    execute = engine.runner.execute

    def noting(inputs):
        seen.append(threading.get_ident())
        return execute(inputs)

    engine.runner.execute = noting


def compute_ident() -> int:
    return compute_thread.compute_executor().submit(threading.get_ident).result()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_overlapped_engine_builds_and_steps_on_the_compute_thread(overlap, monkeypatch):
    model, tok = get_model("tiny-llama")
    built = []
    make_runner = LLMEngine._make_runner
    monkeypatch.setattr(LLMEngine, "_make_runner", lambda self: built.append(threading.get_ident()) or make_runner(self))
    engine = LLMEngine(model, tokenizer=tok, num_blocks=32, async_scheduling=overlap)
    seen: list = []
    record_threads(engine, seen)
    engine.add_request("r", "Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    where = compute_ident() if overlap else threading.get_ident()
    assert built == [where] and seen and set(seen) == {where}
    assert engine.overlapped is overlap
    assert_no_leaks(engine)
    engine.shutdown()


def test_run_on_compute_thread_runs_inline_there_and_carries_exceptions():
    ident = compute_ident()
    assert compute_thread.run_on_compute_thread(threading.get_ident) == ident
    # called from the compute thread itself: at once, not queued behind itself (which would never return)
    nested = compute_thread.run_on_compute_thread(compute_thread.run_on_compute_thread, threading.get_ident)
    assert nested == ident and not compute_thread.on_compute_thread()

    def fails():
        raise ValueError("from the compute thread")

    with pytest.raises(ValueError, match="from the compute thread"):
        compute_thread.run_on_compute_thread(fails)


def test_shutting_an_engine_down_leaves_the_shared_compute_thread_to_the_others():
    model, tok = get_model("tiny-llama")
    first = LLMEngine(model, tokenizer=tok, num_blocks=32, async_scheduling=True)
    second = LLMEngine(model, tokenizer=tok, num_blocks=32, async_scheduling=True)
    first.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        first._worker.submit(lambda: None)
    second.add_request("r", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while second.has_unfinished_requests():
        second.step()
    assert_no_leaks(second)
    second.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_async_engine_steps_an_engine_without_overlap_on_the_compute_thread(overlap):
    model, tok = get_model("tiny-llama")
    engine = AsyncLLMEngine(model, tokenizer=tok, num_blocks=32, async_scheduling=overlap)
    seen: list = []
    record_threads(engine.engine, seen)

    async def run():
        final = None
        async for out in engine.generate("Hello there", SamplingParams(temperature=0, max_tokens=4,
                                                                        ignore_eos=True), "r"):
            final = out
        await engine.shutdown()
        return final

    final = asyncio.run(run())
    assert len(final.outputs[0].token_ids) == 4
    assert seen and set(seen) == {compute_ident()}


def test_a_job_runs_with_the_callers_torch_thread_count():
    """OpenMP's thread count is per thread: a count the caller set after the compute thread started reaches it
    with each job (a 1-thread benchmark or test must not run its forwards on 2)."""
    import torch

    before = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert compute_thread.run_on_compute_thread(torch.get_num_threads) == count
            assert compute_thread.submit(torch.get_num_threads).result() == count
    finally:
        torch.set_num_threads(before)


def test_an_overlapped_engine_stepped_from_the_compute_thread_runs_its_steps_inline():
    """A step submitted to the compute thread from the compute thread would wait behind itself forever: there the
    engine runs its steps inline (in a subprocess, so that a regression hangs only it)."""
    import subprocess
    import sys

    script = (
        "from conftest import get_model\n"
        "from paged_backend import LLM, SamplingParams\n"
        "from paged_backend.worker.compute_thread import run_on_compute_thread\n"
        "def run():\n"
        "    model, tok = get_model('tiny-llama')\n"
        "    llm = LLM(model, tokenizer=tok, num_blocks=32, async_scheduling=True)\n"
        "    out = llm.generate(['Hello'], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "    return len(out[0].outputs[0].token_ids)\n"
        "print('tokens', run_on_compute_thread(run))\n")
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", script], cwd=here, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens 4" in done.stdout


@pytest.mark.parametrize("uses_scratch_dir", [False, True])
def test_a_benchmark_runs_on_the_compute_thread(uses_scratch_dir, tmp_path):
    """A benchmark compares systems in one process (our engines, transformers' generate): all of its torch work
    runs on the compute thread, so the systems share one OpenMP team (a baseline on the main thread would pay the
    two-team throttle our engine no longer pays)."""
    from paged_backend.benchmarks.harness.report import BenchmarkSpec

    seen = []

    def run(config, *scratch):
        seen.append((compute_thread.on_compute_thread(), scratch))
        torch.set_num_threads(1)                 # what a benchmark's set_threads does
        return {"ok": True}

    spec = BenchmarkSpec("probe", dict, run, lambda r: [], lambda r: "", "plot_none", {"quick": {}}, "quick",
                         uses_scratch_dir=uses_scratch_dir)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert spec.execute({}, tmp_path) == {"ok": True}
        assert seen == [(True, (tmp_path,) if uses_scratch_dir else ())]
        assert torch.get_num_threads() == 1      # the report records the thread count the benchmark chose
    finally:
        torch.set_num_threads(threads)


def test_a_callers_openmp_helpers_are_released_when_it_hands_work_to_the_compute_thread():
    """libgomp spins its helpers between parallel regions only while the process holds no more of them than it has
    cores; a caller that ran one parallel operator of its own (a user's main thread) keeps a helper, and every
    step's regions then wake sleeping helpers (smollm2 bfloat16 batch-1 steps 7.4-10 -> 15-21 ms on 2 cores).
    Handing work to the compute thread releases the caller's helpers (in a subprocess: a fresh thread layout)."""
    import subprocess
    import sys

    code = """
import os, torch
from paged_backend.worker import compute_thread
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
compute_thread.run_on_compute_thread(lambda: torch.ones(1 << 22).sum())   # the compute thread and its helper
alone = threads()
torch.ones(1 << 22).sum()                                                  # the caller's own helper
with_callers = threads()
compute_thread.run_on_compute_thread(lambda: torch.ones(1 << 22).sum())
after = threads()
compute_thread.submit(lambda: torch.ones(1 << 22).sum()).result()
print(alone, with_callers, after, threads())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    alone, with_callers, after, again = map(int, done.stdout.split())
    assert with_callers == alone + 1            # the caller's parallel region left a helper behind
    assert after == alone and again == alone    # released; the compute thread's own team is kept
