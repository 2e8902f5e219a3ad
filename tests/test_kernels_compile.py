"""Compile-only check: every Triton kernel builds for sm_80 and sm_90 with `triton.compile`, no GPU needed.

Each case builds the exact launch the kernels would make (arguments, constexprs, num_warps/stages)
from small CPU tensors and runs Triton's full CUDA pipeline on it: TTIR -> TTGIR -> LLVM IR -> PTX
-> cubin (ptxas ships inside the triton wheel). This catches what the CPU interpreter accepts but a
GPU compiler refuses, such as `tl.dot` with K < 16 (see bad_dot_kernel.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_backend.kernels import triton_attention, triton_cache, triton_lora
from paged_backend.kernels.lora import plan_lora
from paged_backend.kernels.triton_compile import compile_launch, cuda_target, resource_usage
from paged_backend.kernels.triton_launch import is_interpreted
from subprocess_pytest import assert_function_passed, list_test_functions, run_pytest_file

TARGETS = [90, 80]

ATTENTION_CASES = {
    # name: (dtype, num_heads, num_kv_heads, head_size, block_size, phase, num_splits)
    "decode-fp16-d128-bs16-gqa4": (torch.float16, 32, 8, 128, 16, "decode", 1),
    "decode-bf16-d64-bs8-gqa1": (torch.bfloat16, 8, 8, 64, 8, "decode", 1),
    "decode-fp32-d96-bs32-gqa8": (torch.float32, 32, 4, 96, 32, "decode", 1),
    "prefill-fp16-d80-bs128-gqa6": (torch.float16, 12, 2, 80, 128, "prefill", 1),
    "prefill-bf16-d128-bs16-gqa4": (torch.bfloat16, 32, 8, 128, 16, "prefill", 1),
    "prefill-fp32-d128-bs8-gqa8": (torch.float32, 32, 4, 128, 8, "prefill", 1),
    "decode-split8-fp16-d128-bs16": (torch.float16, 32, 8, 128, 16, "decode", 8),
    "decode-split4-bf16-d64-bs16-gqa3": (torch.bfloat16, 9, 3, 64, 16, "decode", 4),
    "prefill-split2-fp16-d96-bs32": (torch.float16, 8, 2, 96, 32, "prefill", 2),
    # One sequence with a one-block table: the JIT turns num_seqs == 1 and stride_bt == 1 into constexprs.
    "decode-batch1-bf16-d128-bs128": (torch.bfloat16, 32, 8, 128, 128, "decode", 1, 1, 1),
    "decode-batch1-split2-fp16-d64-bs16": (torch.float16, 8, 8, 64, 16, "decode", 2, 1, 1),
    "prefill-batch1-fp32-d80-bs16": (torch.float32, 4, 4, 80, 16, "prefill", 1, 1, 1),
    # Head size 256 (Gemma 2/3): decode needs 8 warps to stay free of spills.
    "decode-fp16-d256-bs16-gqa2": (torch.float16, 8, 4, 256, 16, "decode", 1),
    "prefill-bf16-d256-bs16-gqa2": (torch.bfloat16, 8, 4, 256, 16, "prefill", 1),
}


# Sliding window, soft-cap and sinks (each variant is its own compiled kernel: constexpr flags).
VARIANT_CASES = {
    # name: (dtype, num_heads, num_kv_heads, head_size, block_size, phase, num_splits, variant)
    "decode-window-fp16-d128-bs16-gqa4": (torch.float16, 32, 8, 128, 16, "decode", 1, "window"),
    "prefill-window-bf16-d128-bs16-gqa4": (torch.bfloat16, 32, 8, 128, 16, "prefill", 1, "window"),
    "decode-softcap-bf16-d256-bs16-gqa2": (torch.bfloat16, 8, 4, 256, 16, "decode", 1, "softcap"),
    "prefill-softcap-window-fp16-d256-bs16": (torch.float16, 8, 4, 256, 16, "prefill", 1, "softcap+window"),
    "decode-sinks-window-bf16-d64-bs16-gqa8": (torch.bfloat16, 64, 8, 64, 16, "decode", 1, "sinks+window"),
    "prefill-sinks-fp16-d64-bs32-gqa8": (torch.float16, 64, 8, 64, 32, "prefill", 1, "sinks"),
    "decode-split8-all-fp16-d128-bs16": (torch.float16, 32, 8, 128, 16, "decode", 8, "all"),
    "prefill-split2-all-bf16-d64-bs8": (torch.bfloat16, 8, 2, 64, 8, "prefill", 2, "all"),
    "decode-all-fp32-d128-bs16-gqa4": (torch.float32, 32, 8, 128, 16, "decode", 1, "all"),
    "prefill-all-fp32-d64-bs128-gqa1": (torch.float32, 8, 8, 64, 128, "prefill", 1, "all"),
}


# Compact caches: fp8 (read as bytes, decoded in the kernel) and a cache dtype other than the query's.
KV_DTYPE_CASES = {
    # name: (query dtype, cache dtype, num_heads, num_kv_heads, head_size, block_size, phase, num_splits)
    "decode-e4m3-fp16-d128-bs16-gqa4": (torch.float16, torch.float8_e4m3fn, 32, 8, 128, 16, "decode", 1),
    "prefill-e4m3-bf16-d128-bs16-gqa4": (torch.bfloat16, torch.float8_e4m3fn, 32, 8, 128, 16, "prefill", 1),
    "decode-split4-e5m2-bf16-d64-bs16": (torch.bfloat16, torch.float8_e5m2, 9, 3, 64, 16, "decode", 4),
    "prefill-e5m2-fp16-d256-bs16-gqa2": (torch.float16, torch.float8_e5m2, 8, 4, 256, 16, "prefill", 1),
    "decode-e4m3-fp32-d128-bs32-gqa8": (torch.float32, torch.float8_e4m3fn, 32, 4, 128, 32, "decode", 1),
    "decode-bf16cache-fp32-d64-bs16": (torch.float32, torch.bfloat16, 9, 3, 64, 16, "decode", 1),
    "prefill-fp16cache-bf16-d128-bs16": (torch.bfloat16, torch.float16, 32, 8, 128, 16, "prefill", 1),
}


# LoRA's segmented kernels: decode (16-row tiles) and prefill segments, small and large ranks.
LORA_CASES = {
    # name: (dtype, num_tokens, max_rank)
    "decode-fp16-r8": (torch.float16, 8, 8),
    "decode-bf16-r64": (torch.bfloat16, 12, 64),
    "prefill-bf16-r16": (torch.bfloat16, 512, 16),
    "prefill-fp16-r64": (torch.float16, 300, 64),
    "decode-fp32-r32": (torch.float32, 4, 32),
    "prefill-fp32-r64": (torch.float32, 200, 64),
}


def _variant_kwargs(variant: str, num_heads: int) -> dict:
    kwargs = {}
    if "window" in variant or variant == "all":
        kwargs["sliding_window"] = 4096
    if "softcap" in variant or variant == "all":
        kwargs["softcap"] = 50.0
    if "sinks" in variant or variant == "all":
        kwargs["sinks"] = torch.zeros(num_heads, dtype=torch.float32)
    return kwargs


def _attention_launches(dtype, heads, kv_heads, head_size, block_size, phase, splits, num_seqs=4, table_width=2,
                        cache_dtype=None, **variant):
    num_tokens = num_seqs if phase == "decode" else 96
    query = torch.zeros(num_tokens, heads, head_size, dtype=dtype)
    cache = torch.zeros(8, block_size, kv_heads, head_size, dtype=cache_dtype or dtype)
    block_tables = torch.zeros(num_seqs, table_width, dtype=torch.int32)
    context_lens = torch.ones(num_seqs, dtype=torch.int32)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    config = triton_attention.choose_config(query, cache, block_tables, splits, variant.get("sliding_window"))
    assert config.num_splits == splits
    return triton_attention.paged_attention_launches(query, cache, cache, block_tables, context_lens,
                                                     query_start_loc, 0.125, query, config, **variant)


def _compile_all(launches, capability, max_stack_bytes=0):
    """Compile to a cubin; the tile choices must also keep the kernels free of register spills
    (fp32, the full-precision FMA path, may keep a few bytes on the stack)."""
    for launch in launches:
        compiled = compile_launch(launch, cuda_target(capability))
        assert compiled.asm.get("cubin"), f"{launch.kernel.__name__}: no cubin for sm_{capability}"
        assert "ptx" in compiled.asm and f"sm_{capability}" in compiled.asm["ptx"]
        usage = resource_usage(compiled)
        assert usage.stack_bytes <= max_stack_bytes, f"{launch.kernel.__name__} spills on sm_{capability}: {usage}"


if is_interpreted(triton_attention.paged_attention_kernel):
    # This pytest process imported Triton with TRITON_INTERPRET=1: compile in a clean process instead.
    @pytest.fixture(scope="module")
    def clean_run(tmp_path_factory):
        junit = tmp_path_factory.mktemp("triton-compile") / "junit.xml"
        return run_pytest_file(Path(__file__), junit, unset_env=("TRITON_INTERPRET",), timeout=590)

    @pytest.mark.parametrize("check", [n for n in list_test_functions(Path(__file__)) if n != "test_in_clean_process"])
    def test_in_clean_process(check, clean_run):
        assert_function_passed(clean_run, check)

else:
    @pytest.mark.parametrize("capability", TARGETS)
    @pytest.mark.parametrize("name", list(ATTENTION_CASES))
    def test_paged_attention_compiles(name, capability):
        launches = _attention_launches(*ATTENTION_CASES[name])
        assert len(launches) == (2 if ATTENTION_CASES[name][6] > 1 else 1)
        _compile_all(launches, capability, max_stack_bytes=32 if ATTENTION_CASES[name][0] == torch.float32 else 0)

    @pytest.mark.parametrize("capability", TARGETS)
    @pytest.mark.parametrize("name", list(VARIANT_CASES))
    def test_attention_variants_compile(name, capability):
        *shape, variant = VARIANT_CASES[name]
        launches = _attention_launches(*shape, **_variant_kwargs(variant, shape[1]))
        assert len(launches) == (2 if shape[6] > 1 else 1)
        flags = launches[0].constexprs
        assert (flags["HAS_WINDOW"], flags["SOFTCAP"], flags["HAS_SINKS"]) == (
            "window" in variant or variant == "all", "softcap" in variant or variant == "all",
            "sinks" in variant or variant == "all")
        _compile_all(launches, capability, max_stack_bytes=32 if shape[0] == torch.float32 else 0)

    @pytest.mark.parametrize("capability", TARGETS)
    @pytest.mark.parametrize("name", list(KV_DTYPE_CASES))
    def test_attention_over_compact_caches_compiles(name, capability):
        query_dtype, cache_dtype, *shape = KV_DTYPE_CASES[name]
        launches = _attention_launches(query_dtype, *shape, cache_dtype=cache_dtype, k_scale=0.5)
        assert launches[0].constexprs["KV_FORMAT"] == {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(cache_dtype, 0)
        _compile_all(launches, capability, max_stack_bytes=32 if query_dtype == torch.float32 else 0)

    @pytest.mark.parametrize("capability", TARGETS)
    @pytest.mark.parametrize("dtype, cache_dtype", [
        (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2),
        (torch.float32, torch.float8_e4m3fn)], ids=str)
    def test_reshape_and_cache_compiles(dtype, cache_dtype, capability):
        cache = torch.zeros(4, 16, 3, 80, dtype=cache_dtype)
        key = torch.zeros(3, 5, 80, dtype=dtype).transpose(0, 1)
        slots = torch.zeros(5, dtype=torch.long)
        scale = 0.5 if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 1.0
        _compile_all([triton_cache.reshape_and_cache_launch(key, key, cache, cache, slots, scale, scale)], capability)

    @pytest.mark.parametrize("capability", TARGETS)
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn], ids=str)
    def test_copy_blocks_compiles(dtype, capability):
        caches = [torch.zeros(4, 16, 2, 64, dtype=dtype) for _ in range(2)]
        mapping = torch.tensor([[0, 1]])
        _compile_all([triton_cache.copy_blocks_launch(caches[:1], caches[1:], mapping)], capability)

    @pytest.mark.parametrize("capability", TARGETS)
    @pytest.mark.parametrize("name", list(LORA_CASES))
    def test_lora_kernels_compile(name, capability):
        """The segmented shrink/expand kernels at a 4096-wide layer (Llama-7B's projections), four slots."""
        dtype, num_tokens, rank = LORA_CASES[name]
        plan = plan_lora(torch.arange(num_tokens) % 4)
        x, y = torch.zeros(num_tokens, 4096, dtype=dtype), torch.zeros(num_tokens, 4096, dtype=dtype)
        a, b = torch.zeros(4, rank, 4096, dtype=dtype), torch.zeros(4, 4096, rank, dtype=dtype)
        launches = triton_lora.lora_launches(y, x, plan, a, b, torch.zeros(4))
        assert [launch.kernel.__name__ for launch in launches] == ["lora_shrink_kernel", "lora_expand_kernel"]
        _compile_all(launches, capability)

    @pytest.mark.parametrize("capability", TARGETS)
    def test_compile_check_rejects_a_dot_with_k_below_16(capability):
        from bad_dot_kernel import small_k_dot_launch

        launch = small_k_dot_launch(torch.zeros(16, 8), torch.zeros(8, 16), torch.zeros(16, 16))
        with pytest.raises(Exception, match="K >= 16"):
            compile_launch(launch, cuda_target(capability))
