"""A batch of prompts through transformers' own `generate` and through the paged backend's drop-in
(`paged_backend.adapters.hf.attach`) on the same model: same arguments, same outputs, wall time of each.

    python benchmarks/micro/hf_adapter_speed.py --model smollm2 --batch 32 --max-new-tokens 32

Prints both times, tokens per second and the ratio (transformers time / paged time; above 1 means the
paged backend is faster), and whether the two outputs are identical. Greedy decoding, left-padded batch.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import List

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

_SUBJECTS = ["the ocean", "a hash table", "the French revolution", "photosynthesis", "a lighthouse keeper",
             "memory paging", "the moon landing", "a bicycle", "compilers", "the rain forest", "jazz", "volcanoes"]
_TEMPLATES = ["Write one sentence about {}.", "Here is a short story about {}:",
              "Explain {} to a child in simple words, step by step, without skipping anything important.",
              "Q: What is the most surprising fact about {}?\nA:", "{}:", "List three things you know about {}:"]


def make_prompts(count: int) -> List[str]:
    """Synthetic prompts of varied lengths (no dataset needed)."""
    return [_TEMPLATES[i % len(_TEMPLATES)].format(_SUBJECTS[(i * 5) % len(_SUBJECTS)]) for i in range(count)]


def count_new_tokens(rows: List[List[int]], eos) -> int:
    """Generated tokens, up to and including each row's first EOS (the rest is padding)."""
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    total = 0
    for row in rows:
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run(model_name: str, batch: int, max_new_tokens: int, dtype: torch.dtype, threads: int,
        engine_options: dict, repeats: int = 3) -> dict:
    from paged_backend.adapters.hf import attach, detach
    from paged_backend.worker.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    model, tok = load_model(model_name, dtype=dtype)
    tok.padding_side = "left"
    enc = tok(make_prompts(batch), return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    hf = type(model).generate
    attach(model, tokenizer=tok, **engine_options)
    try:
        small = {k: v[:2] for k, v in enc.items()}
        hf(model, **small, max_new_tokens=2)          # warm-up of both paths
        model.generate(**small, max_new_tokens=2)
        hf_times, paged_times = [], []
        for _ in range(repeats):  # alternate, keep the best of each: the machine may be shared
            reference, seconds = _timed(lambda: hf(model, **enc, **kwargs))
            hf_times.append(seconds)
            ours, seconds = _timed(lambda: model.generate(**enc, **kwargs))
            paged_times.append(seconds)
        hf_time, paged_time = min(hf_times), min(paged_times)
    finally:
        detach(model)
    new_tokens = count_new_tokens(ours[:, enc.input_ids.shape[1]:].tolist(), model.generation_config.eos_token_id)
    same_rows = int((reference == ours).all(dim=1).sum()) if reference.shape == ours.shape else 0
    return {"model": model_name, "batch": batch, "max_new_tokens": max_new_tokens, "dtype": str(dtype),
            "transformers_s": hf_time, "paged_s": paged_time, "ratio": hf_time / paged_time,
            "identical": bool(reference.shape == ours.shape and torch.equal(reference, ours)),
            "identical_rows": same_rows, "new_tokens": new_tokens,
            "repeats": repeats}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side; the best time counts")
    args = parser.parse_args(argv)
    result = run(args.model, args.batch, args.max_new_tokens, getattr(torch, args.dtype), args.threads,
                 {"kv_cache_memory": args.kv_cache_memory, "block_size": args.block_size}, args.repeats)
    print(f"model {result['model']} ({result['dtype']}), batch {result['batch']}, "
          f"max_new_tokens {result['max_new_tokens']}, best of {result['repeats']} runs each")
    print(f"transformers generate: {result['transformers_s']:.2f} s "
          f"({result['new_tokens'] / result['transformers_s']:.1f} tokens/s)")
    print(f"paged backend:         {result['paged_s']:.2f} s "
          f"({result['new_tokens'] / result['paged_s']:.1f} tokens/s)")
    print(f"ratio (transformers / paged): {result['ratio']:.2f}x")
    print(f"outputs identical: {result['identical']} ({result['identical_rows']}/{result['batch']} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
