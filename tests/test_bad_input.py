"""Bad input gets a clear ValueError or a failed output, and the engine keeps serving the rest."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLM, LLMEngine, SamplingParams


@pytest.fixture()
def engine():
    model, tok = get_model("tiny-llama")
    return LLMEngine(model, tokenizer=tok, num_blocks=8, block_size=4, max_num_seqs=4)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1, 2, 10**6], "outside the vocabulary"),
    ([1, -3], "outside the vocabulary"),
    (12, "prompt must be a string or a list of token ids"),
    ("word " * 40, "needs .* KV blocks but the cache holds only 8 blocks"),
])
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(engine, prompt, message):
    engine.add_request("good-1", "Hello there", SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=3))
    engine.add_request("good-2", "General Kenobi", SamplingParams(temperature=0, max_tokens=3))
    done = run_to_completion(engine)
    assert sorted(done) == ["good-1", "good-2"]
    assert all(len(o.outputs[0].token_ids) == 3 for o in done.values())
    assert_no_leaks(engine)


def test_other_refusals(engine):
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        engine.add_request("x", "Hi", {"temperature": 0})
    with pytest.raises(ValueError, match="max_num_seqs is 4"):
        engine.add_request("x", "Hi", SamplingParams(n=5, max_tokens=2))
    engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    model, _ = get_model("tiny-llama")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLMEngine(model, num_blocks=4, max_model_len=10**6)
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model")
    run_to_completion(engine)
    assert_no_leaks(engine)


def test_prompt_too_long_for_the_model_context():
    model, tok = get_model("tiny-llama")
    engine = LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="the model's context is 16 tokens"):
        engine.add_request("long", list(range(3, 19)), SamplingParams(max_tokens=1))
    engine.add_request("fits", list(range(3, 13)), SamplingParams(temperature=0, ignore_eos=True))
    out = run_to_completion(engine)["fits"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6  # stopped at the context limit


def test_request_that_outgrows_the_cache_fails_alone(engine):
    """A request whose output can never fit fails with an error; the others finish."""
    engine.add_request("greedy-hog", "a b c d e f g h", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("small", "Hi", SamplingParams(temperature=0, max_tokens=2))
    done = run_to_completion(engine)
    hog = done["greedy-hog"]
    assert hog.error and "even running alone" in hog.error and hog.outputs[0].finish_reason == "abort"
    assert done["small"].error is None and len(done["small"].outputs[0].token_ids) == 2
    assert engine.get_stats().num_requests_failed == 1
    assert_no_leaks(engine)


def test_abort_unknown_and_finished_requests_is_harmless(engine):
    assert engine.abort_request("never-seen") == []
    engine.add_request("a", "Hi", SamplingParams(max_tokens=2))
    run_to_completion(engine)
    assert engine.abort_request("a") == []
    assert_no_leaks(engine)


def test_llm_generate_validates_prompt_and_param_lists():
    model, tok = get_model("tiny-llama")
    llm = LLM(model, tokenizer=tok, num_blocks=16)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate([1, 2, 3])
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["Hi"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["Hi", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_models_without_the_attention_interface_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    model._supports_attention_backend = False
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not support transformers' attention backend"):
        LLMEngine(model, num_blocks=4)
    import torch

    with pytest.raises(ValueError, match="Linear is not a Hugging Face causal language model"):
        LLMEngine(torch.nn.Linear(2, 2), num_blocks=4)


def test_a_loaded_model_is_used_as_it_is_or_refused_with_a_dtype_that_disagrees():
    import torch

    model, tok = get_model("tiny-llama")  # float64
    with pytest.raises(ValueError, match="float64 but dtype=torch.float32 was asked for"):
        LLM(model, tokenizer=tok, dtype=torch.float32, num_blocks=8)
    with pytest.raises(ValueError, match="float64 but dtype=torch.bfloat16"):
        LLM(model, tokenizer=tok, dtype="bf16", num_blocks=8)
    for dtype in (None, "auto", torch.float64, "float64"):
        assert LLM(model, tokenizer=tok, dtype=dtype, num_blocks=8).engine.dtype == torch.float64


def test_stop_strings_need_a_tokenizer():
    model, _ = get_model("tiny-llama")
    engine = LLMEngine(model, num_blocks=8)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("x", [5, 6, 7], SamplingParams(stop=["the end"], max_tokens=3))
    engine.add_request("y", [5, 6, 7], SamplingParams(stop_token_ids=[9], max_tokens=3))
    assert len(run_to_completion(engine)["y"].outputs[0].token_ids) <= 3
