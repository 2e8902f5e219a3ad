"""Incremental detokenization: the text of each new token without re-decoding whole outputs, and
stop-string matching on the growing text."""

from __future__ import annotations

from typing import List, Optional

from paged_backend.core.sequence import Sequence

# The cost of a step's decoding grows with the tokens decoded: the window is kept short. Measured over 256
# sequences (tests/test_detokenizer.py holds the text equal to whole decodes, also for the Metaspace and WordPiece
# decoders, which need one token of context): a 16-token window sliding to 5 decoded 0.62 ms per step, this one
# 0.31.
_CONTEXT_TOKENS = 5   # prompt tokens decoded before the first output token, so that merges and spaces come out right
_WINDOW_TOKENS = 4    # the decoded window grows to this many tokens before it slides forward ...
_SLIDE_CONTEXT_TOKENS = 1   # ... keeping this many tokens of context before the next new one


class BatchDecoder:
    """Decodes many token lists: the tokenizers library's own `decode` per list where the tokenizer is a fast one
    whose `decode` adds nothing to it (no clean-up of spaces), `tokenizer.decode` per list otherwise, so the text
    is the same either way. Not `decode_batch`: its thread pool costs more than it saves on short windows (256
    windows of 5 smollm2 tokens, 2 cores: 0.46-0.61 ms a call against 0.31 ms for the loop; 8 windows: 0.10
    against 0.013)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = _plain_backend(tokenizer)

    def decode(self, windows: List[List[int]], skip_special_tokens: bool) -> List[str]:
        if not windows:
            return []
        decode = self.backend.decode if self.backend is not None else self.tokenizer.decode
        return [decode(w, skip_special_tokens=skip_special_tokens) for w in windows]

    def decode_each(self, windows: List[List[int]], skips: List[bool]) -> List[str]:
        """One text per window, each with its own `skip_special_tokens` (at most two batched calls)."""
        if all(skips) or not any(skips):
            return self.decode(windows, bool(skips and skips[0]))
        texts: List[str] = [""] * len(windows)
        for flag in (False, True):
            rows = [i for i, skip in enumerate(skips) if skip == flag]
            for i, text in zip(rows, self.decode([windows[i] for i in rows], flag)):
                texts[i] = text
        return texts


def _plain_backend(tokenizer):
    """The tokenizers-library object behind a transformers tokenizer whose `decode` is exactly its `decode`, or
    None (no tokenizer, a slow one, a subclass with its own decoding, or a clean-up of spaces that applies)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend):   # a wrapper or another class: its own decode is the truth
        return None
    kind = type(tokenizer)
    if kind.decode is not PreTrainedTokenizerBase.decode or kind._decode is not TokenizersBackend._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        bpe = type(backend.model).__name__ == "BPE"
        if not bpe or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                              False):
            return None
    return backend


def decode_new_text(tokenizer, seq: Sequence, skip_special_tokens: bool) -> str:
    """Append the text of the sequence's newest tokens to `seq.output_text`; returns the new piece.

    One decode per call: the text of the window's tokens already emitted is kept from the previous call, and the
    window (context, then everything since) slides forward every few tokens (a second, short decode)."""
    if tokenizer is None:
        return ""
    return decode_new_texts(BatchDecoder(tokenizer), [seq], [skip_special_tokens])[0]


def decode_new_texts(decoder: BatchDecoder, seqs: List[Sequence], skips: List[bool]) -> List[str]:
    """`decode_new_text` for a step's sequences with batched decoding: the windows of the sequences that start
    now, then every sequence's window, then the windows that slide forward, each one batched call. The
    sequences are changed only once every decode of the first two calls has succeeded."""
    started = [i for i, seq in enumerate(seqs) if not seq.detok_started]
    prefix_texts = [seq.detok_prefix_text for seq in seqs]
    prefix_offsets = [seq.detok_prefix_offset for seq in seqs]
    if started:
        for i in started:
            prefix_offsets[i] = max(seqs[i].prompt_len - _CONTEXT_TOKENS, 0)
        tails = decoder.decode_each([seqs[i].token_ids[prefix_offsets[i]:seqs[i].prompt_len] for i in started],
                                    [skips[i] for i in started])
        for i, text in zip(started, tails):
            prefix_texts[i] = text
    fulls = decoder.decode_each([seq.token_ids[start:] for seq, start in zip(seqs, prefix_offsets)], skips)
    for i in started:
        seq = seqs[i]
        seq.detok_started = True
        seq.detok_read_offset = seq.prompt_len
        seq.detok_prefix_offset = prefix_offsets[i]
        seq.detok_prefix_text = prefix_texts[i]
    deltas: List[str] = []
    sliding: List[int] = []
    for i, (seq, full) in enumerate(zip(seqs, fulls)):
        prefix = seq.detok_prefix_text
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            deltas.append("")  # an incomplete UTF-8 character or a token with no text: wait for more
            continue
        delta = full[len(prefix):]
        seq.detok_read_offset = len(seq.token_ids)
        seq.detok_prefix_text = full
        if seq.detok_read_offset - seq.detok_prefix_offset > _WINDOW_TOKENS:
            seq.detok_prefix_offset = seq.detok_read_offset - _SLIDE_CONTEXT_TOKENS
            sliding.append(i)
        seq.output_text += delta
        deltas.append(delta)
    if sliding:
        texts = decoder.decode_each([seqs[i].token_ids[seqs[i].detok_prefix_offset:seqs[i].detok_read_offset]
                                     for i in sliding], [skips[i] for i in sliding])
        for i, text in zip(sliding, texts):
            seqs[i].detok_prefix_text = text
    return deltas


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
