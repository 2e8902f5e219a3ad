"""paged-backend: a PagedAttention LLM serving engine behind familiar fronts."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .metrics import EngineStats
from .outputs import CompletionOutput, RequestOutput
from .request_intake import ValidatedRequest
from .sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    if name == "AsyncLLMEngine":
        from .async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineConfig", "EngineStats", "LLM", "LLMEngine",
           "RequestOutput", "SamplingParams", "ValidatedRequest", "__version__"]
