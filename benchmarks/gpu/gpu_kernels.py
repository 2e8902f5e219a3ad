"""GPU check and timing of the Triton kernels: correctness against the reference, decode bandwidth.

Run on a CUDA machine: `python -m paged_backend.benchmarks.gpu.gpu_kernels [--output docs/kernels_gpu.md]`.
It (1) checks every kernel against the PyTorch reference on CUDA (dtypes, head sizes, block sizes,
GQA, decode / prefill with context / split-KV), (2) measures the device's copy bandwidth, (3) times
decode attention with `triton.testing.do_bench` for batch 1-256 x context 128-8192 and reports the
achieved bandwidth (K/V bytes read / time) as a fraction of the copy bandwidth. A few minutes.
Importable without a GPU; `main` refuses to run without one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from paged_backend.benchmarks.harness.report import conditions, conditions_line

BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (128, 512, 2048, 8192)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}   # tf32-free fp32 path: tight


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale)


def make_batch(context_lens: Sequence[int], query_lens: Sequence[int], num_heads: int, num_kv_heads: int,
               head_size: int, block_size: int, dtype: torch.dtype, device: str = "cuda",
               seed: int = 0) -> Batch:
    """Random caches with each sequence's blocks scattered through a shuffled block pool."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    physical = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = physical[start:start + count]
        start += count
    starts = torch.tensor([0] + list(query_lens), device=device).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_size, generator=gen, device=device,
                        dtype=torch.float32).to(dtype)
    return Batch(query, key_cache, value_cache, block_tables,
                 torch.tensor(list(context_lens), dtype=torch.int32, device=device), starts, head_size ** -0.5)


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.isnan().any():
        return float("nan")
    return (got.float() - want.float()).abs().max().item()


def check_attention_cases(device: str = "cuda") -> List[str]:
    """Triton paged attention vs the reference (computed in fp32) on CUDA; returns failure lines."""
    from paged_backend.kernels import reference, triton_kernels

    cases = [  # (context_lens, query_lens, heads, kv_heads, head_size, block_size, num_splits, variant)
        ([1, 17, 64, 300], [1, 1, 1, 1], 32, 8, 128, 16, None, {}),
        ([1, 17, 64, 300], [1, 1, 1, 1], 12, 4, 96, 8, None, {}),
        ([33, 130, 7], [33, 20, 1], 8, 8, 64, 32, None, {}),
        ([500, 1000], [100, 1], 12, 2, 80, 128, None, {}),
        ([4000, 1], [1, 1], 32, 8, 128, 16, 16, {}),
        ([700, 90], [50, 1], 9, 3, 64, 64, 4, {}),
        # Sliding window, soft-cap (Gemma 2: head size 256) and sinks (gpt-oss), decode / prefill / split.
        ([1, 17, 300, 2000], [1, 1, 1, 1], 8, 4, 256, 16, None, dict(sliding_window=128, softcap=50.0)),
        ([200, 600, 9], [200, 64, 9], 8, 4, 256, 16, None, dict(sliding_window=100, softcap=50.0)),
        ([4000, 130], [1, 1], 64, 8, 64, 16, 8, dict(sliding_window=1000, sinks=True)),
        ([300, 1000], [300, 40], 64, 8, 64, 16, None, dict(sliding_window=128, sinks=True)),
    ]
    failures = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for i, (ctx, qlens, heads, kv_heads, head, bs, splits, variant) in enumerate(cases):
            batch = make_batch(ctx, qlens, heads, kv_heads, head, bs, dtype, device=device, seed=i)
            if variant.get("sinks"):
                variant = dict(variant, sinks=torch.randn(heads, device=device))
            out = torch.full_like(batch.query, float("nan"))
            triton_kernels.paged_attention(*batch.args(), out=out, num_splits=splits, **variant)
            f32 = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in batch.args()]
            want = reference.paged_attention(*f32, **variant)
            error = _max_error(out, want)
            status = "ok" if error <= TOLERANCE[dtype] else "FAIL"
            shown = {k: (v if not torch.is_tensor(v) else "yes") for k, v in variant.items()}
            line = f"attention {dtype} case {i} (ctx {ctx}, q {qlens}, {heads}/{kv_heads} heads, d{head}, bs{bs}" \
                   f"{', ' + str(shown) if shown else ''}): max error {error:.2e} {status}"
            print(line)
            if status != "ok":
                failures.append(line)
    return failures


def check_cache_ops(device: str = "cuda") -> List[str]:
    """reshape_and_cache and copy_blocks vs the reference, bit for bit."""
    from paged_backend.kernels import reference, triton_kernels

    failures = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        key_cache = torch.randn(64, 16, 8, 128, device=device).to(dtype)
        value_cache = torch.randn_like(key_cache)
        slots = torch.randperm(64 * 16, device=device)[:300]
        key = torch.randn(8, 300, 128, device=device).to(dtype).transpose(0, 1)
        value = torch.randn(300, 8, 128, device=device).to(dtype)
        want_k, want_v = key_cache.clone(), value_cache.clone()
        reference.reshape_and_cache(key, value, want_k, want_v, slots)
        triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
        ok = torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
        keys = [torch.randn(32, 16, 8, 128, device=device).to(dtype) for _ in range(4)]
        values = [torch.randn_like(k) for k in keys]
        mapping = torch.tensor([[0, 20], [5, 21], [31, 1]], device=device)
        want_keys, want_values = [k.clone() for k in keys], [v.clone() for v in values]
        reference.copy_blocks(want_keys, want_values, mapping)
        triton_kernels.copy_blocks(keys, values, mapping)
        ok_copy = all(torch.equal(a, b) for a, b in zip(keys + values, want_keys + want_values))
        for name, good in (("reshape_and_cache", ok), ("copy_blocks", ok_copy)):
            line = f"{name} {dtype}: {'ok' if good else 'FAIL'}"
            print(line)
            if not good:
                failures.append(line)
    return failures


COMPACT_CASES = [  # (context_lens, query_lens, heads, kv_heads, head_size, block_size, num_splits)
    ([1, 17, 64, 300], [1, 1, 1, 1], 32, 8, 128, 16, None), ([33, 130, 7], [33, 20, 1], 8, 8, 64, 32, None),
    ([4000, 1], [1, 1], 32, 8, 128, 16, 16), ([700, 90], [50, 1], 8, 4, 256, 16, None)]


def check_compact_caches(device: str = "cuda", cases=COMPACT_CASES) -> List[str]:
    """fp8 and mixed-dtype caches: reshape_and_cache writes the reference's bytes; attention over the written
    cache equals the reference computed in fp32 on the same entries."""
    from paged_backend.kernels import reference, triton_kernels

    failures = []
    combos = [(torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
              (torch.float16, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fn),
              (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]
    for query_dtype, cache_dtype in combos:
        scales = (0.5, 2.0) if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else (1.0, 1.0)
        for i, (ctx, qlens, heads, kv_heads, head, bs, splits) in enumerate(cases):
            batch = make_batch(ctx, qlens, heads, kv_heads, head, bs, torch.float32, device=device, seed=100 + i)
            slots = torch.arange(batch.key_cache.shape[0] * bs, device=device)
            flat_k = batch.key_cache.view(-1, kv_heads, head).to(query_dtype)
            flat_v = batch.value_cache.view(-1, kv_heads, head).to(query_dtype)
            caches = []
            for impl in (triton_kernels, reference):
                kc = torch.empty(batch.key_cache.shape, dtype=cache_dtype, device=device)
                vc = torch.empty_like(kc)
                impl.reshape_and_cache(flat_k, flat_v, kc, vc, slots, *scales)
                caches.append((kc, vc))
            (kc, vc), (want_kc, want_vc) = caches
            bits = (lambda t: t.view(torch.uint8)) if kc.element_size() == 1 else (lambda t: t.view(torch.int16))
            written = torch.equal(bits(kc), bits(want_kc)) and torch.equal(bits(vc), bits(want_vc))
            query = batch.query.to(query_dtype)
            out = torch.full_like(query, float("nan"))
            args = (query, kc, vc, batch.block_tables, batch.context_lens, batch.query_start_loc, batch.scale)
            triton_kernels.paged_attention(*args, out=out, num_splits=splits, k_scale=scales[0], v_scale=scales[1])
            want = reference.paged_attention(query.float(), *args[1:], k_scale=scales[0], v_scale=scales[1])
            error = _max_error(out, want)
            good = written and error <= TOLERANCE[query_dtype]
            line = (f"compact cache {cache_dtype} under {query_dtype} queries, case {i} (ctx {ctx}, q {qlens}, "
                    f"d{head}, bs{bs}, splits {splits}): bytes {'equal' if written else 'DIFFER'}, max error "
                    f"{error:.2e} {'ok' if good else 'FAIL'}")
            print(line, flush=True)
            if not good:
                failures.append(line)
    return failures


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), the roofline reference."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * nbytes / (ms * 1e-3)


@dataclass
class DecodeTiming:
    batch: int
    context: int
    splits: int
    triton_us: float
    reference_us: Optional[float]
    bytes_read: int

    def bandwidth(self) -> float:
        return self.bytes_read / (self.triton_us * 1e-6)


def time_decode(batch_size: int, context: int, heads: int, kv_heads: int, head: int, block_size: int,
                dtype: torch.dtype, with_reference: bool, cache_dtype: Optional[torch.dtype] = None
                ) -> Optional[DecodeTiming]:
    """Time one decode step of attention (one layer); None when it does not fit in memory. `cache_dtype`: a
    compact cache (fp8 entries are read as bytes and decoded in the kernel)."""
    from triton.testing import do_bench

    from paged_backend.kernels import reference, triton_kernels
    from paged_backend.kernels.triton_attention import choose_config

    cache_dtype = cache_dtype or dtype
    element = torch.empty((), dtype=dtype).element_size()
    cache_bytes = 2 * batch_size * context * kv_heads * head * torch.empty((), dtype=cache_dtype).element_size()
    free, _ = torch.cuda.mem_get_info()
    if 2 * batch_size * context * kv_heads * head * 4 * (3 if with_reference else 2) > free:   # fp32 temporaries
        return None
    batch = make_batch([context] * batch_size, [1] * batch_size, heads, kv_heads, head, block_size, dtype)
    if cache_dtype != dtype:
        batch.key_cache, batch.value_cache = batch.key_cache.to(cache_dtype), batch.value_cache.to(cache_dtype)
    out = torch.empty_like(batch.query)
    args = batch.args()
    splits = choose_config(batch.query, batch.key_cache, batch.block_tables, None).num_splits
    triton_ms = do_bench(lambda: triton_kernels.paged_attention(*args, out=out), warmup=25, rep=100)
    reference_ms = None
    if with_reference:
        reference_ms = do_bench(lambda: reference.paged_attention(*args, out=out), warmup=5, rep=50)
    query_bytes = 2 * batch.query.numel() * element          # read q, write out
    table_bytes = batch.block_tables.numel() * 4
    return DecodeTiming(batch_size, context, splits, triton_ms * 1e3,
                        None if reference_ms is None else reference_ms * 1e3,
                        cache_bytes + query_bytes + table_bytes)


def decode_table(copy_bw: float, heads: int, kv_heads: int, head: int, block_size: int,
                 dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None) -> List[str]:
    cache_note = "" if cache_dtype in (None, dtype) else f" over a {cache_dtype} cache"
    lines = [f"Decode attention, one layer: {heads} query heads, {kv_heads} KV heads, head size {head}, "
             f"block size {block_size}, {dtype}{cache_note}; copy bandwidth {copy_bw / 1e9:.0f} GB/s.", "",
             "| batch | context | splits | Triton (us) | reference (us) | K/V+q bytes (MB) | GB/s | of copy bw |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch_size in BATCHES:
        for context in CONTEXTS:
            timing = time_decode(batch_size, context, heads, kv_heads, head, block_size, dtype,
                                 with_reference=batch_size * context <= 64 * 2048, cache_dtype=cache_dtype)
            torch.cuda.empty_cache()
            if timing is None:
                lines.append(f"| {batch_size} | {context} | - | skipped: not enough GPU memory | | | | |")
                continue
            ref = "-" if timing.reference_us is None else f"{timing.reference_us:.1f}"
            bw = timing.bandwidth()
            lines.append(f"| {batch_size} | {context} | {timing.splits} | {timing.triton_us:.1f} | {ref} | "
                         f"{timing.bytes_read / 1e6:.1f} | {bw / 1e9:.0f} | {bw / copy_bw:.0%} |")
            print(lines[-1], flush=True)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the results as markdown to this file")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip-checks", action="store_true", help="only time")
    parser.add_argument("--kv-cache-dtype", default=None, choices=("float8_e4m3fn", "float8_e5m2"),
                        help="also time decode over a compact cache of this dtype")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels needs a CUDA GPU (none found); nothing was run.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    print(f"device: {name}", flush=True)
    started = conditions()
    failures: List[str] = []
    if not args.skip_checks:
        failures += check_cache_ops()
        failures += check_attention_cases()
        failures += check_compact_caches()
    copy_bw = copy_bandwidth()
    dtype = getattr(torch, args.dtype)
    lines = [f"# Triton PagedAttention kernels on {name}", "", conditions_line(started), ""]
    lines += ["Correctness vs the reference: " + ("all checks passed" if not failures else
                                                  f"{len(failures)} FAILED: " + "; ".join(failures)), ""]
    lines += decode_table(copy_bw, 32, 8, 128, args.block_size, dtype)
    if args.kv_cache_dtype:
        lines += [""] + decode_table(copy_bw, 32, 8, 128, args.block_size, dtype, getattr(torch, args.kv_cache_dtype))
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(report)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
