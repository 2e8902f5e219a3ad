"""Instruction sets found at run time (kernels/cpu_features.py): parsed from three real CPUs' feature lists, the
same as PyTorch's own detection and the C++ kernels' build on this machine, and named by `paged-backend info` and
by the benchmark records' machine section."""

from __future__ import annotations

import pytest

from paged_backend.kernels.cpu_features import (cpu_features, describe, kernel_vector_bits, onednn_half_matmuls,
                                                parse_cpuinfo, torch_capability)

# /proc/cpuinfo lines of three machines this project has run on (abridged to the vector and matrix flags).
XEON_AMX = ("flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 avx_vnni avx512f avx512dq avx512cd "
            "avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n")
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 sha_ni\n"
GRAVITON3 = "Features\t: fp asimd evtstrm aes asimdhp asimddp sve i8mm bf16 svebf16\n"


@pytest.mark.parametrize("text, machine, sets, bits, half", [
    (XEON_AMX, "x86_64",
     ["SSE4.2", "AVX", "F16C", "FMA", "AVX2", "AVX-VNNI", "AVX512F", "AVX512BW", "AVX512VL", "AVX512_VNNI",
      "AVX512_BF16", "AVX512_FP16", "AMX_TILE", "AMX_BF16", "AMX_INT8"], 512,
     {"bfloat16": "AMX_BF16", "float16": "AVX512_FP16"}),
    (EPYC_AVX2, "x86_64", ["SSE4.2", "AVX", "F16C", "FMA", "AVX2"], 256,
     {"bfloat16": "converted to float32", "float16": "converted to float32"}),
    (GRAVITON3, "aarch64", ["NEON", "NEON_FP16", "NEON_DOTPROD", "BF16", "I8MM", "SVE"], 128,
     {"bfloat16": "BF16", "float16": "NEON_FP16"}),
    ("processor\t: 0\n", "x86_64", [], None, {"bfloat16": "converted to float32", "float16": "converted to float32"}),
], ids=["xeon-amx", "epyc-avx2", "graviton3", "no-flags"])
def test_instruction_sets_are_read_from_the_cpus_feature_list(text, machine, sets, bits, half):
    features = parse_cpuinfo(text, machine)
    assert features.instruction_sets() == sets
    assert features.vector_bits() == bits
    assert features.half_precision() == half


def test_this_machine_agrees_with_pytorch_and_with_the_kernels_build():
    features = cpu_features()
    capability = torch_capability()
    if capability.startswith("AVX512"):
        assert "AVX512F" in features.instruction_sets(), (capability, features.instruction_sets())
    if capability == "AVX2":
        assert "AVX2" in features.instruction_sets(), (capability, features.instruction_sets())
    if features.machine == "x86_64":   # -march=native: the kernels' vectors are the CPU's widest (at most 512 bits)
        assert kernel_vector_bits() == (512 if features.has("avx512f") else 256)
    if features.has("avx512_bf16") or features.has("amx_bf16"):
        assert onednn_half_matmuls()["bfloat16"] is True


def test_info_and_benchmark_records_name_the_instruction_sets():
    from paged_backend.benchmarks.harness.docgen import render_record
    from paged_backend.benchmarks.harness.provenance import machine
    from paged_backend.worker.model_info import model_info

    sets = cpu_features().instruction_sets()
    report = model_info("tiny-llama", kv_cache_memory="1MiB").splitlines()
    [line] = [line for line in report if line.startswith("cpu:")]
    assert all(name in line for name in sets), line
    recorded = machine()
    assert recorded["cpu_features"] == describe()
    rendered = render_record("x", {"conditions": {"machine": recorded}})
    assert all(name in rendered for name in sets) and f"{kernel_vector_bits()}-bit" in rendered
    older = dict(recorded)
    del older["cpu_features"]   # records made before the machine section named them render as they did
    assert "C++ kernels" not in render_record("x", {"conditions": {"machine": older}})
