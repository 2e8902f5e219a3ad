"""Checks run by tests/test_kernels_triton.py in a subprocess with TRITON_INTERPRET=1 set before Triton
is imported: the Triton kernels, run on the CPU by Triton's interpreter, equal the PyTorch reference.

Inputs are NaN outside every sequence's context and outputs are NaN-poisoned before each call: a
kernel that reads an unmasked slot or skips a row fails. Run directly with
`TRITON_INTERPRET=1 pytest tests/interpreter_kernel_checks.py` to see each case.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernel_inputs import BASE_SEED, case_seed, make_paged_inputs, nan_like, variant_kwargs
from paged_backend import LLM, SamplingParams, kernels
from paged_backend.kernels import cpu, reference, triton_kernels
from paged_backend.kernels.triton_attention import attention_config, auto_num_splits, paged_attention_kernel
from paged_backend.kernels.triton_launch import is_interpreted

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run these checks with TRITON_INTERPRET=1 set before Triton is imported "
                       "(tests/test_kernels_triton.py does)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol) against the float64 result on the same (rounded) inputs; outputs are O(1).
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


ATTENTION_CASES = {
    # name: (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens)
    "decode-gqa1-d16-bs8": (4, 4, 16, 8, [1, 8, 17, 24], [1, 1, 1, 1]),
    "decode-gqa3-d32-bs16": (6, 2, 32, 16, [16, 1, 45, 32], [1, 1, 1, 1]),
    "decode-gqa4-d64-bs32": (8, 2, 64, 32, [64, 3, 100], [1, 1, 1]),
    "prefill-gqa3-d32-bs16": (6, 2, 32, 16, [16, 5, 33], [16, 5, 33]),
    "mixed-gqa4-d64-bs8": (8, 2, 64, 8, [1, 40, 32, 19], [1, 7, 1, 19]),
    "mixed-gqa1-d80-bs16": (2, 2, 80, 16, [23, 48, 1], [23, 9, 1]),
    "decode-gqa4-d96-bs128": (4, 1, 96, 128, [130, 1, 128], [1, 1, 1]),
    "prefill-gqa2-d128-bs64": (4, 2, 128, 64, [70, 2], [70, 2]),
    "long-prefill-gqa1-d16-bs16": (2, 2, 16, 16, [150, 20], [130, 20]),   # several query tiles
}

SPLIT_CASES = {
    # name: (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens, num_splits)
    "decode-split4": (8, 2, 64, 16, [1, 200, 64, 513], [1, 1, 1, 1], 4),
    "mixed-split8": (6, 2, 32, 8, [40, 100, 1], [7, 1, 1], 8),
    "decode-split16-bs128": (4, 1, 128, 128, [1000], [1], 16),
}


VARIANT_CASES = {
    # name: (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens, sliding_window, num_splits)
    "decode-gqa2-bs4": (4, 2, 16, 4, [1, 13, 40], [1, 1, 1], 9, 1),
    "mixed-gqa3-bs16": (6, 2, 16, 16, [37, 5, 1], [20, 5, 1], 7, 1),
    "decode-split4-bs8": (4, 1, 16, 8, [70, 3], [1, 1], 19, 4),
    "mixed-split2-bs32": (2, 2, 32, 32, [45, 9], [12, 1], 33, 2),
}


def _check_against_reference(inputs, out, dtype, label, **variant):
    """Triton output vs the reference in the same dtype and vs dense float64 attention."""
    rtol, atol = TOLERANCE[dtype]
    message = lambda m: f"{label} (seed {BASE_SEED}): {m}"  # noqa: E731
    assert not out.isnan().any(), message("NaN in the output (unwritten row or unmasked read)")
    double = {k: v.double() if torch.is_tensor(v) else v for k, v in variant.items()}
    exact = reference.dense_attention(*[a.double() if torch.is_tensor(a) and a.is_floating_point() else a
                                        for a in inputs.args()], **double)
    torch.testing.assert_close(out.double(), exact, rtol=rtol, atol=atol, msg=message)
    ref = reference.paged_attention(*inputs.args(clean_cache=True), **variant)
    torch.testing.assert_close(out.double(), ref.double(), rtol=2 * rtol, atol=2 * atol, msg=message)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(name, dtype):
    heads, kv_heads, head_size, block_size, ctx, qlens = ATTENTION_CASES[name]
    inputs = make_paged_inputs(case_seed(name, dtype), dtype, heads, kv_heads, head_size, block_size, ctx, qlens)
    out = nan_like(inputs.query)
    returned = triton_kernels.paged_attention(*inputs.args(), out=out)
    assert returned is out
    _check_against_reference(inputs, out, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_matches_reference(name, dtype):
    heads, kv_heads, head_size, block_size, ctx, qlens, splits = SPLIT_CASES[name]
    inputs = make_paged_inputs(case_seed(name, dtype), dtype, heads, kv_heads, head_size, block_size, ctx, qlens)
    out = nan_like(inputs.query)
    triton_kernels.paged_attention(*inputs.args(), out=out, num_splits=splits)
    _check_against_reference(inputs, out, dtype, name)


def _run_variant(name, variant, dtype):
    heads, kv_heads, head_size, block_size, ctx, qlens, window, splits = VARIANT_CASES[name]
    seed = case_seed(name, variant, dtype)
    kwargs = variant_kwargs(variant, seed, heads, dtype, window)
    inputs = make_paged_inputs(seed, dtype, heads, kv_heads, head_size, block_size, ctx, qlens,
                               sliding_window=kwargs.get("sliding_window"))
    out = nan_like(inputs.query)
    # Blocks wholly before the window point at a NaN block: reading one would poison the output.
    triton_kernels.paged_attention(*inputs.args(hole=inputs.spare_block), out=out, num_splits=splits, **kwargs)
    _check_against_reference(inputs, out, dtype, f"{name}/{variant}", **kwargs)


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks"])
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_variants_match_reference_fp32(name, variant):
    """Sliding window, soft-capping and sinks one at a time (decode, prefill over a context, split-KV)."""
    _run_variant(name, variant, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_all_variants_together_match_reference(name, dtype):
    _run_variant(name, "all", dtype)


def test_paged_attention_allocates_output_and_accepts_int64_metadata():
    inputs = make_paged_inputs(case_seed("int64"), torch.float32, 6, 2, 32, 16, [20, 1], [3, 1])
    out = triton_kernels.paged_attention(inputs.query, inputs.key_cache, inputs.value_cache,
                                         inputs.block_tables.long(), inputs.context_lens.long(),
                                         inputs.query_start_loc.long(), inputs.scale)
    _check_against_reference(inputs, out, torch.float32, "int64 metadata")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(case_seed("reshape", dtype))
    num_blocks, block_size, kv_heads, head_size = 7, 16, 3, 80
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11]
    # The engine hands k/v as transposed views of [1, kv_heads, tokens, head_size].
    key = torch.randn(kv_heads, 11, head_size, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(kv_heads, 11, head_size, generator=gen).to(dtype).transpose(0, 1)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_reshape_and_cache_casts_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(case_seed("reshape-cast"))
    key_cache = torch.zeros(4, 8, 2, 16, dtype=torch.float16)
    value_cache = torch.zeros(4, 8, 2, 16, dtype=torch.float16)
    key = torch.randn(5, 2, 16, generator=gen)      # float32 into a float16 cache
    value = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 31, 8, -1], dtype=torch.int32)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    want_k, want_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    keep = slots >= 0
    reference.reshape_and_cache(key[keep], value[keep], want_k, want_v, slots[keep])
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_matches_reference(dtype):
    gen = torch.Generator().manual_seed(case_seed("copy", dtype))
    keys = [torch.randn(9, 8, 2, 32, generator=gen).to(dtype) for _ in range(3)]
    values = [torch.randn(9, 8, 2, 32, generator=gen).to(dtype) for _ in range(3)]
    mapping = torch.tensor([[4, 0], [1, 7], [8, 2]])
    want_k, want_v = [c.clone() for c in keys], [c.clone() for c in values]
    reference.copy_blocks(want_k, want_v, mapping)
    triton_kernels.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_k + want_v):
        assert torch.equal(got, want)


COMPACT_CASES = {
    # name: (query dtype, cache dtype, num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens,
    #        num_splits)
    "decode-e4m3-fp32": (torch.float32, torch.float8_e4m3fn, 6, 2, 32, 8, [1, 20, 41], [1, 1, 1], 1),
    "mixed-e4m3-fp16": (torch.float16, torch.float8_e4m3fn, 8, 2, 64, 16, [1, 40, 32, 19], [1, 7, 1, 19], 1),
    "mixed-e5m2-bf16": (torch.bfloat16, torch.float8_e5m2, 4, 4, 16, 8, [23, 48, 1], [23, 9, 1], 1),
    "decode-split2-e5m2-fp32": (torch.float32, torch.float8_e5m2, 4, 1, 16, 16, [70, 3], [1, 1], 2),
    "mixed-bf16cache-fp32": (torch.float32, torch.bfloat16, 6, 2, 32, 16, [16, 5, 33], [16, 5, 1], 1),
    "decode-fp16cache-bf16": (torch.bfloat16, torch.float16, 8, 2, 64, 32, [64, 3, 100], [1, 1, 1], 1),
}


@pytest.mark.parametrize("name", list(COMPACT_CASES))
def test_compact_caches_match_the_dense_loop(name):
    """A cache of another dtype than the query (fp8 with scales): equal to the dense loop over the same
    entries. The NaN guards become NaN (16-bit) or out-of-range (fp8) entries that the dense loop never reads,
    so an unmasked read still changes the result."""
    from paged_backend.kernels.kv_quant import quantize

    query_dtype, cache_dtype, heads, kv_heads, head_size, block_size, ctx, qlens, splits = COMPACT_CASES[name]
    inputs = make_paged_inputs(case_seed("compact", name), torch.float32, heads, kv_heads, head_size, block_size,
                               ctx, qlens)
    k_scale, v_scale = (0.5, 2.0) if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else (1.0, 1.0)
    query = inputs.query.to(query_dtype)
    key_cache = quantize(inputs.key_cache, cache_dtype, k_scale)
    value_cache = quantize(inputs.value_cache, cache_dtype, v_scale)
    args = (query, key_cache, value_cache, inputs.block_tables, inputs.context_lens, inputs.query_start_loc,
            inputs.scale)
    out = triton_kernels.paged_attention(*args, out=nan_like(query), num_splits=splits, k_scale=k_scale,
                                         v_scale=v_scale)
    want = reference.dense_attention(query.double(), *args[1:], k_scale=k_scale, v_scale=v_scale)
    rtol, atol = TOLERANCE[query_dtype]
    assert not out.isnan().any(), f"{name}: NaN in the output (seed {BASE_SEED})"
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol, msg=lambda m: f"{name} ({BASE_SEED}): {m}")


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_reshape_and_cache_encodes_fp8_as_pytorch_does(cache_dtype):
    """Every finite value of the format, the midpoints between neighbours (ties to even), values beyond the
    range (saturated), tiny and signed zeros, random magnitudes: the bytes equal kv_quant.quantize's."""
    from paged_backend.kernels.kv_quant import FP8_MAX, quantize

    limit = FP8_MAX[cache_dtype]
    every = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    finite = every[torch.isfinite(every) & (every.abs() <= limit)].sort().values
    gen = torch.Generator().manual_seed(case_seed("fp8-encode", cache_dtype))
    noise = torch.randn(2000, generator=gen) * torch.logspace(-10, 5, 2000)
    values = torch.cat([finite, (finite[1:] + finite[:-1]) / 2, noise,
                        torch.tensor([0.0, -0.0, 3 * limit, -3 * limit, 1e-30, -1e-30])])
    values = torch.cat([values, torch.zeros(-values.numel() % 512)])   # tokens of 8 heads x 64 (few programs)
    key = values.view(-1, 8, 64)
    tokens = key.shape[0]
    for scale in (1.0, 0.37):
        key_cache = torch.zeros(tokens, 1, 8, 64, dtype=cache_dtype)
        value_cache = torch.zeros_like(key_cache)
        triton_kernels.reshape_and_cache(key, -key, key_cache, value_cache, torch.arange(tokens), scale, scale)
        for cache, sign in ((key_cache, 1), (value_cache, -1)):
            want = quantize(sign * key, cache_dtype, scale).view(tokens, 1, 8, 64)
            assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), f"scale {scale} ({BASE_SEED})"


def test_dispatch_honours_the_environment(monkeypatch):
    inputs = make_paged_inputs(case_seed("dispatch"), torch.float32, 4, 2, 16, 8, [9, 1], [2, 1])
    calls = []
    original = triton_kernels.paged_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_attention", counting)
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "triton")
    assert kernels.kernel_backend(inputs.key_cache) == "triton"
    out = kernels.paged_attention(*inputs.args(), out=nan_like(inputs.query))
    assert calls == [1]
    _check_against_reference(inputs, out, torch.float32, "dispatch")
    variant = variant_kwargs("all", case_seed("dispatch-variant"), 4, torch.float32, 3)
    out = kernels.paged_attention(*inputs.args(), out=nan_like(inputs.query), **variant)
    assert calls == [1, 1]
    _check_against_reference(inputs, out, torch.float32, "dispatch with a window, a cap and sinks", **variant)
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "auto")
    assert kernels.kernel_backend(inputs.key_cache) == ("cpp" if cpu.available() else "torch")   # CPU tensors
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGED_BACKEND_KERNELS"):
        kernels.kernel_backend(inputs.key_cache)


def test_kernels_run_in_the_interpreter():
    assert is_interpreted(paged_attention_kernel)


def test_bad_inputs_raise_value_errors():
    inputs = make_paged_inputs(case_seed("bad"), torch.float32, 4, 2, 16, 8, [9], [1])
    q, kc, vc, bt, cl, qsl, scale = inputs.args()
    with pytest.raises(ValueError, match="head_size"):
        triton_kernels.paged_attention(q[..., :8].contiguous(), kc, vc, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_kernels.paged_attention(q[:, :3].contiguous(), kc, vc, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="query dtype"):
        triton_kernels.paged_attention(q.double(), kc, vc, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="dtype"):
        triton_kernels.paged_attention(q, kc, vc.half(), bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="k_scale"):
        triton_kernels.paged_attention(q, kc, vc, bt, cl, qsl, scale, k_scale=0.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        triton_kernels.paged_attention(q, kc, vc, bt, cl, qsl[:-1], scale)
    with pytest.raises(ValueError, match="num_splits"):
        triton_kernels.paged_attention(q, kc, vc, bt, cl, qsl, scale, num_splits=3)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_kernels.paged_attention(q, kc, vc, bt, cl, qsl, scale, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        triton_kernels.paged_attention(q, kc, vc, bt, cl, qsl, scale, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        triton_kernels.paged_attention(q, kc, vc, bt, cl, qsl, scale, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="key"):
        triton_kernels.reshape_and_cache(q, q, kc, vc, torch.zeros(q.shape[0], dtype=torch.long))
    with pytest.raises(ValueError, match="block_mapping"):
        triton_kernels.copy_blocks([kc], [vc], torch.zeros(2, 3, dtype=torch.long))


def test_split_heuristic_and_tile_config():
    # Few decode sequences with long contexts on a 132-SM GPU: split; otherwise not.
    assert auto_num_splits(2, 2, 8, 8192, 132) == 16
    assert auto_num_splits(1, 1, 8, 8192, 132) == 32
    assert auto_num_splits(256, 256, 8, 8192, 132) == 1        # enough programs already
    assert auto_num_splits(40, 2, 8, 8192, 132) == 1           # prefill in the batch
    assert auto_num_splits(2, 2, 8, 256, 132) == 1             # short contexts
    assert auto_num_splits(2, 2, 8, 8192, 0) == 1              # not a GPU
    decode = attention_config(num_tokens=4, num_seqs=4, group=3, head_size=80)
    assert (decode.block_m, decode.block_q, decode.head_pad) == (16, 5, 128)
    prefill = attention_config(num_tokens=100, num_seqs=4, group=4, head_size=64)
    assert (prefill.block_m, prefill.block_q, prefill.tile_n) == (64, 16, 16)
    assert attention_config(4, 4, 32, 128).block_m == 32


def _generate_all(llm, prompts, params):
    return [out.outputs[i].token_ids for out in llm.generate(prompts, params, use_tqdm=False)
            for i in range(len(out.outputs))]


def _engine_runs(model, tokenizer, backend, monkeypatch):
    """Greedy batch, a prefix-cache hit (prefill over a cached context) and a beam search (copy-on-write)."""
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", backend)
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a small dragon who"]
    shared = "Paged attention splits the key value cache into fixed size blocks of tokens. " * 3
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model, tokenizer=tokenizer, dtype=torch.float32, num_blocks=64, block_size=16)
    batch = _generate_all(llm, prompts, greedy)
    beams = _generate_all(llm, [prompts[1]], SamplingParams(temperature=0, beam_width=2, max_tokens=4,
                                                            ignore_eos=True))
    cached = LLM(model, tokenizer=tokenizer, dtype=torch.float32, num_blocks=64, block_size=16,
                 enable_prefix_caching=True)
    first = _generate_all(cached, [shared + "First question:"], greedy)
    second = _generate_all(cached, [shared + "Second question:"], greedy)
    hits = cached.engine.get_stats().num_cached_prefill_tokens
    return {"batch": batch, "beams": beams, "prefix": first + second}, hits


def test_engine_greedy_tokens_match_reference_kernels(monkeypatch):
    from conftest import get_model

    model, tokenizer = get_model("tiny-llama", torch.float32)
    calls = {"reshape_and_cache": 0, "paged_attention": 0, "copy_blocks": 0}
    for name in calls:
        original = getattr(triton_kernels, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_kernels, name, counting)
    expected, _ = _engine_runs(model, tokenizer, "torch", monkeypatch)
    assert sum(calls.values()) == 0
    got, hits = _engine_runs(model, tokenizer, "triton", monkeypatch)
    assert got == expected
    assert calls["reshape_and_cache"] > 0 and calls["paged_attention"] > 0
    assert calls["copy_blocks"] > 0, "the beam search should have copied a shared block"
    assert hits > 0, "the second prompt should reuse the cached prefix"


@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gpt-oss"])
def test_engine_runs_windows_softcaps_and_sinks_through_the_kernels(name, monkeypatch):
    """Gemma 2 (window + soft-cap, full + soft-cap) and gpt-oss (window + sinks, full + sinks): the Triton
    kernels give the reference's greedy tokens over a prompt longer than the window, chunked prefill included."""
    from conftest import get_model

    model, tokenizer = get_model(name, torch.float32)
    prompt = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGED_BACKEND_KERNELS", backend)
        llm = LLM(model, tokenizer=tokenizer, num_blocks=16, block_size=8, max_num_batched_tokens=12)
        tokens[backend] = _generate_all(llm, [prompt], params)
    assert tokens["triton"] == tokens["torch"]


def test_interpreter_accepts_a_dot_the_gpu_compiler_rejects():
    from bad_dot_kernel import small_k_dot_launch

    a, b = torch.randn(16, 8), torch.randn(8, 16)
    c = torch.full((16, 16), float("nan"))
    small_k_dot_launch(a, b, c).run()     # K = 8: fine here, refused by the CUDA compiler (compile test)
    torch.testing.assert_close(c, a @ b)


# ---- LoRA: the segmented shrink/expand kernels (kernels/triton_lora.py) ----------------------------------------
LORA_CASES = {
    # name: (slot of each token (-1: no adapter), in_features, out_features, rank of each slot (0: the slot's
    #        adapter does not target the layer), max_rank)
    "decode-3-slots-gqa-shapes": ([0, 2, -1, 1, 0, 2], 64, 32, [8, 4, 2], 8),
    "prefill-long-segments": ([1] * 40 + [-1] * 7 + [0] * 21 + [1] * 5, 48, 80, [16, 3], 16),
    "one-slot-skipped": ([0, 1, 1, 0, -1, 1], 32, 96, [0, 5], 8),
    "rank-above-16": ([2, 2, 0, 1, 2, 0, 1], 40, 24, [20, 1, 32], 32),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(LORA_CASES))
def test_lora_kernels_match_the_grouped_reference(name, dtype):
    from paged_backend.kernels.lora import lora_delta_grouped, plan_lora
    from paged_backend.kernels.triton_lora import lora_delta_triton

    slots, in_features, out_features, ranks, max_rank = LORA_CASES[name]
    generator = torch.Generator().manual_seed(case_seed(BASE_SEED, name))
    x = torch.randn(len(slots), in_features, generator=generator).to(dtype)
    y = torch.randn(len(slots), out_features, generator=generator).to(dtype)
    a = torch.zeros(len(ranks), max_rank, in_features, dtype=dtype)
    b = torch.zeros(len(ranks), out_features, max_rank, dtype=dtype)
    scales = torch.zeros(len(ranks), dtype=torch.float32)
    exact = []
    for slot, rank in enumerate(ranks):
        if rank == 0:
            exact.append(None)
            continue
        lora_a = (torch.randn(rank, in_features, generator=generator) / in_features ** 0.5).to(dtype)
        lora_b = torch.randn(out_features, rank, generator=generator).to(dtype)
        a[slot, :rank], b[slot, :, :rank], scales[slot] = lora_a, lora_b, 0.5 + slot
        exact.append((lora_a.double(), lora_b.double(), 0.5 + slot))
    plan = plan_lora(torch.tensor(slots))
    expected = y.double().clone()
    lora_delta_grouped(expected, x.double(), plan, exact)
    out = y.clone()
    lora_delta_triton(out, x, plan, a, b, scales)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol * 4, atol=atol * 4 * max(1.0, max_rank ** 0.5))
    untouched = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(out[untouched], y[untouched]), "rows without an adapter must be left exactly as they were"


def test_engine_lora_tokens_match_the_grouped_path(monkeypatch, tmp_path):
    """Two adapters and the base model in one batch through the Triton LoRA kernels give the grouped PyTorch
    path's greedy tokens (and the kernels did run)."""
    from conftest import get_model
    from lora_adapters import ADAPTER_SPECS, make_adapter
    from paged_backend import LoRARequest
    from paged_backend.kernels import triton_lora

    model, tokenizer = get_model("tiny-llama", torch.float32)
    loras = [LoRARequest(f"a{i}", i + 1, str(make_adapter("tiny-llama", ADAPTER_SPECS["tiny-llama"][i],
                                                           tmp_path / f"a{i}", seed=7 + i))) for i in (0, 2)]
    calls = []
    original = triton_lora.lora_delta_triton
    monkeypatch.setattr(triton_lora, "lora_delta_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    prompts = ["The capital of France is", "Once upon a time"]
    batch = [(p, lora) for p in prompts for lora in [None] + loras]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGED_BACKEND_KERNELS", backend)
        llm = LLM(model, tokenizer=tokenizer, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=32)
        outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora_request=[lo for _, lo in batch])
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        assert bool(calls) == (backend == "triton")
    assert tokens["triton"] == tokens["torch"]
