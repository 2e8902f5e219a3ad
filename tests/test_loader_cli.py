"""Offline model loading and the `paged-backend` command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import get_model
from paged_backend.worker.cache_engine import kv_geometry
from paged_backend.worker.loader import PRESETS, load_model


def cli(*args, env=None):
    result = subprocess.run([sys.executable, "-m", "paged_backend.cli", *args], capture_output=True, text=True,
                            timeout=300, env=env)
    return result


@pytest.mark.parametrize("name, kv_heads", [("tiny-llama", 2), ("tiny-opt", 4), ("tiny-gpt2", 4),
                                            ("tiny-gpt-neox", 4)])
def test_tiny_presets_are_deterministic_and_round_trip_text(name, kv_heads):
    model, tok = load_model(name, dtype=torch.float32)
    again, _ = load_model(name, dtype=torch.float32)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert kv_geometry(model.config).num_kv_heads == kv_heads
    text = "Paged attention, in plain words."
    assert tok.decode(tok(text).input_ids) == text
    assert not model.training


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError) as err:
        load_model("gpt-17")
    assert all(p in str(err.value) for p in PRESETS)
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-llama", dtype="float8")
    assert next(load_model("tiny-llama", dtype="bf16")[0].parameters()).dtype == torch.bfloat16
    assert next(load_model("tiny-llama", dtype="auto")[0].parameters()).dtype == torch.float32


def test_local_hf_directory(tmp_path):
    model, tok = get_model("tiny-opt", torch.float32)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path))
    assert type(loaded) is type(model) and len(loaded_tok) == len(tok)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_model(str(tmp_path))


def test_cache_location_can_be_overridden(tmp_path):
    env = dict(os.environ, PAGED_BACKEND_CACHE=str(tmp_path))
    code = "from paged_backend.worker.loader import load_model; load_model('tiny-gpt2')"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert (tmp_path / "v1" / "smollm2-tokenizer" / "tokenizer.json").exists()


def test_smollm2_loads_from_the_converted_cache(smollm2):
    from paged_backend.worker.loader import cache_dir

    model, tok = smollm2
    assert (cache_dir() / "v1" / "smollm2" / "config.json").exists()
    geometry = kv_geometry(model.config)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_size) == (30, 3, 64)
    assert tok.eos_token_id == 2


def test_cli_info_reports_kv_cost():
    result = cli("info", "tiny-llama", "--kv-cache-memory", "1MiB", "--block-size", "16")
    assert result.returncode == 0, result.stderr
    # 2 layers x (K and V) x 2 KV heads x 16 dims x 4 bytes
    assert "KV bytes per token: 512" in result.stdout
    assert "KV bytes per block: 8,192 (16 tokens)" in result.stdout
    assert "128 blocks = 2,048 tokens" in result.stdout


def test_cli_generate_prints_outputs_and_stats():
    result = cli("generate", "--model", "tiny-llama", "Hello", "World", "--n", "2", "--temperature", "0.8",
                 "--max-tokens", "4", "--num-blocks", "32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(length, 4 tokens)") == 4
    assert "KV cache: 32 blocks of 16 tokens, 32 free" in result.stdout


def test_cli_reports_bad_options():
    result = cli("generate", "--model", "tiny-llama", "Hi", "--num-blocks", "8", "--kv-cache-memory", "1MiB")
    assert result.returncode == 2 and "either num_blocks or kv_cache_memory" in result.stderr
