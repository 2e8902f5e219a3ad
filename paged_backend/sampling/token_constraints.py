"""vLLM's token constraints of `SamplingParams` (`logit_bias`, `allowed_token_ids`, `bad_words`) as
per-request logits processors, checked against the model's vocabulary when the request is added.

- `logit_bias`: the bias of each listed token is added to its logit.
- `allowed_token_ids`: every other token is masked out.
- `bad_words`: each word is tokenized as it would start the text and, where that differs, after a space;
  the last token of a word is masked wherever the tokens generated so far end with the rest of the word
  (a one-token word is always masked), as vLLM does. (vLLM keeps the spaced form only when it has as many
  tokens as the plain one; here it is always kept, so " word" is banned inside a text too.)
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from paged_backend.errors import InvalidParameter
from paged_backend.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise InvalidParameter(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=name)


class LogitBias:
    """Adds a fixed bias to some tokens' logits."""

    def __init__(self, bias: Dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, output_ids: List[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.ids.to(logits.device)] += self.values.to(logits.device, logits.dtype)
        return logits


class AllowedTokens:
    """Masks every token not in a fixed set."""

    def __init__(self, ids: Sequence[int], vocab_size: int) -> None:
        self.blocked = torch.ones(vocab_size, dtype=torch.bool)
        self.blocked[torch.tensor(sorted(set(ids)), dtype=torch.long)] = False

    def __call__(self, output_ids: List[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill_(self.blocked.to(logits.device), NEG_INF)


class BadWords:
    """Masks the last token of each word's token sequence where the output so far ends with its prefix.

    The sequences are indexed by prefix, so a step costs one lookup per distinct prefix length, not one
    comparison per word."""

    def __init__(self, sequences: List[List[int]]) -> None:
        self.sequences = sequences
        self.always = sorted({seq[-1] for seq in sequences if len(seq) == 1})
        self.after: Dict[int, Dict[tuple, List[int]]] = {}  # prefix length -> prefix -> banned last tokens
        for seq in sequences:
            if len(seq) > 1:
                self.after.setdefault(len(seq) - 1, {}).setdefault(tuple(seq[:-1]), []).append(seq[-1])

    def __call__(self, output_ids: List[int], logits: torch.Tensor) -> torch.Tensor:
        banned = list(self.always)
        for length, by_prefix in self.after.items():
            if len(output_ids) >= length:
                banned += by_prefix.get(tuple(output_ids[len(output_ids) - length:]), ())
        if banned:
            logits[torch.tensor(banned, dtype=torch.long, device=logits.device)] = NEG_INF
        return logits


_WORDS_PER_CALL = 128  # a batched tokenizer call holds the GIL throughout: keep each one short


def _tokenize_words(tokenizer, texts: List[str]) -> List[List[int]]:
    ids: List[List[int]] = []
    for start in range(0, len(texts), _WORDS_PER_CALL):
        ids += tokenizer(texts[start:start + _WORDS_PER_CALL], add_special_tokens=False)["input_ids"]
    return ids


def bad_word_sequences(tokenizer, words: Sequence[str]) -> List[List[int]]:
    """The token sequences of each word: as the text's first word and, when it tokenizes differently, after
    a space (the same word in the middle of a text). Tokenized in batches of `_WORDS_PER_CALL` words."""
    stripped = [word.lstrip() for word in words]
    plain_ids = _tokenize_words(tokenizer, stripped)
    spaced_ids = _tokenize_words(tokenizer, [" " + word for word in stripped])
    sequences: List[List[int]] = []
    for plain, spaced in zip(plain_ids, spaced_ids):
        if not plain:
            continue
        sequences.append(list(plain))
        if spaced and list(spaced) != list(plain):
            sequences.append(list(spaced))
    return sequences


def constraint_processors(params: SamplingParams, tokenizer, vocab_size: int) -> List:
    """The logits processors that implement the request's token constraints (validated here)."""
    processors = []
    if params.logit_bias:
        _check_ids("logit_bias", list(params.logit_bias), vocab_size)
        processors.append(LogitBias(params.logit_bias))
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
        processors.append(AllowedTokens(params.allowed_token_ids, vocab_size))
    if params.bad_words:
        if tokenizer is None:
            raise InvalidParameter("bad_words need a tokenizer; this engine has none", param="bad_words")
        sequences = bad_word_sequences(tokenizer, params.bad_words)
        _check_ids("bad_words", [t for seq in sequences for t in seq], vocab_size)
        processors.append(BadWords(sequences))
    return processors
