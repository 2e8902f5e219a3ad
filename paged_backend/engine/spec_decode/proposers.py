"""The proposer a `SpeculativeConfig` names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged_backend.config import SpeculativeConfig
from paged_backend.engine.spec_decode.draft_model_proposer import DraftModelProposer
from paged_backend.engine.spec_decode.ngram_proposer import NgramProposer
from paged_backend.engine.spec_decode.proposer import Proposer
from paged_backend.worker.loader import load_model
from paged_backend.worker.model_support import check_model_supported, uniform_window

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine


def make_proposer(spec: SpeculativeConfig, engine: "LLMEngine") -> Proposer:
    """Prompt lookup, or a draft model that shares the engine's tokenizer."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    draft = load_draft(spec.model, engine)
    return DraftModelProposer(draft, engine.config.cache.block_size, engine.kv_size.num_blocks, engine.config.seed)


def load_draft(model, engine: "LLMEngine") -> torch.nn.Module:
    """The draft model (a preset, a path or a model object) in the target's dtype on its device, refused by name
    when its tokenizer or vocabulary differs from the target's or the engine cannot run it."""
    if engine.config.parallel.tensor_parallel_size > 1:
        raise ValueError("speculative_config: a draft model runs on one device; use it with tensor_parallel_size 1")
    name = type(model).__name__ if isinstance(model, torch.nn.Module) else str(model)
    if isinstance(model, torch.nn.Module):
        draft, tokenizer = model.eval(), None
    else:
        draft, tokenizer = load_model(str(model), dtype=engine.dtype, device=engine.device)
    if tokenizer is not None and engine.tokenizer is not None and tokenizer.get_vocab() != engine.tokenizer.get_vocab():
        raise ValueError(f"speculative_config: the draft model {name!r} has another tokenizer than the target "
                         "model; a draft must share the target's tokenizer")
    if not hasattr(draft, "get_output_embeddings") or not hasattr(draft, "config"):
        raise ValueError(f"speculative_config: the draft model {name!r} is not a transformers causal LM")
    check_model_supported(draft)
    embeddings = draft.get_output_embeddings()
    vocab = embeddings.weight.shape[0] if embeddings is not None else draft.config.vocab_size
    if vocab != engine.vocab_size:
        raise ValueError(f"speculative_config: the draft model {name!r} has a vocabulary of {vocab} tokens, the "
                         f"target {engine.vocab_size}; a draft must share the target's tokenizer")
    if uniform_window(draft) is not None:
        raise ValueError(f"speculative_config: the draft model {name!r} attends through a sliding window, which "
                         "speculative decoding does not support yet")
    if next(draft.parameters()).dtype != engine.dtype or next(draft.parameters()).device != engine.device:
        raise ValueError(f"speculative_config: the draft model {name!r} must have the target's dtype and device "
                         f"({engine.dtype}, {engine.device})")
    return draft
