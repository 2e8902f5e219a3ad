"""`paged-backend bench NAME`: run a benchmark (waste, throughput, sharing, serving, serving-half, overhead,
structured, or all) or a study (recompute-policies, busy-threads, busy-cores, step-profile, host-overhead, lora,
compiled-decode, speculative) at a named size, print its table, write NAME.json (and NAME.png) under RESULTS/NAME/. `--documented`
runs it at the size docs/benchmarks.md documents, records it (benchmarks: docs/img/bench-NAME.json beside the plot;
studies: docs/measurements/NAME.json) and regenerates the doc; `bench docs` regenerates docs/benchmarks.md and its plots
from the recorded JSON alone."""

from __future__ import annotations

import argparse
import importlib
import shlex
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from paged_backend.benchmarks.harness.provenance import REPO_ROOT, dirty_refusal, git_state, pinned_git_state

# `all`, one commit; serving-half: the serving benchmark in half precision, a record of its own
BENCHMARKS = ("waste", "throughput", "sharing", "serving", "serving-half", "overhead", "structured")
STUDIES = ("recompute-policies", "busy-threads", "busy-cores", "step-profile", "host-overhead", "lora",
           "compiled-decode", "speculative")   # side studies, each recorded on its own
PAPER = ("waste", "throughput", "sharing", "serving", "serving-half")   # in benchmarks/paper/, the others in micro/
DOCS_DIR = REPO_ROOT / "docs"


def record_paths(name: str, docs_dir: Optional[Path] = None) -> Tuple[Path, Optional[Path]]:
    """Where a documented record of `name` lives: a benchmark's JSON beside its plot under docs/img/, a study's
    JSON (no plot) under docs/measurements/."""
    docs = docs_dir or DOCS_DIR
    if name in STUDIES:
        return docs / "measurements" / f"{name}.json", None
    return docs / "img" / f"bench-{name}.json", docs / "img" / f"bench-{name}.png"


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
    "--num-requests": ("num_requests", int, "requests in the trace (waste, throughput, sharing); structured: "
                                            "concurrent requests"),
    "--max-prompt-len": ("max_prompt_len", int, "throughput: cut ShareGPT prompts to this many tokens"),
    "--max-output-len": ("max_output_len", int, "throughput: cap ShareGPT output lengths"),
    "--kv-slots": ("kv_slots", int, "KV cache budget in token slots, the same for every system"),
    "--block-size": ("block_size", int, "tokens per KV block of the paged engine"),
    "--dtype": ("dtype", str, "throughput/serving: model precision, e.g. float32, bfloat16 (serving: llama.cpp "
                              "runs the GGUF of the same precision)"),
    "--seed": ("seed", int, "seed of the trace sampling and arrivals"),
    "--threads": ("threads", int, "torch threads (default: the size's; none: 1 if the machine is busy, else all)"),
    "--repetitions": ("repetitions", int, "throughput/serving/structured: interleaved rounds (median and range "
                                          "reported)"),
    "--systems": ("systems", _names, "throughput/serving: comma list of systems, e.g. paged,oracle,hf-static"),
    "--kv-cache-dtypes": ("kv_cache_dtypes", _names, "throughput: compact-KV rows, e.g. bfloat16,fp8_e4m3 "
                                                     "(own rows, same bytes)"),
    "--allocators": ("allocators", _names, "waste: contiguous allocators for the baselines: first-fit,buddy"),
    "--allocator": ("allocator", str, "throughput: contiguous allocator of the baselines"),
    "--forward": ("forward", bool, "waste: run real model forwards instead of the dry runner"),
    "--parallel-n": ("parallel_n", _ints, "sharing: sample counts, e.g. 2,4,6"),
    "--beam-widths": ("beam_widths", _ints, "sharing: beam widths, e.g. 2,4,6"),
    "--prefix-shots": ("prefix_shots", _ints, "sharing: few-shot prefix sizes, e.g. 1,5"),
    "--prefix-requests": ("prefix_requests", int, "sharing: requests sharing the prefix"),
    "--concurrencies": ("concurrencies", _ints, "serving: concurrent streams, e.g. 1,2,4,8,16,32"),
    "--llama-cpp-kv": ("llama_cpp_kv", str, "serving: llama.cpp's KV budget: equal (the default: the --kv-slots "
                                            "of the other servers, as many slots of a request's tokens as fit, "
                                            "since llama.cpp cannot preempt) or own (a whole request's slot per "
                                            "stream, more KV than the others at high concurrency)"),
    "--prompt-tokens": ("prompt_tokens", int, "serving: synthetic prompt length in tokens"),
    "--output-tokens": ("output_tokens", int, "serving, structured: forced output length in tokens"),
    "--min-requests": ("min_requests", int, "serving: requests per concurrency at least (else 2 per stream)"),
    "--max-model-len": ("max_model_len", int, "throughput/serving: context limit of the engines and servers"),
    "--batch-sizes": ("batch_sizes", _ints, "overhead: running sequences, e.g. 1,64,256"),
    "--decode-steps": ("decode_steps", int, "overhead: decode steps averaged per batch size; step-profile: steps "
                                            "profiled; compiled-decode: decode steps per repetition"),
    "--batch": ("batch", int, "step-profile: running sequences"),
    "--host-steps": ("host_steps", int, "overhead, host-overhead: decode steps timed per stand-in measurement"),
    "--device-ms": ("device_ms", float, "overhead, host-overhead: the sleeping stand-in runner's ms per forward"),
    "--seconds": ("seconds", float, "busy-threads: seconds of streaming per server and wait policy; busy-cores: per concurrency"),
}


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="reproduce the paper's measurements (waste, throughput, sharing, serving, "
                                         "serving-half, overhead; structured: the cost of a JSON schema; all; the "
                                         "studies recompute-policies, busy-threads, busy-cores, step-profile, host-overhead, lora, "
                                         "compiled-decode, speculative; docs regenerates docs/benchmarks.md)",
                          description=__doc__)
    p.add_argument("benchmark", choices=BENCHMARKS + STUDIES + ("all", "docs"))
    p.add_argument("--size", default=None, help="a named size: quick, full (waste/sharing/overhead), anchor "
                                                "(throughput/serving), anchor-half (serving-half); default: the "
                                                "documented one")
    p.add_argument("--quick", action="store_true", help="same as --size quick (a smoke test, seconds)")
    p.add_argument("--documented", action="store_true",
                   help="run the documented configuration, write docs/img/bench-NAME.{json,png} and regenerate "
                        "docs/benchmarks.md (what `make bench` does); refuses a dirty tree and any option")
    p.add_argument("--allow-dirty", action="store_true", help="with --documented: record from a tree with "
                                                              "uncommitted changes (marked dirty in the JSON)")
    p.add_argument("--results-dir", default="results", help="where NAME/NAME.json and NAME.png go")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (docs: do not redraw the plots)")
    p.add_argument("--docs-dir", default=None, help="the docs folder whose benchmarks.md and img/ records `docs` "
                                                    "and --documented use (default: the checkout's docs/)")
    for option, (dest, kind, text) in OPTIONS.items():
        if kind is bool:
            p.add_argument(option, dest=dest, action="store_true", default=None, help=text)
        else:
            p.add_argument(option, dest=dest, type=kind, default=None, help=text)
    p.set_defaults(func=run_bench)
    return p


def spec_of(name: str):
    module = name.replace("-", "_")
    folder = "paper" if name in PAPER else "micro"
    return importlib.import_module(f"{__package__}.{folder}.{module}").SPEC


def _overrides(spec, args: argparse.Namespace) -> dict:
    import dataclasses

    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    return {dest: getattr(args, dest) for dest, _, _ in OPTIONS.values()
            if getattr(args, dest, None) is not None and dest in fields}


def _size(spec, args: argparse.Namespace) -> str:
    if args.quick and args.size not in (None, "quick"):
        raise ValueError("--quick is --size quick; give one of them")
    return "quick" if args.quick else (args.size or spec.documented_size)


def _option_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def command_line(args: argparse.Namespace, name: str, size: str) -> str:
    """The command that reruns this configuration of benchmark `name`."""
    if args.documented:
        return f"paged-backend bench {name} --documented" + (" --allow-dirty" if args.allow_dirty else "")
    parts = ["paged-backend", "bench", name, "--size", size]
    for option, (dest, kind, _) in OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None:
            parts += [option] if kind is bool else [option, _option_text(value)]
    return " ".join(shlex.quote(p) for p in parts)


def run_one(name: str, args: argparse.Namespace) -> List[str]:
    """Run one benchmark; returns its invariant violations."""
    from paged_backend.benchmarks.harness.report import run_and_report

    spec = spec_of(name)
    size = spec.documented_size if args.documented else _size(spec, args)
    config = spec.config(size, **({} if args.documented else _overrides(spec, args)))
    out_dir = Path(args.results_dir) / name
    if args.documented:
        json_path, plot_path = record_paths(name, _docs_dir(args))
    else:
        json_path, plot_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    extra = {"size": size, "documented": bool(args.documented), "command": command_line(args, name, size)}
    plot = None if args.no_plot or not spec.plot else spec.plot_function()
    result = run_and_report(name, lambda: spec.execute(config, out_dir), spec.check, spec.table, plot, json_path,
                            plot_path, extra)
    print(f"[{name}] {result['elapsed_s']:.0f} s; results in {json_path.parent}/")
    return [f"{name}: {p}" for p in result.get("problems", [])]


def _refuse_documented(args: argparse.Namespace) -> None:
    explicit = [option for option, (dest, _, _) in OPTIONS.items() if getattr(args, dest, None) is not None]
    if explicit or args.quick or args.size:
        raise ValueError(f"--documented runs the documented configuration exactly; drop "
                         f"{', '.join(explicit + (['--quick'] if args.quick else []) + (['--size'] if args.size else []))}")
    refusal = dirty_refusal(git_state())
    if refusal and not (args.allow_dirty and git_state().commit):
        raise ValueError(f"refusing to write a documented record: {refusal}")


def _docs_dir(args: argparse.Namespace) -> Path:
    return Path(args.docs_dir) if args.docs_dir else DOCS_DIR


def run_bench(args: argparse.Namespace) -> int:
    from paged_backend.benchmarks.harness.docgen import regenerate

    if args.benchmark == "docs":
        problems = regenerate(_docs_dir(args), plot=not args.no_plot)
        for problem in problems:
            print(f"docs: {problem}")
        return 1 if problems else 0
    if args.allow_dirty and not args.documented:
        raise ValueError("--allow-dirty only applies to --documented")
    if args.documented:
        _refuse_documented(args)
    names = BENCHMARKS if args.benchmark == "all" else (args.benchmark,)
    problems: List[str] = []
    with pinned_git_state():   # the records this run writes do not make the later ones dirty
        for name in names:
            problems += run_one(name, args)
            print()
    if args.documented:
        problems += [f"docs: {p}" for p in regenerate(_docs_dir(args))]
    for problem in problems:
        print(f"INVARIANT VIOLATED: {problem}")
    return 1 if problems else 0
