"""Engine configuration: small validated dataclasses for the cache, the scheduler and parallelism."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
}

PREEMPTION_MODES = (None, "recompute", "swap")
# SchedulerConfig.admission_backoff_steps on a CPU device unless given (docs/architecture.md, *Admission*)
CPU_ADMISSION_BACKOFF_STEPS = 512
# What the KV cache stores (vLLM's names): the model's dtype, a 16-bit float, or fp8 with per-tensor scales
# ("fp8" is fp8_e4m3). cache_engine.kv_cache_torch_dtype maps them to torch dtypes.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def parse_memory(value: Union[int, float, str, None], what: str = "memory", allow_zero: bool = False) -> Optional[int]:
    """Turn 512MiB, "1.5GB", 1048576 or None into a byte count (or None); 0 only where `allow_zero` (swap space:
    none, as vLLM's `--swap-space 0`)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count or a string such as '512MiB', got {value!r}")
    if isinstance(value, (int, float)):
        nbytes = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{what}: cannot parse {value!r}; use bytes or a size such as '512MiB' or '2GB'")
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    return nbytes


@dataclass
class CacheConfig:
    """How the paged KV cache is sized and stored: block size, device blocks, host swap blocks, and the dtype
    of its entries (`kv_cache_dtype`: "auto" is the model's dtype)."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[Union[int, str]] = None
    num_swap_blocks: Optional[int] = None
    swap_space: Optional[Union[int, str]] = None
    enable_prefix_caching: bool = True   # as in vLLM v1: shared prefixes, and cheap recomputation
    watermark: float = 0.01
    # vLLM's meaning: the share of the device's total memory this engine may use, weights included; the KV
    # cache gets what the weights leave of it
    gpu_memory_utilization: Optional[float] = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        given = [name for name in ("num_blocks", "kv_cache_memory", "gpu_memory_utilization")
                 if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give either num_blocks or kv_cache_memory or gpu_memory_utilization, not "
                             f"{' and '.join(given)}")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.num_swap_blocks is not None and self.swap_space is not None:
            raise ValueError("give either num_swap_blocks or swap_space, not both")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if self.num_swap_blocks is not None and (not isinstance(self.num_swap_blocks, int) or self.num_swap_blocks < 0):
            raise ValueError(f"num_swap_blocks must be a non-negative integer, got {self.num_swap_blocks!r}")
        self.kv_cache_memory = parse_memory(self.kv_cache_memory, "kv_cache_memory")
        self.swap_space = parse_memory(self.swap_space, "swap_space", allow_zero=True)
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass
class SchedulerConfig:
    """Per-step budgets and the preemption policy.

    Every running sequence decodes one token per step, so the token budget must cover the sequence budget
    (as in vLLM); without an explicit `max_num_seqs` it is 256 or the token budget if that is smaller.

    `admission_backoff_steps`: admission is on demand (vLLM's: a request needs blocks for its tokens so far)
    until a preemption; from then on a new request must also leave room for every running sequence to grow by a
    share of what its `max_tokens` (or the context limit) still allows, a share that starts at all of it and
    fades to nothing over this many steps (0: on demand always). None: the engine's default for its device,
    CPU_ADMISSION_BACKOFF_STEPS on a CPU (where a step's cost grows with its tokens, so a recomputed prompt is
    lost time while a smaller batch is not), 0 elsewhere (vLLM's: a GPU's decode step costs about the same for
    more sequences, and a prefill little)."""

    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: int = 2048
    preemption_mode: Optional[str] = None
    max_model_len: Optional[int] = None
    # vLLM's name: schedule step N+1 and prepare its inputs while step N's forward runs (in a worker thread)
    async_scheduling: bool = True
    admission_backoff_steps: Optional[int] = None

    def __post_init__(self) -> None:
        steps = self.admission_backoff_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"admission_backoff_steps must be a non-negative integer, got "
                             f"{self.admission_backoff_steps!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens!r}")
        if self.max_num_seqs is None:
            self.max_num_seqs = min(256, self.max_num_batched_tokens)
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs one token of the step's budget")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many ranks share the model's heads."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")


# How the model forward runs (worker/compiled_forward.py): eagerly, or compiled by torch.compile per shape bucket,
# in a background thread (steps run eagerly until their bucket is ready) or before the engine is returned.
COMPILE_MODES = ("off", "background", "blocking")


def compile_mode(value: Union[bool, str, None]) -> str:
    """The compile mode an option names: False/None/'off', True/'background', 'blocking'."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "background"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise ValueError(f"compile must be True, False or one of {COMPILE_MODES}, got {value!r}")


@dataclass
class CompilationConfig:
    """`compile`: run the model forward compiled (torch.compile with inductor, per shape bucket). Off by default:
    the first compilation takes minutes of CPU (cached on disk afterwards), and compiled float32 code rounds
    differently from transformers' eager forward (docs/compilation.md).

    `enforce_eager` (vLLM's name): on a CUDA device, decode steps replay CUDA graphs captured per batch-size
    bucket at start-up (worker/cuda_graphs.py) unless this is True; it has no effect on the CPU."""

    compile: Union[bool, str] = False
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        self.compile = compile_mode(self.compile)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class LoRAConfig:
    """LoRA adapters chosen per request (vLLM's names): `max_loras` adapters on the device at once (the
    adapters of one step), `max_cpu_loras` kept loaded on the host (default `max_loras`), ranks up to
    `max_lora_rank`."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names): each step a proposer guesses up to
    `num_speculative_tokens` next tokens of a sequence and the target model verifies them in the same forward.
    `method` "ngram" looks the sequence's last `prompt_lookup_max`..`prompt_lookup_min` tokens up earlier in
    it (prompt lookup); "draft_model" runs `model` (a preset, a path or a model object with the same
    tokenizer). No speculation in a step whose running batch has more than `disable_by_batch_size` sequences
    (docs/speculative.md)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: Optional[int] = None   # 1 unless given
    prompt_lookup_max: Optional[int] = None   # 3 (at least prompt_lookup_min) unless given
    model: object = None
    disable_by_batch_size: int = 32

    def __post_init__(self) -> None:
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = 1
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(3, self.prompt_lookup_min) if isinstance(self.prompt_lookup_min, int) else 3
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; use one of {SPECULATIVE_METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            _positive_int(f"speculative_config {name}", getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config: method 'draft_model' needs a 'model' (a preset, a path or a model)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")

    @classmethod
    def of(cls, value) -> Optional["SpeculativeConfig"]:
        """From `speculative_config` as given: None, a SpeculativeConfig, or a dict of its fields (unknown keys
        raise, naming them)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**value)


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model itself."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: Optional[SpeculativeConfig] = None
    seed: int = 0
    max_logprobs: int = 20  # the most top logprobs a request may ask for (vLLM's default)

    def __post_init__(self) -> None:
        if self.compilation.compile != "off" and self.parallel.tensor_parallel_size > 1:
            raise ValueError("compile is not available with tensor_parallel_size > 1 (each rank would compile its "
                             "shard separately); run tensor-parallel engines eagerly")
        if self.compilation.compile != "off" and self.lora.enable_lora:
            raise ValueError("compile is not available with enable_lora (each step chooses its adapters, which "
                             "compiled code would not see); run LoRA engines eagerly")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from the flat keyword names that `LLM(...)` and the CLIs use; unknown names raise."""
        parts = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig, "lora": LoRAConfig,
                 "compilation": CompilationConfig}
        values: dict = {name: {} for name in parts}
        seed = kwargs.pop("seed", 0)
        max_logprobs = kwargs.pop("max_logprobs", 20)
        speculative = SpeculativeConfig.of(kwargs.pop("speculative_config", None))
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {max_logprobs!r}")
        for key, value in kwargs.items():
            owner = next((name for name, part in parts.items() if key in part.__dataclass_fields__), None)
            if owner is None:
                raise ValueError(f"unknown engine option {key!r}")
            values[owner][key] = value
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        return cls(**{name: parts[name](**values[name]) for name in parts}, speculative=speculative, seed=seed,
                   max_logprobs=max_logprobs)


ENGINE_OPTION_NAMES = tuple(
    sorted(set(CacheConfig.__dataclass_fields__) | set(SchedulerConfig.__dataclass_fields__)
           | set(ParallelConfig.__dataclass_fields__) | set(LoRAConfig.__dataclass_fields__)
           | set(CompilationConfig.__dataclass_fields__) | {"seed", "max_logprobs", "speculative_config"})
)
