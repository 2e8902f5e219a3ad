"""Errors the engine raises that callers (and fronts) tell apart by type, not by message."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run any more steps (e.g. a tensor-parallel worker died); every request in it has
    failed and a new engine is needed. Runners raise it (or a subclass) for failures nothing can retry."""
