"""The engine's own time on a CUDA GPU, with and without overlapped scheduling and CUDA graphs (issue 22).

Run on a CUDA machine: `python -m paged_backend.benchmarks.gpu.gpu_overlap --output DIR`. On the random-weight
1.1B Llama of gpu_engine (bfloat16), for 1, 64 and 256 greedy sequences with 32-token prompts, it times decode
steps with `async_scheduling` off and on, eagerly and with CUDA graphs: the wall time per step, the device time of
each forward (CUDA events recorded around the runner, in the thread that runs it) and so the share of the step the
device is busy; with the same graph setting, the greedy tokens with and without overlap must be equal. Then the
graph check: greedy tokens of decode batches that need padding (3, 37 and 100 sequences of mixed prompt lengths)
replayed from CUDA graphs must equal the same padded steps run eagerly on the same buffers, and are compared with
the plain eager engine (`enforce_eager`), in float32 (tiny-llama, TF32 off) and bfloat16 (the 1.1B model).
Importable without a GPU; `main` refuses to run without one. Writes `gpu_overlap.json` and `gpu_overlap.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from paged_backend import LLMEngine, SamplingParams

from paged_backend.benchmarks.gpu import gpu_engine
from paged_backend.benchmarks.harness.provenance import load_average
from paged_backend.benchmarks.harness.report import conditions, now

BATCHES = (1, 64, 256)
PROMPT_TOKENS = 32


class TimedRunner:
    """Wraps an engine's runner: the device time of each forward (CUDA events around it; the host's wall time
    on a CPU smoke run)."""

    def __init__(self, runner, device: str, device_fill: bool = True) -> None:
        self.runner, self.device = runner, device
        # the engine fills pending input ids on the device when the runner says it can (step_inputs.DeviceFill)
        self.fills_on_device = device_fill and getattr(runner, "fills_on_device", False)
        self.spans: List[tuple] = []
        self.thread_cpu: List[float] = []   # CPU seconds of the calling thread (the worker's when overlapped)

    def execute(self, inputs, on_launched=None):
        self.thread_cpu.append(time.thread_time())
        if self.device != "cuda":
            start = time.perf_counter()
            logits = self.runner.execute(inputs, on_launched=on_launched)
            self.spans.append((start, time.perf_counter()))
            return logits
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        logits = self.runner.execute(inputs, on_launched=on_launched)
        end.record()
        self.spans.append((begin, end))
        return logits

    def device_ms(self, first: int) -> float:
        """The device time of forwards `first`.. (after a synchronize)."""
        spans = self.spans[first:]
        if self.device != "cuda":
            return sum(1000 * (b - a) for a, b in spans)
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in spans)

    def gap_ms(self, first: int) -> float:
        """The median time from one forward's end to the next one's start (device idle, or its sampling)."""
        spans = self.spans[first:]
        if self.device == "cuda":
            torch.cuda.synchronize()
            gaps = [a[1].elapsed_time(b[0]) for a, b in zip(spans, spans[1:])]
        else:
            gaps = [1000 * (b[0] - a[1]) for a, b in zip(spans, spans[1:])]
        return statistics.median(gaps) if gaps else 0.0

    def forward_thread_cpu_ms(self, first: int) -> float:
        """CPU milliseconds of the thread running the forwards, per forward, from forward `first` on."""
        marks = self.thread_cpu[first:]
        return 1000 * (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else 0.0

    def shutdown(self) -> None:
        self.runner.shutdown()


class TimedSampler:
    """Wraps the engine's draws (`tokens.sample` and `sample_later`, called on the thread that runs the forwards):
    the host's wall time of each call (enqueueing the sampler's operators, and for `sample` waiting for the tokens)
    and, on CUDA, the device's time from the call's start to its end (CUDA events on either side: the sampler's
    kernels, plus any wait for the host to enqueue them after the forward ended)."""

    def __init__(self, tokens, device: str) -> None:
        self.device, self.host_ms, self.spans = device, [], []
        for name in ("sample", "sample_later"):
            setattr(tokens, name, self._timed(getattr(tokens, name)))

    def _timed(self, draw):
        def timed(*args, **kwargs):
            begin = end = None
            if self.device == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            start = time.perf_counter()
            try:
                return draw(*args, **kwargs)
            finally:
                self.host_ms.append(1000 * (time.perf_counter() - start))
                if end is not None:
                    end.record()
                self.spans.append((begin, end))
        return timed

    def medians(self, first: int) -> dict:
        """Median host ms and device ms (the host's figure on a CPU) of calls `first`.. (after a synchronize)."""
        host = self.host_ms[first:]
        if not host:
            return {}
        if self.device == "cuda":
            torch.cuda.synchronize()
            device = [a.elapsed_time(b) for a, b in self.spans[first:]]
        else:
            device = host
        return {"sampler_host_ms": statistics.median(host), "sampler_device_ms": statistics.median(device)}


def measure(model, batch: int, overlap: bool, steps: int, device: str, graphs: bool = False,
            device_fill: bool = True, sampled: bool = False) -> dict:
    """Decode steps of `batch` greedy sequences: wall and device time per step, and the tokens. `device_fill`
    False: the worker waits for each step's tokens on the host and fills the next step's inputs there (as before
    `StepInputs.device_fill`)."""
    vocab = model.config.vocab_size
    prompts = gpu_engine._prompts([PROMPT_TOKENS] * batch, vocab, seed=batch)
    engine = LLMEngine(model, device=device, num_blocks=batch * 8 + 16, block_size=16, max_num_seqs=max(256, batch),
                       max_num_batched_tokens=max(2048, batch * PROMPT_TOKENS), async_scheduling=overlap,
                       enforce_eager=not graphs)
    captured = engine.runner.graphs is not None and engine.runner.graphs.stats.error is None
    timed = engine.runner = TimedRunner(engine.runner, device, device_fill)
    draws = TimedSampler(engine.tokens, device)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True, **(
            dict(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled else dict(temperature=0))))
    for _ in range(4):   # prefill, then decoding
        engine.step()
    gpu_engine._sync()
    first, first_draw = len(timed.spans), len(draws.host_ms)
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    gpu_engine._sync()
    wall_ms = 1000 * (time.perf_counter() - start)
    engine_cpu_ms = 1000 * (time.thread_time() - cpu)
    device_ms = timed.device_ms(first)
    gap_ms, worker_cpu_ms = timed.gap_ms(first), timed.forward_thread_cpu_ms(first)
    sampler = draws.medians(first_draw)
    finals, errors = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
                if out.error:
                    errors.append(out.error)
    engine.shutdown()
    if errors:
        raise RuntimeError(f"{len(errors)} of {batch} requests failed; the first: {errors[0]}")
    return {"batch": batch, "overlap": overlap, "graphs": captured, "device_fill": timed.fills_on_device,
            "sampled": sampled, "step_ms": wall_ms / steps,
            "device_ms_per_step": device_ms / steps, "device_busy": min(1.0, device_ms / wall_ms),
            "between_forwards_ms": gap_ms, "engine_thread_cpu_ms": engine_cpu_ms / steps,
            "forward_thread_cpu_ms": worker_cpu_ms, **sampler,
            "tokens": [finals[str(i)] for i in range(batch)]}


def compare(model, batches: Sequence[int], steps: int, device: str, graphs: Sequence[bool] = (False,),
            sampled: bool = False) -> List[dict]:
    """Per batch and graph setting, overlap off then on (same tokens required); `eager_tokens` says whether the
    graph runs' tokens equal the eager ones."""
    rows = []
    for batch in batches:
        eager_tokens = None
        for graph in graphs:
            off = measure(model, batch, False, steps, device, graph, sampled=sampled)
            on = measure(model, batch, True, steps, device, graph, sampled=sampled)
            tokens = off.pop("tokens")
            same = tokens == on.pop("tokens")
            if eager_tokens is None:
                eager_tokens = tokens
            as_eager = tokens == eager_tokens
            rows += [dict(off, same_tokens=same, same_as_eager=as_eager), dict(on, same_tokens=same,
                                                                              same_as_eager=as_eager)]
            print(rows[-2], rows[-1], flush=True)
            if graph:   # the same overlapped steps with the host fill, for the difference the device fill makes
                host = measure(model, batch, True, steps, device, graph, device_fill=False, sampled=sampled)
                same_host = host.pop("tokens") == tokens
                rows.append(dict(host, same_tokens=same_host, same_as_eager=same_host and as_eager))
                print(rows[-1], flush=True)
    return rows


def _greedy(engine: LLMEngine, prompts: List[List[int]], tokens: int) -> List[List[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                finals[out.request_id] = list(out.outputs[0].token_ids)
    return [finals[str(i)] for i in range(len(prompts))]


def check_graph_tokens(model, batches: Sequence[int] = (3, 37, 100), tokens: int = 24, device: str = "cuda") -> dict:
    """Greedy tokens of padded decode batches: CUDA graphs, the same padded steps run eagerly on the buffers
    (must be equal), and the plain eager engine (reported)."""
    from paged_backend.engine.llm_engine import LLMEngine as EngineClass
    from paged_backend.worker.cuda_graphs import GraphConfig

    results = {}
    for batch in batches:
        lengths = [5 + (37 * i) % 90 for i in range(batch)]
        prompts = gpu_engine._prompts(lengths, model.config.vocab_size, seed=batch)
        options = dict(device=device, num_blocks=batch * 10 + 16, block_size=16, max_num_seqs=128,
                       max_num_batched_tokens=4096)
        graphs_engine = LLMEngine(model, **options)
        captured = graphs_engine.runner.graphs.stats.as_dict() if graphs_engine.runner.graphs else None
        replayed = _greedy(graphs_engine, prompts, tokens)
        real = EngineClass._decode_graphs
        EngineClass._decode_graphs = lambda self, lora: GraphConfig(self.config.scheduler.max_num_seqs,
                                                                     self.max_model_len, capture=False)
        try:
            buffers = _greedy(LLMEngine(model, **options), prompts, tokens)
        finally:
            EngineClass._decode_graphs = real
        eager = _greedy(LLMEngine(model, enforce_eager=True, **options), prompts, tokens)
        results[batch] = {"graphs": captured, "same_as_buffers_eager": replayed == buffers,
                          "sequences_same_as_plain_eager": sum(a == b for a, b in zip(replayed, eager)),
                          "sequences": batch, "replays": graphs_engine.runner.graphs.stats.replays
                          if graphs_engine.runner.graphs else 0}
        print(f"graph tokens, batch {batch}: {results[batch]}", flush=True)
    return results


def _guarded(check, *args) -> dict:
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - one dtype's failure must not hide the other's
        return {"all": {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}}


def report_markdown(result: dict) -> str:
    lines = [f"# Overlapped scheduling and CUDA graphs on {result['device']}", ""] + gpu_engine._conditions(result) + [
             result["model"], "",
             "| sequences | rows | CUDA graphs | overlap | device fill | step ms | device ms per step | device busy | "
             "same tokens, overlap on/off | same tokens as eager | between forwards ms | engine thread CPU ms | "
             "forward thread CPU ms | sampler host ms | sampler device ms |", "|" + " --- |" * 15]
    for r in result.get("rows", []):
        lines.append(f"| {r['batch']} | {'top-p 0.95' if r.get('sampled') else 'greedy'} | "
                     f"{'on' if r.get('graphs') else 'off'} | {'on' if r['overlap'] else 'off'} | "
                     f"{'on' if r.get('device_fill') else 'off'} | {r['step_ms']:.2f} | "
                     f"{r['device_ms_per_step']:.2f} | {100 * r['device_busy']:.0f}% | "
                     f"{'yes' if r['same_tokens'] else 'NO'} | {'yes' if r.get('same_as_eager', True) else 'no'} | "
                     + " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in
                                  ("between_forwards_ms", "engine_thread_cpu_ms", "forward_thread_cpu_ms",
                                   "sampler_host_ms", "sampler_device_ms")) + " |")
    for dtype, checks in result.get("graph_tokens", {}).items():
        lines += ["", f"## CUDA graph replay, padded decode batches, {dtype}", "",
                  "| sequences | same as the padded steps run eagerly | same as the plain eager engine | replays | "
                  "capture |", "| --- | --- | --- | --- | --- |"]
        for batch, row in checks.items():
            if "error" in row:
                lines.append(f"| {batch} | FAILED: {row['error']} | | | |")
                continue
            graphs = row["graphs"] or {}
            lines.append(f"| {batch} | {'yes' if row['same_as_buffers_eager'] else 'NO'} | "
                         f"{row['sequences_same_as_plain_eager']}/{row['sequences']} | {row['replays']} | "
                         f"{len(graphs.get('buckets', []))} buckets in {graphs.get('seconds') or 0:.1f} s"
                         f"{', error: ' + graphs['error'] if graphs.get('error') else ''} |")
    if "error" in result:
        lines += ["", f"FAILED: {result['error']}"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="folder for gpu_overlap.json and gpu_overlap.md")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="running sequences, comma-separated")
    parser.add_argument("--skip-graph-tokens", action="store_true", help="time only (no replay-versus-eager check)")
    parser.add_argument("--sampled-batches", default="64",
                        help="running sequences of the sampled rows (temperature 0.8, top-p 0.95, seeded)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_overlap needs a CUDA GPU (none found); nothing was run.", file=sys.stderr)
        return 2
    result = {"conditions": conditions(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": "random Llama 1.1B (TinyLlama shape), bfloat16; greedy, 32-token prompts"}
    try:
        model = gpu_engine.llama_1b()
        batches = [int(b) for b in args.batches.split(",") if b]
        result["rows"] = compare(model, batches, args.steps, "cuda", graphs=(False, True))
        sampled = [int(b) for b in args.sampled_batches.split(",") if b]   # seeded top-p rows, graphs on
        result["rows"] += compare(model, sampled, args.steps, "cuda", graphs=(True,), sampled=True)
        if not args.skip_graph_tokens:
            torch.backends.cuda.matmul.allow_tf32 = False
            from paged_backend.worker.loader import load_model

            tiny, _ = load_model("tiny-llama", dtype=torch.float32, device="cuda")
            result["graph_tokens"] = {"float32 tiny-llama": _guarded(check_graph_tokens, tiny),
                                      "bfloat16 1.1B": _guarded(check_graph_tokens, model)}
    except Exception as exc:  # noqa: BLE001 - recorded, so the session's other parts still report
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["conditions"].update(finished=now(), load_average_after=load_average())
    report = report_markdown(result)
    print(report)
    if args.output:
        folder = Path(args.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu_overlap.json").write_text(json.dumps(result, indent=2))
        (folder / "gpu_overlap.md").write_text(report)
    rows = result.get("rows", [])
    graph_checks = [row for checks in result.get("graph_tokens", {}).values() for row in checks.values()]
    graphs_ok = args.skip_graph_tokens or (bool(graph_checks) and
                                           all(row.get("same_as_buffers_eager") for row in graph_checks))
    return 0 if rows and all(r["same_tokens"] for r in rows) and graphs_ok else 1


if __name__ == "__main__":
    sys.exit(main())
