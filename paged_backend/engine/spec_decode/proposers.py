"""The proposer a `SpeculativeConfig` names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_backend.config import SpeculativeConfig
from paged_backend.engine.spec_decode.ngram_proposer import NgramProposer
from paged_backend.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine


def make_proposer(spec: SpeculativeConfig, engine: "LLMEngine") -> Proposer:
    """Prompt lookup, or a draft model that shares the engine's tokenizer."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    raise ValueError(f"speculative_config: method {spec.method!r} is not available in this build")
