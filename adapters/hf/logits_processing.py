"""transformers' logits processors inside the engine, for the `generate` arguments that need them:
`logits_processor` (transformers' processors or the user's own), `bad_words_ids`, `no_repeat_ngram_size`,
`suppress_tokens`, `begin_suppress_tokens`, `sequence_bias` and `prefix_allowed_tokens_fn`.

When a call asks for any of them, each prompt row's request carries one engine logits processor that runs
the list transformers' `generate` would build (its own classes, in its order: sequence bias, repetition
penalty, no-repeat n-grams, bad words, min length, min new tokens, prefix constraint, suppressed tokens,
suppressed first tokens, then the user's list merged in as transformers merges it) on transformers' view of
the row: `input_ids` of shape [1, L] holding the left-padded prompt row as passed plus the tokens generated
so far, and the row's float32 scores (log-probabilities in beam search). The repetition penalty and the
minimum lengths then run here, in transformers' place, instead of in the engine's sampler; temperature,
top-k, top-p and min-p stay in the engine, after the list, where transformers' warpers run.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, MinLengthLogitsProcessor,
                                                    MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, PrefixConstrainedLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    SuppressTokensAtBeginLogitsProcessor,
                                                    SuppressTokensLogitsProcessor)

PrefixFn = Callable[[int, torch.Tensor], List[int]]


def asks_for_processors(config: GenerationConfig, logits_processor, prefix_allowed_tokens_fn) -> bool:
    """True when the call needs transformers' processors run in the engine."""
    return bool((logits_processor is not None and len(logits_processor) > 0) or prefix_allowed_tokens_fn is not None
                or config.sequence_bias is not None or (config.no_repeat_ngram_size or 0) > 0
                or config.bad_words_ids is not None or config.suppress_tokens is not None
                or config.begin_suppress_tokens is not None)


def check_user_processors(logits_processor) -> None:
    """A list (or LogitsProcessorList) of callables `(input_ids, scores) -> scores`, as transformers takes."""
    if logits_processor is None:
        return
    if callable(logits_processor) and not isinstance(logits_processor, (list, tuple)):
        raise ValueError("logits_processor must be a LogitsProcessorList (or a list) of processors, "
                         f"got a single {type(logits_processor).__name__}")
    for processor in logits_processor:
        if not callable(processor):
            raise ValueError(f"logits_processor items must be callables (input_ids, scores) -> scores, "
                             f"got {type(processor).__name__}")


def _merge(defaults: List[Any], custom: Sequence[Any]) -> LogitsProcessorList:
    """transformers' merge: a user processor of the same type as a default one takes its place; the other
    user processors follow the defaults in their order."""
    merged = LogitsProcessorList()
    for default in defaults:
        merged.append(next((c for c in custom if type(c) is type(default)), default))
    for processor in custom:
        if processor not in merged:
            merged.append(processor)
    return merged


def _row_prefix_fn(prefix_allowed_tokens_fn: PrefixFn, batch_id: int) -> PrefixFn:
    """The user's function called with the row's batch id (transformers' `row // max(num_beams,
    num_return_sequences)`: the prompt's index) although the list sees one row at a time."""
    def allowed(_row: int, sent: torch.Tensor) -> List[int]:
        return prefix_allowed_tokens_fn(batch_id, sent)
    return allowed


def row_processor_list(config: GenerationConfig, batch_id: int, padded_len: int, padding: int,
                       eos_ids: Optional[List[int]], user_processors, prefix_allowed_tokens_fn: Optional[PrefixFn],
                       device: torch.device) -> LogitsProcessorList:
    """The processors transformers' `_get_logits_processor` would build for one prompt row (before its
    warpers), with the user's list merged in. `padding` is the row's number of left pad tokens."""
    eos = None if not eos_ids else torch.tensor(eos_ids, device=device)
    defaults: List[Any] = []
    if config.sequence_bias is not None:
        defaults.append(SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        defaults.append(RepetitionPenaltyLogitsProcessor(float(config.repetition_penalty),
                                                         prompt_ignore_length=torch.tensor([padding])))
    if config.no_repeat_ngram_size:
        defaults.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        defaults.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_length is not None and eos is not None and config.min_length > 0:
        defaults.append(MinLengthLogitsProcessor(config.min_length, eos, device=device))
    if config.min_new_tokens is not None and eos is not None and config.min_new_tokens > 0:
        defaults.append(MinNewTokensLengthLogitsProcessor(padded_len, config.min_new_tokens, eos, device=device))
    if prefix_allowed_tokens_fn is not None:
        defaults.append(PrefixConstrainedLogitsProcessor(_row_prefix_fn(prefix_allowed_tokens_fn, batch_id), 1))
    if config.suppress_tokens is not None:
        defaults.append(SuppressTokensLogitsProcessor(config.suppress_tokens, device=device))
    if config.begin_suppress_tokens is not None:
        defaults.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, padded_len, device=device))
    return _merge(defaults, list(user_processors or []))


class TransformersRowProcessors:
    """An engine logits processor (vLLM v0's `(prompt_ids, output_ids, logits_row)` shape) that runs a
    transformers processor list on transformers' view of one row: the padded prompt row plus the output."""

    def __init__(self, processors: LogitsProcessorList, padded_prompt: Sequence[int]) -> None:
        self.processors = processors
        self.padded_prompt = [int(t) for t in padded_prompt]

    def __call__(self, prompt_token_ids: List[int], output_token_ids: List[int],
                 logits: torch.Tensor) -> torch.Tensor:
        input_ids = torch.tensor([self.padded_prompt + list(output_token_ids)], dtype=torch.long,
                                 device=logits.device)
        scores = self.processors(input_ids, logits.unsqueeze(0))
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (1, logits.shape[-1]):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"a logits processor returned {got}; expected scores of shape (1, {logits.shape[-1]})")
        return scores[0]
