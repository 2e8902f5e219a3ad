"""Benchmark 6, the cost of structured output: output tokens/s of 32 concurrent requests constrained to a JSON
schema against the same 32 requests unconstrained, on one engine.

Both systems run the same prompts for exactly `output_tokens` greedy tokens each, so every step has the same
batch: the schema (an object holding an array of at least 1000 small objects with enums, bounded integers
and booleans) cannot be complete before that, and the unconstrained requests ignore EOS. The difference is
then what structured output costs per step: filling each row's token bitmask, applying it to the logits and
advancing the matchers. Those parts are timed too (by wrapping the engine's calls, nothing changed), and the
constrained outputs are checked to be accepted by their grammar (every token was). Systems run in
interleaved rounds after a warm-up that compiles the schema; figures are the median and range of the rounds,
the ratio the median of per-round ratios.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional

from paged_backend import LLMEngine, SamplingParams
from paged_backend.structured.params import StructuredOutputsParams

from paged_backend.benchmarks.paper.engine_runs import leaked_blocks, load_bench_model, release, set_threads
from paged_backend.benchmarks.harness.repeat import format_spread, paired_ratio, run_interleaved, spread
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table

SYSTEMS = ("unconstrained", "json-schema")
READINGS = {
    "type": "object",
    "properties": {"station": {"type": "string", "maxLength": 12},
                   "readings": {"type": "array", "minItems": 1000, "items": {
                       "type": "object",
                       "properties": {"sensor": {"enum": ["temp", "humidity", "wind"]},
                                      "value": {"type": "integer", "minimum": -50, "maximum": 999},
                                      "ok": {"type": "boolean"}},
                       "required": ["sensor", "value", "ok"]}}},
    "required": ["station", "readings"],
}
PROMPTS = ["Report the weather station readings as JSON.", "Give the sensor log of station {i} in JSON.",
           "List today's measurements (station {i}) as a JSON object.", "JSON dump of the readings, station {i}:"]


@dataclass
class StructuredConfig:
    model: str = "smollm2"
    num_requests: int = 32
    output_tokens: int = 48
    repetitions: int = 3
    block_size: int = 16
    seed: int = 0
    threads: Optional[int] = None


QUICK = {"model": "tiny-llama", "num_requests": 8, "output_tokens": 8, "repetitions": 2}


class CallTimer:
    """Seconds and calls spent in wrapped functions (the grammar's parts of a step)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}

    @contextlib.contextmanager
    def wrapping(self, owner, name: str, label: str) -> Iterator[None]:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)
        try:
            yield
        finally:
            setattr(owner, name, original)


def _params(system: str, output_tokens: int) -> SamplingParams:
    if system == "unconstrained":
        return SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True, detokenize=False)
    constraint = StructuredOutputsParams(json=READINGS, disable_any_whitespace=True)
    return SamplingParams(temperature=0.0, max_tokens=output_tokens, structured_outputs=constraint,
                          detokenize=False)


def _run(engine: LLMEngine, prompts: List[List[int]], system: str, output_tokens: int, tag: str) -> dict:
    """All requests at once, stepped to the end: wall time, tokens, steps, grammar time."""
    import paged_backend.engine.token_processor as token_processor_module
    from paged_backend.structured.matcher import GrammarMasker

    timer = CallTimer()
    params = _params(system, output_tokens)
    finals = {}
    steps_before = engine.get_stats().num_steps
    with timer.wrapping(GrammarMasker, "apply", "mask"), \
            timer.wrapping(token_processor_module, "accept_grammar", "accept"):
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        wall = time.perf_counter() - start
    steps = engine.get_stats().num_steps - steps_before
    lengths = [len(c.token_ids) for out in finals.values() for c in out.outputs]
    reasons = sorted({c.finish_reason for out in finals.values() for c in out.outputs})
    return {"wall_s": wall, "output_tokens": sum(lengths), "output_tokens_per_s": sum(lengths) / wall,
            "steps": steps, "step_ms": 1000 * wall / max(steps, 1), "min_len": min(lengths), "max_len": max(lengths),
            "finish_reasons": reasons, "errors": sum(out.error is not None for out in finals.values()),
            "mask_ms_per_step": 1000 * timer.seconds.get("mask", 0.0) / max(steps, 1),
            "accept_ms_per_step": 1000 * timer.seconds.get("accept", 0.0) / max(steps, 1),
            "mask_calls": timer.calls.get("mask", 0)}


def _prompts(tokenizer, count: int) -> List[List[int]]:
    texts = [PROMPTS[i % len(PROMPTS)].format(i=i) for i in range(count)]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


def run_structured(config: StructuredConfig) -> dict:
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model)
    prompts = _prompts(tokenizer, config.num_requests)
    longest = max(len(p) for p in prompts) + config.output_tokens
    blocks = config.num_requests * (-(-longest // config.block_size) + 1) + 8
    engine = LLMEngine(model, tokenizer, block_size=config.block_size, num_blocks=blocks, num_swap_blocks=0,
                       max_num_seqs=max(256, config.num_requests), seed=config.seed)
    try:
        for system in SYSTEMS:  # warm-up: compiles the schema, first-call costs
            _run(engine, prompts[:2], system, 2, f"warm-{system}")
        rows = run_interleaved(SYSTEMS, config.repetitions,
                               lambda system, rep: _run(engine, prompts, system, config.output_tokens,
                                                        f"{system}-{rep}"))
        leaked = leaked_blocks(engine)
    finally:
        release(engine)
    summary = []
    for system in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        summary.append({"system": system,
                        "output_tokens_per_s": spread([r["output_tokens_per_s"] for r in mine]),
                        "step_ms": spread([r["step_ms"] for r in mine]),
                        "mask_ms_per_step": spread([r["mask_ms_per_step"] for r in mine]),
                        "accept_ms_per_step": spread([r["accept_ms_per_step"] for r in mine]),
                        "ratio": paired_ratio(rows, system, "unconstrained", "output_tokens_per_s")})
    return {"benchmark": "structured", "config": asdict(config), "schema": READINGS,
            "conditions": {"threads": threads}, "runs": rows, "rows": summary, "leaked_blocks": leaked}


def structured_table(result: dict) -> str:
    headers = ["system", "output tok/s", "step ms", "mask ms/step", "matcher ms/step", "tok/s vs unconstrained"]
    rows = [[r["system"], format_spread(r["output_tokens_per_s"]), format_spread(r["step_ms"]),
             format_spread(r["mask_ms_per_step"], 2), format_spread(r["accept_ms_per_step"], 2),
             format_spread(r["ratio"], 3, "x")] for r in result["rows"]]
    c = result["config"]
    title = (f"Structured output: {c['num_requests']} concurrent requests x {c['output_tokens']} greedy tokens, "
             f"{c['model']}, JSON schema vs unconstrained ({result['conditions']['torch_threads']} threads; "
             f"median (range) of {c['repetitions']} interleaved rounds)")
    return format_table(headers, rows, title)


def check_structured(result: dict) -> List[str]:
    problems = []
    wanted = result["config"]["output_tokens"]
    for run in result["runs"]:
        where = f"{run['system']} round {run['repetition']}"
        if run["errors"]:
            problems.append(f"{where}: {run['errors']} requests failed")
        if run["min_len"] != wanted or run["max_len"] != wanted:
            problems.append(f"{where}: outputs of {run['min_len']}-{run['max_len']} tokens, not {wanted} each: the "
                            f"systems would not run the same batches")
        if run["finish_reasons"] != ["length"]:
            problems.append(f"{where}: finish reasons {run['finish_reasons']}")
        constrained = run["system"] == "json-schema"
        if constrained != (run["mask_calls"] > 0):
            problems.append(f"{where}: the grammar mask ran {run['mask_calls']} times")
    if result["leaked_blocks"]:
        problems.append(f"{result['leaked_blocks']} KV blocks leaked")
    return problems


# The documented record runs on 2 torch threads (both cores of the reference machine).
SIZES = {"quick": QUICK, "full": {"threads": 2}}
SPEC = BenchmarkSpec("structured", StructuredConfig, run_structured, check_structured, structured_table,
                     "plot_structured", SIZES, documented_size="full")
