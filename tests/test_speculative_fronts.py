"""Speculative decoding on every front (issue 25): transformers' assisted generation on the HF drop-in
(`prompt_lookup_num_tokens`, `assistant_model`) gives transformers' own tokens; the server CLI takes vLLM's
`--speculative-config`; Triton's model.json takes `speculative_config`; bad values are refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, get_model
from hf_compare import hf_generate
from paged_backend.adapters.hf import attach, detach
from paged_backend.adapters.triton.model_json import parse_model_options
from paged_backend.cli import build_parser, engine_kwargs
from paged_backend.config import EngineConfig, SpeculativeConfig


@pytest.fixture
def llama():
    model, tok = get_model("tiny-llama", torch.float64)
    attach(model, tokenizer=tok, num_blocks=128, block_size=8)
    try:
        yield model, tok
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


def _prompt():
    ids = torch.tensor([list(range(30, 45)) * 2])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_hf_assistant_model_gives_transformers_tokens(llama):
    """Greedy assisted generation with a draft model: transformers' own assisted generation and the drop-in
    agree token for token; the engine verified drafts during the call (the target as its own draft: all
    accepted) and is back to no speculation after it."""
    model, _ = llama
    draft, _ = get_model("tiny-opt", torch.float64)
    expected = hf_generate(model, **_prompt(), max_new_tokens=20, do_sample=False, assistant_model=draft)
    out = model.generate(**_prompt(), max_new_tokens=20, do_sample=False, assistant_model=model)
    assert torch.equal(out, expected), (out, expected)
    engine = model.paged_engine
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0, stats
    assert engine.speculator is None and engine.config.speculative is None


def test_hf_prompt_lookup_gives_transformers_tokens(smollm2):
    """`prompt_lookup_num_tokens` on a real model repeating a text: transformers' own prompt lookup and the
    drop-in agree token for token, with drafts accepted."""
    model, tok = smollm2
    text = "The quick brown fox jumps over the lazy dog near the river bank, while the farmer watches."
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat this text exactly:\n\n" + text}],
                                     tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    kwargs = dict(max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    expected = hf_generate(model, **enc, **kwargs)
    attach(model, tokenizer=tok, num_blocks=64)
    try:
        out = model.generate(**enc, **kwargs)
        stats = model.paged_engine.get_stats()
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)
    assert torch.equal(out, expected), (tok.decode(out[0]), tok.decode(expected[0]))
    assert stats.spec_decode_num_accepted_tokens > 4, stats


def test_hf_refuses_both_kinds_of_assistance_and_a_foreign_draft(llama):
    model, _ = llama
    small = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="either prompt_lookup_num_tokens or assistant_model"):
        model.generate(**_prompt(), max_new_tokens=4, prompt_lookup_num_tokens=2, assistant_model=model)
    with pytest.raises(ValueError, match="not a transformers causal LM"):
        model.generate(**_prompt(), max_new_tokens=4, assistant_model=small)
    assert model.paged_engine.config.speculative is None


def test_server_cli_takes_vllms_speculative_config(capsys):
    argv = ["serve", "tiny-llama", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}']
    args = build_parser(argv).parse_args(argv)
    config = EngineConfig.from_kwargs(**{k: v for k, v in engine_kwargs(args).items() if k not in ("dtype", "device")})
    assert config.speculative == SpeculativeConfig("ngram", 5, 1, 4)
    bad = ["serve", "tiny-llama", "--speculative-config", '{"method": "ngram", "k": 5}']
    with pytest.raises(SystemExit):
        build_parser(bad).parse_args(bad)
    assert "'k'" in capsys.readouterr().err


def test_model_json_takes_speculative_config():
    options = parse_model_options({"model": "tiny-llama", "speculative_config":
                                   {"method": "ngram", "num_speculative_tokens": 2}})
    assert EngineConfig.from_kwargs(**options.engine).speculative.num_speculative_tokens == 2
    as_text = parse_model_options({"model": "tiny-llama", "speculative_config": '{"method": "ngram"}'})
    assert as_text.engine["speculative_config"] == {"method": "ngram"}
    with pytest.raises(ValueError, match="medusa"):
        parse_model_options({"model": "tiny-llama", "speculative_config": {"method": "medusa"}})
    with pytest.raises(ValueError, match="speculative_model"):
        parse_model_options({"model": "tiny-llama", "speculative_model": "tiny-opt"})
