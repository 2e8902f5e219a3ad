"""Models whose attention the engine cannot reproduce are refused by name at construction; attention keywords
the backend does not implement raise instead of being ignored; `info` shows each layer group's attention."""

from __future__ import annotations

import re

import pytest
import torch

from paged_backend import LLMEngine
from paged_backend.worker import model_support
from paged_backend.worker.attention import attention_options
from paged_backend.worker.model_info import model_info

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _build(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _gemma3_bidirectional():
    from transformers import Gemma3TextConfig

    return _build(Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=8, use_bidirectional_attention=True))


def _llama4_chunked():
    from transformers import Llama4TextConfig

    return _build(Llama4TextConfig(**SMALL, intermediate_size_mlp=64, head_dim=16, num_local_experts=2,
                                   attention_chunk_size=8))


def _lfm2_convolutions():
    from transformers import Lfm2Config

    return _build(Lfm2Config(**{**SMALL, "num_hidden_layers": 4}, layer_types=["conv", "full_attention"] * 2,
                             block_dim=64, block_ff_dim=64))


def _qwen2_window_differs_from_mask():
    """Layer 1 asks for a window of 5 while transformers' mask for it uses the config's 8."""
    from transformers import Qwen2Config

    model = _build(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    model.model.layers[1].self_attn.sliding_window = 5
    return model


def _gpt_oss_with_too_few_sinks():
    """As a tensor-parallel shard would be if its query heads were split but not its sinks."""
    from paged_backend.worker.loader import load_model

    model, _ = load_model("tiny-gpt-oss")
    for layer in model.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(layer.self_attn.sinks.detach()[:2].clone())
    return model


REFUSED = {
    "bidirectional": (_gemma3_bidirectional, "Gemma3ForCausalLM is not supported: its attention is bidirectional"),
    "chunked": (_llama4_chunked, "Llama4ForCausalLM is not supported: it uses chunked attention"),
    "convolution-layers": (_lfm2_convolutions, "Lfm2ForCausalLM is not supported: it has layers of type conv"),
    "window-mismatch": (_qwen2_window_differs_from_mask,
                        "Qwen2ForCausalLM is not supported: layer 1 .* masks query .* window of 5"),
    "unsharded-sinks": (_gpt_oss_with_too_few_sinks,
                        r"GptOssForCausalLM \(GptOssAttention of layer 0\): s_aux has 2 sinks for 4 query heads"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_models_the_engine_cannot_reproduce_are_refused_at_construction(case):
    build, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        LLMEngine(build(), num_blocks=8, block_size=8)


def test_the_probe_alone_catches_what_the_config_checks_catch(monkeypatch):
    """Without the config checks, the probe forward still refuses chunked masks and non-attention layers."""
    monkeypatch.setattr(model_support, "_check_config", lambda model: None)
    with pytest.raises(ValueError, match=r"Llama4ForCausalLM .* masks query \d+ / key \d+ as hidden"):
        model_support.check_model_supported(_llama4_chunked())
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM .* layers \[0, 2\] do not run attention"):
        model_support.check_model_supported(_lfm2_convolutions())
    with pytest.raises(ValueError, match="Gemma3ForCausalLM .* masks query .* as visible"):
        model_support.check_model_supported(_gemma3_bidirectional())


def _mistral_passing(**extra):
    """A tiny Mistral whose attention modules pass `extra` keywords on to the attention function."""
    from transformers import MistralConfig

    model = _build(MistralConfig(**SMALL, head_dim=16, sliding_window=8))
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, **extra}),
                                                  with_kwargs=True)
    return model


@pytest.mark.parametrize("extra, shown", [
    (dict(future_feature=True), "future_feature=True"),
    (dict(is_causal=False), "is_causal=False"),
    (dict(output_attentions=True), "output_attentions=True"),
    (dict(cu_seq_lens_q=torch.tensor([0, 4])), r"cu_seq_lens_q=tensor of shape \(2,\)"),
])
def test_an_unknown_non_default_attention_keyword_is_refused(extra, shown):
    with pytest.raises(ValueError, match=rf"MistralForCausalLM \(MistralAttention of layer 0\): the attention "
                                         rf"keyword {shown} is not implemented"):
        LLMEngine(_mistral_passing(**extra), num_blocks=8, block_size=8)


def test_the_attention_function_refuses_a_keyword_that_appears_after_construction():
    from paged_backend import LLM, SamplingParams

    model = _mistral_passing()
    llm = LLM(model, num_blocks=16, block_size=8)
    model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {**kwargs, "future_feature": 1}), with_kwargs=True)
    # the forward fails, so the step's request fails with the attention function's error (the engine goes on)
    out = llm.generate([[1, 5, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert re.search(r"MistralForCausalLM \(MistralAttention of layer 1\): the attention keyword future_feature=1 "
                     r"is not implemented", out.error)
    assert llm.engine.errored is None


def test_default_valued_and_no_effect_keywords_are_accepted():
    engine = LLMEngine(_mistral_passing(future_feature=None, is_causal=True, output_attentions=False),
                       num_blocks=8, block_size=8)
    assert model_support.describe_attention(engine.model) == ["layers 0-1 (2 of 2): window 8"]


def test_outside_a_step_the_sdpa_fallback_refuses_sinks():
    from paged_backend.worker.attention import paged_attention_forward

    q = torch.zeros(1, 4, 3, 16)
    k = torch.zeros(1, 4, 3, 16)
    out, _ = paged_attention_forward(torch.nn.Module(), q, k, k, None, sliding_window=8)
    assert out.shape == (1, 3, 4, 16)
    with pytest.raises(ValueError, match="cannot apply attention sinks"):
        paged_attention_forward(torch.nn.Module(), q, k, k, None, s_aux=torch.zeros(4))


def test_attention_options_read_the_applied_keywords():
    module = torch.nn.Module()
    sinks = torch.zeros(4)
    options = attention_options(module, 0.0, dict(sliding_window=16, softcap=30, s_aux=sinks, position_ids=None,
                                                  use_cache=False, output_router_logits=True))
    assert (options.sliding_window, options.softcap, options.sinks) == (16, 30.0, sinks)
    with pytest.raises(ValueError, match="dropout=0.1"):
        attention_options(module, 0.1, {})
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        attention_options(module, 0.0, dict(sliding_window=0))
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        attention_options(module, 0.0, dict(softcap=-1.0))


@pytest.mark.parametrize("name, lines", [
    ("tiny-gemma2", ["layer 0 (1 of 2): window 8, soft-cap 2", "layer 1 (1 of 2): full, soft-cap 2"]),
    ("tiny-gemma3", ["layers 0-1 (2 of 3): window 8", "layer 2 (1 of 3): full"]),
    ("tiny-gpt-oss", ["layer 0 (1 of 2): window 8, sinks", "layer 1 (1 of 2): full, sinks"]),
    ("tiny-mistral", ["layers 0-1 (2 of 2): window 8"]),
    ("tiny-llama", ["layers 0-1 (2 of 2): full"]),
])
def test_info_shows_each_layer_groups_attention(name, lines):
    report = model_info(name, kv_cache_memory="1MiB").splitlines()
    start = next(i for i, line in enumerate(report) if line.startswith("attention:"))
    end = next((i for i in range(start + 1, len(report)) if not report[i].startswith(" ")), len(report))
    assert [line[20:] for line in report[start:end]] == lines
