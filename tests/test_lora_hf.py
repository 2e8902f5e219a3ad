"""`attach()` on models with PEFT adapters: transformers' `load_adapter`, and `PeftModel` with `set_adapter` and
`disable_adapter`, generate with the active adapter, token for token as transformers / PEFT do (greedy and beams,
float64 and float32); switching adapters never reuses KV computed under another (a prompt of several blocks is
served from the prefix cache only under the adapter that computed it)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import get_model
from hf_compare import hf_generate
from lora_adapters import adapter_dirs
from paged_backend.adapters.hf import attach, detach

FAMILY = "tiny-llama"
LONG = ("A shared system prompt that many requests start with, long enough to fill several KV blocks of "
        "eight tokens each, and then a question")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return adapter_dirs(FAMILY, tmp_path_factory.mktemp("lora-hf"))


def _inputs(tok, texts):
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True)


def test_load_adapter_then_attach_generates_with_the_adapter(dirs, dtype):
    base, tok = get_model(FAMILY, dtype)
    model = copy.deepcopy(base)
    model.load_adapter(str(dirs[0]), adapter_name="a0")
    inputs = _inputs(tok, ["The capital of France is", LONG])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    expected = hf_generate(model, **inputs, **kwargs)
    assert not torch.equal(expected, hf_generate(base, **inputs, **kwargs)), "the adapter must change the tokens"
    attach(model, tokenizer=tok, num_blocks=64, block_size=8)
    try:
        assert torch.equal(model.generate(**inputs, **kwargs), expected)
        beams = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
        assert torch.equal(model.generate(**inputs, **beams), hf_generate(model, **inputs, **beams))
    finally:
        detach(model)


def test_peft_model_switches_adapters_without_sharing_kv(dirs, dtype):
    from peft import PeftModel

    base, tok = get_model(FAMILY, dtype)
    model = PeftModel.from_pretrained(copy.deepcopy(base), str(dirs[2]), adapter_name="a2").eval()
    model.load_adapter(str(dirs[1]), adapter_name="a1")
    inputs = _inputs(tok, [LONG])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    expected = {}
    for name in ("a2", "a1"):
        model.set_adapter(name)
        expected[name] = hf_generate(model, **inputs, **kwargs)
    with model.disable_adapter():
        expected["base"] = hf_generate(model, **inputs, **kwargs)
    assert len({tuple(t.tolist()[0]) for t in expected.values()}) == 3
    attach(model, tokenizer=tok, num_blocks=64, block_size=8)
    engine = model.paged_engine
    seen = set()
    try:
        for name in ("a2", "a1", "base", "a2"):
            before = engine.get_stats().prefix_cache_hits
            if name == "base":
                with model.disable_adapter():
                    out = model.generate(**inputs, **kwargs)
            else:
                model.set_adapter(name)
                out = model.generate(**inputs, **kwargs)
            assert torch.equal(out, expected[name]), name
            hits = engine.get_stats().prefix_cache_hits - before
            assert hits == (inputs.input_ids.shape[1] // 8 if name in seen else 0), (name, hits)
            seen.add(name)
    finally:
        detach(model)
