"""Per-request logits processors in vLLM v0's shape, applied to the rows that have them.

A processor is a callable `(output_token_ids, logits_row) -> logits_row`, or
`(prompt_token_ids, output_token_ids, logits_row) -> logits_row` (told apart by their number of
parameters, as vLLM v0 does). Processors run in list order on a 1-D row of the step's float32 logits;
rows without processors are not touched, and a processor that fails fails its own row only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

LogitsProcessor = Callable[..., torch.Tensor]


def takes_prompt(processor: LogitsProcessor) -> bool:
    """True for the 3-parameter form (prompt ids first), False for the 2-parameter one; ValueError otherwise."""
    try:
        num_params = len(inspect.signature(processor).parameters)
    except (TypeError, ValueError):
        raise ValueError(f"logits processor {processor!r} has no inspectable signature") from None
    if num_params not in (2, 3):
        raise ValueError(f"logits processor {processor!r} must take (output_token_ids, logits) or "
                         f"(prompt_token_ids, output_token_ids, logits), it takes {num_params} parameters")
    return num_params == 3


def check_logits_processors(processors) -> List[LogitsProcessor]:
    """The processors as a list, each callable with a supported signature (ValueError otherwise)."""
    if processors is None:
        return []
    if callable(processors) or isinstance(processors, (str, bytes)):
        raise ValueError("logits_processors must be a list of callables")
    result = list(processors)
    for processor in result:
        if not callable(processor):
            raise ValueError(f"logits processor {processor!r} is not callable")
        takes_prompt(processor)
    return result


@dataclass
class ProcessorRow:
    """One logits row with processors: its row index, its request's tokens and its processors."""

    row: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    processors: Sequence[LogitsProcessor]


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[ProcessorRow]) -> Dict[int, str]:
    """Run each row's processors in order on that row, in place. A processor that raises (or returns something
    that is not a row) fails its row alone: the other rows are processed as if it were not there. Returns the
    failed rows (row index -> what went wrong); their contents are then undefined."""
    failures: Dict[int, str] = {}
    for item in rows:
        try:
            _apply_row(logits, item)
        except Exception as exc:  # noqa: BLE001 - the error belongs to this row's request only
            failures[item.row] = f"logits processor failed: {type(exc).__name__}: {exc}"
    return failures


def _apply_row(logits: torch.Tensor, item: ProcessorRow) -> None:
    row = logits[item.row]
    for processor in item.processors:
        out = (processor(list(item.prompt_token_ids), list(item.output_token_ids), row)
               if takes_prompt(processor) else processor(list(item.output_token_ids), row))
        if not isinstance(out, torch.Tensor) or out.shape != row.shape:
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"logits processor {processor!r} must return a tensor of shape "
                             f"{list(row.shape)}, got {got}")
        row = out
    if row.data_ptr() != logits[item.row].data_ptr():
        logits[item.row] = row.to(logits.dtype)
