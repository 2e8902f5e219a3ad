"""The sampler's uniforms: every draw of a step in one flat vector, from the right generator in the right order
(the engine's for unseeded single draws, in one batch; each other sampled row's own, in row order)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_backend import SamplingParams
from paged_backend.sampling.sampler import SampleRequest, Sampler, draw_positions

ROW = st.tuples(st.sampled_from(["greedy", "unseeded", "seeded"]), st.integers(1, 3))


def _requests(rows):
    rows = [(kind, 1 if kind == "greedy" else n) for kind, n in rows]   # a greedy row draws once
    return [SampleRequest(SamplingParams(temperature=0.0 if kind == "greedy" else 0.7, n=n,
                                         seed=100 + i if kind == "seeded" else None), None, n,
                          torch.Generator().manual_seed(100 + i) if kind == "seeded" else None, processed=False)
            for i, (kind, n) in enumerate(rows)]


def _row_by_row(engine: torch.Generator, requests):
    """The same draws, one row at a time (what the sampler did before it placed them with one scatter)."""
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + r.num_samples)
    uniforms = torch.zeros(offsets[-1], dtype=torch.float64)
    sampled = [i for i, r in enumerate(requests) if r.params.temperature >= 1e-6]
    shared = [i for i in sampled if requests[i].generator is None and requests[i].num_samples == 1]
    if shared:
        u = torch.rand(len(shared), 1, generator=engine, dtype=torch.float64)[:, 0]
        for j, i in enumerate(shared):
            uniforms[offsets[i]] = u[j]
    for i in sampled:
        if i not in shared:
            uniforms[offsets[i]:offsets[i + 1]] = torch.rand(requests[i].num_samples,
                                                            generator=requests[i].generator or engine,
                                                            dtype=torch.float64)
    return uniforms


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=12))
def test_the_draws_are_each_rows_own_in_order(rows):
    sampler = Sampler(seed=7)
    uniforms, offsets = sampler._uniforms(_requests(rows))
    want = _row_by_row(torch.Generator().manual_seed(7), _requests(rows))
    assert torch.equal(uniforms, want)
    counts = [1 if kind == "greedy" else n for kind, n in rows]
    assert offsets.tolist() == [0] + torch.tensor(counts).cumsum(0).tolist()
    assert torch.equal(sampler.generator.get_state(), _engine_after(rows))   # the engine drew as much as before


def _engine_after(rows):
    engine = torch.Generator().manual_seed(7)
    _row_by_row(engine, _requests(rows))
    return engine.get_state()


def test_draw_positions_lists_each_rows_draws_in_order():
    offsets = torch.tensor([0, 2, 3, 6, 7])
    assert draw_positions(offsets, [0, 2], [2, 3]).tolist() == [0, 1, 3, 4, 5]
    assert draw_positions(offsets, [1, 3], [1, 1]).tolist() == [2, 6]
    assert draw_positions(offsets, [3, 0], [1, 2]).tolist() == [6, 0, 1]
