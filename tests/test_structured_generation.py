"""Structured outputs through the engine with the real model (smollm2): JSON schemas, regexes, choices and
grammars constrain greedy and sampled outputs, `n > 1` samples and beams, under forced preemption of both
kinds; a bad schema fails its own request; logits processors run on every row that has them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import assert_no_leaks, get_model
from paged_backend import LLM, LLMEngine, SamplingParams
from paged_backend.structured.params import GuidedDecodingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "address"],
}
ITEMS = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}},
        "required": ["id", "tags"]}}},
    "required": ["items"],
}
PHONE = r"\d{3}-\d{4}"
COLORS = ["red", "green", "blue"]


def constraint(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(disable_any_whitespace=True, **kind)


REQUESTS = [
    ("Describe a person as JSON:", constraint(json=PERSON), 0.0, 1),
    ("List some items as JSON:", constraint(json=ITEMS), 1.0, 3),
    ("Give a phone number:", StructuredOutputsParams(regex=PHONE), 1.0, 3),
    ("Pick a color:", StructuredOutputsParams(choice=COLORS), 0.0, 1),
]


def check(text: str, so: StructuredOutputsParams) -> None:
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice, text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_outputs_are_valid_under_preemption(smollm2, mode):
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, num_blocks=10, block_size=16, preemption_mode=mode)
    params = [SamplingParams(n=n, temperature=t, seed=5, max_tokens=80, structured_outputs=so)
              for _, so, t, n in REQUESTS]
    outs = llm.generate([p for p, *_ in REQUESTS], params, use_tqdm=False)
    stats = llm.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0, stats
    for out, (_, so, _, n) in zip(outs, REQUESTS):
        assert out.error is None and len(out.outputs) == n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion
            check(completion.text, so)
    assert_no_leaks(llm.engine)


def test_beams_are_constrained_and_older_names_work(smollm2):
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, num_blocks=64)
    out = llm.generate(["Pick a color:"], SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=8,
                                                         guided_decoding=GuidedDecodingParams(choice=COLORS)),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(c.text in COLORS for c in out.outputs)
    as_dict = llm.generate(["Give a phone number:"], SamplingParams(temperature=0, max_tokens=12,
                                                                    structured_outputs={"regex": PHONE}),
                           use_tqdm=False)[0]
    assert re.fullmatch(PHONE, as_dict.outputs[0].text)
    grammar = 'root ::= "yes" | "no"'
    out = llm.generate(["Answer yes or no:"], SamplingParams(temperature=1.0, n=4, seed=2, max_tokens=4,
                                                             structured_outputs={"grammar": grammar}),
                       use_tqdm=False)[0]
    assert {c.text for c in out.outputs} <= {"yes", "no"}
    assert_no_leaks(llm.engine)


def test_invalid_constraints_fail_their_request_only(smollm2):
    model, tok = smollm2
    engine = LLMEngine(model, tokenizer=tok, num_blocks=32)
    engine.add_request("good", "Pick a color:", SamplingParams(temperature=0, max_tokens=4,
                                                               structured_outputs={"choice": COLORS}))
    with pytest.raises(ValueError, match="regex"):
        engine.add_request("bad-regex", "x", SamplingParams(structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(ValueError):
        engine.add_request("bad-schema", "x", SamplingParams(structured_outputs={"json": {"type": "nonsense"}}))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["good"].outputs[0].text in COLORS and set(outs) == {"good"}
    assert_no_leaks(engine)


def test_grammar_and_min_tokens_and_stop_strings_combine(smollm2):
    """min_tokens never masks the EOS a complete grammar needs; a stop string still ends a constrained output."""
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, num_blocks=32)
    out = llm.generate(["Pick a color:"], SamplingParams(temperature=0, max_tokens=8, min_tokens=6,
                                                         structured_outputs={"choice": COLORS}),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in COLORS and out.finish_reason == "stop"
    out = llm.generate(["Give a phone number:"], SamplingParams(temperature=0, max_tokens=12, stop=["-"],
                                                                structured_outputs={"regex": PHONE}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "-" and re.fullmatch(r"\d{3}", out.text)


def test_logits_processors_change_only_their_rows(dtype):
    model, tok = get_model("tiny-llama", dtype)
    banned = set()

    def ban_the_first_choice(output_ids, logits):
        if not output_ids:
            banned.add(int(logits.argmax()))
        logits[list(banned)] = float("-inf")
        return logits

    llm = LLM(model, tokenizer=tok, num_blocks=64)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free, processed = llm.generate(["Hello world", "Hello world"],
                                   [plain, plain.replace(logits_processors=[ban_the_first_choice])],
                                   use_tqdm=False)
    assert free.outputs[0].token_ids[0] in banned
    assert not banned & set(processed.outputs[0].token_ids)
    assert_no_leaks(llm.engine)


def test_a_grammar_that_the_model_cannot_finish_in_time_ends_by_length(smollm2):
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, num_blocks=32)
    out = llm.generate(["Describe a person as JSON:"], SamplingParams(temperature=0, max_tokens=5,
                                                                      structured_outputs=constraint(json=PERSON)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")
