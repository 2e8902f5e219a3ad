"""The engine's own cost per decode step, measured with stand-in runners (no model forward): part of the overhead
benchmark, and on its own the study `paged-backend bench host-overhead` (its record names its own commit).

For each batch size: `batch` greedy requests of `prompt_len` tokens are brought to decoding, then `host_steps`
decode steps are timed one by one (the median is reported):
- with a runner that returns ready logits (`ReadyLogitsRunner`), without overlapped scheduling: the engine's whole
  host time per step, and where it goes (the step's phases timed by wrapping, as in the overhead benchmark);
- the same with overlapped scheduling (`async_scheduling`), when the engine has it;
- with a runner that sleeps `device_ms` first (standing for a device), without and with overlap: how much of the
  engine's work stays outside the device's time.
Each measurement runs on a fresh engine whose runner is replaced by the stand-in; nothing else changes.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from paged_backend import LLMEngine, SamplingParams

from paged_backend.benchmarks.harness.report import BenchmarkSpec, format_table
from paged_backend.benchmarks.micro.standin_runners import ReadyLogitsRunner

# phase -> the (object, method) pairs of the engine timed as that phase; methods a version lacks are skipped
HOST_PHASES = ("schedule", "block_manager", "prepare_inputs", "sampling", "tokens", "outputs", "free", "runner",
               "other")
# The pass a step makes over plain greedy rows' logits: their maxima alone, since such rows report no
# log-probabilities (records before that change timed the pass with each row's log-normaliser too)
PASS_WITH_NORMS = False


class ExclusiveTimer:
    """Seconds per phase, exclusive of the wrapped calls nested inside (the forward's attention calls are not
    counted again as forward, block-manager calls not again as scheduling); one thread only."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)
        self._nested: List[float] = []

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.calls[phase] += 1
            self._nested.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[phase] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed
        return timed


def _patches(engine: LLMEngine) -> list:
    bm = engine.block_manager
    patches = [(engine.scheduler, "schedule", "schedule"), (engine, "_step_inputs", "prepare_inputs"),
               (engine.sampler, "sample", "sampling"), (engine.sampler, "sample_batch", "sampling"),
               (engine.sampler, "sample_later", "sampling"),
               (engine.tokens, "launch", "tokens"), (engine.tokens, "process", "tokens"),
               (engine, "_outputs_of", "outputs"), (engine.scheduler, "free_finished", "free"),
               (engine.runner, "execute", "runner")]
    patches += [(bm, name, "block_manager") for name in ("can_allocate", "allocate", "can_append_slots", "append_slots",
                                                        "append_decode_slots", "free", "fork", "mark_computed")]
    return [(obj, name, phase) for obj, name, phase in patches if hasattr(obj, name)]


@contextlib.contextmanager
def wrapped_methods(patches: List[Tuple[object, str, str]], timer: ExclusiveTimer) -> Iterator[None]:
    """Each (object, method name, phase) timed by `timer` inside the block; the objects are as before after it."""
    saved = [(obj, name, name in vars(obj), vars(obj).get(name)) for obj, name, _ in patches]
    for obj, name, phase in patches:
        setattr(obj, name, timer.wrap(phase, getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, had_own, own in reversed(saved):
            if had_own:
                setattr(obj, name, own)
            else:
                delattr(obj, name)


def timed_phases(engine: LLMEngine, timer: ExclusiveTimer):
    """Wrap the methods a step calls with `timer` (a step without overlap: everything runs in this thread)."""
    return wrapped_methods(_patches(engine), timer)


def has_overlap(engine_cls=LLMEngine) -> bool:
    """Whether this engine version has overlapped scheduling (the option `async_scheduling`)."""
    from paged_backend.config import ENGINE_OPTION_NAMES

    return "async_scheduling" in ENGINE_OPTION_NAMES


def _engine(model, tokenizer, batch: int, config, overlap: Optional[bool], device_ms: float) -> LLMEngine:
    options = {} if overlap is None else {"async_scheduling": overlap}
    steps = config.host_steps + 8
    blocks = batch * (-(-(config.prompt_len + steps) // config.block_size) + 1) + 8
    engine = LLMEngine(model, tokenizer, block_size=config.block_size, num_blocks=blocks, num_swap_blocks=0,
                       max_num_seqs=max(256, batch), max_num_batched_tokens=max(2048, batch), seed=config.seed,
                       **options)
    engine.runner.shutdown()
    engine.runner = ReadyLogitsRunner.for_engine(engine, device_ms)
    return engine


def _bring_to_decode(engine: LLMEngine, prompts: List[List[int]], max_tokens: int) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"h{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
    waiting = engine.scheduler.waiting
    for _ in range(64):
        engine.step()
        if not waiting and all(s.num_computed_tokens >= s.prompt_len for g in engine.scheduler.running
                               for s in g.seqs):
            break
    engine.step()  # one plain decode step more, so the timed ones are alike


def time_steps(model, tokenizer, prompts: List[List[int]], config, overlap: Optional[bool], device_ms: float,
               timer: Optional[ExclusiveTimer] = None) -> dict:
    """Median and spread of `host_steps` decode steps' wall times, on a fresh engine with a stand-in runner. An
    engine without overlap runs on the compute thread, as `AsyncLLMEngine` runs one (so the process keeps one
    OpenMP team: compute_thread.py); an overlapped one is stepped from here and runs its forwards there."""
    from paged_backend.worker.compute_thread import on_compute_thread, run_on_compute_thread

    if not overlap and not on_compute_thread():
        return run_on_compute_thread(time_steps, model, tokenizer, prompts, config, overlap, device_ms, timer)
    if overlap and on_compute_thread():
        raise ValueError("an overlapped engine stepped from the compute thread runs every step inline: step it "
                         "from another thread (the benchmark's spec: on_compute_thread=False)")
    engine = _engine(model, tokenizer, len(prompts), config, overlap, device_ms)
    sampling: List[Tuple[float, float]] = []
    try:
        _bring_to_decode(engine, prompts, config.host_steps + 8)
        spans, first = engine.runner.device_spans, len(engine.runner.device_spans)
        times = []
        with timed_phases(engine, timer) if timer is not None else contextlib.nullcontext(), \
                _durations(engine.tokens, "sample", sampling), _durations(engine.tokens, "sample_later", sampling):
            for _ in range(config.host_steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
        running = engine.get_stats().num_running
        engine.abort_request(list(engine.groups))
    finally:
        engine.shutdown()
    ms = sorted(1000 * t for t in times)
    out = {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "min_ms": ms[0], "max_ms": ms[-1],
           "running": running, "overlapped": engine.runner.forward_threads != {threading.get_ident()}}
    gaps = [(a[1], b[0]) for a, b in zip(spans[first:], spans[first + 1:])]
    if gaps and sampling:   # the worker from a forward's end to the next one's start; its draws; the rest of it
        draws = [sum(end - start for start, end in sampling if gap_start <= start < gap_end)
                 for gap_start, gap_end in gaps]
        out["between_forwards_ms"] = statistics.median(1000 * (end - start) for start, end in gaps)
        out["sampling_ms"] = statistics.median(1000 * (end - start) for start, end in sampling)
        out["worker_rest_ms"] = statistics.median(1000 * (end - start - d) for (start, end), d in zip(gaps, draws))
    return out


@contextlib.contextmanager
def _durations(obj: object, name: str, into: List[Tuple[float, float]]) -> Iterator[None]:
    """Each call of `obj.name` inside the block appends its (start, end) perf_counter seconds to `into` (any
    thread)."""
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append((start, time.perf_counter()))

    setattr(obj, name, timed)
    try:
        yield
    finally:
        delattr(obj, name)


def engine_vocab(model, tokenizer) -> int:
    """The vocabulary the engine samples over (the model's output width)."""
    return int(model.get_output_embeddings().weight.shape[0])


def time_logits_pass(vocab: int, rows: int, repeats: int, idle_ms: float = 0.0, with_norms: bool = True) -> dict:
    """The step's floor on this machine: the sampler's greedy pass over `rows` x `vocab` float32 logits (each
    row's maximum, and its log-normaliser `with_norms`, as a step without overlap computes them), alone; median of
    `repeats`. With `idle_ms` the process sleeps that long before each pass, as the engine's threads wait for a
    device: what waking its threads costs is then part of the pass, as it is of a step after its forward."""
    from paged_backend import kernels

    runner = ReadyLogitsRunner(vocab, 0)
    logits = runner.execute(_Rows(rows))
    kernels.greedy_rows(logits, with_norms)   # warm: the kernel library loaded, the pages touched
    times = []
    for _ in range(repeats):
        if idle_ms:
            time.sleep(idle_ms / 1000.0)
        start = time.perf_counter()
        kernels.greedy_rows(logits, with_norms)
        times.append(time.perf_counter() - start)
    ms = sorted(1000 * t for t in times)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1]}


@dataclass
class _Rows:
    """What `ReadyLogitsRunner.execute` reads of a step's inputs: how many rows are sampled."""
    count: int

    @property
    def sample_indices(self) -> range:
        return range(self.count)


def _repeated(runs: List[dict]) -> dict:
    """Interleaved repetitions of one measurement: the median of their medians, and their range."""
    medians = [r["median_ms"] for r in runs]
    return {"median_ms": statistics.median(medians), "min_ms": min(medians), "max_ms": max(medians),
            "repetitions": runs, "running": runs[0].get("running"),
            "overlapped": all(r.get("overlapped", False) for r in runs)}


def measure_once(model, tokenizer, prompts: List[List[int]], config, overlap: bool) -> Dict[str, dict]:
    """One repetition of every timed measurement of a batch size (the logits pass where the engine makes it: on
    the compute thread)."""
    from paged_backend.worker.compute_thread import run_on_compute_thread

    off = False if overlap else None
    vocab, rows, steps = engine_vocab(model, tokenizer), len(prompts), config.host_steps
    out = {"ready_sync": time_steps(model, tokenizer, prompts, config, off, 0.0),
           "sleep_sync": time_steps(model, tokenizer, prompts, config, off, config.device_ms),
           "logits_pass": run_on_compute_thread(time_logits_pass, vocab, rows, steps, with_norms=PASS_WITH_NORMS)}
    if overlap:   # what the worker does after each forward when overlapped: the argmax alone, after idling
        out["argmax_after_idle"] = run_on_compute_thread(time_logits_pass, vocab, rows, steps, config.device_ms,
                                                         with_norms=False)
        out["ready_overlap"] = time_steps(model, tokenizer, prompts, config, True, 0.0)
        out["sleep_overlap"] = sleeping = time_steps(model, tokenizer, prompts, config, True, config.device_ms)
        if "between_forwards_ms" in sleeping:   # the worker between two forwards: its draws, and the rest
            out["between_forwards"] = {"median_ms": sleeping["between_forwards_ms"]}
            out["sampling_in_step"] = {"median_ms": sleeping["sampling_ms"]}
            out["worker_rest"] = {"median_ms": sleeping["worker_rest_ms"]}
    return out


def measure_host(model, tokenizer, prompts: List[List[int]], config) -> dict:
    """One batch size: the ready-logits step (with its phases) and the sleeping-runner step, without and with
    overlapped scheduling (the latter only when the engine has it), each `repetitions` times interleaved."""
    overlap = has_overlap()
    off = False if overlap else None
    repetitions = getattr(config, "repetitions", 1)   # the overhead benchmark's stand-in rows run once
    runs = [measure_once(model, tokenizer, prompts, config, overlap) for _ in range(repetitions)]
    timed = {key: _repeated([run[key] for run in runs if key in run]) for key in runs[0]}
    ready = timed["ready_sync"]
    timer = ExclusiveTimer()   # the phases on a run of their own, so that the wrapping does not touch `ready`
    phased = time_steps(model, tokenizer, prompts, config, off, 0.0, timer)
    steps = config.host_steps
    phases = {name: 1000 * timer.seconds[name] / steps for name in HOST_PHASES if name != "other"}
    phases["other"] = max(0.0, phased["mean_ms"] - sum(phases.values()))   # phases are means over the timed steps
    return {"batch": len(prompts), "running": ready["running"], "host_phase_ms": phases,
            "phase_calls": {name: timer.calls[name] for name in HOST_PHASES if name != "other"},
            "device_ms": config.device_ms, **timed}


def host_table(rows: List[dict], config: dict) -> List[List[str]]:
    """Rows of the host-time table: per batch size, the ready-logits step and the sleeping step, both ways."""
    def cell(row: dict, key: str, minus: float = 0.0) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        text = f"{value['median_ms'] - minus:.2f}"
        if "repetitions" in value and len(value["repetitions"]) > 1:   # records before repetitions: one run
            text += f" ({value['min_ms'] - minus:.2f}-{value['max_ms'] - minus:.2f})"
        return text

    out = []
    for r in rows:
        d = r["device_ms"]
        out.append([str(r["running"]), cell(r, "ready_sync"), cell(r, "logits_pass"), cell(r, "ready_overlap"),
                    cell(r, "sleep_sync", d), cell(r, "sleep_overlap", d), cell(r, "argmax_after_idle"),
                    cell(r, "between_forwards"), cell(r, "sampling_in_step"), cell(r, "worker_rest")])
    return out


def host_headers(device_ms: float) -> List[str]:
    """The host table's column names."""
    d = device_ms
    return ["running seqs", "ready: step ms", "of it: logits pass", "ready, overlap: ms", f"D={d:g} ms: step - D",
            f"D={d:g}, overlap: - D", f"of it: argmax after {d:g} ms idle", "worker between forwards",
            "of it: draws", "of it: the rest"]


def phase_rows(rows: List[dict]) -> List[List[str]]:
    """Rows of the phase table: where the ready-logits step's host time goes (no overlap)."""
    return [[str(r["running"])] + [f"{r['host_phase_ms'][name]:.2f}" for name in HOST_PHASES] for r in rows]


# ---- the study: `paged-backend bench host-overhead` ------------------------------------------------------
@dataclass
class HostOverheadConfig:
    model: str = "smollm2"          # its tokenizer and vocabulary; no forward runs
    batch_sizes: Tuple[int, ...] = (1, 64, 256)
    prompt_len: int = 32
    block_size: int = 16
    seed: int = 0
    threads: Optional[int] = None
    host_steps: int = 30            # decode steps timed per measurement (their median is its figure)
    repetitions: int = 3            # interleaved repetitions of every measurement (median and range reported)
    device_ms: float = 25.0         # the sleeping runner's time per forward


def run_host_overhead(config: HostOverheadConfig) -> dict:
    from paged_backend.benchmarks.micro.overhead import _prompts
    from paged_backend.benchmarks.paper.engine_runs import load_bench_model, set_threads

    from paged_backend.worker.compute_thread import run_on_compute_thread

    threads = set_threads(config.threads)
    # torch work on the compute thread, as an engine loading a named model does (compute_thread.py)
    model, tokenizer = run_on_compute_thread(load_bench_model, config.model)
    host = [measure_host(model, tokenizer, _prompts(tokenizer, batch, config.prompt_len, config.seed), config)
            for batch in config.batch_sizes]
    return {"benchmark": "host-overhead", "config": asdict(config), "conditions": {"threads": threads},
            "host": host, "overlap": has_overlap(), "pass_with_norms": PASS_WITH_NORMS}


def check_host_overhead(result: dict) -> List[str]:
    problems = []
    for r in result["host"]:
        if r["running"] != r["batch"]:
            problems.append(f"batch {r['batch']}: {r['running']} sequences were running")
        never = [name for name, calls in r["phase_calls"].items() if not calls and name != "block_manager"]
        if never:
            problems.append(f"batch {r['batch']}: no call was timed for {', '.join(never)}")
    return problems


def _repetitions_text(config: dict) -> str:
    """How the figures repeat (records before repetitions ran each measurement once)."""
    reps = config.get("repetitions", 1)
    return f"; median (range) of {reps} interleaved repetitions" if reps > 1 else ""


def _pass_what(result: dict) -> str:
    """What the recorded logits pass computed (records before the change have no `pass_with_norms`: both)."""
    if result.get("pass_with_norms", True):
        return "argmax and log-normaliser"
    return "argmax alone: greedy rows that report no log-probabilities need no log-normaliser"


def host_overhead_table(result: dict) -> str:
    c = result["config"]
    d = c["device_ms"]
    steps = format_table(
        host_headers(d), host_table(result["host"], c),
        f"The engine alone ({c['model']}'s tokenizer, greedy, {c['prompt_len']}-token prompts, median of "
        f"{c['host_steps']} decode steps{_repetitions_text(c)}, {result['conditions'].get('torch_threads')} threads): "
        f"a runner that "
        f"returns ready logits, and one that sleeps D ms per forward (step time minus D); without and with "
        f"overlapped scheduling{'' if result.get('overlap') else ' (this engine has none: -)'}. Logits pass: the "
        f"sampler's one pass over the step's logits ({_pass_what(result)}), alone, back to back (the logits stay in "
        f"cache; inside a step they come from memory): the part of a step no bookkeeping can remove on this machine; "
        f"argmax after idle: the pass the worker makes after each forward "
        f"when overlapped (argmax only), timed after sleeping D ms as the worker does, which pays for waking the "
        f"kernel's threads; worker between forwards: with overlap and D ms, the worker's time from the end of one "
        f"forward to the start of the next (median), of it its draws (the sampler's call on the step's logits, "
        f"inside the step) and the rest (per gap, the gap less its draws: the engine's own time on the critical "
        f"path; -: not measured)")
    phases = format_table(["running seqs"] + list(HOST_PHASES), phase_rows(result["host"]),
                          "Where the ready-logits step's time goes, without overlap (ms per step)")
    return steps + "\n\n" + phases


SPEC = BenchmarkSpec("host-overhead", HostOverheadConfig, run_host_overhead, check_host_overhead,
                     host_overhead_table, "",
                     {"quick": {"model": "tiny-llama", "batch_sizes": (1, 8), "host_steps": 4, "device_ms": 5.0,
                                "repetitions": 1},
                      "full": {}}, documented_size="full", on_compute_thread=False)
