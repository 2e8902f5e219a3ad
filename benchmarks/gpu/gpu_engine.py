"""The engine end to end on a CUDA GPU (Triton kernels): fidelity, features under memory pressure, throughput.

Run on a CUDA machine: `python -m paged_backend.benchmarks.gpu.gpu_engine --output DIR`. It (1) generates greedy
tokens with every tiny preset in float32 (TF32 off) and compares them with transformers' `generate` on the
same GPU and weights, (2) runs a mixed workload (greedy, seeded n=3 sampling, beam search) on a cache small
enough to preempt, once per preemption mode, and compares every output with the same request run alone on a
large cache, (3) times a random-weight Llama-like model of about 1B parameters in bfloat16: the engine's
output tokens/s against transformers' static batches over the same requests, interleaved repetitions.
Importable without a GPU; `main` refuses to run without one. Writes `gpu_engine.json` and `gpu_engine.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from paged_backend import LLM, SamplingParams
from paged_backend.kernels import kernel_backend
from paged_backend.worker.loader import TINY_PRESETS, load_model

from paged_backend.benchmarks.harness.provenance import load_average
from paged_backend.benchmarks.paper.hf_baselines import collect_finished
from paged_backend.benchmarks.harness.report import conditions, conditions_line, now

DEVICE = "cuda"   # a CPU smoke run of the script sets "cpu"
FIDELITY_PROMPT_LENS = (5, 19, 40)      # longer than the families' 8-token windows
FIDELITY_NEW_TOKENS = 24


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _prompts(lengths: Sequence[int], vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(model, prompt: List[int], new_tokens: int) -> List[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _ours_greedy(model, tokenizer, prompts: List[List[int]]) -> List[List[int]]:
    llm = LLM(model, tokenizer=tokenizer, device=DEVICE, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=FIDELITY_NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _first_divergence(got: List[List[int]], want: List[List[int]]) -> List[Optional[int]]:
    return [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]


def _diagnose(model, tokenizer, prompts: List[List[int]], want: List[List[int]], got: List[List[int]]
              ) -> dict:
    """Which side a mismatch comes from: our reference (PyTorch) kernels on the same GPU against transformers,
    and ours against transformers' eager attention."""
    previous = os.environ.get("PAGED_BACKEND_KERNELS")
    os.environ["PAGED_BACKEND_KERNELS"] = "torch"
    try:
        reference = _ours_greedy(model, tokenizer, prompts)
    finally:
        if previous is None:
            os.environ.pop("PAGED_BACKEND_KERNELS")
        else:
            os.environ["PAGED_BACKEND_KERNELS"] = previous
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    eager = [_hf_greedy(model, p, FIDELITY_NEW_TOKENS) for p in prompts]
    model.set_attn_implementation(implementation)
    return {"hf_attention": implementation, "reference_kernels_same_as_hf": reference == want,
            "reference_kernels_same_as_triton": reference == got, "hf_eager_same_as_hf": eager == want,
            "reference_kernels": reference, "hf_eager": eager}


def check_fidelity(presets: Sequence[str] = TINY_PRESETS) -> Dict[str, dict]:
    """Greedy tokens of each preset, ours (Triton kernels on CUDA) against transformers on the same GPU; a
    mismatch is diagnosed (`_diagnose`)."""
    results = {}
    for name in presets:
        try:
            model, tokenizer = load_model(name, dtype=torch.float32, device=DEVICE)
            prompts = _prompts(FIDELITY_PROMPT_LENS, model.config.vocab_size, seed=len(name))
            want = [_hf_greedy(model, p, FIDELITY_NEW_TOKENS) for p in prompts]
            got = _ours_greedy(model, tokenizer, prompts)
            same = [g == w for g, w in zip(got, want)]
            results[name] = {"same": all(same), "prompts_same": sum(same), "prompts": len(prompts),
                             "backend": kernel_backend(torch.empty(1, device=DEVICE))}
            if not all(same):
                diagnosis = _diagnose(model, tokenizer, prompts, want, got)
                results[name].update(diagnosis, first_divergence=_first_divergence(got, want), ours=got, hf=want)
            del model
        except Exception as exc:  # one family's failure must not hide the others'
            results[name] = {"same": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-2000:]}
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(f"fidelity {name}: {results[name]}", flush=True)
    return results


def _pressure_workload(vocab: int) -> List[tuple]:
    rng = random.Random(7)
    work = []
    for i in range(12):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 60))]
        kind = i % 3
        if kind == 0:
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(16, 48), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=rng.randrange(16, 40),
                                    ignore_eos=True)
        else:
            params = SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=rng.randrange(12, 32),
                                    ignore_eos=True)
        work.append((prompt, params))
    return work


def _texts(outputs) -> List[List[List[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


PRESSURE_KINDS = ("greedy", "sampled, n=3", "beams, n=2")   # request i is of kind i % 3 (_pressure_workload)
# engine options of the reruns that say which part a mismatch under pressure comes from
PRESSURE_VARIANTS = {"eager": {"enforce_eager": True}, "no_overlap": {"async_scheduling": False},
                     "host_fill": {"host_fill": True},
                     "eager_no_overlap": {"enforce_eager": True, "async_scheduling": False, "host_fill": True}}


def _host_fill(llm) -> None:
    """The engine's steps sample with host reads and fill the next step's inputs on the host (as before
    `StepInputs.device_fill`), whatever the device."""
    llm.engine.runner.fills_on_device = False


def _first_difference(got: List[List[int]], want: List[List[int]]) -> List[int]:
    """[completion, position] of the first token where two requests' completions differ."""
    for j, (g, w) in enumerate(zip(got, want)):
        for k, (x, y) in enumerate(zip(g, w)):
            if x != y:
                return [j, k]
        if len(g) != len(w):
            return [j, min(len(g), len(w))]
    return [min(len(got), len(want)), 0]


def _tight_run(model, tokenizer, work, mode: str, host_fill: bool = False, **options):
    llm = LLM(model, tokenizer=tokenizer, device=DEVICE, num_blocks=20, preemption_mode=mode,
              **({"num_swap_blocks": 256} if mode == "swap" else {}), **options)
    if host_fill:
        _host_fill(llm)
    outputs = llm.generate([p for p, _ in work], [params for _, params in work], use_tqdm=False)
    return outputs, llm.get_stats()


def check_pressure(mode: str, diagnose: bool = True) -> dict:
    """Mixed requests on 20 blocks of 16 (preempting by `mode`) against each request alone on a large cache.
    Where they differ: which requests (kind, first differing token), and, with `diagnose`, the same pressure run
    again eagerly, without overlap, with the host fill, and all three (how many requests then match), and whether
    the requests alone are the same run that way (float32 rounding of other batch shapes, or a bug of one path)."""
    model, tokenizer = load_model("tiny-llama", dtype=torch.float32, device=DEVICE)
    work = _pressure_workload(model.config.vocab_size)
    alone = LLM(model, tokenizer=tokenizer, device=DEVICE, num_blocks=512)
    alone_outputs = [alone.generate([p], params, use_tqdm=False)[0] for p, params in work]
    want = _texts(alone_outputs)
    alone_errors = [o.error for o in alone_outputs]
    outputs, stats = _tight_run(model, tokenizer, work, mode)
    got = _texts(outputs)
    errors = [o.error for o in outputs if o.error] + [e for e in alone_errors if e]
    same = [g == w for g, w in zip(got, want)]
    result = {"same": all(same) and not errors, "requests_same": sum(same), "requests": len(work),
              "errors": errors[:3], "num_errors": len(errors),
              "preemptions": stats.num_preemptions, "swap_preemptions": stats.num_swap_preemptions,
              "recompute_preemptions": stats.num_recompute_preemptions, "free_blocks_after": stats.num_free_blocks,
              "blocks": stats.num_blocks,
              "differing": [{"request": i, "kind": PRESSURE_KINDS[i % 3], "first_difference":
                             _first_difference(g, w)} for i, (g, w) in enumerate(zip(got, want)) if g != w]}
    if diagnose and not all(same):
        plain = LLM(model, tokenizer=tokenizer, device=DEVICE, num_blocks=512, enforce_eager=True,
                    async_scheduling=False)
        _host_fill(plain)
        result["alone_eager_no_overlap_same"] = sum(
            _texts(plain.generate([p], params, use_tqdm=False))[0] == w for (p, params), w in zip(work, want))
        for name, options in PRESSURE_VARIANTS.items():
            again, _ = _tight_run(model, tokenizer, work, mode, **options)
            result[f"{name}_requests_same"] = sum(g == w for g, w in zip(_texts(again), want))
    return result


def _feature_workload(vocab: int, with_structured: bool) -> List[tuple]:
    """Requests that each take a path of their own on the device: penalties, biases, allowed and banned tokens,
    min_tokens, logprobs, seeded top-k / min-p sampling with n > 1, beams with a length penalty, and (when
    xgrammar is installed) a JSON schema."""
    rng = random.Random(11)
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]   # noqa: E731
    common = dict(max_tokens=20, ignore_eos=True)
    work = [
        ("penalties", prompt(17), SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                                                 frequency_penalty=0.4, **common)),
        ("bias", prompt(9), SamplingParams(temperature=0, logit_bias={5: 4.0, 6: -100.0}, **common)),
        ("allowed", prompt(12), SamplingParams(temperature=0, allowed_token_ids=list(range(3, 40)), **common)),
        ("min_tokens", prompt(7), SamplingParams(temperature=0, min_tokens=10, max_tokens=20)),
        ("logprobs", prompt(21), SamplingParams(temperature=0, logprobs=3, **common)),
        ("seeded", prompt(15), SamplingParams(n=2, temperature=0.9, top_k=20, min_p=0.05, seed=3, **common)),
        ("beams", prompt(11), SamplingParams(beam_width=3, n=2, temperature=0, length_penalty=0.8, max_tokens=12,
                                             ignore_eos=True)),
    ]
    if with_structured:
        from paged_backend.structured.params import StructuredOutputsParams

        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        work.append(("json", prompt(6), SamplingParams(temperature=0, max_tokens=24, structured_outputs=
                                                       StructuredOutputsParams(json=schema,
                                                                               disable_any_whitespace=True))))
    return work


# Log-probabilities of the graph-replayed, overlapped engine against the eager one: float32 matmuls of another
# batch shape (a graph's padded bucket) round differently on a GPU, so values may differ in their last bits
# (the H200 run at fda71e0: tokens the same, log-probs not bit-equal); tokens must be identical.
LOGPROB_TOLERANCE = 1e-4


def _logprob_gap(a, b) -> float:
    """The largest difference between two completions' log-probabilities (inf where their entries differ)."""
    if (a.logprobs is None) != (b.logprobs is None):
        return math.inf
    gap = 0.0
    for x, y in zip(a.logprobs or [], b.logprobs or []):
        if set(x) != set(y):
            return math.inf
        gap = max([gap] + [abs(float(x[t]) - float(y[t])) for t in x])
    if a.cumulative_logprob is not None and b.cumulative_logprob is not None:
        gap = max(gap, abs(a.cumulative_logprob - b.cumulative_logprob))
    return gap


def compare_completions(a, b) -> dict:
    """Two runs of one request: the same tokens (exactly), log-probs within LOGPROB_TOLERANCE, no error."""
    tokens = [list(x.token_ids) for x in a.outputs] == [list(x.token_ids) for x in b.outputs]
    gap = max([_logprob_gap(x, y) for x, y in zip(a.outputs, b.outputs)] or [0.0])
    return {"same": tokens and gap <= LOGPROB_TOLERANCE and not a.error and not b.error, "tokens_same": tokens,
            "logprob_gap": gap, "error": a.error or b.error}


def check_features(device: Optional[str] = None) -> dict:
    """The feature workload on the device's default engine (CUDA graphs, overlapped steps, tokens left on the
    device for the next step) against an eager engine without overlap that samples and fills on the host, on the
    same device and weights (float32, TF32 off): every output the same, no request failed; then greedy requests
    with n-gram speculative decoding against the same requests without it."""
    device = device or DEVICE
    try:
        import xgrammar  # noqa: F401
        structured = True
    except ImportError:
        structured = False
    model, tokenizer = load_model("tiny-llama", dtype=torch.float32, device=device)
    work = _feature_workload(model.config.vocab_size, structured)

    def outputs(host_fill: bool = False, **options):
        llm = LLM(model, tokenizer=tokenizer, device=device, num_blocks=256, **options)
        if host_fill:
            _host_fill(llm)
        got = llm.generate([p for _, p, _ in work], [params for _, _, params in work], use_tqdm=False)
        graphs = llm.engine.runner.graphs
        return got, (graphs.stats.replays if graphs is not None else 0)

    fast, replays = outputs()
    plain, _ = outputs(host_fill=True, enforce_eager=True, async_scheduling=False)
    rows = {}
    for (name, _, _), a, b in zip(work, fast, plain):
        rows[name] = compare_completions(a, b)
    greedy = [([5 + i, 9, 14, 5 + i, 9, 14, 5 + i, 9], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
              for i in range(4)]
    spec = LLM(model, tokenizer=tokenizer, device=device, num_blocks=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    base = LLM(model, tokenizer=tokenizer, device=device, num_blocks=256)
    a = spec.generate([p for p, _ in greedy], [q for _, q in greedy], use_tqdm=False)
    b = base.generate([p for p, _ in greedy], [q for _, q in greedy], use_tqdm=False)
    rows["ngram_speculation"] = {"same": [list(o.outputs[0].token_ids) for o in a] ==
                                 [list(o.outputs[0].token_ids) for o in b] and not any(o.error for o in a + b),
                                 "error": next((o.error for o in a + b if o.error), None)}
    # a draft model (the target itself: every draft is accepted when greedy); sampled rows draw through the
    # rejection sampler, whose generators are the host's: they must come back whole, greedy ones as without it
    draft = LLM(model, tokenizer=tokenizer, device=device, num_blocks=256,
                speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    sampled = [(p, SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)) for i, (p, _) in
               enumerate(greedy)]
    c = draft.generate([p for p, _ in greedy + sampled], [q for _, q in greedy + sampled], use_tqdm=False)
    whole = all(len(o.outputs[0].token_ids) == 24 and not o.error for o in c)
    rows["draft_model_speculation"] = {"same": whole and [list(o.outputs[0].token_ids) for o in c[:len(greedy)]] ==
                                       [list(o.outputs[0].token_ids) for o in b],
                                       "error": next((o.error for o in c if o.error), None)}
    return {"same": all(r["same"] for r in rows.values()), "rows": rows, "structured": structured,
            "graph_replays": replays}


LORA_SPECS = (dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
              dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"], use_rslora=True))


def check_lora(folder: Path, device: Optional[str] = None) -> dict:
    """Two PEFT adapters (random, non-zero, made here) and the base model in one batch on the device (the Triton
    LoRA kernels on CUDA) against PEFT's own greedy tokens on the same device and weights (float32)."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    from paged_backend import LoRARequest

    device = device or DEVICE
    model, tokenizer = load_model("tiny-llama", dtype=torch.float32, device=device)
    prompts = _prompts((6, 13, 22), model.config.vocab_size, seed=5)
    requests, want = [None], [[_hf_greedy(model, p, FIDELITY_NEW_TOKENS) for p in prompts]]
    for i, spec in enumerate(LORA_SPECS):
        torch.manual_seed(100 + i)
        directory = folder / f"adapter{i}"
        get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **spec)).save_pretrained(
            str(directory))
        peft = PeftModel.from_pretrained(copy.deepcopy(model), str(directory)).eval()
        want.append([_hf_greedy(peft, p, FIDELITY_NEW_TOKENS) for p in prompts])
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(directory)))
    llm = LLM(model, tokenizer=tokenizer, device=device, num_blocks=256, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=FIDELITY_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([p for _ in requests for p in prompts], params, use_tqdm=False,
                           lora_request=[r for r in requests for _ in prompts])
    got = [[list(outputs[k * len(prompts) + j].outputs[0].token_ids) for j in range(len(prompts))]
           for k in range(len(requests))]
    same = [g == w for g, w in zip(got, want)]
    return {"same": all(same) and not any(o.error for o in outputs), "adapters_same": same,
            "adapters_change_tokens": [w != want[0] for w in want[1:]],
            "error": next((o.error for o in outputs if o.error), None)}


# ---- throughput --------------------------------------------------------------------------------------------
def llama_1b(vocab: int = 32000):
    """A random-weight Llama-like model of about 1.1B parameters (TinyLlama's shape), bfloat16 on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def _throughput_workload(num: int, seed: int = 0) -> List[tuple]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 32000) for _ in range(rng.randrange(32, 512))], rng.randrange(32, 256))
            for _ in range(num)]


def check_complete(outputs, lengths: Sequence[int]) -> None:
    """RuntimeError unless every request came back whole: a failed request's missing tokens would otherwise be
    counted as produced (the 2026-12-04 GPU run's first throughput figures were)."""
    bad = [o for o, n in zip(outputs, lengths) if o.error or len(o.outputs[0].token_ids) != n]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(lengths)} requests failed or came back short; the first: "
                           f"{bad[0].error or len(bad[0].outputs[0].token_ids)}")


def _ours_seconds(llm: LLM, work: List[tuple]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    _sync()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    _sync()
    seconds = time.perf_counter() - start
    check_complete(outputs, [n for _, n in work])
    return seconds


def _hf_static_seconds(model, work: List[tuple], batch: int) -> float:
    """transformers' generate over static batches of `batch` (left padded, each batch runs to its longest)."""
    _sync()
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long, device=DEVICE)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p, device=DEVICE)
            mask[r, width - len(p):] = 1
        longest = max(n for _, n in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=0)
    _sync()
    return time.perf_counter() - start


def hf_continuous_config(**wanted):
    """transformers' `ContinuousBatchingConfig` with the options this transformers has (its block size was
    `block_size` in 5.17 and is `page_size` later)."""
    from dataclasses import fields

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = {f.name for f in fields(ContinuousBatchingConfig)}
    if "block_size" in wanted and "block_size" not in names:
        wanted["page_size"] = wanted.pop("block_size")
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in names})


class HFContinuous:
    """transformers' continuous batching (the manager behind `generate_batch`, its CUDA graphs warmed up once and
    kept between runs), each request forced to its length."""

    def __init__(self, model, max_memory_percent: float = 0.4, **sizes) -> None:
        """`sizes`: the cache's `num_blocks` and `max_batch_tokens` when not sized from free memory (a CPU smoke
        run: 40% of a host's memory is gigabytes that transformers fills before the first request)."""
        from transformers import GenerationConfig

        self.model = model
        self.generation = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=-1, pad_token_id=0)
        self.config = hf_continuous_config(block_size=256, allow_block_sharing=False,
                                           max_memory_percent=max_memory_percent, **sizes)
        self.warm = False

    def seconds(self, work: List[tuple], timeout_s: float = 300.0) -> float:
        """Wall time of the whole batch of requests (the manager's start and warm-up excluded)."""
        with self.model.continuous_batching_context_manager(
                generation_config=self.generation, continuous_batching_config=self.config, block=True, timeout=30,
                warmup=not self.warm, persistent_manager=True) as manager:
            self.warm = True
            _sync()
            start = time.perf_counter()
            ids = [manager.add_request(list(prompt), max_new_tokens=n, eos_token_id=-1) for prompt, n in work]
            wanted = dict(zip(ids, (n for _, n in work)))
            done = collect_finished(manager, len(wanted), start, timeout_s)
            _sync()
            seconds = time.perf_counter() - start
        short = [rid for rid, out in done.items() if len(out.generated_tokens) < wanted[rid] or out.error is not None]
        if short:
            raise RuntimeError(f"transformers' continuous batching returned {len(short)} short or failed requests")
        return seconds

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()


def time_throughput(num_requests: int = 256, repetitions: int = 3, hf_batch: int = 64,
                    kv_cache_memory: str = "8GiB") -> dict:
    """Output tokens/s of the engine (CUDA graphs, and eager), of transformers' static batches and of its
    continuous batching on the same requests, interleaved."""
    model = llama_1b()
    work = _throughput_workload(num_requests)
    useful = sum(n for _, n in work)
    options = dict(device=DEVICE, kv_cache_memory=kv_cache_memory, max_num_seqs=256, max_num_batched_tokens=8192)
    llm = LLM(model, **options)
    eager = LLM(model, enforce_eager=True, **options)
    _ours_seconds(llm, work[:8])                                   # warm-up: kernel compilation
    _ours_seconds(eager, work[:8])
    _hf_static_seconds(model, work[:hf_batch // 8], hf_batch // 8)
    continuous = HFContinuous(model)
    rows: Dict[str, List[float]] = {"ours": [], "ours_eager": [], "hf_static": [], "hf_continuous": []}
    errors = {}
    try:
        continuous.seconds(work[:8])                               # its warm-up (CUDA graph capture)
    except Exception as exc:  # noqa: BLE001 - our figures still count without this baseline
        errors["hf_continuous"] = f"{type(exc).__name__}: {exc}"
    for _ in range(repetitions):
        rows["ours"].append(useful / _ours_seconds(llm, work))
        rows["ours_eager"].append(useful / _ours_seconds(eager, work))
        rows["hf_static"].append(useful / _hf_static_seconds(model, work, hf_batch))
        if "hf_continuous" not in errors:
            try:
                rows["hf_continuous"].append(useful / continuous.seconds(work))
            except Exception as exc:  # noqa: BLE001
                errors["hf_continuous"] = f"{type(exc).__name__}: {exc}"
    if "hf_continuous" not in errors:
        continuous.close()
    stats = llm.get_stats()

    def ratio(base: str) -> dict:
        values = [o / b for o, b in zip(rows["ours"], rows[base])]
        return {"median": statistics.median(values), "range": [min(values), max(values)]} if values else {}

    graphs = llm.engine.runner.graphs
    return {"model": "random Llama 1.1B (TinyLlama shape), bfloat16", "requests": num_requests,
            "useful_output_tokens": useful, "kv_cache_memory": kv_cache_memory, "hf_batch": hf_batch,
            "ours_tok_s": rows["ours"], "ours_eager_tok_s": rows["ours_eager"], "hf_static_tok_s": rows["hf_static"],
            "hf_continuous_tok_s": rows["hf_continuous"], "errors": errors,
            "ratio_median": ratio("hf_static").get("median"), "ratio_range": ratio("hf_static").get("range"),
            "vs_hf_continuous": ratio("hf_continuous"), "vs_ours_eager": ratio("ours_eager"),
            "preemptions": stats.num_preemptions, "kv_blocks": stats.num_blocks,
            "cuda_graphs": graphs.stats.as_dict() if graphs is not None else None}


def _values(values: List[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values) or "-"


def _ratio(ratio: Optional[dict]) -> str:
    if not ratio:
        return "-"
    return f"{ratio['median']:.2f}x ({ratio['range'][0]:.2f}-{ratio['range'][1]:.2f})"


def report_markdown(result: dict) -> str:
    lines = [f"# The engine on {result['device']}", ""] + _conditions(result)
    lines += ["## Greedy tokens against transformers on the same GPU (float32, TF32 off)", "",
              "| model | same tokens | note |", "| --- | --- | --- |"]
    for name, row in result.get("fidelity", {}).items():
        note = row.get("error", f"{row.get('prompts_same')}/{row.get('prompts')} prompts, kernels: {row.get('backend')}")
        if "first_divergence" in row:
            note += (f"; first divergence at {row['first_divergence']}; our PyTorch kernels on the GPU "
                     f"{'match' if row['reference_kernels_same_as_hf'] else 'differ from'} transformers and "
                     f"{'match' if row['reference_kernels_same_as_triton'] else 'differ from'} the Triton ones; "
                     f"transformers' eager attention {'matches' if row['hf_eager_same_as_hf'] else 'differs from'} "
                     f"its {row['hf_attention']}")
        lines.append(f"| {name} | {'yes' if row['same'] else 'NO'} | {note} |")
    features = result.get("features")
    if features:
        lines += ["", "## Features: default engine (CUDA graphs, overlap, device fill) against eager without "
                      "overlap, host fill",
                  "", f"| request | same outputs | same tokens | largest log-prob difference (tolerance "
                  f"{LOGPROB_TOLERANCE:g}) | error |", "| --- | --- | --- | --- | --- |"]
        for name, row in features.get("rows", {}).items():
            gap = row.get("logprob_gap")
            lines.append(f"| {name} | {'yes' if row['same'] else 'NO'} | {_yes(row.get('tokens_same'))} | "
                         f"{'-' if gap is None else f'{gap:.2g}'} | {row.get('error') or ''} |")
        if "rows" not in features:
            lines.append(f"| all | NO | {features.get('error')} |")
        lines += ["", f"Structured outputs {'checked' if features.get('structured') else 'not checked (no xgrammar)'}"
                      f"; decode steps replayed from CUDA graphs: {features.get('graph_replays', 0)}."]
    lora = result.get("lora")
    if lora:
        lines += ["", "## LoRA: the base model and two adapters in one batch against PEFT on the same device", "",
                  f"Same greedy tokens: {lora.get('adapters_same', 'NO')}; error: {lora.get('error') or 'none'}."]
    lines += ["", "## Mixed requests under memory pressure (20 blocks of 16) against each request alone", "",
              "| preemption | same outputs | preemptions | free blocks after |", "| --- | --- | --- | --- |"]
    for mode, row in result.get("pressure", {}).items():
        if "error" in row:
            lines.append(f"| {mode} | NO | {row['error']} | |")
        else:
            failed = f", {row['num_errors']} FAILED: {row['errors'][:1]}" if row.get("num_errors") else ""
            lines.append(f"| {mode} | {row['requests_same']}/{row['requests']}{failed} | {row['preemptions']} | "
                         f"{row['free_blocks_after']}/{row['blocks']} |")
    for mode, row in result.get("pressure", {}).items():
        if row.get("differing"):
            lines += ["", f"{mode}: requests that differ (kind, [completion, first differing token]): " + "; ".join(
                f"{d['request']} ({d['kind']}, {d['first_difference']})" for d in row["differing"])]
        if "eager_requests_same" in row:
            lines.append(f"{mode} again, requests the same of {row['requests']}: eager {row['eager_requests_same']}, "
                         f"without overlap {row['no_overlap_requests_same']}, host fill "
                         f"{row['host_fill_requests_same']}, eager without overlap with the host fill "
                         f"{row['eager_no_overlap_requests_same']}; the requests alone, eager without overlap with "
                         f"the host fill, the same as alone by default: {row['alone_eager_no_overlap_same']}.")
    tp = result.get("throughput")
    if tp and "error" not in tp:
        lines += ["", f"## Throughput: {tp['model']}, {tp['requests']} requests", "",
                  "| system | output tok/s (per repetition) |", "| --- | --- |",
                  f"| paged-backend (CUDA graphs) | {_values(tp['ours_tok_s'])} |",
                  f"| paged-backend, enforce_eager | {_values(tp.get('ours_eager_tok_s', []))} |",
                  f"| transformers generate, static batches of {tp['hf_batch']} | {_values(tp['hf_static_tok_s'])} |",
                  f"| transformers continuous batching | {_values(tp.get('hf_continuous_tok_s', []))} |", "",
                  f"Ours / static batches (median of interleaved repetitions): {tp['ratio_median']:.2f}x "
                  f"(range {tp['ratio_range'][0]:.2f}-{tp['ratio_range'][1]:.2f}); "
                  f"/ continuous batching: {_ratio(tp.get('vs_hf_continuous'))}; / ours eager: "
                  f"{_ratio(tp.get('vs_ours_eager'))}; {tp['preemptions']} preemptions, {tp['kv_blocks']} KV blocks; "
                  f"errors: {tp.get('errors') or 'none'}; CUDA graphs: {tp.get('cuda_graphs')}."]
    elif tp:
        lines += ["", f"## Throughput: FAILED: {tp['error']}"]
    return "\n".join(lines) + "\n"


def _conditions(result: dict) -> List[str]:
    """The record's commit, machine and versions as the report's first line (with the device's torch build)."""
    if "conditions" not in result:
        return []
    return [conditions_line(result["conditions"]) + f"; device {result['device']}, torch {result.get('torch')}", ""]


def _yes(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:
        return {"same": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="folder for gpu_engine.json and gpu_engine.md")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--only-throughput", action="store_true", help="the throughput timing alone (no checks)")
    parser.add_argument("--throughput-requests", type=int, default=256,
                        help="requests of the throughput workload (the first N of its 256)")
    parser.add_argument("--presets", default=",".join(TINY_PRESETS), help="tiny presets of the fidelity check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_engine needs a CUDA GPU (none found); nothing was run.", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {"conditions": conditions(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "fidelity": {}, "pressure": {}}

    def save() -> str:   # after every part: a part that runs out of time leaves the earlier ones written
        result["conditions"].update(finished=now(), load_average_after=load_average())
        report = report_markdown(result)
        if args.output:
            folder = Path(args.output)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "gpu_engine.json").write_text(json.dumps(result, indent=2))
            (folder / "gpu_engine.md").write_text(report)
        return report

    if not args.only_throughput:
        result["fidelity"] = check_fidelity([p for p in args.presets.split(",") if p])
        save()
        result["features"] = _guarded(check_features)
        print(f"features: {result['features']}", flush=True)
        save()
        with tempfile.TemporaryDirectory() as folder:
            result["lora"] = _guarded(check_lora, Path(folder))
        print(f"lora: {result['lora']}", flush=True)
        save()
        for mode in ("swap", "recompute"):
            result["pressure"][mode] = _guarded(check_pressure, mode)
            save()
        print(f"pressure: {result['pressure']}", flush=True)
    if args.only_throughput or not args.skip_throughput:
        result["throughput"] = _guarded(time_throughput, args.throughput_requests)
        print(f"throughput: {result['throughput']}", flush=True)
    print(save())
    failed = [n for n, r in result["fidelity"].items() if not r["same"]]
    failed += [m for m, r in result["pressure"].items() if not r["same"]]
    failed += [k for k in ("features", "lora") if k in result and not result[k]["same"]]
    return 1 if failed or "error" in result.get("throughput", {}) else 0

if __name__ == "__main__":
    sys.exit(main())
