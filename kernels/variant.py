"""Per-call attention variants shared by every implementation: sliding window, logit soft-capping, sinks.

- `sliding_window` W: the query at context position p sees keys at positions p - W < j <= p (W keys,
  itself included), the convention of transformers' masks (`kv_idx > q_idx - sliding_window`).
- `softcap` c: scores s (already scaled) become `c * tanh(s / c)` before the softmax (Gemma 2).
- `sinks` `[num_heads]`: one learned logit per query head that joins each row's softmax denominator and
  contributes no value (gpt-oss's `s_aux`); the row's weights then sum to less than one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def check_attention_variant(num_heads: int, device: torch.device, sliding_window: Optional[int],
                            softcap: Optional[float], sinks: Optional[torch.Tensor]) -> None:
    """Raise ValueError for a window, cap or sinks tensor that no kernel could apply."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
                or softcap <= 0:
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise ValueError(f"sinks must be a floating-point tensor [num_heads], got {type(sinks).__name__}")
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have one logit per query head, shape ({num_heads},), "
                             f"got {tuple(sinks.shape)}")
        if sinks.device != device:
            raise ValueError(f"sinks are on {sinks.device} but the query is on {device}")
