"""Where the engine's own time goes in a decode step: cProfile of `LLMEngine.step` with a stand-in runner.

`paged-backend bench step-profile --documented` brings 256 32-token prompts of smollm2 to decoding, replaces the
model forward with a runner that returns ready logits (`ReadyLogitsRunner`), then profiles 20 steps and records the
step's call tree four levels deep (milliseconds per step of each function `LLMEngine.step` calls, of what those
call, and so on), the functions with the most time of their own, and the unprofiled step time, in
docs/measurements/step-profile.json. Everything is the step outside the model forward: scheduling, block tables,
input preparation, the sampler, detokenization and outputs. The engine runs without overlapped scheduling here,
so that the whole step runs in the profiled thread.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from paged_backend import LLMEngine, SamplingParams

from paged_backend.benchmarks.paper.engine_runs import load_bench_model, set_threads
from paged_backend.benchmarks.micro.host_overhead import has_overlap
from paged_backend.benchmarks.micro.overhead import _prompts
from paged_backend.benchmarks.micro.standin_runners import ReadyLogitsRunner
from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table

Key = Tuple[str, int, str]
SHOWN_SHARE = 0.02   # the table shows the calls that take at least this share of the profiled step
KEPT_SHARE = 0.01    # the record keeps the calls below the first level that take at least this share
DEPTH = 4
OWN_SHOWN = 12       # the functions with the most own time the table lists


@dataclass
class StepProfileConfig:
    model: str = "smollm2"
    batch: int = 256
    decode_steps: int = 20
    prompt_tokens: int = 32
    threads: Optional[int] = None


def _name(key: Key) -> str:
    path, line, function = key
    return f"{path.rsplit('/', 1)[-1]}:{line}({function})"


def _callees(stats: Dict[Key, tuple], caller: Key, steps: int) -> List[dict]:
    """The functions `caller` called, with the milliseconds per step spent in them (their cumulative time)."""
    found = []
    for key, (_, _, _, _, callers) in stats.items():
        if caller in callers:
            calls, _, _, cumulative = callers[caller]
            found.append({"key": key, "function": _name(key), "calls_per_step": calls / steps,
                          "ms_per_step": cumulative / steps * 1000})
    return sorted(found, key=lambda c: -c["ms_per_step"])


def _tree(stats: Dict[Key, tuple], caller: Key, steps: int, depth: int, floor_ms: float) -> List[dict]:
    """The calls under `caller`, `depth` levels deep; below the first level only those of at least `floor_ms`."""
    calls = []
    for call in _callees(stats, caller, steps):
        key = call.pop("key")
        if depth > 1:
            call["calls"] = [c for c in _tree(stats, key, steps, depth - 1, floor_ms) if c["ms_per_step"] >= floor_ms]
        calls.append(call)
    return calls


def call_tree(profile: cProfile.Profile, steps: int) -> dict:
    """`LLMEngine.step`'s time per step and its calls `DEPTH` levels deep, from a profile of `steps` steps."""
    stats = pstats.Stats(profile).stats
    code = LLMEngine.step.__code__
    root = (code.co_filename, code.co_firstlineno, code.co_name)
    step_ms = stats[root][3] / steps * 1000
    own = sorted(stats.items(), key=lambda item: -item[1][2])[:15]
    return {"step_ms": step_ms, "calls": _tree(stats, root, steps, DEPTH, KEPT_SHARE * step_ms),
            "own_time": [{"function": _name(key), "calls_per_step": nc / steps, "own_ms_per_step": tt / steps * 1000,
                          "cumulative_ms_per_step": ct / steps * 1000} for key, (_, nc, tt, ct, _) in own]}


def run_step_profile(config: StepProfileConfig) -> dict:
    threads = set_threads(config.threads)
    model, tokenizer = load_bench_model(config.model)
    sync = {"async_scheduling": False} if has_overlap() else {}
    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=config.batch * 6 + 8, num_swap_blocks=0,
                       max_num_seqs=max(256, config.batch), max_num_batched_tokens=max(2048, config.batch), **sync)
    engine.runner.shutdown()
    engine.runner = ReadyLogitsRunner.for_engine(engine)
    for i, prompt in enumerate(_prompts(tokenizer, config.batch, config.prompt_tokens, 0)):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                           max_tokens=2 * config.decode_steps + 16))
    for _ in range(8):  # prefill, then a few decode steps
        engine.step()
    running = engine.get_stats().num_running
    forwards = engine.runner.num_forwards
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(config.decode_steps):
        engine.step()
    profile.disable()
    forwards = engine.runner.num_forwards - forwards
    start = time.perf_counter()
    for _ in range(config.decode_steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / config.decode_steps * 1000
    return {"benchmark": "step-profile", "config": asdict(config), "conditions": {"threads": threads},
            "running": running, "profiled_forwards": forwards, "runner": "ready-logits runner",
            "unprofiled_step_ms": step_ms, "profile": call_tree(profile, config.decode_steps)}


def all_calls(calls: List[dict]) -> List[dict]:
    """Every call of a recorded tree, depth first."""
    return [c for call in calls for c in [call] + all_calls(call.get("calls", []))]


def check_step_profile(result: dict) -> List[str]:
    problems = []
    if result["running"] != result["config"]["batch"]:
        problems.append(f"{result['running']} sequences ran, not {result['config']['batch']}")
    if result.get("profiled_forwards", result["config"]["decode_steps"]) != result["config"]["decode_steps"]:
        problems.append(f"the stand-in runner ran {result['profiled_forwards']} forwards in "
                        f"{result['config']['decode_steps']} profiled steps")
    return problems


def _rows(calls: List[dict], total: float, indent: str = "") -> List[List[str]]:
    rows = []
    for call in calls:
        if call["ms_per_step"] >= SHOWN_SHARE * total:
            rows.append([indent + call["function"], f"{call['ms_per_step']:.2f}", f"{call['ms_per_step'] / total:.1%}"])
            rows += _rows(call.get("calls", []), total, indent + "  ")
    return rows


def step_profile_table(result: dict) -> str:
    profile = result["profile"]
    total = profile["step_ms"]
    c = result["config"]
    tree = format_table(["called by LLMEngine.step (and what it calls)", "ms per step", "share of step"],
                        _rows(profile["calls"], total),
                        title=f"cProfile of {c['decode_steps']} decode steps, {result['running']} running sequences "
                              f"of {c['model']}, {result.get('runner', 'dry runner')} (no forward): {total:.1f} ms per "
                              f"profiled step, "
                              f"{result['unprofiled_step_ms']:.1f} ms unprofiled; calls of at least "
                              f"{SHOWN_SHARE:.0%} of the step")
    own = format_table(["function", "calls per step", "own ms per step", "with its calls, ms per step"], [
        [f["function"], f"{f['calls_per_step']:.0f}", f"{f['own_ms_per_step']:.2f}",
         f"{f['cumulative_ms_per_step']:.2f}"] for f in profile["own_time"][:OWN_SHOWN]], title="The functions with the most time of their own")
    return tree + "\n\n" + own


SPEC = BenchmarkSpec("step-profile", StepProfileConfig, run_step_profile, check_step_profile, step_profile_table, "",
                     {"quick": {"model": "tiny-llama", "batch": 4, "decode_steps": 2}, "full": {}},
                     documented_size="full")
