"""One forward of an unmodified Hugging Face model per step, the whole step packed as one row.

`prepare_inputs` turns the scheduler's choice into flat tensors (token ids, positions, cache slots,
block tables); `ModelRunner.execute` applies the step's block swaps and copies, then runs the model
with our attention function and returns logits only for the rows that sample.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from .attention import ATTENTION_NAME, AttentionMetadata, attention_context, register_attention
from .cache_engine import CacheEngine
from .model_support import check_model_supported
from .scheduler import ScheduledSeq


@dataclass
class StepInputs:
    """Everything a worker needs to run one step (rank 0 builds it; tensor-parallel ranks receive it)."""

    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    slot_mapping: torch.Tensor     # [T]
    block_tables: torch.Tensor     # [S, max_blocks] int32
    context_lens: torch.Tensor     # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    sample_indices: torch.Tensor   # [N] rows whose logits the sampler needs
    swap_out: Dict[int, int] = field(default_factory=dict)
    swap_in: Dict[int, int] = field(default_factory=dict)
    copies: List[Tuple[int, int]] = field(default_factory=list)

    def to(self, device) -> "StepInputs":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return StepInputs(**{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                             for k, v in values.items()})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def prepare_inputs(scheduled: Sequence[ScheduledSeq], block_tables: Dict[int, List[int]],
                   block_size: int) -> StepInputs:
    """Flatten the scheduled chunks (CPU tensors; `StepInputs.to` moves them). Python touches each
    sequence once; positions and cache slots of every token come from tensor ops."""
    tokens: List[int] = []
    first_positions: List[int] = []
    chunk_lens: List[int] = []
    tables: List[List[int]] = []
    sample_rows: List[int] = []
    for item in scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        tokens.extend(seq.token_ids[start:start + item.num_tokens])
        first_positions.append(start)
        chunk_lens.append(item.num_tokens)
        tables.append(block_tables[seq.seq_id])
        if item.samples:
            sample_rows.append(len(tokens) - 1)
    width = max((len(t) for t in tables), default=0)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    table_tensor = table_tensor.reshape(len(tables), width)
    lens = torch.tensor(chunk_lens, dtype=torch.long)
    ends = lens.cumsum(0)
    row_seq = torch.repeat_interleave(torch.arange(len(tables)), lens)            # sequence of each token
    first = torch.tensor(first_positions, dtype=torch.long)
    positions = torch.arange(len(tokens)) - (ends - lens)[row_seq] + first[row_seq]
    slots = table_tensor[row_seq, positions // block_size].to(torch.long) * block_size + positions % block_size
    return StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        block_tables=table_tensor,
        context_lens=(first + lens).to(torch.int32),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32),
        sample_indices=torch.tensor(sample_rows, dtype=torch.long),
    )


def attention_layers(model: torch.nn.Module) -> Dict[int, int]:
    """id(attention module) -> cache layer, from the modules' `layer_idx`."""
    layers = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and "attention" in type(module).__name__.lower():
            layers[id(module)] = idx
    return layers


class ModelRunner:
    """Runs steps of one model over its paged KV cache."""

    def __init__(self, model: torch.nn.Module, cache_engine: CacheEngine) -> None:
        check_model_supported(model)
        register_attention()
        self.model = model
        self.cache_engine = cache_engine
        self.device = next(model.parameters()).device
        self.layer_of = attention_layers(model)
        if len(set(self.layer_of.values())) != cache_engine.geometry.num_layers:
            raise ValueError(f"{type(model).__name__}: found {len(set(self.layer_of.values()))} attention layers "
                             f"with a layer index, expected {cache_engine.geometry.num_layers}")

    @contextmanager
    def _paged_attention(self) -> Iterator[None]:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Swap, copy, then one forward; returns logits `[len(sample_indices), vocab]`."""
        self.cache_engine.swap_out(inputs.swap_out)
        self.cache_engine.swap_in(inputs.swap_in)
        self.cache_engine.copy(inputs.copies)
        if inputs.num_tokens == 0:
            return torch.empty(0, 0)
        inputs = inputs.to(self.device)
        metadata = AttentionMetadata(
            slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables, context_lens=inputs.context_lens,
            query_start_loc=inputs.query_start_loc, block_size=self.cache_engine.block_size,
            kv_caches=self.cache_engine.kv_caches, layer_of=self.layer_of)
        with torch.inference_mode(), attention_context(metadata), self._paged_attention():
            output = self.model(input_ids=inputs.input_ids[None], position_ids=inputs.positions[None],
                                use_cache=False, logits_to_keep=inputs.sample_indices)
        return output.logits[0]
