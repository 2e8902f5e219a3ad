"""Around the forward: a launched step's chunks count as computed and its sampling rows get a pending token
(`launch`); once its results are in, the sampled tokens become sequences' tokens (forks for samples and beams,
grammar states, one batched detokenization, stop conditions), each request's part guarded so that an error
fails that request alone (`process`)."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch

from paged_backend.engine.beam_forks import apply_beam_decisions
from paged_backend.sampling.beam_search import BeamSearchState
from paged_backend.core.block_manager import BlockManager
from paged_backend.engine.detokenizer import BatchDecoder, cut_at_stop, decode_new_texts, find_stop_string
from paged_backend.engine.metrics import Counters
from paged_backend.sampling.sampler import (PendingDraws, SampleBatch, SampleRequest, SampleResult, Sampler,
                                            needs_processing)
from paged_backend.core.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_backend.structured.matcher import accept_grammar

logger = logging.getLogger("paged_backend.engine")



def sample_generator(seed: int, index: int) -> torch.Generator:
    """The RNG of sample `index` of a seeded request: its own stream, so its tokens do not depend on when
    its siblings are sampled (they may be scheduled apart after a preemption)."""
    if index == 0:
        return torch.Generator(device="cpu").manual_seed(seed)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little"))


@dataclass(frozen=True)
class SamplingPlan:
    """What every step of a request's rows needs, worked out once: beam search or not, the ids masked before
    `min_tokens`, and whether its rows go through the sampler's per-row processing."""

    beams: bool
    blocked: tuple
    processed: bool

    @classmethod
    def of(cls, group: SequenceGroup) -> "SamplingPlan":
        plan = group.sampling_plan
        if plan is None:
            params = group.sampling_params
            blocked = group.stop_ids if params.min_tokens else ()
            plan = group.sampling_plan = cls(params.use_beam_search, blocked,
                                             needs_processing(params, blocked, group.seqs[0].grammar))
        return plan


@dataclass
class StepRows:
    """Which of a launched step's chunks sample, in the order of the logits rows, and how."""

    samplers: List[ScheduledSeq] = field(default_factory=list)
    normal: List[int] = field(default_factory=list)      # rows sampled by the sampler
    beams: List[int] = field(default_factory=list)       # rows scored by beam search
    requests: List[SampleRequest] = field(default_factory=list)  # one per normal row
    registered: List[tuple] = field(default_factory=list)  # prefix-cache entries added when it was launched
    spec: List[ScheduledSeq] = field(default_factory=list)  # speculating chunks (their rows follow the samplers')
    needs_processing: bool = False   # the next step must not be scheduled before this one is processed


class TokenProcessor:
    """Applies one step's results to the scheduled sequences: sampling, beam search, stops, bookkeeping."""

    def __init__(self, block_manager: BlockManager, sampler: Sampler, tokenizer,
                 counters: Counters, eos_token_ids: List[int], max_model_len: int) -> None:
        self.block_manager = block_manager
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.decoder = BatchDecoder(tokenizer) if tokenizer is not None else None
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.verifier = None  # speculative decoding's verifier (spec_decode/verifier.py), set by the engine

    # ---- failures ----------------------------------------------------------------------------
    def fail_group(self, group: SequenceGroup, error: str) -> None:
        """End one request with an error, logged once (the engine counts it as failed; the scheduler frees its
        blocks when the step's finished sequences are freed). A request that has already ended keeps its first
        error (a later failure of its other rows is not news)."""
        if group.error is not None or group.is_finished():
            return
        logger.error("request %r failed: %s", group.request_id, error)
        group.abort(error)

    def _guarded(self, group: SequenceGroup, what: str, action: Callable[[], None]) -> None:
        """Run one request's part of the step; an exception fails that request alone."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self.fail_group(group, f"{what} failed: {type(exc).__name__}: {exc}")

    # ---- launching a step ----------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput) -> StepRows:
        """The step is about to run: its chunks count as computed (the next step may be scheduled before this one
        ends) and their full blocks enter the prefix cache, the blocks behind a sliding window that no later token
        reads are released (steps run in launch order, so a later step that takes one writes it after this one
        read it), each sampling row gets a pending token, and the rows are sorted into sampled and beam rows."""
        rows = StepRows()
        counters = self.counters
        caching = self.block_manager.prefix_cache is not None
        block_size = self.block_manager.block_size
        windowed = self.block_manager.sliding_window is not None
        now = time.monotonic()
        for item in sched.scheduled:
            seq, start, end = item.seq, item.start, item.start + item.num_tokens
            drafts = seq.draft_token_ids
            if (item.num_tokens > 1 and not drafts) or start < seq.prompt_len:
                counters.num_prompt_tokens += item.num_tokens - len(drafts)   # draft tokens are no prompt
            if start < seq.max_computed_tokens:
                counters.num_recomputed_tokens += min(end, seq.max_computed_tokens) - start
                seq.max_computed_tokens = max(seq.max_computed_tokens, end)
            else:
                seq.max_computed_tokens = end
            seq.num_computed_tokens = end
            if caching and (item.num_tokens > 1 or end % block_size == 0):  # else no block became full
                rows.registered += self.block_manager.mark_computed(seq, end)
            if windowed:
                self.block_manager.release_out_of_window(seq, end)
            metrics = item.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if item.samples:
                seq.num_pending += 1
                (rows.spec if drafts else rows.samplers).append(item)
        if rows.spec:
            rows.needs_processing = True  # the next step starts from the tokens its verification accepts
        for i, item in enumerate(rows.samplers):
            group = item.group
            plan = group.sampling_plan or SamplingPlan.of(group)
            if plan.beams:
                rows.beams.append(i)
                rows.needs_processing = True
                continue
            rows.normal.append(i)
            params = group.sampling_params
            if group.branched:
                samples = 1
            else:
                samples = params.best_of
                rows.needs_processing = rows.needs_processing or samples > 1
            rows.needs_processing = rows.needs_processing or plan.processed
            rows.requests.append(SampleRequest(params, item.seq, samples, item.seq.generator, plan.blocked,
                                               plan.processed))
        return rows

    def sample(self, rows: StepRows, logits: torch.Tensor) -> SampleBatch:
        """The sampler's draws for the step's sampled rows (the rows in order need no gathered copy)."""
        if rows.spec:
            logits = logits[:len(rows.samplers)]
        if len(rows.normal) != len(rows.samplers):
            logits = logits[rows.normal]
        return self.sampler.sample_batch(logits, rows.requests)

    def sample_later(self, rows: StepRows, logits: torch.Tensor) -> Optional[PendingDraws]:
        """`sample` without waiting for the device, for a step whose rows each draw one token and report nothing
        else (greedy or sampled; no beams, speculation, processing or log-probabilities): None for any other."""
        if rows.spec or rows.beams:
            return None
        return self.sampler.sample_later(logits, rows.requests)

    # ---- processing a step -------------------------------------------------------------------------
    def process(self, sched: SchedulerOutput, rows: StepRows, logits: Optional[torch.Tensor],
                batch: Optional[SampleBatch], sample_error: Optional[BaseException] = None) -> None:
        """Register the blocks the step completed, then apply its draws (and step the beam searches)."""
        bm = self.block_manager
        if bm.prefix_cache is not None:  # a block completed by a token that was pending at launch (a decode row)
            for item in sched.scheduled:
                end = item.start + item.num_tokens
                if item.num_tokens == 1 and end % bm.block_size == 0:
                    bm.mark_computed(item.seq, end)
        for item in rows.samplers:
            item.seq.num_pending -= 1
        if rows.normal:
            items = [rows.samplers[i] for i in rows.normal]
            if sample_error is not None or batch is None:
                exc = sample_error or RuntimeError("no draws")
                for item in items:  # a batched stage failed for no single row: the step's rows fail
                    self.fail_group(item.group, f"sampling failed: {type(exc).__name__}: {exc}")
            else:
                self._apply_draws(items, batch)
        if rows.beams:
            self._beam_search([rows.samplers[i] for i in rows.beams], logits[rows.beams])
        if rows.spec:
            self.verifier.verify(rows.spec, None if logits is None else logits[len(rows.samplers):])

    def _apply_draws(self, items: List[ScheduledSeq], batch: SampleBatch) -> None:
        """Apply the results request by request: a request with a failed row fails and none of its rows' results
        is applied; the other requests' results are exactly what they would be without it (the sampler isolates
        rows; nothing is sampled twice). A row whose sequence has ended since it was launched (it stopped in the
        step before, or was aborted) computed its token in vain: it is dropped."""
        failures = batch.failures
        for i, message in failures.items():
            self.fail_group(items[i].group, f"sampling failed: {message}")
        tokens, logprobs, offsets = batch.tokens, batch.logprobs, batch.offsets
        extras = batch.top_logprobs or batch.scores
        appended: List[ScheduledSeq] = []
        for i, item in enumerate(items):
            group, seq = item.group, item.seq
            if group.error is not None or seq.is_finished():
                continue
            if not group.branched:
                if group.sampling_params.best_of > 1:
                    self._guarded(group, "generating the next token",
                                  lambda item=item, result=batch.result(i): self._take_sample(item, result))
                    continue
                group.branched = True
            token = tokens[offsets[i]]
            if seq.grammar is not None and not self._accepts(group, seq, token):
                continue
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[offsets[i]]
            if extras:
                self._keep_extras(seq, batch, i)
            appended.append(item)
        self._note_tokens(appended)
        self._finish_tokens(appended)

    def _accepts(self, group: SequenceGroup, seq: Sequence, token: int) -> bool:
        try:
            accept_grammar(seq, token)  # first: a refused token is not appended
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self.fail_group(group, f"generating the next token failed: {type(exc).__name__}: {exc}")
            return False
        return True

    @staticmethod
    def _keep_extras(seq: Sequence, batch: SampleBatch, i: int, j: int = 0) -> None:
        top = batch.top_logprobs.get(i)
        if top is not None:
            seq.output_logprobs.append(top[j])
        scores = batch.scores.get(i)
        if scores is not None:
            seq.output_scores.append((scores[1], scores[0]))

    def _note_tokens(self, items: List[ScheduledSeq]) -> None:
        """Token counters and per-request times for the tokens just appended (one clock reading per step; the
        time per output token is observed once per request and step)."""
        if not items:
            return
        now = time.monotonic()
        seen: Set[int] = set()
        observe = self.counters.observe
        for item in items:
            metrics = item.group.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            elif id(metrics) not in seen:
                observe("time_per_output_token_seconds", now - metrics.last_token_time)
            seen.add(id(metrics))
            metrics.last_token_time = now
        self.counters.num_generated_tokens += len(items)

    def _finish_tokens(self, items: List[ScheduledSeq]) -> None:
        """One batched detokenization for the sequences that got a token, then each one's stop conditions."""
        texts = self._new_texts(items)
        check_stop = self._check_stop
        for item, text in zip(items, texts):
            group = item.group
            if group.error is None:
                try:   # `_guarded`, inline: this loop runs once per sequence and step
                    check_stop(group, item.seq, text)
                except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
                    self.fail_group(group, f"generating the next token failed: {type(exc).__name__}: {exc}")

    def _new_texts(self, items: List[ScheduledSeq]) -> List[str]:
        """The text each sequence's new token adds ("" without detokenization); a decode that fails fails its
        request alone (the batch is retried one sequence at a time)."""
        texts = [""] * len(items)
        if self.decoder is None:
            return texts
        rows = [i for i, item in enumerate(items) if item.group.sampling_params.detokenize]
        if not rows:
            return texts
        seqs = [items[i].seq for i in rows]
        skips = [items[i].group.sampling_params.skip_special_tokens for i in rows]
        try:
            decoded = decode_new_texts(self.decoder, seqs, skips)
        except Exception:  # noqa: BLE001 - find the request whose tokens do not decode
            decoded = [self._decode_alone(items[i], seq, skip) for i, seq, skip in zip(rows, seqs, skips)]
        for i, text in zip(rows, decoded):
            texts[i] = text
        return texts

    def _decode_alone(self, item: ScheduledSeq, seq: Sequence, skip: bool) -> str:
        try:
            return decode_new_texts(self.decoder, [seq], [skip])[0]
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self.fail_group(item.group, f"generating the next token failed: {type(exc).__name__}: {exc}")
            return ""

    def _take_sample(self, item: ScheduledSeq, result: SampleResult) -> None:
        """The first sample of a request with `best_of > 1`: its sequence forks once per further draw."""
        group, seq = item.group, item.seq
        group.branched = True
        seed = group.sampling_params.seed
        for j in range(1, len(result.token_ids)):
            child = seq.fork()
            child.generator = None if seed is None else sample_generator(seed, j)
            self.block_manager.fork(seq, child)
            group.seqs.append(child)
            self._append(group, child, result, j)
        self._append(group, seq, result, 0)

    def _append(self, group: SequenceGroup, seq: Sequence, result: SampleResult, j: int) -> None:
        params = group.sampling_params
        accept_grammar(seq, result.token_ids[j])  # first: a refused token is not appended
        seq.append_token(result.token_ids[j], result.logprobs[j])
        if result.top_logprobs is not None:
            seq.output_logprobs.append(result.top_logprobs[j])
        if result.scores is not None:
            seq.output_scores.append((result.logits, result.scores))
        self._note_token(group)
        new_text = ""
        if params.detokenize and self.decoder is not None:
            new_text = decode_new_texts(self.decoder, [seq], [params.skip_special_tokens])[0]
        self._check_stop(group, seq, new_text)

    def _note_token(self, group: SequenceGroup) -> None:
        """One token of a forking or beam step (the time per output token is observed once per step)."""
        now = time.monotonic()
        metrics = group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        elif metrics.last_token_time is not None and metrics.last_token_time < self._step_start:
            self.counters.observe("time_per_output_token_seconds", now - metrics.last_token_time)
        metrics.last_token_time = now
        self.counters.num_generated_tokens += 1

    _step_start = 0.0

    def begin(self) -> None:
        """A step's processing starts (forks and beams observe their time per output token once per step)."""
        self._step_start = time.monotonic()

    def _check_stop(self, group: SequenceGroup, seq: Sequence, new_text: str) -> None:
        params = group.sampling_params
        token = seq.token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_terminated:  # the structured output is complete
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if len(seq.token_ids) - seq.prompt_len >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
            if params.stop_strings and new_text:
                found = find_stop_string(seq.output_text, len(new_text), params.stop_strings)
                if found is not None:
                    stop = found[0]
                    seq.output_text = cut_at_stop(seq.output_text, len(new_text), stop,
                                                  params.include_stop_str_in_output)
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                    return
        if params.max_tokens is not None and len(seq.token_ids) - seq.prompt_len >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
        elif len(seq.token_ids) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    # ---- beam search -------------------------------------------------------------------------
    def _beam_search(self, items: List[ScheduledSeq], logits: torch.Tensor) -> None:
        requests = [SampleRequest(item.group.sampling_params, item.seq, 1, None,
                                  item.group.stop_ids) for item in items]
        try:
            log_probs, failures = self.sampler.beam_log_probs(logits, requests)
        except Exception as exc:  # noqa: BLE001 - a batched stage failed for no single row: the step's beams fail
            for item in items:
                self.fail_group(item.group, f"beam scoring failed: {type(exc).__name__}: {exc}")
            return
        for i, message in failures.items():
            self.fail_group(items[i].group, f"beam scoring failed: {message}")
        touched: Dict[str, SequenceGroup] = {}
        for i, item in enumerate(items):
            if item.group.is_finished():
                continue
            state: BeamSearchState = item.group.beam_state
            state.pending[item.seq.seq_id] = log_probs[i]
            if state.record_scores:
                state.pending_logits[item.seq.seq_id] = logits[i].to(torch.float32)
            touched[item.group.request_id] = item.group
        for group in touched.values():
            self._guarded(group, "the beam search step", lambda group=group: self._beam_advance(group))

    def _beam_advance(self, group: SequenceGroup) -> None:
        """Step the beam search once every live beam has its log-probs."""
        live = group.unfinished_seqs()
        state = group.beam_state
        if all(seq.seq_id in state.pending for seq in live):
            rows = torch.stack([state.pending.pop(seq.seq_id) for seq in live])
            if state.record_scores:
                state.record(rows, torch.stack([state.pending_logits.pop(seq.seq_id) for seq in live]))
            self._beam_step(group, live, rows)

    def _beam_step(self, group: SequenceGroup, live: List[Sequence], log_probs: torch.Tensor) -> None:
        state: BeamSearchState = group.beam_state
        decisions = state.step(log_probs, [seq.output_token_ids for seq in live], [seq.beam_indices for seq in live])
        group.branched = True
        for _ in decisions:
            self._note_token(group)
        if state.done:
            for seq in live:
                seq.status = SequenceStatus.FINISHED_STOPPED
            return
        group.seqs = apply_beam_decisions(live, decisions, self.block_manager)
