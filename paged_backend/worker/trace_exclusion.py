"""Keeps the process's model forwards out of the way while dynamo traces a model in a background compile.

While any compile runs, `torch.compiler.is_compiling()` is true in every thread of the process (a process-wide
flag), so a forward on a serving thread takes the code paths meant for tracing; transformers' hub-kernels layers
then keep their active functions in one process-wide variable (`kernels`' `CompileableContextVar`) instead of a
context variable. A forward that set and reset it while dynamo traced a model, or built the guards of what it
traced, made the guards fail ("Expected dict, got NoneType") and left that bucket eager for good. Forwards
therefore wait while dynamo traces or builds guards (seconds), never while inductor generates and builds the
code (the long part), and run side by side with each other as before.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

# How long a trace, back from the backend inside dynamo (which holds its compile lock then), waits for running
# forwards before it goes on beside them: a forward that itself reached a `torch.compile`d function would wait
# for that lock, and both would wait for good.
DRAIN_TIMEOUT_S = 60.0


class TraceExclusion:
    """A gate with two kinds of holders: forwards (any number at once) and traces (they exclude forwards; a
    waiting trace lets no new forward in, so steps arriving back to back cannot starve it)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._forwards = 0
        self._traces = 0   # traces holding the gate or waiting for it
        self._tracing = threading.local()

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Around a model forward: waits while a trace holds or waits for the gate."""
        with self._changed:
            self._changed.wait_for(lambda: self._traces == 0)
            self._forwards += 1
        try:
            yield
        finally:
            with self._changed:
                self._forwards -= 1
                self._changed.notify_all()

    @contextmanager
    def trace(self) -> Iterator[None]:
        """Around a compile call (dynamo's trace, the backend, the guards): no forward runs inside it, except
        where `backend_runs()` lets them."""
        self._enter_trace()
        self._tracing.active = True
        try:
            yield
        finally:
            self._tracing.active = False
            self._leave_trace()

    @contextmanager
    def backend_runs(self) -> Iterator[None]:
        """Inside `trace()`, around the compiler backend: forwards may run meanwhile (they touch nothing the
        backend reads: it compiles a graph, not the model's Python). A no-op outside `trace()`."""
        if not getattr(self._tracing, "active", False):
            yield
            return
        self._leave_trace()
        try:
            yield
        finally:
            if not self._enter_trace(timeout=DRAIN_TIMEOUT_S):
                logger.warning("a forward still runs %.0f s after the compiler backend returned; dynamo builds "
                               "the guards beside it", DRAIN_TIMEOUT_S)

    def _enter_trace(self, timeout: Optional[float] = None) -> bool:
        """Counts this trace in (no new forward starts), then waits for running forwards; False on timeout."""
        with self._changed:
            self._traces += 1
            return self._changed.wait_for(lambda: self._forwards == 0, timeout)

    def _leave_trace(self) -> None:
        with self._changed:
            self._traces -= 1
            self._changed.notify_all()


# One per process: the state the forwards and the traces share (torch's flag, transformers' globals) is the
# process's, whichever engine or model each belongs to.
TRACE_EXCLUSION = TraceExclusion()
