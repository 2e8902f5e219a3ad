"""Run one `generate` call through the engine: every prompt row is a request (its `num_return_sequences`
samples or its beams inside it), and the engine steps them all together (continuous batching).

Greedy and sampling are replayed step by step in transformers' lockstep view: step t is committed once
every live row has its t-th token; then the streamer gets the step's tokens and the stopping criteria
see the full ids (prompt as passed, finished rows padded). A row that a criterion stops is cut at that
step, and its request is aborted in the engine once all its rows have stopped. A call reaches the engine
through its `EngineSession`, so calls from several threads share the engine's steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch

from paged_backend import RequestOutput, SamplingParams

from .attachment import EngineSession
from .outputs import (BeamResult, OutputOptions, beam_fill_value, beam_output, decoder_only_output,
                      expanded_prompt, neg_inf_rows)
from .prompts import PromptBatch

@dataclass
class Plan:
    """Everything one call decided before touching the engine."""

    batch: PromptBatch
    params: List[SamplingParams]        # one per prompt row
    num_return: int
    num_beams: int
    eos_ids: Optional[List[int]]
    pad_id: Optional[int]
    options: OutputOptions
    criteria: Optional[object] = None   # a StoppingCriteriaList run on the full ids, or None
    speculation: Optional[dict] = None  # the engine's speculative_config while the call runs (assisted generation)

    @property
    def pad_after_finish(self) -> bool:
        """transformers pads finished rows only when it has an EOS criterion; without one, a row that a
        stopping criterion ended keeps receiving real tokens until every row is done."""
        return bool(self.eos_ids)


@dataclass
class Row:
    """One output row (a prompt's sample) as the engine has produced it so far."""

    request: int
    sample: int
    tokens: List[int] = field(default_factory=list)
    scores: Optional[List[torch.Tensor]] = None
    logits: Optional[List[torch.Tensor]] = None
    engine_done: bool = False
    finish_reason: Optional[str] = None
    stopped_at: Optional[int] = None    # the step at which transformers would mark it finished


@dataclass
class Commit:
    """One lockstep step: the token of every row (pad for rows finished earlier) and the rows it ended."""

    step: int
    tokens: List[int]
    live: List[bool]                     # rows that produced a real token at this step
    ended: List[int]                     # rows that finished at this step


def _add_requests(session: EngineSession, plan: Plan) -> Dict[str, int]:
    """Queue one engine request per prompt row; request id -> row."""
    rows = enumerate(zip(plan.batch.prompts, plan.params))
    return {session.add(b, prompt, params): b for b, (prompt, params) in rows}


class SamplingRun:
    """Greedy or multinomial sampling for a whole batch, committed in lockstep."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.session: Optional[EngineSession] = None
        self.rows = [Row(b, s) for b in range(plan.batch.batch_size) for s in range(plan.num_return)]
        self.generated: List[List[int]] = [[] for _ in self.rows]
        self.step_scores: List[torch.Tensor] = []
        self.step_logits: List[torch.Tensor] = []
        self.request_of: Dict[str, int] = {}
        self.committed = 0
        self.filled_rows = False

    # ---- engine side ---------------------------------------------------------------------------
    def commits(self, session: EngineSession) -> Iterator[Commit]:
        """Drive the engine (through this call's session); yield each lockstep step as soon as every live
        row has reached it. The session aborts what is left when it closes."""
        self.session = session
        self.request_of = _add_requests(session, self.plan)
        while not self._all_stopped():
            if not self._running_requests():
                raise RuntimeError("the engine finished every request before generate was done (internal error)")
            for out in session.outputs():
                self._update(out)
            while not self._all_stopped() and self._can_commit(self.committed + 1):
                yield self._commit(self.committed + 1)

    def _running_requests(self) -> List[str]:
        active = {r.request for r in self.rows if not r.engine_done}
        return [rid for rid, b in self.request_of.items() if b in active]

    def _update(self, out: RequestOutput) -> None:
        b = self.request_of.get(out.request_id)
        if b is None:
            return
        if out.error is not None:
            raise RuntimeError(f"the engine failed prompt row {b}: {out.error}")
        for completion in out.outputs:
            row = self.rows[b * self.plan.num_return + completion.index]
            row.tokens = completion.token_ids
            row.scores, row.logits = completion.scores, completion.logits
            if completion.finish_reason is not None or out.finished:
                row.engine_done, row.finish_reason = True, completion.finish_reason

    def _needs_tokens(self, row: Row) -> bool:
        return row.stopped_at is None or (not self.plan.pad_after_finish and not row.engine_done)

    def _can_commit(self, step: int) -> bool:
        return all(len(r.tokens) >= step for r in self.rows if self._needs_tokens(r))

    def _all_stopped(self) -> bool:
        return all(r.stopped_at is not None for r in self.rows)

    # ---- one lockstep step -----------------------------------------------------------------------
    def _commit(self, step: int) -> Commit:
        plan = self.plan
        live = [r.stopped_at is None for r in self.rows]
        real = [alive or (not plan.pad_after_finish and len(r.tokens) >= step) for r, alive in zip(self.rows, live)]
        tokens = [r.tokens[step - 1] if use else plan.pad_id for r, use in zip(self.rows, real)]
        for ids, token in zip(self.generated, tokens):
            ids.append(token)
        self.committed = step
        if plan.options.records:
            self._record(step, real)
        ended = []
        for i, row in enumerate(self.rows):
            if live[i] and row.engine_done and len(row.tokens) == step:
                row.stopped_at = step
                ended.append(i)
        if plan.criteria is not None:
            self._apply_criteria(step, live, ended)
        self._abort_stopped_requests()
        return Commit(step, tokens, live, ended)

    def _record(self, step: int, real: List[bool]) -> None:
        device = self.plan.batch.input_ids.device
        have = [use and r.scores is not None and len(r.scores) >= step for r, use in zip(self.rows, real)]
        vocab = next(r.scores[step - 1].shape[-1] for r, ok in zip(self.rows, have) if ok)
        if not all(have):
            self.filled_rows = True
        blank = neg_inf_rows(1, vocab, "cpu")[0]
        if self.plan.options.output_scores:
            self.step_scores.append(torch.stack([r.scores[step - 1] if ok else blank
                                                 for r, ok in zip(self.rows, have)]).to(device))
        if self.plan.options.output_logits:
            self.step_logits.append(torch.stack([r.logits[step - 1] if ok else blank
                                                 for r, ok in zip(self.rows, have)]).to(device))

    def _apply_criteria(self, step: int, live: List[bool], ended: List[int]) -> None:
        ids = self.sequences()
        scores = tuple(self.step_scores) if self.plan.options.records and self.plan.options.output_scores else None
        # transformers passes its `scores` tuple (None unless return_dict_in_generate and output_scores)
        done = self.plan.criteria(ids, scores)
        done = torch.as_tensor(done, dtype=torch.bool).reshape(-1).expand(len(self.rows)).tolist()
        for i, row in enumerate(self.rows):
            if live[i] and row.stopped_at is None and done[i]:
                row.stopped_at = step
                ended.append(i)

    def _abort_stopped_requests(self) -> None:
        """Free the engine's work on requests whose rows transformers would only pad from now on."""
        if not self.plan.pad_after_finish:
            return
        for rid, b in self.request_of.items():
            rows = self.rows[b * self.plan.num_return:(b + 1) * self.plan.num_return]
            if all(r.stopped_at is not None for r in rows) and not all(r.engine_done for r in rows):
                self.session.abort([rid])
                for r in rows:
                    r.engine_done = True

    # ---- result ----------------------------------------------------------------------------------
    def sequences(self) -> torch.Tensor:
        batch = self.plan.batch
        prompt = expanded_prompt(batch.input_ids, self.plan.num_return)
        generated = torch.tensor(self.generated, dtype=torch.long).reshape(len(self.rows), self.committed)
        return torch.cat([prompt, generated.to(prompt.device)], dim=1)

    def output(self):
        return decoder_only_output(self.sequences(), self.plan.options, self.step_scores, self.step_logits)


class BeamRun:
    """Beam search for a whole batch: one engine request per prompt row, all stepped together."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.filled_rows = False

    def run(self, session: EngineSession):
        plan = self.plan
        request_of = _add_requests(session, plan)
        finals: Dict[int, RequestOutput] = {}
        while len(finals) < len(request_of):
            for out in session.outputs():
                b = request_of.get(out.request_id)
                if b is not None and out.finished:
                    if out.error is not None:
                        raise RuntimeError(f"the engine failed prompt row {b}: {out.error}")
                    finals[b] = out
        ordered = [finals[b] for b in range(plan.batch.batch_size)]
        results = [[BeamResult(c.token_ids, c.beam_score, c.beam_indices or []) for c in out.outputs]
                   for out in ordered]
        output, self.filled_rows = beam_output(
            plan.batch.input_ids, results, plan.num_beams, plan.num_return, beam_fill_value(plan.pad_id, plan.eos_ids),
            plan.options, [out.step_scores or [] for out in ordered], [out.step_logits or [] for out in ordered])
        return output
