"""`paged-backend triton-repo`: every engine option the command accepts reaches model.json, and the model's
model.json reader turns it back into the engine argument the same option gives every other command; the
device written follows the instance kind, so the model accepts it on that kind of instance."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from paged_backend.adapters.triton.model_json import load_model_options
from paged_backend.adapters.triton.placement import engine_kwargs as instance_engine_kwargs
from paged_backend.adapters.triton.placement import place
from paged_backend.cli import build_parser, engine_kwargs, main
from paged_backend.config import EngineConfig

# A value other than the default for each engine option of the command line (argument lists: a flag alone for
# a switch). An option missing here fails the test below by name, so a new option cannot skip model.json.
NON_DEFAULT = {
    "dtype": ["--dtype", "float64"],
    "device": ["--device", "cuda", "--kind", "KIND_MODEL", "--num-blocks", "40"],  # sized: no GPU-share default
    "block_size": ["--block-size", "32"],
    "num_blocks": ["--num-blocks", "40"],
    "kv_cache_memory": ["--kv-cache-memory", "96MiB"],
    "swap_space": ["--swap-space", "3MiB"],
    "kv_cache_dtype": ["--kv-cache-dtype", "fp8"],
    "max_num_seqs": ["--max-num-seqs", "7"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "1024"],
    "max_model_len": ["--max-model-len", "300"],
    "preemption_mode": ["--preemption-mode", "swap"],
    "admission_backoff_steps": ["--admission-backoff-steps", "64"],
    "enable_prefix_caching": ["--no-enable-prefix-caching"],
    "tensor_parallel_size": ["--tensor-parallel-size", "2", "--kind", "KIND_MODEL"],
    "compile": ["--compile", "blocking"],
    "seed": ["--seed", "5"],
    "enable_lora": ["--enable-lora"],
    "max_loras": ["--enable-lora", "--max-loras", "3"],
    "max_lora_rank": ["--enable-lora", "--max-lora-rank", "64"],
    "max_cpu_loras": ["--enable-lora", "--max-cpu-loras", "5"],
    "async_scheduling": ["--no-async-scheduling"],
    "enforce_eager": ["--enforce-eager"],
    "speculative_config": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
}
KIND_NAMES = {"KIND_CPU": "CPU", "KIND_GPU": "GPU", "KIND_MODEL": "MODEL"}


def _engine_options() -> list:
    """The destinations of the `engine` argument group of `triton-repo`."""
    parser = build_parser(["triton-repo"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["triton-repo"]
    group = next(g for g in sub._action_groups if g.title == "engine")
    return [action.dest for action in group._group_actions]


def _write(tmp_path, extra):
    argv = ["triton-repo", str(tmp_path), "--model", "tiny-llama", *extra]
    assert main(argv) == 0
    args = build_parser(argv).parse_args(argv)
    return args, json.loads((tmp_path / "paged_llm" / "1" / "model.json").read_text())


def _as_loaded(tmp_path, kind: str) -> dict:
    """The engine arguments the Triton model builds from the written model.json on an instance of `kind`."""
    options = load_model_options(tmp_path / "paged_llm" / "1")
    config = {"instance_group": [{"kind": kind, "count": 1}]}
    kwargs = instance_engine_kwargs(options, place(options, KIND_NAMES[kind], 0, config))
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return kwargs


def _split(kwargs: dict):
    engine = {k: v for k, v in kwargs.items() if k not in ("dtype", "device", "trust_remote_code")}
    return EngineConfig.from_kwargs(**engine), kwargs["dtype"], kwargs["device"]


def test_every_engine_option_has_a_non_default_value_here():
    assert sorted(_engine_options()) == sorted(NON_DEFAULT), "give the new engine option a value in NON_DEFAULT"


@pytest.mark.parametrize("dest", sorted(NON_DEFAULT))
def test_every_engine_option_reaches_model_json_and_back(tmp_path, dest):
    args, written = _write(tmp_path, NON_DEFAULT[dest])
    default = build_parser(["triton-repo"]).parse_args(["triton-repo", "x"])
    assert getattr(args, dest) != getattr(default, dest), dest
    wanted = engine_kwargs(args)           # what `generate` and `serve` give the engine for the same options
    loaded = _as_loaded(tmp_path, args.kind)
    if args.device is None:                # no --device: the instance kind's (the next test)
        wanted["device"] = loaded["device"]
    assert _split(loaded) == _split(wanted), written


@pytest.mark.parametrize("kind, device", [("KIND_CPU", "cpu"), ("KIND_GPU", "cuda:0"), ("KIND_MODEL", "cpu")])
def test_the_device_follows_the_instance_kind(tmp_path, kind, device):
    _, written = _write(tmp_path, ["--kind", kind])
    assert f"kind: {kind}" in (tmp_path / "paged_llm" / "config.pbtxt").read_text()
    options = load_model_options(tmp_path / "paged_llm" / "1")
    placed = place(options, KIND_NAMES[kind], 0, {"instance_group": [{"kind": kind, "count": 1}]})
    if kind == "KIND_MODEL":   # the model's own device choice: the GPU where there is one
        device = "cuda" if torch.cuda.is_available() else "cpu"
    assert placed.device == device, written


def test_a_device_the_instance_kind_refuses_is_an_error_naming_both(tmp_path, capsys):
    assert main(["triton-repo", str(tmp_path), "--model", "tiny-llama", "--kind", "KIND_CPU", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "KIND_CPU" in err
    assert not (tmp_path / "paged_llm").exists()


def test_max_batch_size_one_is_written_for_the_openai_frontends_tensors(tmp_path, capsys):
    """`--max-batch-size 1` writes the line that lets Triton accept the [1, 1] tensors its OpenAI frontend sends
    (the model's auto-completion keeps it and adds the TensorRT-LLM inputs); the default leaves it out."""
    _write(tmp_path / "a", ["--max-batch-size", "1"])
    assert "max_batch_size: 1\n" in (tmp_path / "a" / "paged_llm" / "config.pbtxt").read_text()
    _write(tmp_path / "b", [])
    assert "max_batch_size" not in (tmp_path / "b" / "paged_llm" / "config.pbtxt").read_text()
    assert main(["triton-repo", str(tmp_path / "c"), "--model", "tiny-llama", "--layout", "python",
                 "--max-batch-size", "1"]) == 2
    assert "backend layout" in capsys.readouterr().err
