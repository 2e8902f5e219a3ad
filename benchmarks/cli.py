"""`paged-backend bench NAME`: run a benchmark (waste, throughput, sharing, serving, overhead, or all),
print its table, write NAME.json and NAME.png under RESULTS/NAME/. `--quick` runs a small size."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

BENCHMARKS = ("waste", "throughput", "sharing", "serving", "overhead")
_CONFIGS = {"waste": "WasteConfig", "throughput": "ThroughputConfig", "sharing": "SharingConfig",
            "serving": "ServingConfig", "overhead": "OverheadConfig"}


def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> Tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _names(text: str) -> Tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


# option -> (config field, type, help); an option only applies to benchmarks whose config has the field.
OPTIONS: Dict[str, Tuple[str, Callable, str]] = {
    "--model": ("model", str, "model preset or HF directory (defaults: smollm2; waste: tiny-llama)"),
    "--workload": ("workload", str, "sharegpt or alpaca (synthetic)"),
    "--num-requests": ("num_requests", int, "requests in the trace (waste, throughput, sharing)"),
    "--kv-slots": ("kv_slots", int, "KV cache budget in token slots, the same for every system"),
    "--block-size": ("block_size", int, "tokens per KV block of the paged engine"),
    "--seed": ("seed", int, "seed of the trace sampling and arrivals"),
    "--threads": ("threads", int, "torch threads (default: 1 if the machine is busy, else all cores)"),
    "--systems": ("systems", _names, "waste/throughput: comma list of paged,oracle,pow2,max[,hf-static,hf-continuous]"),
    "--allocators": ("allocators", _names, "waste: contiguous allocators for the baselines: first-fit,buddy"),
    "--allocator": ("allocator", str, "throughput: contiguous allocator of the baselines"),
    "--forward": ("forward", bool, "waste: run real model forwards instead of the dry runner"),
    "--parallel-n": ("parallel_n", _ints, "sharing: sample counts, e.g. 2,4,6"),
    "--beam-widths": ("beam_widths", _ints, "sharing: beam widths, e.g. 2,4,6"),
    "--prefix-shots": ("prefix_shots", _ints, "sharing: few-shot prefix sizes, e.g. 1,5"),
    "--prefix-requests": ("prefix_requests", int, "sharing: requests sharing the prefix"),
    "--rates": ("rates", _floats, "serving: request rates in req/s, e.g. 0.5,1,2"),
    "--duration": ("duration_s", float, "serving: seconds of arrivals per rate"),
    "--max-requests": ("max_requests", int, "serving: most requests per rate"),
    "--baselines": ("baselines", _names, "serving: reservation baselines to serve too, e.g. oracle,pow2"),
    "--max-model-len": ("max_model_len", int, "serving: context limit of the servers"),
    "--batch-sizes": ("batch_sizes", _ints, "overhead: running sequences, e.g. 1,64,256"),
    "--decode-steps": ("decode_steps", int, "overhead: decode steps averaged per batch size"),
}


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="reproduce the paper's measurements (waste, throughput, sharing, serving, "
                                         "overhead, all)", description=__doc__)
    p.add_argument("benchmark", choices=BENCHMARKS + ("all",))
    p.add_argument("--quick", action="store_true", help="a small size that finishes in seconds (smoke test)")
    p.add_argument("--results-dir", default="results", help="where NAME/NAME.json and NAME.png go")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    for option, (dest, kind, text) in OPTIONS.items():
        if kind is bool:
            p.add_argument(option, dest=dest, action="store_true", default=None, help=text)
        else:
            p.add_argument(option, dest=dest, type=kind, default=None, help=text)
    p.set_defaults(func=run_bench)
    return p


def make_config(name: str, args: argparse.Namespace):
    """The benchmark's config: full-size defaults, the quick size with --quick, then explicit options."""
    module = importlib.import_module(f"{__package__}.{name}")
    config_cls = getattr(module, _CONFIGS[name])
    fields = {f.name for f in dataclasses.fields(config_cls)}
    values = dict(module.QUICK) if args.quick else {}
    for dest, _, _ in OPTIONS.values():
        value = getattr(args, dest, None)
        if value is not None and dest in fields:
            values[dest] = value
    return module, config_cls(**values)


def run_one(name: str, args: argparse.Namespace) -> List[str]:
    """Run one benchmark; returns its invariant violations."""
    module, config = make_config(name, args)
    out_dir = Path(args.results_dir) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = module.main(config, out_dir, plot=not args.no_plot)
    print(f"[{name}] {time.perf_counter() - start:.0f} s; results in {out_dir}/")
    return [f"{name}: {p}" for p in result.get("problems", [])]


def run_bench(args: argparse.Namespace) -> int:
    names = BENCHMARKS if args.benchmark == "all" else (args.benchmark,)
    problems: List[str] = []
    for name in names:
        problems += run_one(name, args)
        print()
    for problem in problems:
        print(f"INVARIANT VIOLATED: {problem}")
    return 1 if problems else 0
