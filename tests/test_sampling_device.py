"""`sample_rows_nosync` (kernels/sampling_device.py): the draws of `sample_rows_torch` with every shape decided on
the host, so a GPU never waits. Compared with the torch version on the CPU over rows that take every branch:
greedy, top-k with ties, top-p, min-p, their mixes, -inf entries, failed rows, several draws per row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from paged_backend.kernels.sampling import sample_rows_torch
from paged_backend.kernels.sampling_device import sample_rows_nosync


def _batch(seed: int, rows: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float32) * 3
    logits[:, : vocab // 4] = torch.round(logits[:, : vocab // 4])          # ties
    logits[0, 5:] = float("-inf")                                           # a short row
    top_k = torch.where(torch.rand(rows, generator=g) < 0.5, torch.randint(1, vocab + 3, (rows,), generator=g),
                        torch.full((rows,), -1))                              # half the rows without top-k
    top_p = torch.where(torch.rand(rows, generator=g) < 0.5, torch.rand(rows, generator=g).double(),
                        torch.ones(rows, dtype=torch.float64))
    min_p = torch.where(torch.rand(rows, generator=g) < 0.3, torch.rand(rows, generator=g).double() * 0.2,
                        torch.zeros(rows, dtype=torch.float64))
    greedy = torch.rand(rows, generator=g) < 0.2
    counts = torch.randint(1, 3, (rows,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    uniforms = torch.rand(int(offsets[-1]), generator=g, dtype=torch.float64)
    return logits, top_k, top_p, min_p, greedy, uniforms, offsets


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 9), vocab=st.sampled_from([7, 64, 1500, 2100]))
def test_nosync_draws_are_the_torch_versions(seed, rows, vocab):
    args = _batch(seed, rows, vocab)
    want = sample_rows_torch(*args)
    tokens, failed = sample_rows_nosync(*args)
    assert not failed.any()
    assert torch.equal(tokens, want.tokens)


def test_failed_rows_are_marked_and_leave_the_others_alone():
    logits, top_k, top_p, min_p, greedy, uniforms, offsets = _batch(3, 6, 300)
    want = sample_rows_torch(logits, top_k, top_p, min_p, greedy, uniforms, offsets)
    logits = logits.clone()
    logits[2] = float("nan")
    logits[4] = float("-inf")
    tokens, failed = sample_rows_nosync(logits, top_k, top_p, min_p, greedy, uniforms, offsets)
    assert failed.tolist() == [False, False, True, False, True, False]
    keep = torch.cat([torch.arange(int(offsets[r]), int(offsets[r + 1])) for r in (0, 1, 3, 5)])
    assert torch.equal(tokens[keep], want.tokens[keep])


def test_parameters_on_a_device_are_refused():
    args = list(_batch(1, 2, 16))
    args[1] = args[1].to("meta")
    with pytest.raises(ValueError, match="top_k must be on the host"):
        sample_rows_nosync(*args)


def test_truncated_rows_are_sorted_in_bounded_chunks(monkeypatch):
    # a large vocabulary times many rows would sort gigabytes at once on a GPU: rows go in chunks, same draws
    from paged_backend.kernels import sampling_device

    args = _batch(7, 9, 1500)
    want, _ = sample_rows_nosync(*args)
    monkeypatch.setattr(sampling_device, "SORTED_ELEMENTS", 2 * 1500)   # two rows per chunk
    got, failed = sample_rows_nosync(*args)
    assert torch.equal(got, want) and not failed.any()


def test_the_draw_masks_and_sums_rows_in_bounded_chunks(monkeypatch):
    # the inverse CDF's float64 and int64 temporaries are rows x vocab: chunked by rows, for both samplers
    from paged_backend.kernels import sampling

    args = _batch(11, 9, 1500)
    want_torch, (want, _) = sample_rows_torch(*args), sample_rows_nosync(*args)
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 2 * 1500)   # two rows per chunk
    assert torch.equal(sample_rows_torch(*args).tokens, want_torch.tokens)
    assert torch.equal(sample_rows_nosync(*args)[0], want)


def test_a_sampled_batch_reads_nothing_back_from_the_device(monkeypatch):
    # on a meta device every read of a value raises (.item(), nonzero(), tolist()); and a tensor made on a GPU
    # from host values waits for its stream (a found wait: the temperatures), so none may be made there
    from paged_backend import SamplingParams
    from paged_backend.sampling.sampler import SampleRequest, Sampler

    made = torch.tensor

    def host_only(*args, device=None, **kwargs):
        assert device is None or torch.device(device).type == "cpu", f"a tensor made on {device} waits for it"
        return made(*args, **kwargs)
    monkeypatch.setattr(torch, "tensor", host_only)

    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=5, min_p=0.1), SamplingParams(temperature=0.5)]
    requests = [SampleRequest(p, None, generator=torch.Generator().manual_seed(i) if p.seed else None,
                              processed=False) for i, p in enumerate(params)]
    pending = Sampler().sample_later(torch.empty(4, 300, device="meta"), requests)
    assert pending.tokens.shape == (4,) and pending.tokens.device.type == "meta"
    assert Sampler().sample_later(torch.empty(2, 300, device="meta"), requests[1:2] * 2).tokens.shape == (2,)
