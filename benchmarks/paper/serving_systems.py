"""The servers the serving benchmark compares, all on the same weights, KV budget and threads: our engine
(`paged-backend serve`), transformers' own server with continuous batching (`transformers serve
--continuous-batching`) and the reservation baseline behind our HTTP app; each with the request fields that
force its output length (ours take `ignore_eos`; transformers rejects it and takes a `generation_config`)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Pattern

from paged_backend.benchmarks.harness.server_process import OUR_READY, UVICORN_READY, free_port

SERVED_SYSTEMS = ("paged", "hf-serve", "oracle")
LABELS = {"paged": "paged-backend serve", "hf-serve": "transformers serve --continuous-batching",
          "oracle": "reservation baseline (oracle)"}
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


def paged_system(model_dir: Path, kv_slots: int, block_size: int, max_model_len: Optional[int], dtype: str) -> ServedSystem:
    argv = [sys.executable, "-m", "paged_backend.cli", "serve", str(model_dir), "--port", "0", "--log-level",
            "warning", "--block-size", str(block_size), "--num-blocks", str(kv_slots // block_size),
            "--dtype", dtype, *_context_limit(max_model_len)]
    return ServedSystem("paged", argv, OUR_READY, _ours_force)


def reservation_system(model_dir: Path, policy: str, kv_slots: int, max_model_len: Optional[int],
                       dtype: str) -> ServedSystem:
    argv = [sys.executable, "-m", "paged_backend.benchmarks.paper.baseline_server", str(model_dir), "--policy", policy,
            "--allocator", "first-fit", "--block-size", "1", "--num-blocks", str(kv_slots), "--dtype", dtype,
            *_context_limit(max_model_len)]
    return ServedSystem(policy, argv, OUR_READY, _ours_force)


def transformers_system(model_dir: Path, kv_slots: int, block_size: int, max_batch_tokens: int,
                        dtype: str) -> ServedSystem:
    """`transformers serve MODEL --continuous-batching` with a paged cache of the same slots (blocks of the same
    size) and the same per-step token budget as our engine."""
    argv = [sys.executable, "-c", _TRANSFORMERS_CLI, "serve", str(model_dir), "--continuous-batching",
            "--cb-block-size", str(block_size), "--cb-num-blocks", str(kv_slots // block_size),
            "--cb-max-batch-tokens", str(max_batch_tokens), "--device", "cpu", "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(free_port())]
    return ServedSystem("hf-serve", argv, UVICORN_READY, _transformers_force, {"HF_HUB_OFFLINE": "1"})
