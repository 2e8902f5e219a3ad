"""`paged-backend` command line: info, generate, serve, bench, triton-repo, triton-serve."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Dict, List, Optional

from paged_backend.config import COMPILE_MODES, KV_CACHE_DTYPES

# Subcommands that live with their front (adapters, benchmarks): module with add_parser(sub) and run(args).
EXTERNAL_COMMANDS: Dict[str, str] = {
    "serve": "paged_backend.adapters.http.cli",
    "triton-repo": "paged_backend.adapters.triton.cli",
    "triton-backend": "paged_backend.adapters.triton.cli",
    "triton-serve": "paged_backend.adapters.triton.cli",
    "bench": "paged_backend.benchmarks.cli",
}

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64", "fp64": "float64"}


def dtype_name(name: str) -> str:
    """The canonical name of a dtype option (`fp32` -> `float32`); argparse reports an unknown one."""
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; use one of {sorted(set(DTYPES.values()))}")
    return DTYPES[name]


def parse_dtype(name: str):
    import torch

    return getattr(torch, dtype_name(name))


def speculative_config(text: str) -> dict:
    """`--speculative-config`: a JSON object of `SpeculativeConfig` fields, checked here (argparse reports why
    it is refused)."""
    import json

    from paged_backend.config import SpeculativeConfig

    try:
        value = json.loads(text)
        SpeculativeConfig.of(value)
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"not a speculative config: {exc}") from None
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that builds an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="float32", type=dtype_name,
                       help="model dtype (float32, float16, bfloat16, float64)")
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--num-blocks", type=int, default=None, help="device KV blocks (instead of --kv-cache-memory)")
    group.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 512MiB (default: share of free memory)")
    group.add_argument("--swap-space", default=None,
                       help="host swap space for preempted requests, e.g. 1GiB; 0: none, they recompute (default: as "
                            "many blocks as the device's, at most 1 GiB)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="what the KV cache stores: the model's dtype (auto), a 16-bit float or fp8")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences per step (default 256, or the token budget if smaller)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    group.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    group.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                       help="how preempted requests give back their blocks (default: swap on a CPU device, where it "
                            "is a copy within memory; elsewhere recompute one-sequence requests and swap the others)")
    group.add_argument("--admission-backoff-steps", type=int, default=None,
                       help="after a preemption, admit a new request only with room for the running ones to grow "
                            "to their max_tokens, a caution that fades over this many steps (default: 512 on a CPU "
                            "device, 0 elsewhere; 0: admit whenever a request's tokens fit, as vLLM)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="share cached prompt prefixes, and let recomputed requests find their own blocks "
                            "(default: on, as in vLLM v1)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks to shard the model over")
    group.add_argument("--compile", nargs="?", const="background", default="off", choices=COMPILE_MODES,
                       help="run the model forward compiled by torch.compile (inductor), per shape bucket: "
                            "`--compile` compiles in the background while steps run eagerly, `--compile blocking` "
                            "before serving; compiled code is cached on disk (default: off)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule the next step and prepare its inputs while the model runs the current one "
                            "(vLLM's name; default: the engine's, on)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="on a CUDA device, run decode steps eagerly instead of replaying CUDA graphs (vLLM's "
                            "name; no effect on the CPU)")
    group.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                       help="speculative decoding (vLLM's): a JSON object such as "
                            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (docs/speculative.md)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters chosen per request")
    group.add_argument("--max-loras", type=int, default=1, help="LoRA adapters on the device at once (default 1)")
    group.add_argument("--max-lora-rank", type=int, default=16, help="the highest adapter rank accepted (default 16)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="LoRA adapters kept loaded on the host (default: --max-loras)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for LLM / LLMEngine / AsyncLLMEngine from parsed engine options."""
    return dict(dtype=parse_dtype(args.dtype), device=args.device, block_size=args.block_size,
                num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory, swap_space=args.swap_space,
                kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
                admission_backoff_steps=args.admission_backoff_steps,
                enable_prefix_caching=args.enable_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size, compile=args.compile,
                enforce_eager=args.enforce_eager, seed=args.seed, enable_lora=args.enable_lora,
                max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
                **({} if args.speculative_config is None else {"speculative_config": args.speculative_config}))


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="architecture, size, attention kind per layer group and KV cache cost of a model")
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--dtype", default="float32", type=dtype_name)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.set_defaults(func=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    from paged_backend.worker.model_info import model_info

    print(model_info(args.model, parse_dtype(args.dtype), args.block_size, args.kv_cache_memory))
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts and print the KV stats")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--beam-width", type=int, default=1)
    p.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from paged_backend import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, beam_width=args.beam_width, seed=args.request_seed)
    llm = LLM(args.model, **engine_kwargs(args))
    for out in llm.generate(args.prompts, params):
        print(f"### {out.prompt!r}")
        for c in out.outputs:
            print(f"[{c.index}] ({c.finish_reason}, {len(c.token_ids)} tokens) {c.text!r}")
    print(format_stats(llm.get_stats()))
    return 0


def format_stats(stats) -> str:
    return (f"KV cache: {stats.num_blocks} blocks of {stats.block_size} tokens, "
            f"{stats.num_free_blocks} free; swap {stats.num_free_swap_blocks}/{stats.num_swap_blocks} free; "
            f"preemptions {stats.num_preemptions}; copy-on-write {stats.num_copy_on_write}; "
            f"steps {stats.num_steps}; prompt tokens {stats.num_prompt_tokens}; "
            f"generated tokens {stats.num_generated_tokens}")


def _external(name: str) -> Optional[Callable]:
    try:
        return importlib.import_module(EXTERNAL_COMMANDS[name])
    except ImportError as exc:
        missing = getattr(exc, "name", "") or ""
        if missing and EXTERNAL_COMMANDS[name].startswith(missing):
            return None
        raise


def build_parser(argv: List[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_info(sub)
    _add_generate(sub)
    wanted = argv[0] if argv else None
    for name, module_name in EXTERNAL_COMMANDS.items():
        if wanted not in (None, name, "-h", "--help"):
            continue
        module = _external(name)
        if module is not None:
            module.add_parser(sub, name)
    return parser


def _join_torchrun_workers() -> None:
    """Under a multi-rank torchrun launch, ranks other than 0 serve as tensor-parallel workers and exit there."""
    if os.environ.get("RANK", "0") != "0" and int(os.environ.get("WORLD_SIZE") or 1) > 1:
        from paged_backend.worker.tp_runner import maybe_run_worker_loop

        maybe_run_worker_loop()


def main(argv: Optional[List[str]] = None) -> int:
    _join_torchrun_workers()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"paged-backend: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
