"""`Logprob`: a log-probability that also carries its rank, as the sampler reports it and outputs hold it."""

from __future__ import annotations

from typing import Optional


class Logprob(float):
    """A token's log-probability (a float, so existing code reads it as one) with its `rank` at that position:
    1 for the most likely token, as vLLM's `Logprob.rank` (None where the engine did not rank it)."""

    __slots__ = ("rank",)

    def __new__(cls, value: float, rank: Optional[int] = None) -> "Logprob":
        self = super().__new__(cls, value)
        self.rank = rank
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return (Logprob, (float(self), self.rank))

    def __repr__(self) -> str:
        return f"Logprob({float(self)!r}, rank={self.rank})"
