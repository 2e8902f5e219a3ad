"""The engine's own time on a CUDA GPU, with and without overlapped scheduling (issue 22).

Run on a CUDA machine: `python -m paged_backend.benchmarks.gpu.gpu_overlap --output DIR`. On the random-weight
1.1B Llama of gpu_engine (bfloat16), for 1, 64 and 256 greedy sequences with 32-token prompts, it times decode
steps with `async_scheduling` off and on: the wall time per step, the device time of each forward and its draws
(CUDA events recorded around the runner, in the thread that runs it) and so the share of the step the device is
busy; the greedy tokens of both runs must be equal. Importable without a GPU; `main` refuses to run without one.
Writes `gpu_overlap.json` and `gpu_overlap.md`. CUDA graphs are not implemented: every step runs eagerly.
"""

from __future__ import annotations

import argparse
import json
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

    def __init__(self, runner, device: str) -> None:
        self.runner, self.device = runner, device
        self.spans: List[tuple] = []

    def execute(self, inputs, on_launched=None):
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

    def shutdown(self) -> None:
        self.runner.shutdown()


def measure(model, batch: int, overlap: bool, steps: int, device: str) -> dict:
    """Decode steps of `batch` greedy sequences: wall and device time per step, and the tokens."""
    vocab = model.config.vocab_size
    prompts = gpu_engine._prompts([PROMPT_TOKENS] * batch, vocab, seed=batch)
    engine = LLMEngine(model, device=device, num_blocks=batch * 8 + 16, block_size=16, max_num_seqs=max(256, batch),
                       max_num_batched_tokens=max(2048, batch * PROMPT_TOKENS), async_scheduling=overlap)
    timed = engine.runner = TimedRunner(engine.runner, device)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):   # prefill, then decoding
        engine.step()
    gpu_engine._sync()
    first = len(timed.spans)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    gpu_engine._sync()
    wall_ms = 1000 * (time.perf_counter() - start)
    device_ms = timed.device_ms(first)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    engine.shutdown()
    return {"batch": batch, "overlap": overlap, "step_ms": wall_ms / steps, "device_ms_per_step": device_ms / steps,
            "device_busy": min(1.0, device_ms / wall_ms), "tokens": [finals[str(i)] for i in range(batch)]}


def compare(model, batches: Sequence[int], steps: int, device: str) -> List[dict]:
    rows = []
    for batch in batches:
        off, on = measure(model, batch, False, steps, device), measure(model, batch, True, steps, device)
        same = off.pop("tokens") == on.pop("tokens")
        rows += [dict(off, same_tokens=same), dict(on, same_tokens=same)]
        print(rows[-2], rows[-1], flush=True)
    return rows


def report_markdown(result: dict) -> str:
    lines = [f"# Overlapped scheduling on {result['device']}", "", result["model"], "",
             "| sequences | overlap | step ms | device ms per step | device busy | same greedy tokens |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result.get("rows", []):
        lines.append(f"| {r['batch']} | {'on' if r['overlap'] else 'off'} | {r['step_ms']:.2f} | "
                     f"{r['device_ms_per_step']:.2f} | {100 * r['device_busy']:.0f}% | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    if "error" in result:
        lines += ["", f"FAILED: {result['error']}"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="folder for gpu_overlap.json and gpu_overlap.md")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_overlap needs a CUDA GPU (none found); nothing was run.", file=sys.stderr)
        return 2
    result = {"conditions": conditions(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": "random Llama 1.1B (TinyLlama shape), bfloat16; greedy, 32-token prompts"}
    try:
        result["rows"] = compare(gpu_engine.llama_1b(), BATCHES, args.steps, "cuda")
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
    return 0 if rows and all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
