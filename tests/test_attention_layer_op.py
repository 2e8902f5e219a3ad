"""The attention operator of compiled forwards (`torch.ops.paged_backend.attend_layer`, kernels/cpu_attention_op.cpp
with kernels/cpu_attention_step.py): bit-identical to the Python path through the same kernel (outputs and the
cache rows it writes) in every dtype and variant it takes; the fallback for every call it does not take; plans
that do not fit the caches refused; the step's state private to its thread. The engine's compiled steps:
tests/test_compiled_forward.py."""

from __future__ import annotations

import threading

import pytest
import torch

from paged_backend import kernels
from paged_backend.kernels import cpu, cpu_attention_step
from paged_backend.worker import attention_op  # noqa: F401  (registers the fallback)
from paged_backend.worker.attention import AttentionMetadata, attention_context

pytestmark = pytest.mark.skipif(not cpu_attention_step.op_available(),
                                reason="no C++ compiler: the operator cannot be built")

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS, LAYERS = 4, 2, 16, 4, 24, 3


class Step:
    """A step of three sequences (1, 3 and 1 new tokens) over shuffled blocks, and its caches."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, query_lens=(1, 3, 1), context_lens=(6, 9, 13)):
        g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.caches = [tuple(torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
                             for _ in range(2)) for _ in range(LAYERS)]
        blocks = torch.randperm(NUM_BLOCKS, generator=g)
        width = 4
        self.tables = blocks[:3 * width].reshape(3, width).to(torch.int32)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)
        self.query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        slots = []
        for s, (q, c) in enumerate(zip(query_lens, context_lens)):
            for pos in range(c - q, c):
                slots.append(int(self.tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.tokens = len(slots)
        self.generator = g

    def inputs(self, query_dtype=None):
        """query [1, heads, T, D] as transformers hands it (its memory [T, heads, D]), new key/value [1, kv, T, D]."""
        g, dtype = self.generator, query_dtype or self.dtype
        rows = torch.randn(self.tokens, HEADS, HEAD_SIZE, generator=g).to(dtype)
        key = torch.randn(self.tokens, KV_HEADS, HEAD_SIZE, generator=g).to(self.dtype)
        value = torch.randn(self.tokens, KV_HEADS, HEAD_SIZE, generator=g).to(self.dtype)
        return rows.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None]

    def plan(self, window=None):
        return cpu.plan_paged_attention(self.tables, self.context_lens, self.query_start, BLOCK_SIZE, NUM_BLOCKS,
                                        window, self.slots)

    def clone_caches(self):
        return [(k.clone(), v.clone()) for k, v in self.caches]

    def metadata(self, caches, scales=None) -> AttentionMetadata:
        return AttentionMetadata(self.slots, self.tables, self.context_lens, self.query_start, BLOCK_SIZE, caches, {},
                                 kv_scales=scales)


def python_path(step: Step, caches, query, key, value, layer, scale, window, softcap, sinks):
    """The same kernel through kernels.attend_and_cache on [T, heads, D] views: [1, T, heads, D], caches written."""
    out = kernels.attend_and_cache(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                   caches[layer][0], caches[layer][1], step.slots, step.tables, step.context_lens,
                                   step.query_start, scale, plan=step.plan(window), sliding_window=window,
                                   softcap=softcap, sinks=sinks)
    return out[None]


def operator(step: Step, caches, query, key, value, layer, scale, window, softcap, sinks, plans=(None,)):
    with cpu_attention_step.attention_step(caches) as active:
        assert active
        for w in plans:
            cpu_attention_step.set_plan(w, step.plan(w))
        return torch.ops.paged_backend.attend_layer(query, key, value, layer, scale, window or 0, softcap or 0.0,
                                                    sinks)


def _kernel_ran(before: int, times: int = 1) -> bool:
    return cpu_attention_step.kernel_calls() == before + times


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=["fp32", "fp64", "bf16", "fp16"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "sinks"])
def test_the_operator_equals_the_python_path_bit_for_bit(dtype, variant):
    step = Step(dtype, seed=hash(variant) % 1000)
    window = 5 if variant == "window" else None
    softcap = 7.5 if variant == "softcap" else None
    sinks = torch.randn(HEADS, generator=step.generator) if variant == "sinks" else None
    query, key, value = step.inputs()
    reference_caches, caches = step.clone_caches(), step.clone_caches()
    expected = python_path(step, reference_caches, query, key, value, 1, 0.3, window, softcap, sinks)
    before = cpu_attention_step.kernel_calls()
    got = operator(step, caches, query, key, value, 1, 0.3, window, softcap, sinks, plans=(window,))
    assert _kernel_ran(before)
    assert got.dtype == dtype and got.shape == (1, step.tokens, HEADS, HEAD_SIZE)
    assert torch.equal(got, expected)
    for (k, v), (rk, rv) in zip(caches, reference_caches):   # the new rows in their slots, nothing else touched
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert not torch.equal(caches[1][0], step.caches[1][0])


def test_a_query_of_another_layout_or_dtype_is_converted_first():
    """A query whose memory is not [T, heads, D] (made contiguous as [1, heads, T, D]) and a bfloat16 query over a
    float32 cache are copied to the kernel's layout and dtype: same results as the Python path."""
    step = Step(torch.float32, seed=3)
    query, key, value = step.inputs()
    query = query.contiguous()
    expected = python_path(step, step.clone_caches(), query, key, value, 0, 0.25, None, None, None)
    before = cpu_attention_step.kernel_calls()
    assert torch.equal(operator(step, step.clone_caches(), query, key, value, 0, 0.25, None, None, None), expected)
    half = query.to(torch.bfloat16)
    expected = python_path(step, step.clone_caches(), half, key, value, 0, 0.25, None, None, None)
    got = operator(step, step.clone_caches(), half, key, value, 0, 0.25, None, None, None)
    assert _kernel_ran(before, 2) and got.dtype == torch.bfloat16 and torch.equal(got, expected)


def _fallback_case(name: str, step: Step):
    """(query, key, value, layer, window, caches, metadata scales) of a call the C++ kernel must not take."""
    query, key, value = step.inputs()
    caches, scales = step.clone_caches(), None
    layer, window = 2, None
    if name == "no plan for the window":
        window = 4
    elif name == "key of another dtype than the cache":
        key = key.double()
    elif name == "fp8 cache":
        caches = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in caches]
        scales = [(1.0, 1.0)] * LAYERS
    return query, key, value, layer, window, caches, scales


@pytest.mark.parametrize("case", ["no plan for the window", "key of another dtype than the cache", "fp8 cache"])
def test_calls_the_kernel_does_not_take_are_the_fallback_with_the_same_results(case):
    step = Step(torch.float32, seed=5)
    query, key, value, layer, window, caches, scales = _fallback_case(case, step)
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    with attention_context(step.metadata(reference_caches, scales)):
        expected = torch.ops.paged_backend.attend_layer_fallback(query, key, value, layer, 0.3, window or 0, 0.0, None)
    before = cpu_attention_step.kernel_calls()
    with attention_context(step.metadata(caches, scales)), cpu_attention_step.attention_step(caches) as active:
        assert active
        cpu_attention_step.set_plan(None, step.plan())
        got = torch.ops.paged_backend.attend_layer(query, key, value, layer, 0.3, window or 0, 0.0, None)
    assert _kernel_ran(before, 0)
    assert torch.equal(got, expected)
    assert all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(caches, reference_caches))


def test_without_a_step_every_call_is_the_fallback_and_needs_the_metadata():
    step = Step(torch.float32)
    query, key, value = step.inputs()
    before = cpu_attention_step.kernel_calls()
    with attention_context(step.metadata(step.clone_caches())):
        got = torch.ops.paged_backend.attend_layer(query, key, value, 0, 0.3, 0, 0.0, None)
    assert _kernel_ran(before, 0)
    assert torch.equal(got, python_path(step, step.clone_caches(), query, key, value, 0, 0.3, None, None, None))
    with pytest.raises(RuntimeError, match="outside an engine step"):
        torch.ops.paged_backend.attend_layer(query, key, value, 0, 0.3, 0, 0.0, None)


def test_plans_and_caches_that_do_not_fit_are_refused():
    step = Step(torch.float32)
    caches = step.clone_caches()
    with cpu_attention_step.attention_step(caches) as active:
        assert active
        bad = step.plan()
        bad.block_tables[1, 1] = NUM_BLOCKS   # a block the kernel would read, outside the cache
        with pytest.raises(RuntimeError, match="does not fit the caches"):
            cpu_attention_step.set_plan(None, bad)
        short = step.plan()
        with pytest.raises(RuntimeError, match="slots for"):
            torch.ops.paged_backend.set_attention_plan(0, short.block_tables, short.context_lens,
                                                       short.query_start_loc, short.slot_mapping[:-1])
    uneven = caches[:2] + [(caches[2][0][:-1], caches[2][1][:-1])]   # one layer with fewer blocks
    with cpu_attention_step.attention_step(uneven) as active:
        assert not active
    with cpu_attention_step.attention_step(None) as active:
        assert not active
    assert not torch.ops.paged_backend.attention_step_set()


def test_the_step_belongs_to_the_thread_that_set_it():
    step = Step(torch.float32)
    query, key, value = step.inputs()
    seen = {}

    def other_thread():
        seen["set"] = torch.ops.paged_backend.attention_step_set()
        before = cpu_attention_step.kernel_calls()
        with attention_context(step.metadata(step.clone_caches())):
            torch.ops.paged_backend.attend_layer(query, key, value, 0, 0.3, 0, 0.0, None)
        seen["kernel"] = cpu_attention_step.kernel_calls() - before

    with cpu_attention_step.attention_step(step.clone_caches()):
        cpu_attention_step.set_plan(None, step.plan())
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert torch.ops.paged_backend.attention_step_set()
    assert seen == {"set": False, "kernel": 0}
    assert not torch.ops.paged_backend.attention_step_set()


def test_a_forced_kernel_backend_other_than_cpp_keeps_every_call_on_the_fallback(monkeypatch):
    """`PAGED_BACKEND_KERNELS=torch` asks for PyTorch's attention: compiled code must not run the C++ kernel."""
    step = Step(torch.float32)
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "torch")
    with cpu_attention_step.attention_step(step.clone_caches()) as active:
        assert not active and not torch.ops.paged_backend.attention_step_set()
    assert kernels.kernels_in_use("cpu")["attend_layer"] == "python"
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "cpp")
    assert kernels.kernels_in_use("cpu")["attend_layer"] == "cpp"
