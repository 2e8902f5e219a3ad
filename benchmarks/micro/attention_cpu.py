"""Attention on the CPU, side by side: the compiled kernel (`cpp`, reads the paged cache in place) against
the PyTorch path (`torch`, gathers each sequence's blocks padded to the longest context, then SDPA).

`python -m paged_backend.benchmarks.micro.attention_cpu` runs smollm2 steps (30 layers, 9 query / 3 KV heads,
head size 64) over a KV cache of random contents: decode batches with contexts drawn from 100-600
tokens and mixed steps (decode rows plus prefill chunks). Systems: `main` (the PyTorch path as it was
before issue 17: advanced-indexing gather), `torch` (the PyTorch path now: `index_select` gather),
`cpp` (the compiled kernel) and, with `--kv-cache-dtypes`, `cpp` over compact caches. Each repetition
runs the same step once per system, in an order that alternates; it reports the step time, the time
inside attention (the plan and `attend_and_cache` calls of all layers: the cache writes and attention) and its share of the step, and
per-repetition ratios against `cpp` as median and range. `--layer` adds a one-layer decode comparison;
`--flex` includes `torch.nn.attention.flex_attention` over the paged cache in it (compiled by inductor).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from paged_backend import kernels
from paged_backend.worker.cache_engine import CacheEngine, kv_cache_torch_dtype, kv_geometry
from paged_backend.kernels import reference
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.step_inputs import StepInputs

from paged_backend.benchmarks.harness.provenance import load_average
from paged_backend.benchmarks.harness.report import conditions, now

BACKENDS = ("cpp", "torch")


@dataclass
class System:
    """One compared configuration: a kernel backend over a runner's cache (of some dtype)."""

    name: str
    backend: str
    runner: ModelRunner
    main_gather: bool = False   # the PyTorch path with the advanced-indexing gather it had before issue 17


def _main_gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """reference._gather as it was on main before issue 17 (`cache[blocks]`), for the `main` system."""
    _, block_size, num_kv_heads, head_size = cache.shape
    return cache[blocks].view(blocks.shape[0], -1, num_kv_heads, head_size).transpose(1, 2).to(dtype)


@contextmanager
def system_active(system: System) -> Iterator[None]:
    saved = reference._gather
    if system.main_gather:
        reference._gather = _main_gather
    try:
        with backend(system.backend):
            yield
    finally:
        reference._gather = saved


@dataclass
class StepShape:
    name: str
    context_lens: List[int]
    query_lens: List[int]


def workloads(seed: int, decode_batches: Sequence[int]) -> List[StepShape]:
    """Decode batches (contexts 100-600) and mixed steps (a decode batch plus prefill chunks)."""
    rng = random.Random(seed)
    shapes = []
    for n in decode_batches:
        ctx = [rng.randint(100, 600) for _ in range(n)]
        shapes.append(StepShape(f"decode {n} x ctx 100-600", ctx, [1] * n))
    ctx = [rng.randint(100, 600) for _ in range(32)]
    shapes.append(StepShape("mixed: 32 decode + 2 chunks of 256 (0 and 128 cached)",
                            ctx + [256, 384], [1] * 32 + [256, 256]))
    shapes.append(StepShape("prefill: 4 prompts of 256", [256] * 4, [256] * 4))
    return shapes


def step_inputs(shape: StepShape, block_size: int, num_blocks: int, seed: int) -> StepInputs:
    """A step over shuffled blocks: each sequence's new tokens are the last of its context."""
    rng = random.Random(seed)
    need = [-(-c // block_size) for c in shape.context_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"{shape.name} needs {sum(need)} blocks, the cache has {num_blocks}")
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    tables, used = [], 0
    for n in need:
        tables.append(physical[used:used + n])
        used += n
    width = max(need)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = torch.tensor(shape.query_lens)
    ends = q_lens.cumsum(0)
    row_seq = torch.repeat_interleave(torch.arange(len(need)), q_lens)
    first = torch.tensor(shape.context_lens) - q_lens
    positions = torch.arange(int(q_lens.sum())) - (ends - q_lens)[row_seq] + first[row_seq]
    slots = table[row_seq, positions // block_size].long() * block_size + positions % block_size
    return StepInputs(input_ids=torch.randint(0, 1000, (positions.shape[0],), generator=torch.Generator().manual_seed(seed)),
                      positions=positions, slot_mapping=slots, block_tables=table,
                      context_lens=torch.tensor(shape.context_lens, dtype=torch.int32),
                      query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32),
                      sample_indices=ends - 1)


class AttentionClock:
    """Seconds spent in the kernels' plan and attention calls while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    @contextmanager
    def installed(self) -> Iterator["AttentionClock"]:
        saved = kernels.attend_and_cache, kernels.plan_attention
        kernels.attend_and_cache, kernels.plan_attention = self._timed(saved[0]), self._timed(saved[1])
        try:
            yield self
        finally:
            kernels.attend_and_cache, kernels.plan_attention = saved


@contextmanager
def backend(name: str) -> Iterator[None]:
    previous = os.environ.get("PAGED_BACKEND_KERNELS")
    os.environ["PAGED_BACKEND_KERNELS"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PAGED_BACKEND_KERNELS", None)
        else:
            os.environ["PAGED_BACKEND_KERNELS"] = previous


def summary(values: Sequence[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_steps(systems: List[System], shape: StepShape, inputs: StepInputs, repetitions: int) -> dict:
    """Interleaved repetitions of one step under each system: step and attention seconds, ratios to cpp."""
    samples: Dict[str, Dict[str, List[float]]] = {s.name: {"step": [], "attention": []} for s in systems}
    for system in systems:   # warm-up (the first cpp call builds the kernel library)
        with system_active(system):
            system.runner.execute(inputs)
    for rep in range(repetitions):
        for system in (systems if rep % 2 == 0 else systems[::-1]):
            with system_active(system), AttentionClock().installed() as clock:
                start = time.perf_counter()
                system.runner.execute(inputs)
                samples[system.name]["step"].append(time.perf_counter() - start)
            samples[system.name]["attention"].append(clock.seconds)
    result = {"shape": shape.name, "tokens": inputs.num_tokens, "systems": {}}
    base = samples["cpp"]
    for name, got in samples.items():
        steps, attn = got["step"], got["attention"]
        result["systems"][name] = {
            "step_ms": summary([s * 1e3 for s in steps]), "attention_ms": summary([a * 1e3 for a in attn]),
            "attention_share": summary([a / s for a, s in zip(attn, steps)]),
            "step_ratio_over_cpp": summary([s / c for s, c in zip(steps, base["step"])]),
            "attention_ratio_over_cpp": summary([a / c for a, c in zip(attn, base["attention"])])}
    return result


def flex_decode(num_blocks: int, block_size: int):
    """flex_attention over the paged cache for decode rows: one query block per row (Q_BLOCK_SIZE 1),
    its sequence's blocks as the row's KV blocks (the last one partial, masked by position)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(query, key_cache, value_cache, block_tables, context_lens, scale):
        rows = query.shape[0]
        tables = block_tables.long()
        counts = -(-context_lens.long() // block_size)
        logical = torch.zeros(num_blocks, dtype=torch.long)
        cols = torch.arange(tables.shape[1])
        used = cols[None, :] < counts[:, None]
        logical[tables[used]] = cols.expand_as(tables)[used]
        last_pos = context_lens.long() - 1
        full_idx = torch.zeros(rows, num_blocks, dtype=torch.int32)
        full_idx[:, :tables.shape[1]] = torch.where(cols[None, :] < (counts - 1)[:, None], tables, 0).to(torch.int32)
        part_idx = torch.zeros(rows, num_blocks, dtype=torch.int32)
        part_idx[:, 0] = tables.gather(1, (counts - 1)[:, None])[:, 0].to(torch.int32)

        def mask_mod(b, h, q_idx, kv_idx):
            return logical[kv_idx // block_size] * block_size + kv_idx % block_size <= last_pos[q_idx]

        mask = BlockMask.from_kv_blocks(torch.ones(1, 1, rows, dtype=torch.int32), part_idx[None, None],
                                        (counts - 1).to(torch.int32)[None, None], full_idx[None, None],
                                        BLOCK_SIZE=(1, block_size), mask_mod=mask_mod,
                                        seq_lengths=(rows, num_blocks * block_size))
        kv_heads, head_size = key_cache.shape[2:]
        k = key_cache.view(-1, kv_heads, head_size).permute(1, 0, 2)[None]
        v = value_cache.view(-1, kv_heads, head_size).permute(1, 0, 2)[None]
        out = compiled(query.transpose(0, 1)[None], k, v, block_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    return attend


def measure_layer(batch: int, repetitions: int, with_flex: bool, seed: int) -> dict:
    """One smollm2 layer's decode attention over `batch` sequences (contexts 100-600): torch, cpp, flex."""
    num_heads, kv_heads, head_size, block_size = 9, 3, 64, 16
    rng = random.Random(seed)
    shape = StepShape(f"one layer, decode {batch}", [rng.randint(100, 600) for _ in range(batch)], [1] * batch)
    num_blocks = sum(-(-c // block_size) for c in shape.context_lens) + 64
    inputs = step_inputs(shape, block_size, num_blocks, seed)
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    q = torch.randn(batch, num_heads, head_size, generator=gen)
    args = (q, kc, vc, inputs.block_tables, inputs.context_lens, inputs.query_start_loc, head_size ** -0.5)
    impls: Dict[str, Callable[[], torch.Tensor]] = {}
    for name in BACKENDS:
        with backend(name):
            plan = kernels.plan_attention(kc, *args[3:6])
        impls[name] = (lambda name=name, plan=plan: _with_backend(name, lambda: kernels.paged_attention(*args,
                                                                                                    plan=plan)))
    compile_s = None
    if with_flex:
        attend = flex_decode(num_blocks, block_size)
        start = time.perf_counter()
        got = attend(q, kc, vc, inputs.block_tables, inputs.context_lens, head_size ** -0.5)
        compile_s = time.perf_counter() - start
        want = impls["torch"]()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise AssertionError("flex_attention disagrees with the reference")
        impls["flex"] = lambda: attend(q, kc, vc, inputs.block_tables, inputs.context_lens, head_size ** -0.5)
    times: Dict[str, List[float]] = {name: [] for name in impls}
    for fn in impls.values():
        fn()
    for rep in range(repetitions):
        order = list(impls) if rep % 2 == 0 else list(impls)[::-1]
        for name in order:
            start = time.perf_counter()
            impls[name]()
            times[name].append(time.perf_counter() - start)
    result = {"shape": shape.name, "flex_compile_s": compile_s}
    for name, values in times.items():
        result[name] = summary([v * 1e3 for v in values])
        result[f"ratio_torch_over_{name}"] = summary([t / v for t, v in zip(times["torch"], values)])
    return result


def _with_backend(name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    with backend(name):
        return fn()


def _range(s: Dict[str, float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def format_steps(results: List[dict]) -> str:
    lines = ["| step | system | step ms | attention ms | attention share | step / cpp | attention / cpp |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for name, m in r["systems"].items():
            lines.append(f"| {r['shape']} ({r['tokens']} tokens) | {name} | {_range(m['step_ms'])} | "
                         f"{_range(m['attention_ms'])} | {_range(m['attention_share'], '{:.0%}')} | "
                         f"{_range(m['step_ratio_over_cpp'], '{:.2f}')} | "
                         f"{_range(m['attention_ratio_over_cpp'], '{:.2f}')} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", default="16,32,64", help="decode batch sizes")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layer", action="store_true", help="also the one-layer decode comparison")
    parser.add_argument("--flex", action="store_true", help="include flex_attention in the one-layer comparison")
    parser.add_argument("--kv-cache-dtypes", default="", help="also cpp over these compact caches, e.g. bfloat16,fp8")
    parser.add_argument("--no-main", action="store_true", help="leave out the pre-issue-17 PyTorch path")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from paged_backend.worker.loader import load_model

    model, _ = load_model(args.model, dtype=torch.float32)
    shapes = workloads(args.seed, [int(x) for x in args.batches.split(",")])
    num_blocks = max(sum(-(-c // args.block_size) for c in s.context_lens) for s in shapes) + 16

    def runner_for(kv: str) -> ModelRunner:
        dtype = kv_cache_torch_dtype(kv, torch.float32)
        cache = CacheEngine(kv_geometry(model.config), args.block_size, num_blocks, 0, dtype, torch.device("cpu"))
        values = torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(args.seed))
        cache.kv.copy_(values.to(dtype))
        return ModelRunner(model, cache)

    full = runner_for("auto")
    systems = [System("cpp", "cpp", full), System("torch", "torch", full)]
    if not args.no_main:
        systems.append(System("main", "torch", full, main_gather=True))
    systems += [System(f"cpp {kv} cache", "cpp", runner_for(kv)) for kv in args.kv_cache_dtypes.split(",") if kv]
    report = {"conditions": conditions(), "threads": torch.get_num_threads(), "model": args.model, "steps": [],
              "layer": []}
    for i, shape in enumerate(shapes):
        result = measure_steps(systems, shape, step_inputs(shape, args.block_size, num_blocks, args.seed + i),
                               args.repetitions)
        report["steps"].append(result)
        print("\n".join(format_steps([result]).splitlines()[2:]), flush=True)
    print(format_steps(report["steps"]))
    if args.layer or args.flex:
        for batch in (16, 64):
            result = measure_layer(batch, args.repetitions * 4, args.flex, args.seed)
            report["layer"].append(result)
            print(json.dumps(result))
    if args.json:
        report["conditions"].update(finished=now(), load_average_after=load_average())
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()


__all__ = ["StepShape", "measure_layer", "measure_steps", "workloads"]
