"""Turns a request's sequences (or its beam hypotheses) into the `RequestOutput` users receive."""

from __future__ import annotations

from typing import List, Optional

from paged_backend.sampling.beam_search import BeamSearchState, Hypothesis
from paged_backend.engine.detokenizer import cut_at_stop
from paged_backend.engine.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling_params import SamplingParams
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus


class OutputBuilder:
    """Builds outputs with the engine's tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def build(self, group: SequenceGroup, final: bool = False) -> RequestOutput:
        m = group.metrics
        state: Optional[BeamSearchState] = group.beam_state
        recorded = state is not None and state.record_scores
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             self.completions(group, final), final, group.error,
                             {"arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
                              "first_token_time": m.first_token_time, "last_token_time": m.last_token_time,
                              "finished_time": m.finished_time},
                             step_scores=list(state.step_scores) if recorded else None,
                             step_logits=list(state.step_logits) if recorded else None)

    def completions(self, group: SequenceGroup, final: bool) -> List[CompletionOutput]:
        """One output per returned sequence: the first n, or the n most likely of best_of when done."""
        params = group.sampling_params
        if params.use_beam_search:
            return self._beam_completions(group, final)
        seqs = group.seqs
        if final and params.best_of > params.n and len(seqs) > params.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            seqs = seqs[: params.n]
        return [self._completion(i, seq, params) for i, seq in enumerate(seqs)]

    @staticmethod
    def _completion(index: int, seq: Sequence, params: SamplingParams) -> CompletionOutput:
        return CompletionOutput(
            index=index, text=seq.output_text, token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if params.reports_logprobs else None,
            logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
            finish_reason=seq.status.value if seq.is_finished() else None, stop_reason=seq.stop_reason,
            scores=[scores for _, scores in seq.output_scores] if params.output_scores else None,
            logits=[logits for logits, _ in seq.output_scores] if params.output_scores else None)

    def _decode(self, token_ids: List[int], params: SamplingParams) -> str:
        if self.tokenizer is None or not params.detokenize:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _hypothesis_text(self, hyp: Hypothesis, params: SamplingParams) -> str:
        """The hypothesis' text, cut at the stop string that ended it (as sampled outputs are)."""
        text = self._decode(hyp.token_ids, params)
        if hyp.stop_reason is None or not text:
            return text
        new_len = len(text) - len(self._decode(hyp.token_ids[:-1], params))
        return cut_at_stop(text, max(new_len, 0), hyp.stop_reason, params.include_stop_str_in_output)

    def _beam_completions(self, group: SequenceGroup, final: bool) -> List[CompletionOutput]:
        """The best finished hypotheses once done; the live beams while running or when aborted."""
        params = group.sampling_params
        state: BeamSearchState = group.beam_state
        aborted = group.error is not None or any(s.status == SequenceStatus.FINISHED_ABORTED for s in group.seqs)
        if final and not aborted:
            stop_ids = set(group.stop_ids)
            return [CompletionOutput(i, self._hypothesis_text(hyp, params), hyp.token_ids, hyp.sum_logprob,
                                     finish_reason="stop" if hyp.stop_reason is not None or
                                     (hyp.token_ids and hyp.token_ids[-1] in stop_ids) else "length",
                                     stop_reason=hyp.stop_reason,
                                     beam_score=hyp.score, beam_indices=list(hyp.beam_indices))
                    for i, hyp in enumerate(state.best(params.n))]
        return [CompletionOutput(i, self._decode(seq.output_token_ids, params), seq.output_token_ids,
                                 seq.cumulative_logprob, finish_reason="abort" if final else None,
                                 beam_indices=list(seq.beam_indices))
                for i, seq in enumerate(group.seqs[: params.n])]
