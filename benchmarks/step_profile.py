"""Where the engine's own time goes in a decode step: cProfile of `LLMEngine.step` with the dry runner.

`python -m paged_backend.benchmarks.step_profile [--batch 256]` brings `batch` 32-token prompts of smollm2 to
decoding, replaces the model forward with the dry runner (fixed logits), then profiles 20 steps and prints
the functions by own time and by cumulative time, and the unprofiled step time. What remains besides the dry
runner's logits (`engine_runs.DryRunner.execute`) is the step outside the model forward: scheduling, block
tables, input preparation, the sampler, detokenization and outputs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from typing import Optional, Sequence

from paged_backend import LLMEngine, SamplingParams

from .engine_runs import DryRunner, load_bench_model
from .overhead import _prompts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    model, tokenizer = load_bench_model("smollm2")
    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=args.batch * 6 + 8, num_swap_blocks=0,
                       max_num_seqs=max(256, args.batch), max_num_batched_tokens=max(2048, args.batch))
    engine.runner = DryRunner.for_engine(engine)
    for i, prompt in enumerate(_prompts(tokenizer, args.batch, 32, 0)):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                           max_tokens=2 * args.steps + 16))
    for _ in range(8):  # prefill, then a few decode steps
        engine.step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    print(f"{engine.get_stats().num_running} running sequences; {step_ms:.1f} ms per step unprofiled "
          f"(dry runner: no forward)")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(25)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
