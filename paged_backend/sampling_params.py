"""`SamplingParams`: how to pick tokens for one request, validated at construction (vLLM's names)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

from paged_backend.errors import InvalidParameter
from paged_backend.sampling.logits_processors import check_logits_processors
from paged_backend.structured.params import StructuredOutputsParams, structured_outputs_from

_EPS = 1e-6
_INT64 = 2 ** 63
# Bounds on the per-request lists whose cost grows with their size every step (stop strings are searched in
# the new text, bad words tokenized once and matched each step); far above what vLLM or TGI users send.
MAX_STOP_STRINGS = 256
MAX_BAD_WORDS = 4096
MAX_STRING_CHARS = 1024  # characters of one stop string or bad word


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bad(name: str, message: str) -> InvalidParameter:
    return InvalidParameter(message, param=name)


def _short(value, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (a refused list may hold thousands of items)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _check_strings(name: str, strings: List[str], limit: int) -> None:
    """At most `limit` strings of at most MAX_STRING_CHARS characters each."""
    if len(strings) > limit:
        raise _bad(name, f"{name} has {len(strings)} entries; at most {limit} are accepted")
    longest = max((len(s) for s in strings), default=0)
    if longest > MAX_STRING_CHARS:
        raise _bad(name, f"{name} has an entry of {longest} characters; at most {MAX_STRING_CHARS} are accepted")


class RequestOutputKind(enum.Enum):
    """What the engine reports for a request after each step (vLLM's names)."""

    CUMULATIVE = 0   # everything generated so far
    DELTA = 1        # only what is new since the last output (see streaming.py)
    FINAL_ONLY = 2   # nothing until the request has finished


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    temperature=0 is greedy. `beam_width > 1` turns on beam search (then temperature must be 0 and
    `n <= beam_width`). `max_tokens=None` generates until EOS, a stop condition or the context limit.
    `top_k` 0 or -1 disables top-k (stored as -1). Errors are `InvalidParameter`s naming the field.
    """

    n: int = 1
    best_of: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    detokenize: bool = True          # False: outputs carry token ids only (no text, no stop strings)
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    output_scores: bool = False  # keep the processed per-step scores (used by the HF adapter)
    # vLLM v0's per-request processors: (output_ids, logits_row) or (prompt_ids, output_ids, logits_row)
    # -> logits_row, applied after the penalties; an exception fails this request only.
    logits_processors: Optional[List[Callable]] = None
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's names; a dict or JSON string of
    # StructuredOutputsParams' fields is accepted too); `guided_decoding` is vLLM's older name for it.
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None
    # vLLM's token constraints, turned into logits processors by the engine (token_constraints.py)
    logit_bias: Optional[Dict[int, float]] = None    # token id -> added to its logit
    allowed_token_ids: Optional[List[int]] = None    # only these tokens may be generated
    bad_words: Optional[List[str]] = None            # words whose last token is banned where it would complete them
    truncate_prompt_tokens: Optional[int] = None     # keep only the last k prompt tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: List[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        try:
            self.logits_processors = check_logits_processors(self.logits_processors)
        except InvalidParameter:
            raise
        except ValueError as exc:
            raise _bad("logits_processors", str(exc)) from None
        if self.top_k == 0 and _is_int(self.top_k):
            self.top_k = -1
        self._check_structured_outputs()
        self._check_counts()
        self._check_sampling()
        self._check_stops()
        self._check_beam()
        self._check_constraints()

    def _check_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", f"n must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.best_of) or self.best_of < self.n:
            raise _bad("best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -_INT64 <= self.seed < 2 * _INT64):
            raise _bad("seed", f"seed must be a 64-bit integer or None, got {self.seed!r}")

    def _check_sampling(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _bad("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0 or self.top_k >= _INT64:
            raise _bad("top_k", f"top_k must be 0 or -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty",
                       f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise _bad(name, f"{name} must be in [-2, 2], got {value!r}")
        if self.is_greedy and self.best_of > 1 and self.beam_width == 1:
            if self.n > 1:  # vLLM names n: best_of only follows it
                raise _bad("n", f"n={self.n} needs sampling: greedy (temperature=0) gives one answer")
            raise _bad("best_of", f"best_of={self.best_of} needs sampling: greedy (temperature=0) gives one answer")

    def _check_stops(self) -> None:
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise _bad("stop", f"stop must be a non-empty string or a list of non-empty strings, got "
                               f"{_short(self.stop)}")
        _check_strings("stop", self.stop_strings, MAX_STOP_STRINGS)
        if self.stop_strings and not self.detokenize:
            raise _bad("stop", "stop strings need detokenize=True (they are matched on the text)")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", f"stop_token_ids must be non-negative integers, got "
                                         f"{_short(self.stop_token_ids)}")

    def _check_structured_outputs(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise _bad("guided_decoding", "give structured_outputs or its older name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        try:
            self.structured_outputs = structured_outputs_from(self.structured_outputs)
        except InvalidParameter:
            raise
        except ValueError as exc:
            raise _bad("structured_outputs", str(exc)) from None
        if self.structured_outputs is not None and self.ignore_eos:
            raise _bad("ignore_eos", "ignore_eos cannot be combined with structured_outputs: the output ends where "
                                     "the grammar does")

    def _check_beam(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise _bad("beam_width", f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.early_stopping not in (True, False, "never"):
            raise _bad("early_stopping", f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not _is_number(self.length_penalty):
            raise _bad("length_penalty", f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.beam_width == 1:
            return
        if self.temperature > _EPS:
            raise _bad("temperature", "beam search (beam_width > 1) needs temperature=0")
        if self.n > self.beam_width:
            raise _bad("n", f"n ({self.n}) must not exceed beam_width ({self.beam_width})")
        if self.best_of not in (self.n, self.beam_width):
            raise _bad("best_of", "best_of has no meaning with beam search; use beam_width")
        if self.min_p > 0 or self.top_k != -1 or self.top_p < 1.0:
            raise _bad("top_k", "top_k, top_p and min_p do not apply to beam search")

    def _check_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not _is_int(k) or k < 0 or not _is_number(v) for k, v in self.logit_bias.items()):
                raise _bad("logit_bias", f"logit_bias must map token ids (integers >= 0) to finite numbers, "
                                         f"got {_short(self.logit_bias)}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise _bad("allowed_token_ids", f"allowed_token_ids must be a non-empty list of token ids, got "
                                                f"{_short(ids)}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w.strip() for w in words):
                raise _bad("bad_words", f"bad_words must be a list of non-empty strings, got {_short(words)}")
            _check_strings("bad_words", words, MAX_BAD_WORDS)
            if words and not self.detokenize:
                raise _bad("bad_words", "bad_words need detokenize=True (the words are tokenized)")
            self.bad_words = list(words)
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            raise _bad("truncate_prompt_tokens",
                       f"truncate_prompt_tokens must be an integer >= 1 or None, got {self.truncate_prompt_tokens!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _bad("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def reports_logprobs(self) -> bool:
        """Whether outputs carry `cumulative_logprob`: when `logprobs` is set (0 is enough), when best_of > n
        samples are ranked by it, and for beam search (vLLM v1's contract: otherwise it is None, so that a
        greedy step need not compute its rows' log-normalisers)."""
        return self.logprobs is not None or self.best_of > self.n or self.use_beam_search

    @property
    def num_branches(self) -> int:
        """Sequences the request runs at once after its prompt: best_of samples or beam_width beams."""
        return self.beam_width if self.use_beam_search else self.best_of

    def replace(self, **changes) -> "SamplingParams":
        """A validated copy with some fields changed."""
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        if "n" in changes and "best_of" not in changes and values["best_of"] == values["n"]:
            values["best_of"] = None
        values.update(changes)
        return SamplingParams(**values)
