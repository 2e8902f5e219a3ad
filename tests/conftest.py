"""Shared fixtures: tiny models are built once per session and reused (they are deterministic)."""

from __future__ import annotations

import os
import sys

# The checkout's root off the import path, here and in every Python the tests start: `python -m pytest` and
# pytest-xdist's `-c` workers put the current folder first, where kernels/ and adapters/ (paged_backend.kernels and
# paged_backend.adapters) would shadow PyPI packages of those names, and transformers >= 5.25 imports Hugging
# Face's `kernels` whenever it is installed (tests/test_packaging.py).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(__file__))

from paged_backend.worker.loader import load_model  # noqa: E402

TINY_MODELS = ("tiny-llama", "tiny-opt", "tiny-gpt2", "tiny-gpt-neox")


def pytest_addoption(parser):
    parser.addoption("--stress-seeds", type=int, default=3,
                     help="random workloads the differential stress test runs per dtype and preemption mode "
                          "(default 3)")
    parser.addoption("--async-scheduling", choices=("on", "off", "default"), default="default",
                     help="every engine built in this process without an explicit async_scheduling runs with "
                          "overlapped scheduling on or off (default: the engine's own default)")
    parser.addoption("--device-fill", action="store_true",
                     help="every model runner takes the GPU's path for the next step's input ids (the tokens stay "
                          "where they were drawn; StepInputs.device_fill), with host tensors")


def pytest_configure(config):
    """`--async-scheduling on|off`: the whole suite with overlapped scheduling forced either way; `--device-fill`:
    with every runner filling pending input ids as on a GPU."""
    if config.getoption("--device-fill"):
        from paged_backend.worker.model_runner import ModelRunner

        ModelRunner.fills_on_device = property(lambda self: True, lambda self, value: None)
    mode = config.getoption("--async-scheduling")
    if mode == "default":
        return
    from paged_backend.config import EngineConfig

    original = EngineConfig.from_kwargs.__func__

    def from_kwargs(cls, **kwargs):
        kwargs.setdefault("async_scheduling", mode == "on")
        return original(cls, **kwargs)

    EngineConfig.from_kwargs = classmethod(from_kwargs)
_cache = {}


def get_model(name: str, dtype: torch.dtype = torch.float64):
    """(model, tokenizer), cached for the whole session; callers must not modify the model."""
    key = (name, dtype)
    if key not in _cache:
        _cache[key] = load_model(name, dtype=dtype)
    return _cache[key]


@pytest.fixture(params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def dtype(request) -> torch.dtype:
    """The dtype axis: float32 is what users run, float64 what exact comparisons with transformers need."""
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    return get_model("smollm2", torch.float32)


def assert_no_leaks(engine) -> None:
    """Every device and swap block is back in its pool and no request is left."""
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_free_swap_blocks == stats.num_swap_blocks, stats
    bm = engine.block_manager
    assert not bm.block_tables and not bm.swapped_tables


def run_requests(engine, work, max_steps: int = 20_000) -> dict:
    """Add every (request id, prompt, params) of `work`, then `run_to_completion`."""
    for rid, prompt, params in work:
        engine.add_request(rid, prompt, params)
    return run_to_completion(engine, max_steps)


def run_to_completion(engine, max_steps: int = 20_000) -> dict:
    """Step an LLMEngine until it is idle; the final output of every request, by request id. Fails the test
    (instead of hanging) if that takes more than `max_steps` steps."""
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        assert steps <= max_steps, f"no progress after {steps} steps: {engine.get_stats()}"
    return finals


def hf_greedy_tokens(model, prompt_ids, max_tokens: int) -> list:
    """transformers' greedy continuation of one prompt, exactly `max_tokens` long (EOS does not stop it)."""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens)
    return out[0, len(prompt_ids):].tolist()
