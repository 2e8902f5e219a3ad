"""The PyTorch reference kernels equal the obvious dense computation in float64 (ragged, shuffled inputs)."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import BASE_SEED, case_seed, make_paged_inputs, nan_like, variant_kwargs
from paged_backend.kernels import reference

CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens)
    (4, 4, 16, 8, [1, 8, 17, 24], [1, 1, 1, 1]),                 # decode, GQA 1, exact multiples
    (6, 2, 32, 16, [16, 5, 33], [16, 5, 33]),                      # fresh prefill, GQA 3
    (8, 2, 64, 16, [1, 40, 32, 19], [1, 7, 1, 19]),                # mixed: prefill with context + decode
    (12, 3, 80, 8, [9, 64], [2, 64]),                              # GQA 4, head size 80
    (4, 1, 96, 128, [130, 1, 128], [3, 1, 1]),                     # block size 128, GQA 4
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reference_equals_dense_float64(case):
    heads, kv_heads, head_size, block_size, ctx, qlens = case
    seed = case_seed("reference", case)
    inputs = make_paged_inputs(seed, torch.float64, heads, kv_heads, head_size, block_size, ctx, qlens)
    dense = reference.dense_attention(*inputs.args())
    assert not dense.isnan().any(), "the dense loop must only read valid slots"
    out = nan_like(inputs.query)
    reference.paged_attention(*inputs.args(clean_cache=True), out=out)
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {BASE_SEED}: {m}")


VARIANT_CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens, sliding_window)
    (4, 2, 16, 8, [1, 8, 17, 40], [1, 1, 1, 1], 5),               # decode, window inside one block
    (6, 2, 32, 4, [16, 5, 33], [16, 5, 33], 7),                     # fresh prefill: the window moves per row
    (8, 2, 16, 8, [1, 40, 32, 19], [1, 7, 1, 19], 16),              # chunk over a cached context + decode
    (4, 4, 16, 16, [50, 3, 33], [4, 3, 1], 1),                      # window 1: each query sees itself only
    (4, 1, 16, 8, [30, 9], [30, 2], 64),                            # window longer than every context
]


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[f"case{i}" for i in range(len(VARIANT_CASES))])
def test_reference_variants_equal_dense_float64(case, variant):
    """Sliding window, soft-capping and sinks: the reference equals the dense loop. Table entries of blocks
    wholly before the window point outside the cache: the reference must never read them."""
    heads, kv_heads, head_size, block_size, ctx, qlens, window = case
    seed = case_seed("reference-variant", case, variant)
    kwargs = variant_kwargs(variant, seed, heads, torch.float64, window)
    inputs = make_paged_inputs(seed, torch.float64, heads, kv_heads, head_size, block_size, ctx, qlens,
                               sliding_window=kwargs.get("sliding_window"))
    dense = reference.dense_attention(*inputs.args(), **kwargs)
    assert not dense.isnan().any(), "the dense loop must only read visible slots"
    out = nan_like(inputs.query)
    outside = inputs.key_cache.shape[0] + 1000
    reference.paged_attention(*inputs.args(clean_cache=True, hole=outside), out=out, **kwargs)
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {BASE_SEED}: {m}")
    plain = reference.dense_attention(*inputs.args(clean_cache=True))
    if variant != "window" or window < max(ctx):   # a window longer than every context changes nothing
        assert not torch.allclose(dense, plain), "the variant should change the result on these inputs"
    else:
        torch.testing.assert_close(dense, plain, rtol=1e-10, atol=1e-10)


def test_dense_variants_follow_their_definitions():
    """One sequence, one head, by hand: window 2 over 3 keys, cap 1, sink 0 (adds e^0 to the denominator)."""
    key = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64).view(1, 3, 1, 1)
    value = torch.tensor([[10.0], [20.0], [30.0]], dtype=torch.float64).view(1, 3, 1, 1)
    query = torch.tensor([[[1.0]]], dtype=torch.float64)
    args = (query, key, value, torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0, 1]), 1.0)
    scores = torch.tensor([2.0, 3.0], dtype=torch.float64)       # keys 1 and 2 (key 0 is outside the window)
    want = (scores.softmax(0) * torch.tensor([20.0, 30.0], dtype=torch.float64)).sum()
    torch.testing.assert_close(reference.dense_attention(*args, sliding_window=2)[0, 0, 0], want)
    capped = torch.tanh(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    want = (capped.softmax(0) * torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)).sum()
    torch.testing.assert_close(reference.dense_attention(*args, softcap=1.0)[0, 0, 0], want)
    exp = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).exp()
    want = (exp * torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)).sum() / (exp.sum() + 1.0)
    sinks = torch.zeros(1, dtype=torch.float64)
    torch.testing.assert_close(reference.dense_attention(*args, sinks=sinks)[0, 0, 0], want)
    torch.testing.assert_close(reference.paged_attention(*args, sinks=sinks)[0, 0, 0], want)


def test_reference_refuses_bad_variants_and_a_plan_for_another_window():
    inputs = make_paged_inputs(case_seed("bad-variant"), torch.float64, 4, 2, 16, 8, [9, 1], [2, 1])
    args = inputs.args()
    for bad, match in ((dict(sliding_window=0), "sliding_window"), (dict(sliding_window=2.5), "sliding_window"),
                       (dict(softcap=0.0), "softcap"), (dict(softcap=float("inf")), "softcap"),
                       (dict(sinks=torch.zeros(3, dtype=torch.float64)), "sinks"),
                       (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks")):
        with pytest.raises(ValueError, match=match):
            reference.paged_attention(*args, **bad)
    plan = reference.plan_paged_attention(inputs.block_tables, inputs.context_lens, inputs.query_start_loc, 8, 4)
    with pytest.raises(ValueError, match="sliding_window=4"):
        reference.paged_attention(*args, plan=plan)
    reference.paged_attention(*inputs.args(clean_cache=True), plan=plan, sliding_window=4)


def test_reference_plan_is_reusable_across_layers():
    inputs = make_paged_inputs(case_seed("plan"), torch.float64, 6, 2, 32, 16, [20, 3, 48], [4, 1, 48])
    plan = reference.plan_paged_attention(inputs.block_tables, inputs.context_lens, inputs.query_start_loc, 16)
    args = inputs.args(clean_cache=True)
    first = reference.paged_attention(*args, plan=plan)
    again = reference.paged_attention(*args, plan=plan)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    torch.testing.assert_close(first, reference.dense_attention(*inputs.args()), rtol=1e-10, atol=1e-10)


def test_reference_reshape_and_cache_writes_only_its_slots():
    gen = torch.Generator().manual_seed(case_seed("cache"))
    key_cache = torch.randn(6, 8, 2, 16, generator=gen, dtype=torch.float64)
    value_cache = torch.randn(6, 8, 2, 16, generator=gen, dtype=torch.float64)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([47, 0, 9, 30])
    key = torch.randn(4, 2, 16, generator=gen, dtype=torch.float64)
    value = torch.randn(4, 2, 16, generator=gen, dtype=torch.float64)
    reference.reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 2, 16), value_cache.view(-1, 2, 16)
    torch.testing.assert_close(flat_k[slots], key, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots], value, rtol=0, atol=0)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 16)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, 16)[untouched])


def test_reference_copy_blocks_copies_every_layer():
    gen = torch.Generator().manual_seed(case_seed("copy"))
    keys = [torch.randn(5, 4, 2, 8, generator=gen) for _ in range(3)]
    values = [torch.randn(5, 4, 2, 8, generator=gen) for _ in range(3)]
    expected = [c.clone() for c in keys + values]
    mapping = torch.tensor([[0, 3], [2, 4]])
    for cache in expected:
        cache[3], cache[4] = cache[0].clone(), cache[2].clone()
    reference.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, expected):
        assert torch.equal(got, want)
