"""Hugging Face baselines on the same model object: static-batch `generate` and transformers' own
continuous batching (the manager behind `model.generate_batch`), each forced to the trace's lengths.

Static batching pads every prompt to the longest in its batch and runs every row for the longest
output; batches are formed in trace order as large as fit the KV budget (rows x padded length
<= budget slots). Only the trace's true output tokens count as useful output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List

import torch

from paged_backend.benchmarks.paper.engine_runs import token_digest
from paged_backend.benchmarks.harness.workloads import Trace, TraceRequest


@dataclass
class BaselineRun:
    """Wall time and token counts of one HF baseline over a trace."""

    system: str
    wall_s: float
    num_requests: int
    num_finished: int
    output_tokens: int        # the trace's output tokens that were produced
    generated_tokens: int     # every generated token, padding rows included
    wrong_lengths: int
    detail: dict
    digests: List[str] = field(default_factory=list)   # per request, in trace order

    def as_dict(self) -> dict:
        return {"system": self.system, "wall_s": self.wall_s, "num_requests": self.num_requests,
                "num_finished": self.num_finished, "output_tokens": self.output_tokens,
                "generated_tokens": self.generated_tokens, "wrong_lengths": self.wrong_lengths,
                "requests_per_s": self.num_finished / self.wall_s if self.wall_s else 0.0,
                "output_tokens_per_s": self.output_tokens / self.wall_s if self.wall_s else 0.0, **self.detail}


def static_batches(requests: List[TraceRequest], kv_slots: int, max_batch: int = 256) -> List[List[int]]:
    """Indices of consecutive requests grouped so that rows x (longest prompt + longest output) <= kv_slots."""
    batches: List[List[int]] = []
    current: List[int] = []
    longest_prompt = longest_output = 0
    for i, request in enumerate(requests):
        p = max(longest_prompt, request.prompt_len)
        o = max(longest_output, request.output_len)
        if current and ((len(current) + 1) * (p + o) > kv_slots or len(current) >= max_batch):
            batches.append(current)
            current, p, o = [], request.prompt_len, request.output_len
        if request.total_len > kv_slots:
            raise ValueError(f"request {i} needs {request.total_len} slots; the budget is {kv_slots}")
        current.append(i)
        longest_prompt, longest_output = p, o
    if current:
        batches.append(current)
    return batches


def _pad_id(model, tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return 0 if pad is None else int(pad)


def run_hf_static(model, tokenizer, trace: Trace, kv_slots: int) -> BaselineRun:
    """HF `generate`, greedy, static batches padded to their longest prompt and longest output."""
    pad = _pad_id(model, tokenizer)
    batches = static_batches(trace.requests, kv_slots)
    produced = generated = wrong = 0
    digests = [""] * len(trace.requests)
    start = time.perf_counter()
    for batch in batches:
        reqs = [trace.requests[i] for i in batch]
        width = max(r.prompt_len for r in reqs)
        new = max(r.output_len for r in reqs)
        ids = torch.tensor([[pad] * (width - r.prompt_len) + list(r.prompt_token_ids) for r in reqs])
        mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in reqs])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        rows = out.shape[1] - width
        generated += rows * len(reqs)
        for row, (i, r) in enumerate(zip(batch, reqs)):
            produced += min(r.output_len, rows)
            wrong += rows < r.output_len
            digests[i] = token_digest(out[row, width:width + r.output_len].tolist())
    wall = time.perf_counter() - start
    sizes = [len(b) for b in batches]
    return BaselineRun("hf-static", wall, len(trace.requests), len(trace.requests), produced, generated, wrong,
                       {"num_batches": len(batches), "avg_batch": sum(sizes) / len(sizes),
                        "max_batch": max(sizes)}, digests)


def warm_up_hf(model, tokenizer, prompt_ids: List[int], tokens: int = 2) -> None:
    """One short `generate` so first-call costs do not land in a timed baseline run."""
    pad = _pad_id(model, tokenizer)
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                       dtype=torch.long), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=pad)


def collect_finished(manager, count: int, start: float, timeout_s: float) -> dict:
    """The finished outputs of `count` requests from transformers' continuous batching manager, by request id
    (TimeoutError `timeout_s` after `start`, RuntimeError if its loop stops)."""
    results = {}
    while len(results) < count:
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"HF continuous batching not done after {timeout_s:.0f} s")
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            results[out.request_id] = out
        elif out is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching loop stopped unexpectedly")
    return results


def run_hf_continuous(model, tokenizer, trace: Trace, kv_slots: int, page_size: int = 16,
                      max_batch_tokens: int = 2048, timeout_s: float = 3600.0) -> BaselineRun:
    """transformers' continuous batching (paged cache of kv_slots tokens), per-request output lengths, no EOS."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pad = _pad_id(model, tokenizer)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in trace.requests),
                                  eos_token_id=-1, pad_token_id=pad)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=kv_slots // page_size,
                                  max_batch_tokens=max_batch_tokens, allow_block_sharing=False)
    previous = model.config._attn_implementation
    results = {}
    try:
        with model.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=cb,
                                                       block=True, timeout=10, warmup=False) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(list(r.prompt_token_ids), max_new_tokens=r.output_len, eos_token_id=-1)
                   for r in trace.requests]
            wanted = {rid: r.output_len for rid, r in zip(ids, trace.requests)}
            results = collect_finished(manager, len(wanted), start, timeout_s)
            wall = time.perf_counter() - start
    finally:
        model.config._attn_implementation = previous
    lengths = {rid: len(out.generated_tokens) for rid, out in results.items()}
    produced = sum(min(n, wanted[rid]) for rid, n in lengths.items())
    failed = sum(1 for out in results.values() if out.error is not None)
    return BaselineRun("hf-continuous", wall, len(trace.requests), len(results) - failed, produced,
                       sum(lengths.values()), sum(1 for rid, n in lengths.items() if n != wanted[rid]),
                       {"page_size": page_size, "num_blocks": kv_slots // page_size,
                        "max_batch_tokens": max_batch_tokens},
                       [token_digest(list(results[rid].generated_tokens)[:wanted[rid]]) if rid in results else ""
                        for rid in ids])
