"""Benchmark 4 in half precision, a record of its own: the serving benchmark with our bfloat16 servers against
llama.cpp's bf16 and f16 GGUFs and `transformers serve` in bfloat16 (the anchor-half size), so that `make bench`
records the half-precision comparison at the same commit as the float32 one."""

from __future__ import annotations

from dataclasses import replace

from paged_backend.benchmarks.paper.serving import ANCHOR_HALF, QUICK, SPEC as FLOAT32_SPEC

# The smoke size: the float32 smoke run's load, our server alone in bfloat16 (llama.cpp is never built by a test).
QUICK_HALF = {**QUICK, "systems": ("paged",), "dtype": "bfloat16"}
SPEC = replace(FLOAT32_SPEC, name="serving-half", sizes={"quick": QUICK_HALF, "anchor-half": ANCHOR_HALF},
               documented_size="anchor-half")
