"""Incremental detokenization: the text of each new token without re-decoding whole outputs, and
stop-string matching on the growing text."""

from __future__ import annotations

from typing import List, Optional

from paged_backend.core.sequence import Sequence

_CONTEXT_TOKENS = 5   # tokens decoded before the new ones, so that merges and spaces come out right
_WINDOW_TOKENS = 16   # the decoded window grows to this many tokens before it slides forward


def decode_new_text(tokenizer, seq: Sequence, skip_special_tokens: bool) -> str:
    """Append the text of the sequence's newest tokens to `seq.output_text`; returns the new piece.

    One decode per call: the text of the window's tokens already emitted is kept from the previous call,
    and the window (context, then everything since) slides forward only every few tokens."""
    if tokenizer is None:
        return ""
    ids = seq.token_ids
    if not seq.detok_started:
        seq.detok_started = True
        seq.detok_read_offset = seq.prompt_len
        seq.detok_prefix_offset = max(seq.prompt_len - _CONTEXT_TOKENS, 0)
        seq.detok_prefix_text = tokenizer.decode(ids[seq.detok_prefix_offset:seq.detok_read_offset],
                                                 skip_special_tokens=skip_special_tokens)
    prefix = seq.detok_prefix_text
    full = tokenizer.decode(ids[seq.detok_prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""  # an incomplete UTF-8 character or a token with no text: wait for more
    delta = full[len(prefix):]
    seq.detok_read_offset = len(ids)
    seq.detok_prefix_text = full
    if seq.detok_read_offset - seq.detok_prefix_offset > _WINDOW_TOKENS:
        seq.detok_prefix_offset = seq.detok_read_offset - _CONTEXT_TOKENS
        seq.detok_prefix_text = tokenizer.decode(ids[seq.detok_prefix_offset:seq.detok_read_offset],
                                                 skip_special_tokens=skip_special_tokens)
    seq.output_text += delta
    return delta


def find_stop_string(text: str, new_len: int, stops: List[str]) -> Optional[tuple]:
    """(stop string, index) of the earliest stop string that ends inside the newest `new_len` chars."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best


def stop_string_in_candidate(tokenizer, output_ids: List[int], token: int, stops: List[str],
                             skip_special_tokens: bool) -> Optional[str]:
    """The stop string that ends inside the text `token` adds after `output_ids`, or None (beam search
    checks every candidate continuation this way, as transformers' `stop_strings` does)."""
    context = output_ids[-(max(len(s) for s in stops) + _CONTEXT_TOKENS):]
    before = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    after = tokenizer.decode(context + [token], skip_special_tokens=skip_special_tokens)
    found = find_stop_string(after, max(0, len(after) - len(before)), stops)
    return found[0] if found is not None else None


def cut_at_stop(text: str, new_len: int, stop: str, include_stop: bool) -> str:
    """`text` up to the stop string that ends inside its newest `new_len` characters (or through it)."""
    found = find_stop_string(text, new_len, [stop])
    if found is None:
        return text
    return text[: found[1] + len(stop) if include_stop else found[1]]
