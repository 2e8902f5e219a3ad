"""Logits -> next tokens for a whole step at once.

Order of processing follows Hugging Face's logits processors: penalties and min-tokens masking,
then temperature, top-k, top-p, min-p. Logits are handled in float32 (as transformers' `generate`
does), so greedy and beam decisions match it. Rows with a `seed` draw from their own generator, so given
its logits a seeded row's draws do not depend on the rest of the batch. Every stage treats rows
independently: a row that fails (a processor raises, nothing finite is left) is reported, not raised, and
the other rows come out exactly as they would without it.

Truncation and the draws are `kernels.sample_rows` (see kernels/sampling.py): no row is sorted, the
draw's cumulative sum covers only the kept tokens. A batch of greedy rows that report no log-probabilities
costs one pass of row maxima; a greedy row that reports them costs one log-sum-exp more. Full log-softmax
rows are computed only for the rows that ask for top logprobs or scores, and only over their kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Tuple

import torch

from paged_backend import kernels
from paged_backend.sampling.logits_processors import ProcessorRow, apply_logits_processors
from paged_backend.sampling.logprob import Logprob
from paged_backend.sampling_params import SamplingParams
from paged_backend.structured.matcher import GrammarMasker, GrammarState

NEG_INF = float("-inf")


class SampledSequence(Protocol):
    """What the sampler reads of a sequence (the engine's `Sequence` has it): its tokens and its grammar."""

    token_ids: List[int]
    prompt_len: int
    grammar: Optional[GrammarState]

    @property
    def output_token_ids(self) -> List[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class SampleRequest:
    """One logits row to sample from."""

    params: SamplingParams
    seq: SampledSequence
    num_samples: int = 1
    generator: Optional[torch.Generator] = None
    blocked_ids: Tuple[int, ...] = ()  # masked while fewer than min_tokens were generated
    # False when the caller knows the row has no penalty, processor, grammar or min-tokens mask: the sampler then
    # reads nothing of `seq` (so it may run while another thread appends to it)
    processed: bool = True


def needs_processing(params: SamplingParams, blocked_ids: Tuple[int, ...], grammar) -> bool:
    """Whether a row of a request with these parameters goes through `apply_penalties` (penalties, min-tokens
    masking, logits processors, a grammar)."""
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                or blocked_ids or params.logits_processors or grammar is not None)


@dataclass
class SampleBatch:
    """A step's draws as flat lists (row `i`'s draws are `tokens[offsets[i]:offsets[i + 1]]`) and the first draw
    of every row as a tensor (what the next step's input ids are filled from); the rows' optional extras by row.
    `logprobs` is None for a batch of plain greedy rows: none of them reports log-probabilities, so none was
    computed."""

    tokens: List[int]
    logprobs: Optional[List[float]]
    offsets: List[int]
    first_tokens: torch.Tensor                           # [rows] int64 on the host: each row's first draw (0 for
    #                                                      failed rows), where the next step's input ids come from
    failures: Dict[int, str]
    top_logprobs: Dict[int, List[Dict[int, Logprob]]]    # rows that asked for logprobs
    scores: Dict[int, Tuple[torch.Tensor, torch.Tensor]]  # rows with output_scores: (processed scores, raw logits)

    def result(self, i: int) -> "SampleResult":
        """Row `i` as a `SampleResult`."""
        if i in self.failures:
            return SampleResult([], [], error=self.failures[i])
        start, end = self.offsets[i], self.offsets[i + 1]
        scores, logits = self.scores.get(i, (None, None))
        logprobs = self.logprobs[start:end] if self.logprobs is not None else [0.0] * (end - start)
        return SampleResult(self.tokens[start:end], logprobs, self.top_logprobs.get(i), scores, logits)

    def results(self) -> List["SampleResult"]:
        return [self.result(i) for i in range(len(self.offsets) - 1)]


@dataclass
class PendingDraws:
    """A step's draws of one token per row still on their way to the host: `tokens` (on the device; 0 for a row
    that failed) are what the next step's input ids are filled from there, and `batch()` waits for the host copy
    (`ready`: its CUDA event; None when the tokens are on the host already) and gives the `SampleBatch` the
    engine applies, as `Sampler.sample_batch` would have."""

    tokens: torch.Tensor                 # [rows] int64 on the logits' device
    host: torch.Tensor                   # [rows] int64 on the host (-1: the row failed), once `ready` has passed
    ready: Optional[object] = None       # torch.cuda.Event recorded after the copy

    @classmethod
    def of(cls, marked: torch.Tensor) -> "PendingDraws":
        """From each row's token, -1 where the row failed: on a CUDA device a copy to pinned host memory is
        started and an event recorded after it (nothing waits); elsewhere the tokens are the host's already."""
        if marked.device.type != "cuda":
            return cls(marked.clamp(min=0), marked)
        host = torch.empty(marked.shape, dtype=marked.dtype, pin_memory=True)
        host.copy_(marked, non_blocking=True)   # on the current stream of the tokens' device
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(marked.device))   # that stream, whichever device is current
        return cls(marked.clamp(min=0), host, ready)

    def batch(self) -> "SampleBatch":
        if self.ready is not None:
            self.ready.synchronize()
        return single_draw_batch(self.host)


def single_draw_batch(host_tokens: torch.Tensor) -> "SampleBatch":
    """The `SampleBatch` of rows that draw one token each and report no log-probabilities, from their host tokens
    (-1 where a row has no finite maximum)."""
    failed = (host_tokens < 0).nonzero().flatten().tolist()
    failures = {row: "logits row has no finite maximum (all -inf, +inf or NaN): nothing to sample" for row in failed}
    first = host_tokens.clamp(min=0) if failures else host_tokens
    return SampleBatch(first.tolist(), None, list(range(len(first) + 1)), first, failures, {}, {})


def plain_rows(requests: List[SampleRequest]) -> Optional[bool]:
    """Whether every row draws one token with nothing else to compute (no processing, log-probabilities asked for
    or ranking best_of > n samples, or scores): None if not, else whether they are all greedy (one pass)."""
    greedy = True
    for r in requests:
        p = r.params
        if r.processed or r.num_samples != 1 or p.reports_logprobs or p.output_scores:
            return None
        greedy = greedy and p.temperature < 1e-6
    return greedy


@dataclass
class SampleResult:
    token_ids: List[int]
    logprobs: List[float]
    top_logprobs: Optional[List[Dict[int, Logprob]]] = None
    scores: Optional[torch.Tensor] = None   # processed scores of the row (output_scores)
    logits: Optional[torch.Tensor] = None   # raw logits of the row (output_scores)
    error: Optional[str] = None             # the row could not be sampled: why (its request fails)


def apply_penalties(logits: torch.Tensor, requests: List[SampleRequest],
                    masker: Optional[GrammarMasker] = None) -> Dict[int, str]:
    """Repetition (HF: over prompt and output), presence and frequency (over output) penalties,
    min-tokens masking, the request's own logits processors, then its structured-output grammar mask,
    in place on float32 rows. A row whose processing fails fails alone: the others are processed exactly as
    without it, and its own row is set to zeros (so that batched steps after this one see finite values).
    Returns the failed rows (row -> what went wrong)."""
    failures: Dict[int, str] = {}
    if not any(r.processed for r in requests):
        return failures
    for i, req in enumerate(requests):
        p = req.params
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or req.blocked_ids:
            try:
                _penalize_row(logits, i, req)
            except Exception as exc:  # noqa: BLE001 - the error belongs to this row's request only
                failures[i] = f"penalties failed: {type(exc).__name__}: {exc}"
    with_processors = [ProcessorRow(i, r.seq.token_ids[:r.seq.prompt_len], r.seq.output_token_ids,
                                    r.params.logits_processors)
                       for i, r in enumerate(requests) if r.params.logits_processors and i not in failures]
    if with_processors:
        failures.update(apply_logits_processors(logits, with_processors))
    constrained = [i for i, r in enumerate(requests) if r.seq.grammar is not None and i not in failures]
    if constrained:  # last, so that nothing after it can allow a token the grammar forbids
        if masker is None:
            masker = GrammarMasker(logits.shape[1])
        failures.update(masker.apply_isolated(logits, constrained, [requests[i].seq.grammar for i in constrained]))
    if failures:
        logits[sorted(failures)] = 0.0
    return failures


def _penalize_row(logits: torch.Tensor, i: int, req: SampleRequest) -> None:
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


def _grammar_complete(seq: SampledSequence) -> bool:
    """The sequence's grammar may end here, so EOS must stay allowed even before min_tokens."""
    return seq.grammar is not None and seq.grammar.is_completed


def apply_temperature(logits: torch.Tensor, requests: List[SampleRequest]) -> torch.Tensor:
    """Divide sampled rows by their temperature, in place (greedy rows are left as they are)."""
    temps = [1.0 if r.params.temperature < 1e-6 else r.params.temperature for r in requests]
    if any(t != 1.0 for t in temps):
        # built on the host and sent without a wait (a tensor made on a GPU directly waits for its stream)
        logits.div_(torch.tensor(temps, dtype=logits.dtype).to(logits.device, non_blocking=True)[:, None])
    return logits


def truncation_params(requests: List[SampleRequest]) -> tuple:
    """Per row: top_k (-1: none), top_p, min_p and whether the row is greedy, as tensors."""
    params = [r.params for r in requests]
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64)
    greedy = torch.tensor([p.temperature < 1e-6 for p in params], dtype=torch.bool)
    return top_k, top_p, min_p, greedy


def draw_positions(offsets: torch.Tensor, rows: List[int], counts: List[int]) -> torch.Tensor:
    """Where the draws of `rows` (with `counts` draws each, in that order) sit in the flat draw order, where row
    i's draws are `offsets[i]` up to `offsets[i + 1]`."""
    starts = offsets[torch.tensor(rows, dtype=torch.long)]
    if all(c == 1 for c in counts):
        return starts
    sizes = torch.tensor(counts, dtype=torch.long)
    before = torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)   # draws of the earlier rows listed
    return torch.repeat_interleave(starts, sizes) + torch.arange(int(sizes.sum())) - before


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
        """One result per row (`sample_batch`, row by row)."""
        return self.sample_batch(logits, requests).results()

    def sample_batch(self, logits: torch.Tensor, requests: List[SampleRequest]) -> SampleBatch:
        """Every row's draws. A row that cannot be sampled (a processor or its grammar failed, or nothing
        finite is left to draw from) is in `failures` and draws nothing usable; every other row's tokens,
        log-probabilities and generator draws are exactly what they would be without that failure (each
        stage treats rows independently, every row draws its uniforms, and nothing is sampled twice).
        A batch of plain greedy rows takes each row's first maximum in one batched call (`kernels.greedy_rows`),
        without log-normalisers: no row reports a log-probability."""
        if requests and plain_rows(requests):   # all plain and all greedy
            return self._greedy_batch(logits.to(torch.float32))
        raw = logits.to(torch.float32)
        keep_raw = any(r.params.output_scores for r in requests)
        scores = raw.clone() if keep_raw else raw
        failures = apply_penalties(scores, requests, self._masker_for(logits, requests))
        scores = apply_temperature(scores, requests)
        uniforms, offsets = self._uniforms(requests)
        draws = kernels.sample_rows(scores, *truncation_params(requests), uniforms, offsets, allow_failed_rows=True)
        for row in draws.failed_rows:
            failures.setdefault(row, "logits row has no finite maximum (all -inf, +inf or NaN): nothing to sample")
        offset_list = offsets.tolist()
        host_tokens = draws.tokens.cpu()   # the next step's inputs are filled from them on the host
        tokens, token_lps = host_tokens.tolist(), draws.logprobs.tolist()
        batch = SampleBatch(tokens, token_lps, offset_list, host_tokens[offsets[:-1]], failures, {}, {})
        for i, req in enumerate(requests):
            params = req.params
            if (params.logprobs is None and not params.output_scores) or i in failures:
                continue
            row_tokens = tokens[offset_list[i]:offset_list[i + 1]]
            if params.logprobs is not None:
                row_lps = token_lps[offset_list[i]:offset_list[i + 1]]
                top = self._top_logprobs(scores[i], int(draws.kept[i]), float(draws.log_norm[i]), params.logprobs)
                batch.top_logprobs[i] = [{**top, t: Logprob(lp, top[t].rank if t in top else self._rank(scores[i], t))}
                                         for t, lp in zip(row_tokens, row_lps)]
            if params.output_scores:
                batch.scores[i] = (self._kept_scores(scores[i], int(draws.kept[i])), raw[i].clone())
        return batch

    @staticmethod
    def _greedy_batch(logits: torch.Tensor) -> SampleBatch:
        return single_draw_batch(kernels.greedy_rows(logits, with_norms=False).tokens)   # host (GreedyDraws)

    @staticmethod
    def greedy_later(logits: torch.Tensor) -> PendingDraws:
        """`sample_batch` for plain greedy rows without waiting for the device: their tokens stay there for the
        next step's inputs while a copy goes to the host (pinned memory, one CUDA event). On the CPU the tokens
        are ready at once (the same draws as `sample_batch`: each row's first maximum)."""
        return PendingDraws.of(kernels.greedy_tokens(logits.to(torch.float32)))

    def sample_later(self, logits: torch.Tensor, requests: List[SampleRequest]) -> Optional[PendingDraws]:
        """`sample_batch` without waiting for the device, for rows that draw one token each and report nothing
        else (`plain_rows`; None for any other batch): the uniforms come from the same generators in the same
        order, the truncation is decided from the host's parameters (`kernels.sample_rows_nosync`)."""
        greedy = plain_rows(requests) if requests else None
        if greedy is None:
            return None
        if greedy:
            return self.greedy_later(logits)
        scores = apply_temperature(logits.to(torch.float32), requests)
        uniforms, offsets = self._uniforms(requests)
        tokens, failed = kernels.sample_rows_nosync(scores, *truncation_params(requests), uniforms, offsets)
        return PendingDraws.of(tokens.masked_fill(failed, -1))   # one draw per row: draw i is row i

    @staticmethod
    def _top_logprobs(row: torch.Tensor, kept: int, log_norm: float, k: int) -> Dict[int, Logprob]:
        """The k most likely kept tokens and their log-probabilities under the truncated distribution, ranked."""
        if not k:
            return {}
        values, ids = row.topk(min(k, kept))
        return {t: Logprob(lp, rank) for rank, (t, lp) in
                enumerate(zip(ids.tolist(), (values.double() - log_norm).tolist()), start=1)}

    @staticmethod
    def _rank(row: torch.Tensor, token: int) -> int:
        """A token's rank in the row (1 + how many tokens score higher), as vLLM ranks a sampled token."""
        return int((row > row[token]).sum()) + 1

    @staticmethod
    def _kept_scores(row: torch.Tensor, kept: int) -> torch.Tensor:
        """The row as sampling saw it: the kept tokens' scores, -inf elsewhere (output_scores)."""
        if kept >= row.shape[0]:
            return row.clone()
        values, ids = row.topk(kept)
        return torch.full_like(row, NEG_INF).scatter_(0, ids, values)

    def _uniforms(self, requests: List[SampleRequest]):
        """One float64 uniform per draw of every sampled row (greedy rows get zeros, unused), drawn in the
        order the previous inverse-CDF sampler drew them: one batch from the engine's generator for the
        unseeded single-sample rows, then each other row from its own generator (or the engine's). A seeded
        row's draws therefore never depend on the rest of the batch. The other rows' draws are placed with one
        scatter (a slice assignment per row cost 1.2 ms of host time for 256 seeded rows)."""
        counts = [r.num_samples for r in requests]
        offsets = torch.tensor([0] + counts, dtype=torch.long).cumsum(0)
        uniforms = torch.zeros(int(offsets[-1]), dtype=torch.float64)
        sampled = [i for i, r in enumerate(requests) if r.params.temperature >= 1e-6]
        if not sampled:
            return uniforms, offsets
        shared = [i for i in sampled if requests[i].generator is None and requests[i].num_samples == 1]
        if shared:
            u = torch.rand(len(shared), 1, generator=self.generator, dtype=torch.float64)[:, 0]
            uniforms[offsets[torch.tensor(shared)]] = u
        own = [i for i in sampled if requests[i].generator is not None or requests[i].num_samples != 1]
        if own:
            draws = [torch.rand(requests[i].num_samples, generator=requests[i].generator or self.generator,
                                dtype=torch.float64) for i in own]
            uniforms[draw_positions(offsets, own, [counts[i] for i in own])] = torch.cat(draws)
        return uniforms, offsets

    def beam_log_probs(self, logits: torch.Tensor,
                       requests: List[SampleRequest]) -> Tuple[torch.Tensor, Dict[int, str]]:
        """HF beam search scores: log-softmax first, then the processors applied to the log-probs. Also the rows
        that failed (row -> what went wrong), as `apply_penalties` reports them."""
        log_probs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        return log_probs, apply_penalties(log_probs, requests, self._masker_for(logits, requests))
