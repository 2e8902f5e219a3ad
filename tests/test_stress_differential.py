"""Differential stress test: random workloads under memory pressure, every output checked against a reference.

Each seed builds requests that mix shared prompt prefixes, greedy decoding, seeded sampling (n 1-3, top-p,
top-k) and beam search, arriving over several steps, on a cache small enough that requests are preempted both
by swapping and by recomputation, with prefix caching on and a token budget small enough to chunk prefills.
Greedy and beam outputs must equal transformers' `generate`; seeded samples must equal the same request run
alone on a roomy engine. Each workload runs with preemption by swapping, by recomputation, and the default mix. Every request must finish within a bounded number of steps and no block may be held
at the end. `make test` runs a few seeds; `pytest --stress-seeds=N` runs more.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLMEngine, SamplingParams

BLOCK = 8
EOS = 2


@dataclass
class Request:
    request_id: str
    prompt: List[int]
    params: SamplingParams
    arrival_step: int


def random_workload(seed: int) -> List[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 40000) for _ in range(rng.choice([16, 20, 24]))] for _ in range(3)]
    requests = []
    for i in range(14):
        tail = [rng.randrange(3, 40000) for _ in range(rng.randint(1, 20))]
        prompt = (rng.choice(prefixes) + tail) if rng.random() < 0.6 else tail + [rng.randrange(3, 40000)] * 4
        kind = rng.choice(["greedy", "greedy", "sample", "sample", "beam"])
        if kind == "greedy":
            params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 16))
        elif kind == "sample":
            params = SamplingParams(n=rng.randint(1, 3), temperature=rng.choice([0.7, 1.0]),
                                    top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]),
                                    seed=rng.randrange(10**6), max_tokens=rng.randint(4, 16))
        else:
            width = rng.randint(2, 3)
            params = SamplingParams(beam_width=width, n=rng.randint(1, width), temperature=0,
                                    max_tokens=rng.randint(4, 10), early_stopping=rng.choice([False, True]))
        requests.append(Request(f"{kind}-{i}", prompt, params, arrival_step=rng.randint(0, 8)))
    return requests


def hf_reference(model, request: Request) -> List[List[int]]:
    """transformers' generate for a greedy or beam request, cut after EOS."""
    p = request.params
    ids = torch.tensor([request.prompt])
    kwargs = dict(num_beams=p.beam_width, num_return_sequences=p.n, early_stopping=p.early_stopping,
                  length_penalty=p.length_penalty) if p.use_beam_search else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=p.max_tokens,
                         eos_token_id=EOS, pad_token_id=EOS, **kwargs)
    rows = []
    for row in out[:, len(request.prompt):].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def alone_reference(model, tok, request: Request) -> List[List[int]]:
    engine = LLMEngine(model, tokenizer=tok, num_blocks=256, block_size=BLOCK)
    engine.add_request("alone", request.prompt, request.params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return [c.token_ids for c in out.outputs]
    raise AssertionError("the reference run did not finish")


def run_under_pressure(model, tok, requests: List[Request], mode: Optional[str]):
    engine = LLMEngine(model, tokenizer=tok, block_size=BLOCK, num_blocks=18, num_swap_blocks=8,
                       enable_prefix_caching=True, max_num_batched_tokens=24, preemption_mode=mode)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    bound = 50 + 4 * sum(len(r.prompt) // 8 + r.params.max_tokens * r.params.num_branches for r in requests)
    finals: Dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            request = pending.pop(0)
            engine.add_request(request.request_id, request.prompt, request.params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step <= bound, f"no progress after {step} steps: {engine.get_stats()}"
    return engine, finals


@pytest.mark.parametrize("mode", ["swap", "recompute", None], ids=["swap", "recompute", "mixed"])
def test_stress_seed(stress_seed, mode, dtype):
    """mixed: the default policy (recompute one sequence, swap several, recompute when the host is full)."""
    model, tok = get_model("tiny-llama", dtype)
    requests = random_workload(stress_seed)
    engine, finals = run_under_pressure(model, tok, requests, mode)
    stats = engine.get_stats()
    preempted = {"swap": stats.num_swap_preemptions, "recompute": stats.num_recompute_preemptions,
                 None: stats.num_preemptions}[mode]
    assert preempted > 0, stats
    assert stats.prefix_cache_hits > 0, stats
    assert_no_leaks(engine)
    for request in requests:
        out = finals[request.request_id]
        assert out.error is None, (request.request_id, out.error)
        got = [c.token_ids for c in out.outputs]
        if request.params.temperature == 0:
            expected = hf_reference(model, request)
        else:
            expected = alone_reference(model, tok, request)
        assert got == expected, (stress_seed, request.request_id, request.params)


def pytest_generate_tests(metafunc):
    if "stress_seed" in metafunc.fixturenames:
        count = metafunc.config.getoption("stress_seeds")
        metafunc.parametrize("stress_seed", list(range(count)))
