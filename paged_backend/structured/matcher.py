"""Per-sequence grammar state and the batched token mask of a step.

`GrammarState` follows one sequence through its grammar: `accept` advances it by a sampled token (refusing
one the grammar does not allow), `fork` copies it for a new sample or beam, `rebuild` replays a token list
(for a sequence whose state was lost). EOS is allowed only where the grammar is complete.
`GrammarMasker.apply` fills one bitmask for a step's constrained rows and masks their logits in one batched
operation; rows without a constraint are not touched and cost nothing.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from paged_backend.structured.compiler import CompiledConstraint, _xgrammar

# Bit j of an int32 word (bit 31 is the sign bit, -2**31); one bitwise_and per word and bit unpacks a mask.
_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)


class GrammarState:
    """The matcher state of one sequence under one compiled constraint."""

    def __init__(self, constraint: CompiledConstraint, _matcher=None) -> None:
        self.constraint = constraint
        self._matcher = _matcher if _matcher is not None else _xgrammar().GrammarMatcher(constraint.grammar)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it here."""
        if not self._matcher.accept_token(int(token_id)):
            return False
        self.num_accepted += 1
        return True

    def rebuild(self, token_ids: Sequence[int]) -> None:
        """Reset and replay `token_ids` (the sequence's generated tokens); ValueError on a rejected token."""
        self._matcher.reset()
        self.num_accepted = 0
        for position, token in enumerate(token_ids):
            if not self.accept(token):
                raise ValueError(f"token {int(token)} at output position {position} does not match the "
                                 "request's structured output constraint")

    def fork(self) -> "GrammarState":
        """An independent copy (for a forked sample or beam)."""
        child = GrammarState(self.constraint, self._matcher.fork())
        child.num_accepted = self.num_accepted
        return child

    @property
    def is_completed(self) -> bool:
        """The tokens so far form a complete match: EOS is allowed now."""
        return self._matcher.is_completed()

    @property
    def is_terminated(self) -> bool:
        """EOS was accepted: the grammar allows no further token."""
        return self._matcher.is_terminated()

    def allowed_token_ids(self) -> List[int]:
        """The tokens allowed next (for tests and debugging; the step uses `GrammarMasker`)."""
        bitmask = torch.empty((1, _bitmask_width(self.constraint.vocab_size)), dtype=torch.int32)
        self._fill(bitmask, 0)
        allowed = _unpack(bitmask, self.constraint.vocab_size)[0]
        return torch.nonzero(allowed).flatten().tolist()

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            raise ValueError("this sequence's grammar is terminated (EOS was accepted): nothing more may be sampled")
        self._matcher.fill_next_token_bitmask(bitmask, row)


def accept_grammar(seq, token_id: int) -> None:
    """Advance a sequence's grammar (if it has one) by the token about to be appended; the sampler masked
    everything the grammar forbids, so a refusal is a bug and fails the request (the state is unchanged)."""
    if seq.grammar is not None and not seq.grammar.accept(token_id):
        raise RuntimeError(f"token {token_id} was sampled but the structured-output grammar does not allow it")


def _bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 bit words -> [rows, V] bool (bit j of word w is token 32 * w + j)."""
    bits = bitmask.unsqueeze(-1).bitwise_and(_BITS.to(bitmask.device)).ne(0)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]


class GrammarMasker:
    """Masks a step's constrained logits rows with their grammars' allowed tokens, all rows at once.

    Keeps one bitmask buffer (grown to the largest batch seen) and xgrammar's batch matcher, which can fill
    the rows in parallel threads (one by default: filling 32 JSON rows takes well under a millisecond here,
    less than handing work to threads; applying the mask is the larger cost).
    """

    def __init__(self, vocab_size: int, max_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._bitmask: Optional[torch.Tensor] = None
        self._batch = _xgrammar().BatchGrammarMatcher(max_threads)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
        """Set logits[row, t] = -inf for every token t the state of that row does not allow (in place)."""
        if len(rows) != len(states):
            raise ValueError(f"{len(rows)} rows but {len(states)} grammar states")
        if not rows:
            return
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [rows, {self.vocab_size}], got {list(logits.shape)}")
        for state in states:
            if state.constraint.vocab_size != self.vocab_size:
                raise ValueError(f"a grammar compiled for vocabulary size {state.constraint.vocab_size} "
                                 f"cannot mask logits of size {self.vocab_size}")
            if state.is_terminated:
                raise ValueError("a row's grammar is terminated (EOS was accepted): nothing more may be sampled")
        bitmask = self._buffer(logits.shape[0])
        row_list = [int(r) for r in rows]
        self._batch.batch_fill_next_token_bitmask([s._matcher for s in states], bitmask, row_list)
        _apply_bitmask(logits, bitmask, row_list, self.vocab_size)

    def apply_isolated(self, logits: torch.Tensor, rows: Sequence[int],
                       states: Sequence[GrammarState]) -> Dict[int, str]:
        """`apply`, except that a row whose grammar cannot give a mask (it is terminated, or the matcher fails)
        fails alone: returns those rows (row -> what went wrong), the others are masked. Filling a mask does
        not change a matcher, so rows are retried one by one only after the batched call failed."""
        failures = {int(r): "the structured-output grammar is terminated (EOS was accepted): nothing more may be "
                    "sampled" for r, s in zip(rows, states) if s.is_terminated}
        if failures:
            states = [s for r, s in zip(rows, states) if int(r) not in failures]
            rows = [r for r in rows if int(r) not in failures]
        try:
            self.apply(logits, rows, states)
        except Exception:  # noqa: BLE001 - find the rows at fault
            for row, state in zip(rows, states):
                try:
                    self.apply(logits, [row], [state])
                except Exception as exc:  # noqa: BLE001 - the error belongs to this row's request only
                    failures[int(row)] = f"structured-output mask failed: {type(exc).__name__}: {exc}"
        return failures

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.empty((num_rows, _bitmask_width(self.vocab_size)), dtype=torch.int32)
        return self._bitmask


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: List[int], vocab_size: int) -> None:
    """xgrammar's CPU kernel for CPU float32/16/bf16 logits; a torch op on the bitmask for anything else."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16, torch.bfloat16):
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
        return
    index = torch.tensor(rows, device=logits.device)
    allowed = _unpack(bitmask[rows].to(logits.device, non_blocking=True), vocab_size)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
