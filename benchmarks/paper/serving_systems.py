"""The servers the serving benchmark compares, all on the same weights, precision and threads: our engine
(`paged-backend serve`), transformers' own server with continuous batching (`transformers serve
--continuous-batching`), the reservation baseline behind our HTTP app (those three on the same KV budget) and
llama.cpp's `llama-server` on a GGUF of the same weights (its slots each hold a whole request's context); each with
the request fields that force its output length (ours and llama.cpp take `ignore_eos`; transformers rejects it and
takes a `generation_config`)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Pattern

from paged_backend.adapters.ports import free_port
from paged_backend.benchmarks.harness.server_process import OUR_READY, UVICORN_READY
from paged_backend.worker.child_python import python_command

SERVED_SYSTEMS = ("paged", "hf-serve", "oracle")
COMPILED = "paged-compiled"    # our server with the compiled forward (`--compile blocking`, docs/compilation.md)
LLAMA_CPP_SYSTEMS = ("llama.cpp", "llama.cpp-f16")
LABELS = {"paged": "paged-backend serve", COMPILED: "paged-backend serve --compile",
          "hf-serve": "transformers serve --continuous-batching",
          "oracle": "reservation baseline (oracle)", "llama.cpp": "llama.cpp llama-server, GGUF of equal precision",
          "llama.cpp-f16": "llama.cpp llama-server, f16 GGUF"}
# our dtype -> the GGUF (weights and KV cache) of equal precision; llama.cpp-f16 pairs f16 with a 16-bit dtype
EQUAL_GGUF = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
LLAMA_READY = re.compile(r"listening on (http://\S+)")    # printed once the model is loaded
_TRANSFORMERS_CLI = ("import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; "
                     "sys.exit(main())")


@dataclass
class ServedSystem:
    """How to start one server and what each request adds to force `n` output tokens, greedily."""

    name: str
    argv: List[str]
    ready_pattern: Pattern
    force_length: Callable[[int], dict]
    env: Dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 300.0   # how long its start may take (a first compiled start compiles every bucket)

    @property
    def label(self) -> str:
        return LABELS.get(self.name, self.name)


def served_model_dir(model: str) -> Path:
    """A Hugging Face directory holding `model`'s weights and tokenizer, which every server loads: the smollm2
    conversion in the loader's cache, or a tiny preset saved there once (its random weights are seeded)."""
    from paged_backend.worker.loader import TINY_PRESETS, _smollm2_model_dir, cache_dir, load_model

    if model == "smollm2":
        return _smollm2_model_dir()
    if model in TINY_PRESETS:
        target = cache_dir() / "bench-models" / model
        if not (target / "config.json").exists():
            module, tokenizer = load_model(model)
            _save_atomically(target, lambda folder: (module.save_pretrained(folder), tokenizer.save_pretrained(folder)))
        return target
    path = Path(model)
    if not (path / "config.json").exists():
        raise ValueError(f"{model!r} is neither a preset nor a Hugging Face model directory")
    return path


def _save_atomically(target: Path, save: Callable[[Path], object]) -> None:
    """Write a folder under a temporary name and rename it, so a reader never sees half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; left over after a lost race


def _ours_force(n: int) -> dict:
    return {"temperature": 0.0, "ignore_eos": True}


def _transformers_force(n: int) -> dict:
    # transformers serve answers 422 to `ignore_eos`, and its continuous batching ignores `min_new_tokens` (a
    # request still ends at EOS); a generation_config whose eos_token_id is -1 (no token) forces the length.
    return {"temperature": 0.0,
            "generation_config": json.dumps({"do_sample": False, "max_new_tokens": n, "eos_token_id": -1})}


def _context_limit(max_model_len: Optional[int]) -> List[str]:
    return [] if max_model_len is None else ["--max-model-len", str(max_model_len)]


def paged_system(model_dir: Path, kv_slots: int, block_size: int, max_model_len: Optional[int], dtype: str,
                 compiled: bool = False) -> ServedSystem:
    """Our server; `compiled`: with the compiled forward, compiled (or read from inductor's cache) before it
    listens, so every measured step runs compiled code. No host swap pool: the KV budget is all the memory its
    requests' states get (on a CPU the engine would otherwise swap preempted requests into more of the same RAM)."""
    argv = [*python_command(), "-m", "paged_backend.cli", "serve", str(model_dir), "--port", "0", "--log-level",
            "warning", "--block-size", str(block_size), "--num-blocks", str(kv_slots // block_size),
            "--swap-space", "0", "--dtype", dtype, *_context_limit(max_model_len),
            *(["--compile", "blocking"] if compiled else [])]
    # a first compiled start compiles every batch bucket before it listens: 160-170 s alone on a quiet 2-core
    # Xeon, over 300 s on a slower one while the other servers load beside it
    return ServedSystem(COMPILED if compiled else "paged", argv, OUR_READY, _ours_force,
                        ready_timeout_s=1800.0 if compiled else 300.0)


def reservation_system(model_dir: Path, policy: str, kv_slots: int, max_model_len: Optional[int],
                       dtype: str) -> ServedSystem:
    argv = [*python_command(), "-m", "paged_backend.benchmarks.paper.baseline_server", str(model_dir), "--policy", policy,
            "--allocator", "first-fit", "--block-size", "1", "--num-blocks", str(kv_slots), "--dtype", dtype,
            *_context_limit(max_model_len)]
    return ServedSystem(policy, argv, OUR_READY, _ours_force)


def transformers_system(model_dir: Path, kv_slots: int, block_size: int, max_batch_tokens: int,
                        dtype: str) -> ServedSystem:
    """`transformers serve MODEL --continuous-batching` with a paged cache of the same slots (blocks of the same
    size) and the same per-step token budget as our engine."""
    argv = [*python_command(), "-c", _TRANSFORMERS_CLI, "serve", str(model_dir), "--continuous-batching",
            "--cb-block-size", str(block_size), "--cb-num-blocks", str(kv_slots // block_size),
            "--cb-max-batch-tokens", str(max_batch_tokens), "--device", "cpu", "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(free_port())]
    return ServedSystem("hf-serve", argv, UVICORN_READY, _transformers_force, {"HF_HUB_OFFLINE": "1"})


def gguf_type(system: str, dtype: str) -> str:
    """The GGUF precision a llama.cpp system serves beside our server at `dtype`; refuses unequal pairs."""
    if dtype not in EQUAL_GGUF:
        raise ValueError(f"llama.cpp has no GGUF of {dtype}; its systems run beside {', '.join(EQUAL_GGUF)}")
    if system == "llama.cpp-f16" and dtype == "float32":
        raise ValueError("llama.cpp-f16 is a half-precision peer: run it with --dtype bfloat16 or float16")
    return "f16" if system == "llama.cpp-f16" else EQUAL_GGUF[dtype]


def llama_slot_context(prompt_tokens: int, output_tokens: int, max_model_len: Optional[int]) -> int:
    """Tokens of context per llama.cpp slot: the context limit if one is set, else a whole request with room for
    tokenizer differences, in multiples of 256."""
    if max_model_len is not None:
        return max_model_len
    return -(-(prompt_tokens + output_tokens + 64) // 256) * 256


def llama_cpp_system(name: str, server: Path, gguf: Path, kv_type: str, threads: int, slots: int,
                     slot_context: int, alias: str) -> ServedSystem:
    """`llama-server` on 127.0.0.1 (a port of its own choosing) with `slots` parallel slots of `slot_context`
    tokens each (continuous batching across slots), `threads` threads for decode and prompt batches, and a KV
    cache of `kv_type` (equal to the weights' precision)."""
    argv = [str(server), "--model", str(gguf), "--alias", alias, "--host", "127.0.0.1", "--port", "0",
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(slots * slot_context), "--no-kv-unified", "--cont-batching",
            "--cache-type-k", kv_type, "--cache-type-v", kv_type, "--no-webui"]
    return ServedSystem(name, argv, LLAMA_READY, _ours_force)
