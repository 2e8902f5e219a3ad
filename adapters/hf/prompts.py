"""The prompt side of `generate`: `input_ids` / `attention_mask` as transformers accepts them, turned into
one unpadded token list per row (left padding stripped with the mask; right padding refused)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from transformers import GenerationConfig


@dataclass
class PromptBatch:
    """The prompts of one call: the ids exactly as passed (for the output) and each row without padding."""

    input_ids: torch.Tensor       # [batch, padded_len], as passed (device kept)
    prompts: List[List[int]]      # per row, the tokens the attention mask keeps

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_len(self) -> int:
        return int(self.input_ids.shape[1])


def _input_ids(inputs: Optional[torch.Tensor], model_kwargs: Dict[str, Any], bos_token_id) -> torch.Tensor:
    kwarg = model_kwargs.pop("input_ids", None)
    if kwarg is not None and inputs is not None:
        raise ValueError("`inputs` were passed alongside `input_ids`, which is not allowed: pass one of them")
    ids = inputs if inputs is not None else kwarg
    if ids is None:  # transformers starts from BOS, one row per row of any other tensor argument
        if bos_token_id is None:
            raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
        mask = model_kwargs.get("attention_mask")
        batch = mask.shape[0] if isinstance(mask, torch.Tensor) else 1
        return torch.full((batch, 1), int(bos_token_id), dtype=torch.long)
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be a 2-D integer tensor [batch, sequence], got {tuple(ids.shape)} "
                         f"of {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(ids.shape)})")
    return ids


def _attention_mask(ids: torch.Tensor, mask: Optional[torch.Tensor], eos_ids: Optional[List[int]],
                    pad_id: Optional[int]) -> torch.Tensor:
    if mask is None:
        # transformers infers a mask from pad tokens only when the pad token is not also an EOS token
        if pad_id is not None and bool((ids == pad_id).any()) and pad_id not in (eos_ids or []):
            return (ids != pad_id).long()
        return torch.ones_like(ids, dtype=torch.long)
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError("`attention_mask` passed to `generate` must be 2D.")
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(ids.shape)}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must contain only 0 and 1")
    return mask.long()


def _strip(ids: torch.Tensor, mask: torch.Tensor) -> List[List[int]]:
    prompts = []
    for row, (tokens, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
        if 1 not in keep:
            raise ValueError(f"row {row} of the batch is empty: its attention_mask has no 1")
        first = keep.index(1)
        if 0 in keep[first:]:
            raise ValueError(f"row {row} of attention_mask has a 0 after a 1: right padding (or a gap) is not "
                             f"supported by a decoder-only model; pad on the left "
                             f"(tokenizer.padding_side = 'left')")
        prompts.append(tokens[first:])
    return prompts


def prepare_prompts(inputs: Optional[torch.Tensor], model_kwargs: Dict[str, Any], config: GenerationConfig,
                    eos_ids: Optional[List[int]], pad_id: Optional[int]) -> PromptBatch:
    """The call's prompts; pops `input_ids` and `attention_mask` from `model_kwargs`."""
    ids = _input_ids(inputs, model_kwargs, config.bos_token_id)
    mask = _attention_mask(ids, model_kwargs.pop("attention_mask", None), eos_ids, pad_id)
    cpu_ids = ids.detach().to("cpu", torch.long)
    prompts = _strip(cpu_ids, mask.detach().cpu())
    return PromptBatch(ids, prompts)
