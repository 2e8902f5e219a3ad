"""Errors the engine raises that callers (and fronts) tell apart by type, not by message.

Every refusal of a request is an `InvalidRequest` (a `ValueError`); its subclass says why, and `param`
names the field at fault when there is one, so each front maps it to its own status code and shape:

    InvalidRequest            bad input (an empty prompt, token ids outside the vocabulary, ...)
      InvalidParameter        a parameter with a wrong type or value
        UnsupportedParameter  a parameter (or value) this engine does not implement
      PromptTooLong           the prompt, or prompt + max_tokens, exceeds the model's context
      CannotFit               the request can never fit the KV cache or max_num_seqs, even running alone
"""

from __future__ import annotations

from typing import Optional


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field, if one is at fault."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidParameter(InvalidRequest):
    """A parameter has a wrong type or a value outside its range."""


class UnsupportedParameter(InvalidParameter):
    """A parameter, or a value of it, that this engine does not implement (refused, never ignored)."""


class PromptTooLong(InvalidRequest):
    """The prompt (or the prompt plus max_tokens) does not fit the model's context."""


class CannotFit(InvalidRequest):
    """The request needs more KV blocks (or sequences per step) than the engine has, even running alone."""


class EngineDeadError(RuntimeError):
    """The engine cannot run any more steps (e.g. a tensor-parallel worker died); every request in it has
    failed and a new engine is needed. Runners raise it (or a subclass) for failures nothing can retry."""


class EngineClosedError(RuntimeError):
    """The engine was shut down and takes no more requests."""
