"""The compiled forward (`compile=...`, worker/compiled_forward.py): greedy tokens identical to the eager engine
and to transformers, in float64 and float32, with every step of a run taken by compiled code; the background mode
serves eagerly while it compiles, with the same tokens; the option on every front.

Compiling costs time: tiny-llama's two buckets take about 30 s the first time on a 2-core machine and about 5 s
once inductor's on-disk cache (under the cache dir) holds them; the whole file takes about 30 s with a warm cache.
"""

from __future__ import annotations

import argparse
import os
import time

import pytest
import torch

from conftest import get_model, hf_greedy_tokens, run_to_completion
from paged_backend import LLMEngine, SamplingParams, load_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 45))]
SOLO = [3, 4]   # run alone afterwards: batch-1 decode steps (the `single` bucket)
MAX_TOKENS = 10


def _greedy(engine: LLMEngine, prompts) -> dict:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}


def _expected(model, prompts) -> dict:
    return {f"r{i}": hf_greedy_tokens(model, prompt, MAX_TOKENS) for i, prompt in enumerate(prompts)}


def _count_eager_attention(monkeypatch) -> list:
    """Calls of the eager attention path (compiled code calls the kernel through the custom op instead)."""
    import paged_backend.worker.attention as attention

    calls = []
    eager = attention.attend_step

    def counted(*args, **kwargs):
        calls.append(1)
        return eager(*args, **kwargs)

    monkeypatch.setattr(attention, "attend_step", counted)
    return calls


def _count_operator_paths(monkeypatch) -> dict:
    """Calls of the compiled attention operator's Python fallback, and the C++ kernel's count before the run
    (kernels/cpu_attention_op.cpp)."""
    import paged_backend.worker.attention_op as attention_op
    from paged_backend.kernels import cpu_attention_step

    counts = {"fallbacks": 0, "kernel_before": cpu_attention_step.kernel_calls()}
    fallback = attention_op.attend_step

    def counted(*args, **kwargs):
        counts["fallbacks"] += 1
        return fallback(*args, **kwargs)

    monkeypatch.setattr(attention_op, "attend_step", counted)
    return counts


def _assert_the_kernel_took_all_but_each_windows_first_call(engine: LLMEngine, model, counts: dict, windows: int):
    """Each step's attention layers ran the C++ operator, but for the first call of each sliding window (the
    fallback builds its plan; later steps build it before the forward)."""
    from paged_backend.kernels import cpu_attention_step

    steps = sum(state.steps for state in engine.runner.compiled.stats.buckets.values())
    calls = steps * model.config.num_hidden_layers
    assert counts["fallbacks"] == windows
    assert cpu_attention_step.kernel_calls() - counts["kernel_before"] == calls - windows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_compiled_greedy_tokens_match_transformers(dtype, monkeypatch):
    model, _ = get_model("tiny-llama", dtype)
    # a 16-token budget chunks the 25-token prompt: chunks that sample no row run compiled too
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=16, compile="blocking")
    stats = engine.runner.compiled.stats
    assert all(state.ready for state in stats.buckets.values()), stats.as_dict()
    # float32 linear layers run our kernel off Intel CPUs (worker/kernel_linear.py): transformers' tokens all the same
    from paged_backend.kernels import cpu_linear

    served = dtype == torch.float32 and cpu_linear.max_rows(dtype) is not None
    assert stats.linear_kernels == (sum(isinstance(m, torch.nn.Linear) for m in model.modules()) if served else 0)
    eager_calls = _count_eager_attention(monkeypatch)
    paths = _count_operator_paths(monkeypatch)
    assert _greedy(engine, PROMPTS) == _expected(model, PROMPTS)
    assert _greedy(engine, [SOLO]) == _expected(model, [SOLO])
    _assert_the_kernel_took_all_but_each_windows_first_call(engine, model, paths, windows=1)
    # every step ran compiled code: prefills and the 3-sequence decodes in `batch`, the solo decodes in `single`
    assert stats.eager_steps == 0 and eager_calls == [], stats.as_dict()
    assert stats.buckets["batch"].steps >= MAX_TOKENS and stats.buckets["single"].steps >= MAX_TOKENS - 1


def test_sliding_windows_and_soft_capping_compile_with_the_same_tokens(monkeypatch):
    """Gemma 2: alternating sliding-window layers and logit soft-capping, options read while tracing."""
    model, _ = get_model("tiny-gemma2", torch.float32)
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=16, compile="blocking")
    eager_calls = _count_eager_attention(monkeypatch)
    paths = _count_operator_paths(monkeypatch)
    assert _greedy(engine, PROMPTS) == _expected(model, PROMPTS)
    assert engine.runner.compiled.stats.eager_steps == 0 and eager_calls == [], engine.runner.compiled.stats.as_dict()
    _assert_the_kernel_took_all_but_each_windows_first_call(engine, model, paths, windows=2)


def test_bfloat16_linear_layers_run_the_kernel_when_compiled(monkeypatch):
    """In bfloat16 the compiled steps' linear layers are our kernel (worker/kernel_linear.py): for every step where
    oneDNN converts bfloat16 to float32, for steps of up to 8 tokens where it has native bfloat16 matmuls (PyTorch's
    GEMM for longer ones); the greedy tokens are those of compiled code without the kernel
    (`PAGED_BACKEND_LINEAR_KERNEL=0`). Compiled bfloat16 code itself rounds differently from the eager forward
    (inductor computes fused bfloat16 operators in float32): on tiny-llama's random weights both compiled runs
    leave the eager tokens after 5 steps, with or without the kernel."""
    from paged_backend.kernels import cpu_linear

    monkeypatch.setenv("PAGED_BACKEND_LINEAR_KERNEL", "0")
    plain, _ = load_model("tiny-llama", dtype=torch.bfloat16)   # own copies: their linear layers may change class
    without = LLMEngine(plain, num_blocks=64, max_num_batched_tokens=16, compile="blocking")
    assert without.runner.compiled.stats.linear_kernels == 0
    expected = _greedy(without, PROMPTS), _greedy(without, [SOLO])
    monkeypatch.delenv("PAGED_BACKEND_LINEAR_KERNEL")
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=16, compile="blocking")
    stats = engine.runner.compiled.stats
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert stats.linear_kernels == linears and stats.as_dict()["linear_kernels"] == linears
    # one kernel call per step for a layer's q, k and v, one for its gate and up (worker/linear_fusion.py)
    per_step = linears - 3 * model.config.num_hidden_layers
    calls = cpu_linear.kernel_calls()
    assert _greedy(engine, PROMPTS) == expected[0]
    assert stats.eager_steps == 0, stats.as_dict()
    # 12 steps under a 16-token budget: two of more than 8 tokens (the first chunks of the prompts), whose linear
    # layers take PyTorch's GEMM under a row limit of 8, but not their lm_head (over the sampled rows only); ten of
    # at most 8 tokens (the last 3-token chunk beside two decodes, then 3-sequence decodes)
    limited = cpu_linear.max_rows(torch.bfloat16) == 8
    assert cpu_linear.kernel_calls() - calls == (per_step * 10 + 2 if limited else per_step * 12)
    calls = cpu_linear.kernel_calls()
    assert _greedy(engine, [SOLO]) == expected[1]
    assert cpu_linear.kernel_calls() - calls == per_step * MAX_TOKENS   # the prefill of 2 tokens, 9 decodes


def test_a_model_that_cannot_compile_runs_eagerly_and_says_why():
    """gpt-oss routes tokens to experts by data-dependent counts, which a full graph cannot hold: both buckets
    fail to compile, say why, and every step runs eagerly with transformers' tokens."""
    model, _ = get_model("tiny-gpt-oss", torch.float32)
    engine = LLMEngine(model, num_blocks=64, compile="blocking")
    stats = engine.runner.compiled.stats
    assert not any(state.ready for state in stats.buckets.values())
    assert all("data-dependent" in state.error for state in stats.buckets.values()), stats.as_dict()
    assert _greedy(engine, PROMPTS) == _expected(model, PROMPTS)
    assert stats.eager_steps >= MAX_TOKENS


def test_compiled_code_is_cached_and_background_compile_serves_eagerly_until_ready():
    from torch._dynamo.utils import counters

    from paged_backend.worker.compiled_forward import inductor_cache_dir

    first, _ = load_model("tiny-llama", dtype=torch.float64)   # own copies: nothing compiled for them yet
    LLMEngine(first, num_blocks=64, compile="blocking")       # fills the on-disk cache if it was empty
    model, _ = load_model("tiny-llama", dtype=torch.float64)
    expected = _expected(model, PROMPTS)
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    engine = LLMEngine(model, num_blocks=64, compile=True)
    compiled = engine.runner.compiled
    assert compiled.stats.mode == "background"
    assert _greedy(engine, PROMPTS) == expected   # while the compile thread traces the same model
    assert compiled.stats.eager_steps > 0, compiled.stats.as_dict()
    assert compiled.wait(timeout=600), compiled.stats.as_dict()
    assert all(state.ready for state in compiled.stats.buckets.values()), compiled.stats.as_dict()
    # both buckets' code came from inductor's cache, kept in the project's cache dir
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == 2, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_miss"] == misses, dict(counters["inductor"])
    assert compiled.stats.cache_dir == inductor_cache_dir() and os.listdir(os.path.join(inductor_cache_dir(), "fxgraph"))
    steps_before = compiled.stats.buckets["batch"].steps
    assert _greedy(engine, PROMPTS) == expected
    assert compiled.stats.buckets["batch"].steps > steps_before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_steps_served_all_through_a_background_compile_leave_every_bucket_compiled(dtype):
    """While any compile runs, `torch.compiler.is_compiling()` is true in every thread, so an eager step on the
    serving thread switches transformers' hub-kernels context variable to its process-wide value; when that
    happened while dynamo traced the model or built its guards, the bucket failed to compile ('Expected dict, got
    NoneType') and stayed eager for good. Steps run back to back until both buckets are done."""
    model, _ = load_model("tiny-llama", dtype=dtype)
    expected = _expected(model, PROMPTS[:2])
    engine = LLMEngine(model, num_blocks=64, compile=True)
    compiled = engine.runner.compiled
    deadline = time.monotonic() + 600
    while not compiled.wait(timeout=0) and time.monotonic() < deadline:
        assert _greedy(engine, PROMPTS[:2]) == expected
    assert compiled.wait(timeout=0), compiled.stats.as_dict()
    assert compiled.stats.eager_steps > 0
    assert all(state.ready for state in compiled.stats.buckets.values()), compiled.stats.as_dict()
    assert _greedy(engine, PROMPTS[:2]) == expected


def test_compile_option_is_validated_everywhere():
    from paged_backend import EngineConfig
    from paged_backend.adapters.triton.model_json import parse_model_options
    from paged_backend.cli import add_engine_args, engine_kwargs

    assert EngineConfig.from_kwargs().compilation.compile == "off"
    assert EngineConfig.from_kwargs(compile=True).compilation.compile == "background"
    with pytest.raises(ValueError, match="compile must be"):
        EngineConfig.from_kwargs(compile="fast")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(compile=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig.from_kwargs(compile=True, enable_lora=True)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["compile"] == "off"
    assert engine_kwargs(parser.parse_args(["--compile"]))["compile"] == "background"
    assert engine_kwargs(parser.parse_args(["--compile", "blocking"]))["compile"] == "blocking"
    assert parse_model_options({"model": "tiny-llama", "compile": "true"}).engine["compile"] == "background"
    assert parse_model_options({"model": "tiny-llama", "compile": "blocking"}).engine["compile"] == "blocking"
    with pytest.raises(ValueError, match="enforce_eager"):
        parse_model_options({"model": "tiny-llama", "compile": True, "enforce_eager": True})


def _parameter_reads(engine: LLMEngine) -> int:
    """Reads of a module's parameters in the code dynamo runs before each compiled call, over the buckets."""
    import dis

    code = engine.runner.compiled._compiled._torchdynamo_orig_callable
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    assert len(entries) == 2   # the two buckets
    return sum(1 for entry in entries for ins in dis.get_instructions(entry.code) if ins.argval == "_parameters")


def test_the_parameters_are_the_graphs_attributes_not_inputs_of_every_call():
    """`DYNAMO_OPTIONS`: a compiled call does not fetch the model's parameters one by one (as inputs they were read
    through the modules' attribute chains before every step: 272 reads per smollm2 step)."""
    model, _ = get_model("tiny-llama", torch.float32)
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=16, compile="blocking")
    assert engine.runner.compiled.stats.buckets["single"].ready and engine.runner.compiled.stats.buckets["batch"].ready
    assert _parameter_reads(engine) == 0
    assert _greedy(engine, PROMPTS[:1]) == _expected(model, PROMPTS[:1])


def test_the_guard_filter_drops_the_models_guards_and_keeps_the_inputs():
    """`skip_model_guards`: a change of a module attribute no longer triggers a new compilation (its guard is
    gone), a new input shape still does (the guards that pick a step's bucket stay)."""
    from paged_backend.worker.compiled_forward import GUARD_FILTER, skip_model_guards

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = 2.0
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.factor * self.weight

    def compilations(guard_filter) -> int:
        module, graphs = Scale(), []

        def backend(graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

        options = {"guard_filter_fn": guard_filter} if guard_filter else None
        step = torch.compile(lambda x: module(x), backend=backend, options=options)
        step(torch.ones(3))
        module.factor = 3.0
        step(torch.ones(3))
        step(torch.ones(2, 3))
        return len(graphs)

    assert GUARD_FILTER is skip_model_guards
    assert compilations(None) == 3
    assert compilations(skip_model_guards) == 2


def test_hooks_a_dropped_lora_runner_leaves_for_the_collector_are_gone_before_the_trace(monkeypatch):
    """A LoRA runner that was dropped but sits in a reference cycle keeps its forward hooks on the model until the
    garbage collector runs its finalizer, which may happen in the middle of tracing a bucket (its guards then
    name a hook that is gone: the bucket fails to compile and runs eagerly; seen in `make test` when an earlier
    test's LoRA engine shared the cached model). Compiling collects first, so the trace never sees them."""
    import gc

    from paged_backend.worker import compiled_forward
    from paged_backend.worker.lora_layers import LoRALayers

    model, _ = load_model("tiny-llama", dtype=torch.float32)   # its own copy: hooks must not reach other tests
    layers = LoRALayers(model, max_loras=1, max_lora_rank=8)
    layers._layer("model.layers.0.self_attn.q_proj")   # a hook on q_proj, as a loaded adapter leaves
    layers.cycle = layers                                # freed only by a collection
    del layers
    hooked = lambda: sum(len(m._forward_hooks) for m in model.modules())   # noqa: E731
    assert hooked() == 1
    seen = []
    compile_bucket = compiled_forward.CompiledForward._compile

    def traced(self, bucket):
        seen.append(hooked())   # what the trace of this bucket meets
        return compile_bucket(self, bucket)

    monkeypatch.setattr(compiled_forward.CompiledForward, "_compile", traced)
    gc.disable()   # no automatic collection: only the engine's own may free the runner before the trace
    try:
        engine = LLMEngine(model, num_blocks=64, compile="blocking")
    finally:
        gc.enable()
    assert seen == [0, 0]
    assert all(state.ready for state in engine.runner.compiled.stats.buckets.values())
    assert _greedy(engine, [SOLO]) == _expected(model, [SOLO]) and engine.runner.compiled.stats.eager_steps == 0


def test_the_compiled_step_checks_no_shapes_at_run_time():
    """`INDUCTOR_OPTIONS`: the compiled wrapper asserts no sizes and strides on each call (inductor's
    `size_asserts`, `scalar_asserts`): dynamo's guards already pick the bucket by the step's input shapes, the
    parameters keep theirs while an engine runs, and the operators' outputs are ours. On smollm2 they were about
    400 checks per decode step, each reading a tensor's metadata after the step's weights had evicted it from the
    caches (0.2-0.3 ms of a 17-20 ms float32 batch-1 step on a 2-core AVX-512 EPYC, docs/compilation.md)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    model, _ = get_model("tiny-llama", torch.float32)
    codes = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
            torch._inductor.config.patch(fx_graph_cache=False):   # generate the code, not read it from the cache
        engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=16, compile="blocking")
    assert len(codes) == 2 and all("inductor_entry" in code for code in codes)   # the two buckets, C++ wrappers
    assert [code.count("assert_size_stride(") for code in codes] == [0, 0]
    assert _greedy(engine, PROMPTS[:1]) == _expected(model, PROMPTS[:1])
