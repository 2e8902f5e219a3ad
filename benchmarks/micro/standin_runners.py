"""Stand-in runners that measure the engine alone: no model runs.

`ReadyLogitsRunner` returns logits at once, so a step's wall time is the engine's own (scheduling, block tables,
inputs, the sampler, token processing, detokenization, outputs). With `device_ms` it first sleeps that long,
standing for a device that takes D ms per forward: `time.sleep` releases the GIL as a CUDA forward or a torch CPU
forward does, so the engine's host work can run meanwhile (overlapped scheduling) or not; as a device runner
does, it reports the forward on its way (`on_launched`) before that time.

Every row's logits put all their mass on one ordinary word piece (" the"), so detokenization does what it does
with text. The logits are one preallocated tensor handed out as a view: the workloads these runners serve are
greedy with no penalty, processor or grammar, so the sampler reads them without writing.
"""

from __future__ import annotations

import threading
import time
from typing import List, Set, Tuple

import torch


class ReadyLogitsRunner:
    """A runner whose forward is free (or takes `device_ms`, asleep); every sampled row's next token is
    `token_id`."""

    def __init__(self, vocab_size: int, token_id: int, device_ms: float = 0.0) -> None:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token_id {token_id} is outside the vocabulary of {vocab_size}")
        if device_ms < 0:
            raise ValueError(f"device_ms must be >= 0, got {device_ms}")
        self.vocab_size = vocab_size
        self.token_id = token_id
        self.device_s = device_ms / 1000.0
        self.num_forwards = 0
        self.device_spans: List[Tuple[float, float]] = []   # (start, end) of each sleep, perf_counter seconds
        self.forward_threads: Set[int] = set()   # the threads its forwards ran in
        self._logits = torch.zeros(0, vocab_size)

    @classmethod
    def for_engine(cls, engine, device_ms: float = 0.0) -> "ReadyLogitsRunner":
        ids = engine.tokenizer(" the", add_special_tokens=False)["input_ids"] if engine.tokenizer else [0]
        return cls(engine.vocab_size, ids[-1], device_ms)

    def execute(self, inputs, on_launched=None) -> torch.Tensor:
        self.num_forwards += 1
        self.forward_threads.add(threading.get_ident())
        if on_launched is not None:   # the device has the forward: the host is free until it ends
            on_launched()
        if self.device_s:
            start = time.perf_counter()
            time.sleep(self.device_s)
            self.device_spans.append((start, time.perf_counter()))
        rows = len(inputs.sample_indices)
        if rows > self._logits.shape[0]:
            self._logits = torch.zeros(max(rows, 2 * self._logits.shape[0]), self.vocab_size)
            self._logits[:, self.token_id] = 1.0
        return self._logits[:rows]

    def shutdown(self) -> None:
        """Nothing to release: no model, no cache."""
