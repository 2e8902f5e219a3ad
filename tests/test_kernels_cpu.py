"""The compiled CPU kernel (kernels/cpu_attention.cpp) equals the dense float64 loop: ragged, shuffled
inputs whose unused cache slots are NaN (so any read outside a sequence's visible keys shows), every
variant, block sizes 1-128, head sizes that are not multiples of the vector width, every dtype."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import BASE_SEED, case_seed, make_paged_inputs, nan_like, variant_kwargs
from paged_backend import kernels
from paged_backend.kernels import cpu, reference


def test_the_cpu_kernel_builds_here():
    """The suite runs where a C++ compiler is (make install's machines): the kernels below must not silently
    test nothing."""
    assert cpu.available(), "the C++ CPU kernel does not build here (see `paged-backend info`)"


def test_the_torch_operators_build_here():
    """Likewise the operator libraries of compiled forwards (kernels/cpu_attention_op.cpp, cpu_linear_op.cpp): the
    files that test them skip where they cannot be built, so a source that no longer compiles must fail here."""
    from paged_backend.kernels import cpu_attention_step, cpu_linear

    assert cpu_attention_step.op_available(), "cpu_attention_op does not build here (see `paged-backend info`)"
    assert cpu_linear.op_available(), "cpu_linear_op does not build here (see `paged-backend info`)"


CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens)
    (4, 4, 16, 8, [1, 8, 17, 24], [1, 1, 1, 1]),                 # decode, GQA 1, exact multiples
    (6, 2, 32, 16, [16, 5, 33], [16, 5, 33]),                      # fresh prefill, GQA 3
    (8, 2, 64, 16, [1, 40, 32, 19], [1, 7, 1, 19]),                # mixed: prefill with context + decode
    (12, 3, 80, 8, [9, 64], [2, 64]),                              # GQA 4, head size 80
    (4, 1, 96, 128, [130, 1, 128], [3, 1, 1]),                     # block size 128, GQA 4
    (9, 3, 20, 1, [70, 3, 45], [37, 1, 45]),                       # block size 1, head 20 (vector tails)
    (2, 1, 8, 4, [100, 33], [1, 33]),                              # head 8, long decode over many key tiles
    (4, 2, 128, 32, [300, 65, 17], [40, 65, 1]),                   # several query tiles per sequence
]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _dense(inputs, **kwargs):
    """The dense loop in float64 on the same (rounded) inputs."""
    query, kc, vc, *rest = inputs.args()
    return reference.dense_attention(query.double(), kc.double(), vc.double(), *rest, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp64", "fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_cpu_kernel_equals_dense(case, dtype):
    heads, kv_heads, head_size, block_size, ctx, qlens = case
    inputs = make_paged_inputs(case_seed("cpu", case, str(dtype)), dtype, heads, kv_heads, head_size, block_size,
                               ctx, qlens)
    out = nan_like(inputs.query)
    returned = cpu.paged_attention(*inputs.args(), out=out)
    assert returned is out and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), _dense(inputs), rtol=tol, atol=tol,
                               msg=lambda m: f"seed {BASE_SEED}: {m}")


VARIANT_CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, context_lens, query_lens, sliding_window)
    (4, 2, 16, 8, [1, 8, 17, 40], [1, 1, 1, 1], 5),               # decode, window inside one block
    (6, 2, 32, 4, [16, 5, 33], [16, 5, 33], 7),                     # fresh prefill: the window moves per row
    (8, 2, 16, 8, [1, 40, 32, 19], [1, 7, 1, 19], 16),              # chunk over a cached context + decode
    (4, 4, 16, 16, [50, 3, 33], [4, 3, 1], 1),                      # window 1: each query sees itself only
    (4, 1, 16, 8, [30, 9], [30, 2], 64),                            # window longer than every context
    (6, 3, 24, 2, [120, 77], [50, 77], 40),                         # windows across key and query tiles
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[f"case{i}" for i in range(len(VARIANT_CASES))])
def test_cpu_kernel_variants_equal_dense(case, variant, dtype):
    """Table entries of blocks wholly before the window point outside the cache: never read (the plan only
    checks the entries the kernel reads)."""
    heads, kv_heads, head_size, block_size, ctx, qlens, window = case
    seed = case_seed("cpu-variant", case, variant, str(dtype))
    kwargs = variant_kwargs(variant, seed, heads, dtype, window)
    inputs = make_paged_inputs(seed, dtype, heads, kv_heads, head_size, block_size, ctx, qlens,
                               sliding_window=kwargs.get("sliding_window"))
    out = nan_like(inputs.query)
    cpu.paged_attention(*inputs.args(hole=inputs.key_cache.shape[0] + 1000), out=out, **kwargs)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), _dense(inputs, **kwargs), rtol=tol, atol=tol,
                               msg=lambda m: f"seed {BASE_SEED}: {m}")


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
                                         torch.float8_e5m2], ids=["fp16", "bf16", "fp64", "e4m3", "e5m2"])
def test_cpu_kernel_reads_a_cache_of_another_dtype(cache_dtype, query_dtype):
    """A query over a cache of another dtype (fp8 entries times their scales): the kernel converts each row as it
    reads it (vectorised for head sizes that fill vectors, a scalar tail otherwise: head 20)."""
    from paged_backend.kernels.kv_quant import quantize

    for head_size in (64, 20):
        inputs = make_paged_inputs(case_seed("cpu-mixed", str(cache_dtype), head_size), torch.float32, 8, 2,
                                   head_size, 16, [1, 40, 32, 19], [1, 7, 1, 19])
        query, kc, vc, *rest = inputs.args()
        k_scale, v_scale = (0.5, 3.0) if cache_dtype.itemsize == 1 else (1.0, 1.0)
        kc, vc = quantize(kc, cache_dtype, k_scale), quantize(vc, cache_dtype, v_scale)
        out = cpu.paged_attention(query.to(query_dtype), kc, vc, *rest, k_scale=k_scale, v_scale=v_scale)
        want = reference.dense_attention(query.double(), kc, vc, *rest, k_scale=k_scale, v_scale=v_scale)
        tol = 2e-5 if query_dtype == torch.float32 else 1e-10
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol, msg=lambda m: f"seed {BASE_SEED}: {m}")


def test_cpu_kernel_is_deterministic_across_thread_counts():
    inputs = make_paged_inputs(case_seed("cpu-threads"), torch.float32, 9, 3, 64, 16, [300, 5, 170, 64, 1],
                               [1, 5, 40, 1, 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.paged_attention(*inputs.args())
        torch.set_num_threads(2)
        two = cpu.paged_attention(*inputs.args())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kv_heads,group", [(3, 3), (4, 3), (1, 3), (2, 4), (3, 1)])
@pytest.mark.parametrize("context_lens", [[170], [9, 300]], ids=["one-sequence", "two-sequences"])
def test_decode_steps_of_fewer_sequences_than_threads_split_the_heads_with_the_same_results(kv_heads, group,
                                                                                          context_lens):
    """At one new token per sequence and fewer sequences than threads, each sequence's query heads are shared
    among the threads (cpu_attention.cpp, `work_items`): in whole KV heads, or in parts of a group of fewer than
    4 query heads (3 KV heads of 3 on 2 threads: 5 and 4 query heads; one KV head of 3 on 2 or 3 threads), or whole
    KV heads only (a group of 4): bit-identical to one thread attending all of them."""
    inputs = make_paged_inputs(case_seed(f"cpu-split-{kv_heads}-{group}-{len(context_lens)}"), torch.float32,
                               group * kv_heads, kv_heads, 32, 16, context_lens, [1] * len(context_lens))
    threads = torch.get_num_threads()
    outs = {}
    try:
        for count in (1, 2, 3, 4, 8):
            torch.set_num_threads(count)
            outs[count] = cpu.paged_attention(*inputs.args())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[1], out) for out in outs.values())
    torch.testing.assert_close(outs[1].double(), _dense(inputs), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["fp16", "bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_decode_rows_widen_a_compact_cache_in_place_to_the_values_of_a_float32_copy(cache_dtype, group):
    """Decode rows (fewer than 4 query rows per KV head) read 16-bit and fp8 cache rows in place, widening them in
    registers (cpu_attention.cpp, `RawRows`): bit for bit the result over a float32 cache that holds the same
    values, for head sizes of one and of eight vectors, several sequences, key tiles and block sizes."""
    from paged_backend.kernels.kv_quant import quantize

    for head_size, block_size, contexts in ((64, 16, [100, 31, 7]), (8, 8, [70, 1])):
        inputs = make_paged_inputs(case_seed("cpu-in-place", str(cache_dtype), group, head_size), torch.float32,
                                   2 * group, 2, head_size, block_size, contexts, [1] * len(contexts))
        query, kc, vc, *rest = inputs.args()
        k_scale, v_scale = (0.5, 3.0) if cache_dtype.itemsize == 1 else (1.0, 1.0)
        kc, vc = quantize(kc, cache_dtype, k_scale), quantize(vc, cache_dtype, v_scale)
        kwargs = dict(k_scale=k_scale, v_scale=v_scale)
        compact = cpu.paged_attention(query, kc, vc, *rest, **kwargs)
        widened = cpu.paged_attention(query, kc.float(), vc.float(), *rest, **kwargs)
        assert torch.equal(compact, widened), f"head size {head_size}: a compact cache's rows widen differently"
        want = reference.dense_attention(query.double(), kc, vc, *rest, **kwargs)
        torch.testing.assert_close(compact.double(), want, rtol=2e-5, atol=2e-5)


def test_cpu_plan_refuses_tables_outside_the_cache_and_inconsistent_metadata():
    inputs = make_paged_inputs(case_seed("cpu-bad"), torch.float32, 4, 2, 16, 8, [9, 1], [2, 1])
    query, kc, vc, tables, lens, starts, scale = inputs.args()
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        cpu.paged_attention(query, kc, vc, bad, lens, starts, scale)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        cpu.paged_attention(query, kc, vc, bad, lens, starts, scale)
    with pytest.raises(ValueError, match="context length"):
        cpu.paged_attention(query, kc, vc, tables, torch.tensor([1, 1]), starts, scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu.paged_attention(query, kc, vc, tables, lens, starts[:-1], scale)
    with pytest.raises(ValueError, match="query rows"):
        cpu.paged_attention(query[:2], kc, vc, tables, lens, starts, scale)
    with pytest.raises(ValueError, match="KV heads"):
        cpu.paged_attention(query[:, :3].contiguous(), kc, vc, tables, lens, starts, scale)
    plan = cpu.plan_paged_attention(tables, lens, starts, 8, kc.shape[0], sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window=4"):
        cpu.paged_attention(query, kc, vc, tables, lens, starts, scale, plan=plan)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma2", "tiny-gpt-oss"])
def test_engine_through_the_cpu_kernel_equals_the_pytorch_path(model, monkeypatch):
    """The engine's default CPU path is the compiled kernel (counted), and it generates the same greedy tokens
    as the PyTorch path in float64: a batch with chunked prefill (windows, soft-caps and sinks on the family
    presets) and a beam search (copy-on-write)."""
    from conftest import get_model
    from paged_backend import LLM, SamplingParams, kernels

    llm_model, tok = get_model(model, torch.float64)
    prompts = ["Once upon a time in a land far away, there was a village", "Hi"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    beams = SamplingParams(beam_width=2, temperature=0, max_tokens=4, ignore_eos=True)
    outputs = {}
    calls = []
    for name in ("attend_and_cache", "attend_heads_first"):   # the engine's paths: one call per layer
        original = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _original=original, **k: calls.append(1) or _original(*a, **k))
    for backend in ("cpp", "torch"):
        monkeypatch.setenv("PAGED_BACKEND_KERNELS", backend)
        llm = LLM(llm_model, tokenizer=tok, num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
        assert kernels.kernel_backend(llm.engine.runner.cache_engine.kv) == backend
        outputs[backend] = ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
                            [c.token_ids for c in llm.generate(prompts[:1], beams, use_tqdm=False)[0].outputs])
        if backend == "cpp":
            assert calls, "the engine did not call the compiled kernel"
            calls.clear()
    assert not calls
    assert outputs["cpp"] == outputs["torch"]


def _new_rows(inputs, cache):
    """The step's slots (the last query_lens tokens of each sequence) and the K or V rows held there, as a
    transposed view like the ones transformers' attention layers hand over ([kv_heads, T, D] memory)."""
    block_size = cache.shape[1]
    slots = []
    starts, lens = inputs.query_start_loc.tolist(), inputs.context_lens.tolist()
    for s, length in enumerate(lens):
        for pos in range(length - (starts[s + 1] - starts[s]), length):
            slots.append(int(inputs.block_tables[s, pos // block_size]) * block_size + pos % block_size)
    slots = torch.tensor(slots, dtype=torch.int64)
    rows = cache.flatten(0, 1)[slots]
    return slots, rows.transpose(0, 1).contiguous().transpose(0, 1)


def _step_case(name, case, dtype, variant):
    """A step's inputs with its new rows taken out of the cache: the inputs, the variant's keywords, the slots,
    the new K and V rows, paged_attention's output over the full cache, and copies of the caches whose new slots
    hold stale entries (7 and -7)."""
    heads, kv_heads, head_size, block_size, ctx, qlens = case
    seed = case_seed(name, case, str(dtype), variant)
    kwargs = variant_kwargs(variant, seed, heads, dtype, 9)
    inputs = make_paged_inputs(seed, dtype, heads, kv_heads, head_size, block_size, ctx, qlens,
                               sliding_window=kwargs.get("sliding_window"))
    query, kc, vc, tables, lens, starts, scale = inputs.args()
    slots, new_k = _new_rows(inputs, kc)
    _, new_v = _new_rows(inputs, vc)
    want = cpu.paged_attention(query, kc, vc, tables, lens, starts, scale, **kwargs)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2.flatten(0, 1)[slots] = 7.0
    vc2.flatten(0, 1)[slots] = -7.0
    return inputs, kwargs, slots, new_k, new_v, want, kc2, vc2


@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp64", "fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", [CASES[2], CASES[5], VARIANT_CASES[5][:6]], ids=["mixed", "block1", "tiles"])
def test_attend_and_cache_writes_the_new_rows_then_equals_paged_attention(case, dtype, variant):
    """One call per layer (the engine's path): the new K/V rows, handed over as strided views, land in their
    slots bit for bit, and the output is paged_attention's over the filled cache, bit for bit."""
    inputs, kwargs, slots, new_k, new_v, want, kc2, vc2 = _step_case("cpu-attend-and-cache", case, dtype, variant)
    query, kc, vc, tables, lens, starts, scale = inputs.args()
    block_size = case[3]
    plan = cpu.plan_paged_attention(tables, lens, starts, block_size, kc.shape[0], kwargs.get("sliding_window"),
                                    slots.to(torch.int32))
    got = kernels.attend_and_cache(query, new_k, new_v, kc2, vc2, slots, tables, lens, starts, scale, plan=plan,
                                   **kwargs)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(kc2.nan_to_num(1e9), kc.nan_to_num(1e9)) and torch.equal(vc2.nan_to_num(1e9), vc.nan_to_num(1e9))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "e4m3-cache"])
def test_attend_and_cache_converts_rows_of_another_dtype_as_reshape_and_cache_does(cache_dtype):
    """Float32 rows into a bfloat16 or fp8 cache (with scales): written as kv_quant stores them, then attended
    over, exactly as reshape_and_cache followed by paged_attention."""
    from paged_backend.kernels.kv_quant import quantize

    inputs = make_paged_inputs(case_seed("cpu-aac-convert", str(cache_dtype)), torch.float32, 8, 2, 64, 16,
                               [1, 40, 32, 19], [1, 7, 1, 19])
    query, kc, vc, tables, lens, starts, scale = inputs.args(clean_cache=True)
    slots, new_k = _new_rows(inputs, kc)
    _, new_v = _new_rows(inputs, vc)
    k_scale, v_scale = (0.5, 2.0) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    caches = [quantize(c, cache_dtype, s) for c, s in ((kc, k_scale), (vc, v_scale))]
    expected = [c.clone() for c in caches]
    reference.reshape_and_cache(new_k, new_v, *expected, slots, k_scale, v_scale)
    want = cpu.paged_attention(query, *expected, tables, lens, starts, scale, k_scale=k_scale, v_scale=v_scale)
    plan = cpu.plan_paged_attention(tables, lens, starts, 16, kc.shape[0], None, slots)
    got = kernels.attend_and_cache(query, new_k, new_v, *caches, slots, tables, lens, starts, scale, plan=plan,
                                   k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(got, want)
    for written, wanted in zip(caches, expected):
        assert torch.equal(written.view(torch.uint8) if cache_dtype.itemsize == 1 else written,
                           wanted.view(torch.uint8) if cache_dtype.itemsize == 1 else wanted)


def test_attend_and_cache_refuses_bad_slots_and_rows_by_name():
    inputs = make_paged_inputs(case_seed("cpu-aac-bad"), torch.float32, 4, 2, 16, 8, [9, 1], [2, 1])
    query, kc, vc, tables, lens, starts, scale = inputs.args()
    slots, new_k = _new_rows(inputs, kc)
    _, new_v = _new_rows(inputs, vc)
    for bad in (torch.tensor([0, 1, kc.shape[0] * 8]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1])):
        with pytest.raises(ValueError, match="slot"):
            cpu.plan_paged_attention(tables, lens, starts, 8, kc.shape[0], None, bad)
    plan = cpu.plan_paged_attention(tables, lens, starts, 8, kc.shape[0], None, slots)
    with pytest.raises(ValueError, match="key must be"):
        cpu.attend_and_cache(query, new_k[:, :1], new_v, kc, vc, plan, scale)
    with pytest.raises(ValueError, match="query has 2 rows"):
        cpu.attend_and_cache(query[:2], new_k[:2], new_v[:2], kc, vc, plan, scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu.attend_and_cache(query, new_k, new_v, kc, vc, cpu.plan_paged_attention(tables, lens, starts, 8,
                                                                                 kc.shape[0]), scale)
    with pytest.raises(ValueError, match="sliding_window=4"):
        kernels.attend_and_cache(query, new_k, new_v, kc, vc, slots, tables, lens, starts, scale, plan=plan,
                                 sliding_window=4)


@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=["decode", "mixed", "block1"])
def test_attend_heads_first_reads_transformers_layout_in_place(case, dtype, variant):
    """Query `[1, heads, T, D]` as transformers hands it over (projected, viewed per head, transposed), K/V the
    same: the rows land in their slots and the output `[1, T, heads, D]` is paged_attention's, bit for bit."""
    inputs, kwargs, slots, new_k, new_v, want, kc2, vc2 = _step_case("cpu-heads-first", case, dtype, variant)
    query, kc, vc, tables, lens, starts, scale = inputs.args()
    block_size = case[3]
    plan = cpu.plan_paged_attention(tables, lens, starts, block_size, kc.shape[0], kwargs.get("sliding_window"),
                                    slots)
    heads_first = [rows.contiguous()[None].transpose(1, 2) for rows in (query, new_k, new_v)]
    got = kernels.attend_heads_first(*heads_first, kc2, vc2, plan, scale, **kwargs)
    assert got is not None and got.shape == (1, *query.shape) and torch.equal(got[0], want)
    assert torch.equal(kc2.nan_to_num(1e9), kc.nan_to_num(1e9)) and torch.equal(vc2.nan_to_num(1e9), vc.nan_to_num(1e9))


def test_attend_heads_first_declines_what_it_cannot_read_in_place_and_writes_nothing():
    """A half-precision query, a query whose memory is not [T, heads, D], rows the PyTorch code must convert
    (fp8), or a plan of another kernel: None, and the cache untouched (the caller's general path writes it)."""
    from paged_backend.kernels.kv_quant import quantize

    inputs = make_paged_inputs(case_seed("cpu-heads-first-declines"), torch.float32, 4, 2, 16, 8, [9, 3], [2, 3])
    query, kc, vc, tables, lens, starts, scale = inputs.args(clean_cache=True)
    slots, new_k = _new_rows(inputs, kc)
    _, new_v = _new_rows(inputs, vc)
    plan = cpu.plan_paged_attention(tables, lens, starts, 8, kc.shape[0], None, slots)
    k4, v4 = (rows.contiguous()[None].transpose(1, 2) for rows in (new_k, new_v))
    q4 = query.contiguous()[None].transpose(1, 2)
    kc_fp8, vc_fp8 = quantize(kc, torch.float8_e4m3fn, 1.0), quantize(vc, torch.float8_e4m3fn, 1.0)
    for args in [(q4.to(torch.bfloat16), k4, v4, kc, vc), (q4.contiguous(), k4, v4, kc, vc),
                 (q4, k4, v4, kc_fp8, vc_fp8)]:
        before = [c.clone() for c in args[3:]]
        assert kernels.attend_heads_first(*args, plan, scale) is None
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(args[3:], before))
    reference_plan = reference.plan_paged_attention(tables, lens, starts, 8)
    assert kernels.attend_heads_first(q4, k4, v4, kc, vc, reference_plan, scale) is None
    with pytest.raises(ValueError, match="sliding_window=4"):
        kernels.attend_heads_first(q4, k4, v4, kc, vc, plan, scale, sliding_window=4)
