"""Beam search with the exact semantics of Hugging Face transformers (5.x), one request at a time.

Each step takes the log-probabilities of the live beams (in the order of the previous step's
ranking), keeps the top `(1 + num_eos) * k` continuations, finalizes those that end (EOS or length)
if they rank in the top `k`, continues the best `k` that did not end, and applies the
`early_stopping` rules. Scores are float32 tensors combined in the same order as transformers does,
so hypotheses and scores match it exactly. The engine maps the decisions onto forked sequences.

Where a grammar (or a processor) leaves fewer allowed continuations than the beams need, transformers fills
the live beams with placeholders: candidates whose score is -inf, and candidates that just ended, continued
at a score 1e9 lower. They never outrank a real beam or hypothesis, so its real hypotheses come out the same;
here they are dropped instead (fewer beams live on, the search ends when none is left, and fewer than `n`
hypotheses are returned when fewer exist, where transformers pads its `n` rows with placeholders). One
difference remains possible in principle: with `early_stopping=True` transformers counts a placeholder that
reaches EOS among its `k` finished hypotheses and may stop while a real beam still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Union

import torch

_BIG = -1.0e9


class BeamSearchExhausted(ValueError):
    """Every beam ended without a continuation the request allows and no hypothesis finished: the request fails."""


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, summed log-prob and length-normalized score."""

    token_ids: List[int]
    sum_logprob: float
    score: float
    beam_indices: List[int] = field(default_factory=list)  # live beam extended at each step
    stop_reason: Optional[str] = None  # the stop string its last token completed, if that ended it


@dataclass
class BeamDecision:
    """The continuation chosen for one new live beam."""

    parent: int       # index of the parent among the live beams
    token_id: int
    logprob: float    # log-prob of this token under the parent
    score: float      # running summed log-prob


@dataclass
class BeamSearchState:
    """Live beam scores and the k slots of finished hypotheses of one request."""

    beam_width: int
    prompt_len: int
    max_length: int
    length_penalty: float
    early_stopping: Union[bool, str]
    eos_ids: List[int]
    running_scores: torch.Tensor = field(init=False)
    finished_scores: torch.Tensor = field(init=False)
    finished_flags: torch.Tensor = field(init=False)
    finished: List[Optional[Hypothesis]] = field(init=False)
    heuristic_unsatisfied: bool = True
    done: bool = False
    cur_len: int = field(init=False)
    pending: Dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> log-probs awaiting siblings
    record_scores: bool = False  # keep each step's log-probs and raw logits of the live beams (output_scores)
    pending_logits: Dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> raw logits awaiting siblings
    step_scores: List[torch.Tensor] = field(default_factory=list)
    step_logits: List[torch.Tensor] = field(default_factory=list)
    # (generated tokens of a beam, candidate token) -> the stop string the candidate completes, or None.
    # A candidate that completes one ends like EOS does (transformers' `stop_strings` in beam search).
    stop_check: Optional[Callable[[List[int], int], Optional[str]]] = None

    def __post_init__(self) -> None:
        self.running_scores = torch.zeros(1, dtype=torch.float32)
        self.finished_scores = torch.full((self.beam_width,), _BIG, dtype=torch.float32)
        self.finished_flags = torch.zeros(self.beam_width, dtype=torch.bool)
        self.finished = [None] * self.beam_width
        self.cur_len = self.prompt_len
        self._eos_set: Set[int] = set(self.eos_ids)

    def _follow(self, device: torch.device) -> None:
        """Keep the running and finished scores on the device of the log-probs (a GPU model's beams are scored
        there, as transformers does, so ties break the same way)."""
        if self.running_scores.device != device:
            self.running_scores = self.running_scores.to(device)
            self.finished_scores = self.finished_scores.to(device)
            self.finished_flags = self.finished_flags.to(device)

    def record(self, log_probs: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep a step's log-probs and raw logits of the live beams (output_scores). After the first step (one
        row, the prompt) a step has `beam_width` rows as in transformers: a beam dropped for want of an allowed
        continuation leaves a -inf row, where transformers keeps a placeholder beam."""
        missing = self.beam_width - log_probs.shape[0] if self.cur_len > self.prompt_len else 0
        if missing > 0:
            log_probs = torch.cat([log_probs, log_probs.new_full((missing, log_probs.shape[1]), float("-inf"))])
            logits = torch.cat([logits, logits.new_full((missing, logits.shape[1]), float("-inf"))])
        self.step_scores.append(log_probs.clone())
        self.step_logits.append(logits)

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_ids)) * self.beam_width

    def step(self, log_probs: torch.Tensor, beam_tokens: List[List[int]],
             beam_paths: Optional[List[List[int]]] = None) -> List[BeamDecision]:
        """Advance by one token. `log_probs` `[live beams, vocab]` (processed, float32), each live
        beam's generated tokens so far and (optionally) the live beam it extended at each earlier step;
        returns the new live beams, best first."""
        k = self.beam_width
        vocab = log_probs.shape[1]
        self._follow(log_probs.device)
        accumulated = (log_probs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(accumulated, k=self.num_candidates)
        parents = (top_index // vocab).tolist()
        tokens = (top_index % vocab).tolist()
        possible = torch.isfinite(top_scores)  # -inf: a continuation the grammar or a processor forbids
        at_max_length = self.cur_len + 1 >= self.max_length
        stops = self._stop_strings(parents, tokens, beam_tokens)
        hits = torch.tensor([at_max_length or t in self._eos_set or stop is not None
                             for t, stop in zip(tokens, stops)], dtype=torch.bool, device=log_probs.device)

        running = top_scores + hits.to(torch.float32) * _BIG
        keep = self._continued(running, hits | ~possible)
        decisions = [BeamDecision(parents[c], tokens[c], float(log_probs[parents[c], tokens[c]]), float(running[c]))
                     for c in keep]
        paths = beam_paths if beam_paths is not None else [[] for _ in beam_tokens]
        self._update_finished(top_scores, hits & possible, parents, tokens, beam_tokens, paths, stops)
        self.running_scores = running[keep]
        self.cur_len += 1
        self._update_done(hits)
        if self.done and not self.best(1):
            raise BeamSearchExhausted("no beam has a continuation that the request allows (its structured output, "
                                      "allowed_token_ids or logits processors leave none) and none has finished")
        return decisions

    def _continued(self, running: torch.Tensor, ended: torch.Tensor) -> List[int]:
        """The candidates that become the next live beams, best first: transformers' top `k` of the running
        scores, less those that ended or are impossible. transformers keeps those as placeholder beams (an
        ended one at a score 1e9 lower, an impossible one at -inf) that can never outrank a real beam; here
        they are dropped, so a beam never continues past its EOS or with a token its grammar forbids, and
        fewer than `k` beams live on when fewer real continuations exist."""
        keep = torch.topk(running, k=self.beam_width)[1]
        return keep[~ended[keep]].tolist()

    def _stop_strings(self, parents: List[int], tokens: List[int], beam_tokens: List[List[int]]
                      ) -> List[Optional[str]]:
        if self.stop_check is None:
            return [None] * len(tokens)
        return [self.stop_check(beam_tokens[p], t) for p, t in zip(parents, tokens)]

    def _update_finished(self, top_scores: torch.Tensor, hits: torch.Tensor, parents: List[int],
                         tokens: List[int], beam_tokens: List[List[int]], paths: List[List[int]],
                         stops: List[Optional[str]]) -> None:
        k = self.beam_width
        top_mask = torch.arange(len(tokens), device=hits.device) < k
        just_finished = hits & top_mask
        scores = top_scores / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = bool(self.finished_flags.all()) and self.early_stopping is True
        scores += float(full) * _BIG
        scores += float(not self.heuristic_unsatisfied) * _BIG
        scores += (~just_finished) * _BIG
        merged_scores = torch.cat((self.finished_scores, scores))
        merged_flags = torch.cat((self.finished_flags, just_finished))
        chosen = torch.topk(merged_scores, k=k)[1].tolist()
        slots: List[Optional[Hypothesis]] = []
        for c in chosen:
            if c < k:
                slots.append(self.finished[c])
            elif bool(just_finished[c - k]):
                j = c - k
                slots.append(Hypothesis(beam_tokens[parents[j]] + [tokens[j]], float(top_scores[j]),
                                        float(merged_scores[c]), paths[parents[j]] + [parents[j]], stops[j]))
            else:
                slots.append(None)
        self.finished = slots
        self.finished_scores = merged_scores[chosen]
        self.finished_flags = merged_flags[chosen]

    def _update_done(self, hits: torch.Tensor) -> None:
        if self.running_scores.numel() == 0:  # no beam has a continuation left
            self.done = True
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_possible = self.running_scores[:1] / (best_len ** self.length_penalty)
        worst_finished = torch.where(self.finished_flags, torch.min(self.finished_scores),
                                     torch.tensor(_BIG, dtype=torch.float32, device=hits.device))
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and bool(torch.any(best_possible > worst_finished))
        exists_open_beam = not (bool(self.finished_flags.all()) and self.early_stopping is True)
        valid_continuations = not bool(hits.all())
        self.done = not (self.heuristic_unsatisfied and exists_open_beam and valid_continuations)

    def best(self, n: int) -> List[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return [h for h in self.finished[:n] if h is not None]
