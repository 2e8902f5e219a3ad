"""Logits -> next tokens for a whole step at once.

Order of processing follows Hugging Face's logits processors: penalties and min-tokens masking,
then temperature, top-k, top-p, min-p. Logits are handled in float32 (as transformers' `generate`
does), so greedy and beam decisions match it. Rows with a `seed` draw from their own generator, so a
seeded request gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .logits_processors import ProcessorRow, apply_logits_processors
from .structured_matcher import GrammarMasker
from .sampling_params import SamplingParams
from .sequence import Sequence

NEG_INF = float("-inf")


@dataclass
class SampleRequest:
    """One logits row to sample from."""

    params: SamplingParams
    seq: Sequence
    num_samples: int = 1
    generator: Optional[torch.Generator] = None
    blocked_ids: List[int] = field(default_factory=list)  # masked while fewer than min_tokens were generated


@dataclass
class SampleResult:
    token_ids: List[int]
    logprobs: List[float]
    top_logprobs: Optional[List[Dict[int, float]]] = None
    scores: Optional[torch.Tensor] = None   # processed scores of the row (output_scores)
    logits: Optional[torch.Tensor] = None   # raw logits of the row (output_scores)


def apply_penalties(logits: torch.Tensor, requests: List[SampleRequest],
                    masker: Optional[GrammarMasker] = None) -> torch.Tensor:
    """Repetition (HF: over prompt and output), presence and frequency (over output) penalties,
    min-tokens masking, the request's own logits processors, then its structured-output grammar mask,
    in place on float32 rows."""
    for i, req in enumerate(requests):
        p = req.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(req.seq.token_ids, device=logits.device, dtype=torch.long)
            picked = logits[i].gather(0, ids)
            picked = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
            logits[i].scatter_(0, ids, picked)
        if (p.presence_penalty or p.frequency_penalty) and req.seq.num_output_tokens:
            ids = torch.tensor(req.seq.output_token_ids, device=logits.device, dtype=torch.long)
            counts = torch.bincount(ids, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if req.blocked_ids and req.seq.num_output_tokens < p.min_tokens and not _grammar_complete(req.seq):
            logits[i, [t for t in req.blocked_ids if t < logits.shape[1]]] = NEG_INF
    with_processors = [ProcessorRow(i, r.seq.token_ids[:r.seq.prompt_len], r.seq.output_token_ids,
                                    r.params.logits_processors)
                       for i, r in enumerate(requests) if r.params.logits_processors]
    if with_processors:
        apply_logits_processors(logits, with_processors)
    constrained = [i for i, r in enumerate(requests) if r.seq.grammar is not None]
    if constrained:  # last, so that nothing after it can allow a token the grammar forbids
        if masker is None:
            masker = GrammarMasker(logits.shape[1])
        masker.apply(logits, constrained, [requests[i].seq.grammar for i in constrained])
    return logits


def _grammar_complete(seq: Sequence) -> bool:
    """The sequence's grammar may end here, so EOS must stay allowed even before min_tokens."""
    return seq.grammar is not None and seq.grammar.is_completed


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Top-k, top-p and min-p (HF semantics) on rows sorted in descending order."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], NEG_INF)
    probs = sorted_logits.softmax(-1)
    sorted_logits = sorted_logits.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], NEG_INF)
    probs = sorted_logits.softmax(-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter_(1, order, sorted_logits)


def process_logits(logits: torch.Tensor, requests: List[SampleRequest],
                   masker: Optional[GrammarMasker] = None) -> torch.Tensor:
    """Penalties, processors, grammar masks, temperature and truncation: the scores sampling draws from."""
    logits = apply_penalties(logits, requests, masker)
    temps = torch.tensor([1.0 if r.params.is_greedy else r.params.temperature for r in requests],
                         device=logits.device, dtype=logits.dtype)
    if bool((temps != 1.0).any()):
        logits = logits / temps[:, None]
    needs_filter = [i for i, r in enumerate(requests) if not r.params.is_greedy and
                    (r.params.top_k != -1 or r.params.top_p < 1.0 or r.params.min_p > 0.0)]
    if needs_filter:
        vocab = logits.shape[1]
        reqs = [requests[i].params for i in needs_filter]
        top_k = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in reqs], device=logits.device)
        top_p = torch.tensor([p.top_p for p in reqs], device=logits.device, dtype=logits.dtype)
        min_p = torch.tensor([p.min_p for p in reqs], device=logits.device, dtype=logits.dtype)
        rows = torch.tensor(needs_filter, device=logits.device)
        logits[rows] = _filter_sorted(logits[rows], top_k, top_p, min_p)
    return logits


class Sampler:
    """Samples a step's rows: greedy, temperature, top-k/p, min-p, penalties, seeds, logprobs."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._masker: Optional[GrammarMasker] = None

    def masker(self, vocab_size: int) -> GrammarMasker:
        """The grammar masker (its bitmask buffer is kept across steps)."""
        if self._masker is None or self._masker.vocab_size != vocab_size:
            self._masker = GrammarMasker(vocab_size)
        return self._masker

    def _masker_for(self, logits: torch.Tensor, requests: List[SampleRequest]) -> Optional[GrammarMasker]:
        return self.masker(logits.shape[1]) if any(r.seq.grammar is not None for r in requests) else None

    def sample(self, logits: torch.Tensor, requests: List[SampleRequest]) -> List[SampleResult]:
        raw = logits.to(torch.float32)
        keep_raw = any(r.params.output_scores for r in requests)
        scores = process_logits(raw.clone() if keep_raw else raw, requests, self._masker_for(logits, requests))
        tokens = self._draw(scores, requests)
        greedy = [i for i, r in enumerate(requests) if r.params.is_greedy]
        if greedy:
            best = (scores if len(greedy) == len(requests) else scores[greedy]).argmax(dim=-1).tolist()
            for i, token in zip(greedy, best):
                tokens[i] = [token] * requests[i].num_samples
        logprobs = torch.log_softmax(scores, dim=-1)  # (faster on the CPU than torch.logsumexp alone)
        rows = torch.tensor([i for i in range(len(requests)) for _ in tokens[i]], device=scores.device)
        picked = torch.tensor([t for i in range(len(requests)) for t in tokens[i]], device=scores.device)
        flat_lps = logprobs[rows, picked].tolist()
        results, start = [], 0
        for i, req in enumerate(requests):
            token_lps = flat_lps[start:start + len(tokens[i])]
            start += len(tokens[i])
            top = None
            if req.params.logprobs is not None:
                top = [self._top_logprobs(logprobs[i], t, lp, req.params.logprobs)
                       for t, lp in zip(tokens[i], token_lps)]
            result = SampleResult(tokens[i], token_lps, top)
            if req.params.output_scores:
                result.scores, result.logits = scores[i].clone(), raw[i].clone()
            results.append(result)
        return results

    @staticmethod
    def _top_logprobs(row: torch.Tensor, token: int, logprob: float, k: int) -> Dict[int, float]:
        top: Dict[int, float] = {}
        if k:
            values, ids = row.topk(min(k, row.shape[0]))
            top = dict(zip(ids.tolist(), values.tolist()))
        top[token] = logprob
        return top

    def _draw(self, scores: torch.Tensor, requests: List[SampleRequest]) -> Dict[int, List[int]]:
        """Random draws for sampled rows, seeded rows from their own generator.

        Inverse-CDF sampling: one uniform number per draw against the row's cumulative probabilities
        (in float64, so that rare tokens keep their exact share); far cheaper on a large vocabulary than
        torch.multinomial, which spends tens of milliseconds per step on the CPU.
        """
        drawn: Dict[int, List[int]] = {}
        sampled = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if not sampled:
            return drawn
        cdf = scores[sampled].softmax(-1).to("cpu", torch.float64).cumsum(-1)
        last = cdf.shape[1] - 1
        shared = [row for row, i in enumerate(sampled) if requests[i].generator is None
                  and requests[i].num_samples == 1]
        if shared:
            rows = cdf[shared]
            u = torch.rand(len(shared), 1, generator=self.generator, dtype=torch.float64) * rows[:, -1:]
            tokens = torch.searchsorted(rows, u, right=True).clamp_(max=last)
            for row, token in zip(shared, tokens[:, 0].tolist()):
                drawn[sampled[row]] = [token]
        for row, i in enumerate(sampled):
            if i in drawn:
                continue
            req = requests[i]
            u = torch.rand(req.num_samples, generator=req.generator or self.generator, dtype=torch.float64)
            drawn[i] = torch.searchsorted(cdf[row], u * cdf[row, -1], right=True).clamp_(max=last).tolist()
        return drawn

    def beam_log_probs(self, logits: torch.Tensor, requests: List[SampleRequest]) -> torch.Tensor:
        """HF beam search scores: log-softmax first, then the processors applied to the log-probs."""
        return apply_penalties(torch.log_softmax(logits.to(torch.float32), dim=-1), requests,
                               self._masker_for(logits, requests))
