"""Requests are validated once, off the event loop, within bounds: caps on the lists and constraints whose cost
grows with their size, JSON nested thousands deep refused as a ValueError, a prompt far beyond the context refused
after tokenizing about a context's worth, and the engine's ranks on top logprobs."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from conftest import get_model
from paged_backend import AsyncLLMEngine, LLMEngine, SamplingParams
from paged_backend.errors import InvalidParameter, PromptTooLong
from paged_backend.engine.request_params import sampling_params_from_dict
from paged_backend.sampling_params import MAX_BAD_WORDS, MAX_STOP_STRINGS, MAX_STRING_CHARS
from paged_backend.structured.params import MAX_CHOICES, MAX_CONSTRAINT_CHARS, StructuredOutputsParams

DEEP = "[" * 5000 + "]" * 5000  # a JSON document nested 5,000 levels deep


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny-llama", torch.float32)


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    return LLMEngine(model, tokenizer=tok, num_blocks=32, block_size=8, max_model_len=200, max_logprobs=5)


class CountingTokenizer:
    """Wraps a tokenizer and records every text it is asked to tokenize, with the calling thread."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.calls = []

    def __call__(self, text, *args, **kwargs):
        self.calls.append((threading.get_ident(), text))
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


# ---- caps -------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, param, message", [
    ({"bad_words": [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]}, "bad_words", f"at most {MAX_BAD_WORDS}"),
    ({"bad_words": ["x" * (MAX_STRING_CHARS + 1)]}, "bad_words", f"at most {MAX_STRING_CHARS}"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop": "y" * (MAX_STRING_CHARS + 1)}, "stop", f"at most {MAX_STRING_CHARS}"),
    ({"structured_outputs": {"choice": [str(i) for i in range(MAX_CHOICES + 1)]}}, "structured_outputs",
     f"at most {MAX_CHOICES}"),
    ({"structured_outputs": {"choice": ["z" * (MAX_CONSTRAINT_CHARS + 1)]}}, "structured_outputs",
     f"at most {MAX_CONSTRAINT_CHARS}"),
    ({"structured_outputs": {"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}}, "structured_outputs",
     f"at most {MAX_CONSTRAINT_CHARS}"),
    ({"structured_outputs": {"json": json.dumps({"type": "object", "description": "d" * MAX_CONSTRAINT_CHARS})}},
     "structured_outputs", f"at most {MAX_CONSTRAINT_CHARS}"),
])
def test_oversized_lists_and_constraints_are_refused_naming_the_field(values, param, message):
    with pytest.raises(InvalidParameter, match=message) as info:
        sampling_params_from_dict(values)
    assert info.value.param == param
    assert len(str(info.value)) < 500  # the refused list is not echoed back whole


def test_lists_at_the_caps_are_accepted():
    params = sampling_params_from_dict({"bad_words": [f"w{i}" for i in range(MAX_BAD_WORDS)],
                                        "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)],
                                        "structured_outputs": {"choice": [str(i) for i in range(MAX_CHOICES)]}})
    assert len(params.bad_words) == MAX_BAD_WORDS and len(params.stop_strings) == MAX_STOP_STRINGS


# ---- JSON nested thousands deep ------------------------------------------------------------------
def _deep_dict(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _deep_schema_text(levels: int) -> str:
    """A JSON schema nested `levels` object schemas deep, as text (json.dumps itself would recurse)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize("value", [
    {"structured_outputs": {"json": DEEP}},
    {"structured_outputs": json.dumps({"json": DEEP})},
    {"structured_outputs": DEEP},
    {"guided_decoding": {"json": _deep_schema_text(2500)}},
    {"structured_outputs": {"json": _deep_dict(2500)}},
])
def test_a_schema_nested_thousands_deep_is_an_invalid_parameter(value):
    with pytest.raises(InvalidParameter, match="nested more than") as info:
        sampling_params_from_dict(value)
    assert info.value.param in ("structured_outputs", "guided_decoding")


def test_a_stop_string_that_looks_like_deep_json_is_just_a_string():
    with pytest.raises(InvalidParameter, match=f"at most {MAX_STRING_CHARS}"):
        sampling_params_from_dict({"stop": DEEP})  # not JSON it can unpack: one (too long) stop string
    assert sampling_params_from_dict({"stop": "[[[["}).stop_strings == ["[[[["]


def test_a_schema_within_the_depth_bound_compiles(engine):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=_deep_dict(20)), max_tokens=4)
    assert engine.prepare_request("Hello", params).grammar is not None


# ---- prompts far beyond the context -----------------------------------------------------------
def test_a_prompt_far_beyond_the_context_is_refused_after_tokenizing_a_prefix(tiny):
    model, tok = tiny
    counting = CountingTokenizer(tok)
    engine = LLMEngine(model, tokenizer=counting, num_blocks=32, block_size=8, max_model_len=200)
    text = ("word " * engine.max_prompt_chars)[: engine.max_prompt_chars - 5]  # fits the character bound
    with pytest.raises(PromptTooLong, match="more than") as info:
        engine.validate_request(text, SamplingParams())
    assert info.value.param == "prompt"
    longest = max(len(t) for _, t in counting.calls if isinstance(t, str))
    assert longest <= 200 * 8, (longest, len(text))  # a context's worth of text, not the whole prompt
    counting.calls.clear()
    fits = "word " * 150
    assert len(engine.validate_request(fits, SamplingParams())) == len(tok(fits)["input_ids"])


def test_truncate_prompt_tokens_above_the_context_is_refused(engine):
    with pytest.raises(PromptTooLong, match="truncate_prompt_tokens") as info:
        engine.validate_request("a short prompt", SamplingParams(truncate_prompt_tokens=201))
    assert info.value.param == "truncate_prompt_tokens"
    assert len(engine.validate_request("word " * 50, SamplingParams(truncate_prompt_tokens=200))) <= 200


# ---- validated once, off the event loop ---------------------------------------------------------
def test_a_request_is_validated_once_and_never_on_the_event_loop(tiny):
    model, tok = tiny
    counting = CountingTokenizer(tok)
    engine = AsyncLLMEngine(model, tokenizer=counting, num_blocks=32, block_size=8, max_model_len=200)
    words = ["alpha", "beta gamma"]
    params = SamplingParams(temperature=0.0, max_tokens=3, bad_words=words)

    def times_tokenized(word: str) -> int:
        return sum(1 for _, t in counting.calls for text in (t if isinstance(t, list) else [t]) if text.strip() == word)

    async def run():
        loop_thread = threading.get_ident()
        first = None
        async for output in engine.generate("Hello there", params, "r1"):
            first = output
        # the bad words were tokenized once (the plain and the spaced forms), and not on the event loop
        assert times_tokenized("alpha") == 2, counting.calls
        on_loop = [text for thread, text in counting.calls if thread == loop_thread]
        assert on_loop == [], on_loop
        prepared = await asyncio.get_running_loop().run_in_executor(None, engine.prepare, "Hello there", params)
        before = len(counting.calls)
        async for output in engine.generate(prepared, None, "r2"):
            second = output
        assert len(counting.calls) == before  # a prepared request is queued without being tokenized again
        await engine.shutdown()
        return first, second

    first, second = asyncio.run(run())
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


# ---- vLLM's names in errors, ranks ---------------------------------------------------------------
def test_n_above_one_with_greedy_sampling_names_n():
    with pytest.raises(InvalidParameter, match="n=2") as info:
        SamplingParams(n=2, temperature=0.0)
    assert info.value.param == "n"
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(n=1, best_of=2, temperature=0.0)
    assert info.value.param == "best_of"


def test_top_logprobs_carry_the_engines_rank(engine):
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
    engine.add_request("ranks", [5, 6, 7], params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "ranks"), final)
    comp = final.outputs[0]
    outside = 0
    for token, top in zip(comp.token_ids, comp.logprobs):
        ranks = sorted(lp.rank for t, lp in top.items() if t != token or len(top) == 2)
        assert ranks[:2] == [1, 2]
        best = sorted(top.items(), key=lambda kv: -float(kv[1]))
        assert [t for t, _ in best[:2]] == [t for t, lp in sorted(top.items(), key=lambda kv: kv[1].rank)][:2]
        if len(top) == 3:  # the sampled token was outside the top 2: its true rank in the vocabulary
            outside += 1
            assert top[token].rank > 2 and float(top[token]) <= float(best[1][1])
    assert outside > 0  # temperature 1.5 on a random model samples outside the top 2
