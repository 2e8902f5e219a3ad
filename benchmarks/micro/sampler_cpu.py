"""The sampler's cost per step on the CPU: `Sampler.sample` over 64 rows of smollm2 logits (vocabulary
49,152) for greedy, temperature-only, top-k, top-p, min-p and combined settings.

`python -m paged_backend.benchmarks.micro.sampler_cpu` computes the logits once (smollm2 over ShareGPT text, the
last positions of many prompts), then times `Sampler.sample` on a fresh copy of them per call, as the
engine would call it, with interleaved repetitions (median and range). `--baseline FILE` also loads
another version of `paged_backend/sampling/sampler.py` (e.g. `git show main:paged_backend/sampling/sampler.py > old.py`) and
times it in the same loop, alternating with the current one, and reports the per-repetition ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from paged_backend.sampling.sampler import SampleRequest, Sampler
from paged_backend.sampling_params import SamplingParams
from paged_backend.core.sequence import Sequence as Seq

from paged_backend.benchmarks.harness.provenance import load_average
from paged_backend.benchmarks.harness.report import conditions, now

SETTINGS: Dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_p 0.95, temperature 0.7": SamplingParams(temperature=0.7, top_p=0.95),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "top_k 40, top_p 0.8, min_p 0.02": SamplingParams(temperature=1.0, top_k=40, top_p=0.8, min_p=0.02),
    "top_p 0.9 + logprobs 5": SamplingParams(temperature=1.0, top_p=0.9, logprobs=5),
}


def model_logits(rows: int, seed: int) -> torch.Tensor:
    """Next-token logits of smollm2 at the ends of `rows` ShareGPT text prefixes (float32)."""
    from paged_backend.benchmarks.harness.workloads import sharegpt_exchanges
    from paged_backend.worker.loader import load_model

    model, tokenizer = load_model("smollm2", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    found: List[torch.Tensor] = []
    with torch.no_grad():
        for prompt, answer in sharegpt_exchanges():
            ids = tokenizer(prompt + " " + answer[:400]).input_ids[:192]
            if len(ids) < 48:
                continue
            ends = torch.randint(32, len(ids) + 1, (2,), generator=gen).tolist()
            logits = model(torch.tensor([ids])).logits[0]
            found.extend(logits[end - 1] for end in ends)
            if len(found) >= rows:
                break
    return torch.stack(found[:rows]).contiguous()


def load_sampler_module(path: str):
    """Another version of paged_backend/sampling/sampler.py, imported inside its package (for relative imports;
    a version from before the subpackages, paged_backend/sampler.py, imports flat modules that no longer exist)."""
    spec = importlib.util.spec_from_file_location("paged_backend.sampling._baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "paged_backend.sampling"
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def requests_for(module, params: SamplingParams, rows: int) -> list:
    return [module.SampleRequest(params, Seq(list(range(1, 17)))) for _ in range(rows)]


def summary(values: Sequence[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(logits: torch.Tensor, samplers: Dict[str, tuple], repetitions: int) -> dict:
    """Milliseconds per `sample` call for each setting and sampler, interleaved."""
    results = {}
    for name, params in SETTINGS.items():
        times: Dict[str, List[float]] = {label: [] for label in samplers}
        for rep in range(repetitions + 1):
            order = list(samplers) if rep % 2 == 0 else list(samplers)[::-1]
            for label in order:
                module, sampler = samplers[label]
                requests = requests_for(module, params, logits.shape[0])
                work = logits.clone()
                start = time.perf_counter()
                sampler.sample(work, requests)
                if rep:   # the first round warms up (and builds the kernel library)
                    times[label].append((time.perf_counter() - start) * 1e3)
        entry = {label: summary(values) for label, values in times.items()}
        if "baseline" in times:
            entry["ratio_baseline_over_current"] = summary([b / c for b, c in zip(times["baseline"], times["current"])])
        results[name] = entry
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--baseline", default=None, help="another sampler.py to compare with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = conditions()
    logits = model_logits(args.rows, args.seed)
    samplers = {"current": (sys.modules[SampleRequest.__module__], Sampler(args.seed))}
    if args.baseline:
        old = load_sampler_module(args.baseline)
        samplers["baseline"] = (old, old.Sampler(args.seed))
    results = measure(logits, samplers, args.repetitions)
    head = "| setting | current ms |" + (" baseline ms | baseline / current |" if args.baseline else "")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    fmt = lambda s, f="{:.1f}": f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"  # noqa: E731
    for name, entry in results.items():
        line = f"| {name} | {fmt(entry['current'])} |"
        if args.baseline:
            line += f" {fmt(entry['baseline'])} | {fmt(entry['ratio_baseline_over_current'])} |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": {**started, "finished": now(), "load_average_after": load_average()},
                       "rows": args.rows, "threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
