"""Tiny LoRA adapters made by `peft` for the tests (no downloads), and PEFT's own models over them.

Each family gets three adapters with different ranks, alphas and target modules (one rsLoRA), all with
non-zero B (`init_lora_weights=False`: PEFT's default B is zero, an adapter that changes nothing). They are
written with `save_pretrained` as PEFT directories and read back by the engine from disk.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from conftest import get_model

# family -> three LoraConfig keyword sets (different ranks and targets)
ADAPTER_SPECS: Dict[str, List[dict]] = {
    "tiny-llama": [
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
        dict(r=4, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
             use_rslora=True),
        dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    ],
    "tiny-opt": [
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
        dict(r=4, lora_alpha=16, target_modules=["out_proj", "fc1", "fc2"], use_rslora=True),
        dict(r=8, lora_alpha=8, target_modules=["k_proj", "q_proj", "fc2"]),
    ],
    "tiny-gpt-neox": [
        dict(r=2, lora_alpha=4, target_modules=["query_key_value"]),
        dict(r=4, lora_alpha=16, target_modules=["dense", "dense_h_to_4h"], use_rslora=True),
        dict(r=8, lora_alpha=8, target_modules=["dense_4h_to_h", "query_key_value"]),
    ],
    "tiny-gpt2": [  # GPT-2's Conv1D layers (PEFT's fan_in_fan_out)
        dict(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True),
        dict(r=4, lora_alpha=16, target_modules=["c_proj", "c_fc"], fan_in_fan_out=True, use_rslora=True),
        dict(r=8, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
    ],
}
FAMILIES = ("tiny-llama", "tiny-opt", "tiny-gpt-neox")


def make_adapter(family: str, spec: dict, directory: Path, seed: int) -> Path:
    """A PEFT adapter with random, non-zero A and B for `family`, saved (float32) in `directory`."""
    from peft import LoraConfig, get_peft_model

    base, _ = get_model(family, torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **spec))
    peft_model.save_pretrained(str(directory))
    return directory


_ROOTS: Dict[str, Path] = {}


def adapter_dirs(family: str, root: Path) -> List[Path]:
    """The family's three adapters under `root` (made once per test session)."""
    if family not in _ROOTS:
        folder = root / family
        for i, spec in enumerate(ADAPTER_SPECS[family]):
            make_adapter(family, spec, folder / f"adapter{i}", seed=1000 + 17 * i)
        _ROOTS[family] = folder
    return sorted(p for p in _ROOTS[family].iterdir() if p.is_dir())


@lru_cache(maxsize=None)
def peft_model(family: str, dtype: torch.dtype, directory: str):
    """PEFT's model for one adapter over a copy of the base model (the reference)."""
    from peft import PeftModel

    base, _ = get_model(family, dtype)
    return PeftModel.from_pretrained(copy.deepcopy(base), directory).eval()


def peft_greedy(family: str, dtype: torch.dtype, directory, prompt_ids: List[int], max_tokens: int) -> List[int]:
    """PEFT's greedy continuation (exactly `max_tokens` long), or the base model's when `directory` is None."""
    return list(_peft_greedy(family, dtype, None if directory is None else str(directory), tuple(prompt_ids),
                             max_tokens))


@lru_cache(maxsize=None)
def _peft_greedy(family: str, dtype: torch.dtype, directory, prompt_ids: Tuple[int, ...], max_tokens: int):
    model = get_model(family, dtype)[0] if directory is None else peft_model(family, dtype, str(directory))
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    return tuple(out[0, len(prompt_ids):].tolist())


def peft_beams(family: str, dtype: torch.dtype, directory, prompt_ids: List[int], width: int,
               max_tokens: int, eos: int = 2) -> Tuple[List[List[int]], List[float]]:
    """PEFT's beam search (all `width` beams returned, cut after EOS) and their scores."""
    rows, scores = _peft_beams(family, dtype, None if directory is None else str(directory), tuple(prompt_ids),
                               width, max_tokens, eos)
    return [list(r) for r in rows], list(scores)


@lru_cache(maxsize=None)
def _peft_beams(family: str, dtype: torch.dtype, directory, prompt_ids: Tuple[int, ...], width: int,
                max_tokens: int, eos: int):
    model = get_model(family, dtype)[0] if directory is None else peft_model(family, dtype, str(directory))
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                         output_scores=True, return_dict_in_generate=True)
    rows = []
    for row in out.sequences[:, len(prompt_ids):].tolist():
        rows.append(tuple(row[: row.index(eos) + 1] if eos in row else row))
    return tuple(rows), tuple(out.sequences_scores.tolist())
