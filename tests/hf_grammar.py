"""transformers' beam search under a structured-output grammar, as the reference for the engine's: the same
mask through a logits processor, and its finished hypotheses less the placeholders it pads them with."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from paged_backend.structured.matcher import GrammarState

# A real hypothesis of transformers scores above this; its placeholder beams carry -1e9 (or -inf) in their score.
PLACEHOLDER = -1.0e6


class GrammarMask(LogitsProcessor):
    """Each beam's allowed tokens from a fresh matcher that replays its generated tokens; a beam the grammar
    refuses (or that already ended with EOS) allows nothing."""

    def __init__(self, state: GrammarState, prompt_len: int) -> None:
        self.constraint = state.constraint
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(scores, float("-inf"))
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            state = GrammarState(self.constraint)
            try:
                state.rebuild(ids)
                allowed = state.allowed_token_ids()
            except ValueError:  # a placeholder beam: its tokens left the grammar, or it is terminated
                continue
            mask[row, allowed] = 0.0
        return scores + mask


def hf_real_hypotheses(model, prompt_ids: Sequence[int], params, state: GrammarState,
                       eos: int) -> List[Tuple[List[int], float]]:
    """transformers' finished hypotheses with the grammar mask, placeholders left out: (tokens up to EOS, score)."""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=params.beam_width,
                         num_return_sequences=params.n, do_sample=False, length_penalty=params.length_penalty,
                         early_stopping=params.early_stopping, max_new_tokens=params.max_tokens,
                         eos_token_id=eos, pad_token_id=eos, output_scores=True, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([GrammarMask(state, len(prompt_ids))]))
    real = []
    for row, score in zip(out.sequences[:, len(prompt_ids):].tolist(), out.sequences_scores.tolist()):
        if score > PLACEHOLDER:
            real.append((row[: row.index(eos) + 1] if eos in row else row, score))
    return real
