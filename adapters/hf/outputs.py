"""What `generate` returns, built the way transformers 5.x builds it: the sequences tensor (prompt as
passed, then generated tokens, finished rows padded) and, with `return_dict_in_generate=True`,
`GenerateDecoderOnlyOutput` / `GenerateBeamDecoderOnlyOutput` with transformers' shapes and dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

_BIG_NEGATIVE = -1.0e9  # transformers' score of a beam slot that never received a finished hypothesis
UNMATCHED_ROWS_WARNING = (
    "paged backend: some score/logit rows belong to sequences (or beam searches) that had already finished; "
    "transformers fills them by running the model on padding, the paged engine does not run finished sequences, "
    "so those rows are -inf here (see docs/hf.md)")


@dataclass
class OutputOptions:
    """Which optional fields the caller asked for."""

    return_dict: bool
    output_scores: bool
    output_logits: bool

    @property
    def records(self) -> bool:
        """The engine must keep per-token scores (and raw logits)."""
        return self.return_dict and (self.output_scores or self.output_logits)


def neg_inf_rows(rows: int, vocab: int, device) -> torch.Tensor:
    return torch.full((rows, vocab), float("-inf"), dtype=torch.float32, device=device)


def expanded_prompt(input_ids: torch.Tensor, copies: int) -> torch.Tensor:
    """The prompt rows as transformers expands them: `[b0, b0, ..., b1, ...]`, as int64."""
    ids = input_ids.to(torch.long)
    return ids.repeat_interleave(copies, dim=0) if copies > 1 else ids


def decoder_only_output(sequences: torch.Tensor, options: OutputOptions, step_scores: Sequence[torch.Tensor],
                        step_logits: Sequence[torch.Tensor]):
    """Greedy / sampling result: the tensor, or `GenerateDecoderOnlyOutput`."""
    if not options.return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(step_scores) if options.output_scores else None,
        logits=tuple(step_logits) if options.output_logits else None,
        attentions=None, hidden_states=None, cache=None)


@dataclass
class BeamResult:
    """One returned hypothesis of a beam search (engine output of one request)."""

    token_ids: List[int]
    score: float
    beam_indices: List[int]   # live beam (0..num_beams-1) extended at each step


def beam_fill_value(pad_id: Optional[int], eos_ids: Optional[List[int]]) -> int:
    """transformers' `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1` (note: a pad id of 0
    counts as unset there, and without EOS the fill is -1 even when a pad id is given)."""
    if eos_ids is None:
        return -1
    return pad_id if pad_id else eos_ids[0]


def _per_step_rows(per_request: List[Optional[List[torch.Tensor]]], num_beams: int, device) -> Tuple[List, bool]:
    """Stack each step's `[num_beams, vocab]` rows of every request (first step tiled, as transformers runs
    the prompt once per beam); requests whose search ended earlier get -inf rows."""
    steps = max(len(r) for r in per_request)
    vocab = next(r[0].shape[-1] for r in per_request if r)
    filled = False
    out = []
    for t in range(steps):
        blocks = []
        for rows in per_request:
            if t < len(rows):
                block = rows[t]
                blocks.append(block.expand(num_beams, -1) if block.shape[0] == 1 else block)
            else:
                blocks.append(neg_inf_rows(num_beams, vocab, device))
                filled = True
        out.append(torch.cat([b.to(device) for b in blocks], dim=0))
    return out, filled


def beam_output(input_ids: torch.Tensor, results: List[List[BeamResult]], num_beams: int, num_return: int,
                fill: int, options: OutputOptions, step_scores: List[Optional[List[torch.Tensor]]],
                step_logits: List[Optional[List[torch.Tensor]]]):
    """Beam search result (the tensor, or `GenerateBeamDecoderOnlyOutput`) and whether some score rows had
    to be left blank (prompts whose search ended before the others)."""
    device = input_ids.device
    prompt = expanded_prompt(input_ids, num_return)
    rows, indices, scores = [], [], []
    for b, hyps in enumerate(results):
        for s in range(num_return):
            hyp = hyps[s] if s < len(hyps) else BeamResult([], _BIG_NEGATIVE, [])
            rows.append(hyp.token_ids)
            indices.append([b * num_beams + i for i in hyp.beam_indices])
            scores.append(hyp.score)
    width = max(len(r) for r in rows)
    generated = torch.full((len(rows), width), fill, dtype=torch.long)
    beam_indices = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, (tokens, path) in enumerate(zip(rows, indices)):
        generated[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        beam_indices[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
    sequences = torch.cat([prompt, generated.to(device)], dim=1)
    if not options.return_dict:
        return sequences, False
    all_scores = all_logits = None
    filled = False
    if options.output_scores:
        all_scores, filled = _per_step_rows(step_scores, num_beams, device)
    if options.output_logits:
        all_logits, filled_logits = _per_step_rows(step_logits, num_beams, device)
        filled = filled or filled_logits
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=torch.tensor(scores, dtype=torch.float32, device=device) if options.output_scores else None,
        scores=tuple(all_scores) if all_scores is not None else None,
        logits=tuple(all_logits) if all_logits is not None else None,
        beam_indices=beam_indices.to(device), attentions=None, hidden_states=None, cache=None), filled
