"""Structured outputs core: params, compilation and cache, grammar state, and the batched mask.

Random and adversarial logits are driven through the mask with the real smollm2 tokenizer: whatever the
logits want, the decoded output must parse and validate against its constraint.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from paged_backend.worker.loader import AutoTokenizerFromDir, _smollm2_tokenizer_dir
from paged_backend.structured.compiler import StructuredOutputsCompiler, compiler_for
from paged_backend.structured.matcher import GrammarMasker, GrammarState
from paged_backend.structured.params import (GuidedDecodingParams, StructuredOutputsParams,
                                              structured_outputs_from)

EOS = 2
MAX_STEPS = 400

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}
ITEMS = {
    "type": "array",
    "items": {"type": "object",
              "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "ok": {"type": "boolean"}},
              "required": ["id", "ok"]},
    "minItems": 1, "maxItems": 4,
}
REVIEW = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "kind": {"const": "review"},
    },
    "required": ["color", "score", "note", "kind"],
}
SCHEMAS = {"nested": PERSON, "array": ITEMS, "enums": REVIEW}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizerFromDir(_smollm2_tokenizer_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return compiler_for(tokenizer, len(tokenizer), [EOS])


@pytest.fixture(scope="module")
def steering(tokenizer):
    """Token ids an adversary favours: EOS, whitespace-only tokens, and tokens that close strings/objects."""
    ids = []
    for token, index in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if text and (text.isspace() or any(ch in text for ch in '"}]')):
            ids.append(index)
    return torch.tensor(sorted(set(ids) | {EOS}))


def _logits(kind: str, rows: int, vocab: int, generator: torch.Generator, steering: torch.Tensor):
    logits = torch.randn(rows, vocab, generator=generator) * 3
    if kind == "adversarial":
        logits[:, steering] += 40.0
    return logits


def drive(compiler, params, tokenizer, steering, kind="random", rows=4, seed=0, dtype=torch.float32):
    """Generate `rows` outputs under `params` from random or adversarial logits; returns the texts."""
    constraint = compiler.compile(params)
    states = [GrammarState(constraint) for _ in range(rows)]
    masker = GrammarMasker(compiler.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    outputs = [[] for _ in range(rows)]
    active = list(range(rows))
    for _ in range(MAX_STEPS):
        logits = _logits(kind, rows, compiler.vocab_size, generator, steering).to(dtype)
        masker.apply(logits, active, [states[r] for r in active])
        picks = logits.argmax(dim=-1).tolist()  # the logits are random already: the best allowed token
        for r in list(active):
            token = picks[r]
            assert states[r].accept(token), f"the mask let through token {token} that the grammar rejects"
            if token == EOS:
                assert states[r].is_terminated
                active.remove(r)
            else:
                outputs[r].append(token)
        if not active:
            return [tokenizer.decode(ids) for ids in outputs]
    raise AssertionError(f"{len(active)} of {rows} outputs did not finish in {MAX_STEPS} steps")


# ---- outputs that parse and validate ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["random", "adversarial"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(compiler, tokenizer, steering, name, kind):
    schema = SCHEMAS[name]
    texts = drive(compiler, StructuredOutputsParams(json=schema), tokenizer, steering, kind, seed=len(name))
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_compact_json_schema_output_is_canonical(compiler, tokenizer, steering):
    """disable_any_whitespace: exactly json.dumps's layout, whatever whitespace the logits push for."""
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    for text in drive(compiler, params, tokenizer, steering, "adversarial", seed=5):
        value = json.loads(text)
        jsonschema.validate(value, PERSON)
        assert text == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_regex_outputs_fullmatch(compiler, tokenizer, steering, kind, dtype):
    pattern = r"[0-9]{3}-[A-Z]{2,4}( [a-z]{1,6})?"
    params = StructuredOutputsParams(regex=pattern)
    for text in drive(compiler, params, tokenizer, steering, kind, seed=3, dtype=dtype):
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_choice_outputs_are_members(compiler, tokenizer, steering, kind):
    choices = ["yes", "no", "n", 'say "hi"', "back\\slash", "new\nline", "ünïcode"]
    texts = drive(compiler, StructuredOutputsParams(choice=choices), tokenizer, steering, kind, rows=8, seed=4)
    assert all(text in choices for text in texts), texts


def test_json_object_outputs_are_objects(compiler, tokenizer, steering):
    for text in drive(compiler, StructuredOutputsParams(json_object=True), tokenizer, steering, "adversarial"):
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("grammar, pattern", [
    ('root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]{0,2}', r"\([1-9][0-9]{0,2}(,[1-9][0-9]{0,2})*\)"),
    ('start: WORD ("-" WORD)*\nWORD: /[a-z]{1,5}/', r"[a-z]{1,5}(-[a-z]{1,5})*"),
], ids=["ebnf", "lark"])
def test_grammar_outputs_match(compiler, tokenizer, steering, grammar, pattern):
    for text in drive(compiler, StructuredOutputsParams(grammar=grammar), tokenizer, steering, "random", seed=6):
        assert re.fullmatch(pattern, text), text


# ---- EOS, rejection, fork, rebuild -----------------------------------------------------------------

def _accept_text(state: GrammarState, tokenizer, text: str) -> list:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token in ids:
        assert state.accept(token), (text, token)
    return ids


def test_eos_only_where_the_grammar_is_complete(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredOutputsParams(json=REVIEW)))
    assert EOS not in state.allowed_token_ids()
    assert not state.accept(EOS) and not state.is_terminated
    _accept_text(state, tokenizer, '{"color": "red", "score": 3, "note": null, "kind": "review"')
    assert EOS not in state.allowed_token_ids() and not state.is_completed
    _accept_text(state, tokenizer, "}")
    assert state.is_completed and state.allowed_token_ids() == [EOS]
    assert state.accept(EOS) and state.is_terminated
    assert not state.accept(EOS)
    with pytest.raises(ValueError, match="terminated"):
        GrammarMasker(compiler.vocab_size).apply(torch.zeros(1, compiler.vocab_size), [0], [state])


def test_rejected_token_leaves_the_state_unchanged(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredOutputsParams(regex=r"[0-9]{2}")))
    before = state.allowed_token_ids()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert letter not in before and not state.accept(letter)
    assert state.allowed_token_ids() == before and state.num_accepted == 0


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 8}, {"type": "string", "minLength": 1},
                                    {"type": "object", "properties": {"a": {"anyOf": [
                                        {"type": "string", "maxLength": 4}, {"type": "null"}]}}}],
                         ids=["maxLength", "minLength", "nested"])
def test_bounded_strings_hold_no_raw_control_characters(compiler, tokenizer, schema):
    """xgrammar 0.2.9 lets raw tabs into length-bounded strings (mlc-ai/xgrammar#800): invalid JSON."""
    state = GrammarState(compiler.compile(StructuredOutputsParams(json=schema)))
    _accept_text(state, tokenizer, '{"a": "x' if schema["type"] == "object" else '"x')
    allowed = state.allowed_token_ids()
    assert len(allowed) > 1000
    texts = tokenizer.convert_ids_to_tokens(allowed)
    controls = [t for t in texts if any(ord(ch) < 0x20 for ch in tokenizer.convert_tokens_to_string([t]))]
    assert not controls, controls[:5]
    tab = tokenizer.encode("\t", add_special_tokens=False)
    assert len(tab) == 1 and not state.accept(tab[0])


def test_special_tokens_are_never_allowed(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredOutputsParams(json={"type": "string"})))
    _accept_text(state, tokenizer, '"x')
    allowed = set(state.allowed_token_ids())
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert len(allowed) > 40000 and not allowed & special


def test_fork_is_independent(compiler, tokenizer):
    parent = GrammarState(compiler.compile(StructuredOutputsParams(json=PERSON)))
    prefix = _accept_text(parent, tokenizer, '{"name": "Al')
    child = parent.fork()
    assert child.num_accepted == parent.num_accepted == len(prefix)
    child_ids = _accept_text(child, tokenizer, 'ice", "age": 30, "address": {"city": "R')
    parent_ids = _accept_text(parent, tokenizer, 'an"')
    fresh = GrammarState(parent.constraint)
    fresh.rebuild(prefix + parent_ids)
    assert parent.allowed_token_ids() == fresh.allowed_token_ids()
    fresh.rebuild(prefix + child_ids)
    assert child.allowed_token_ids() == fresh.allowed_token_ids()
    assert parent.allowed_token_ids() != child.allowed_token_ids()


def test_rebuild_equals_incremental_state(compiler, tokenizer, steering):
    constraint = compiler.compile(StructuredOutputsParams(json=ITEMS))
    text = drive(compiler, StructuredOutputsParams(json=ITEMS), tokenizer, steering, "random", rows=1, seed=9)[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    incremental = GrammarState(constraint)
    rebuilt = GrammarState(constraint)
    for k, token in enumerate(ids + [EOS]):
        if k % 5 == 0 or k == len(ids):
            rebuilt.rebuild(ids[:k])
            assert rebuilt.allowed_token_ids() == incremental.allowed_token_ids(), k
            assert rebuilt.num_accepted == incremental.num_accepted == k
            assert rebuilt.is_completed == incremental.is_completed
        assert incremental.accept(token)
    rebuilt.rebuild(ids + [EOS])
    assert rebuilt.is_terminated


def test_rebuild_names_the_rejected_token(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredOutputsParams(regex=r"[0-9]+")))
    ids = tokenizer.encode("12x", add_special_tokens=False)
    with pytest.raises(ValueError, match=rf"token {ids[-1]} at output position {len(ids) - 1}"):
        state.rebuild(ids)


# ---- the batched mask ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mask_touches_only_constrained_rows(compiler, tokenizer, dtype):
    """Rows 1 and 3 of 5 are constrained (two grammars, one batch); the others stay bit-identical.
    float32 takes xgrammar's CPU kernel, float64 the torch op: both give exactly the grammar's allowed set."""
    digits = GrammarState(compiler.compile(StructuredOutputsParams(regex=r"[0-9]{2}")))
    review = GrammarState(compiler.compile(StructuredOutputsParams(json=REVIEW)))
    _accept_text(review, tokenizer, '{"color": ')
    logits = torch.randn(5, compiler.vocab_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    original = logits.clone()
    GrammarMasker(compiler.vocab_size).apply(logits, [3, 1], [digits, review])
    for row in (0, 2, 4):
        assert torch.equal(logits[row], original[row])
    for row, state in ((3, digits), (1, review)):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed == state.allowed_token_ids() and len(allowed) > 0
        assert torch.equal(logits[row, allowed], original[row, allowed])


def test_mask_with_no_constrained_rows_is_a_no_op(compiler):
    logits = torch.randn(3, compiler.vocab_size)
    original = logits.clone()
    GrammarMasker(compiler.vocab_size).apply(logits, [], [])
    assert torch.equal(logits, original)


def test_mask_refuses_mismatched_shapes(compiler):
    state = GrammarState(compiler.compile(StructuredOutputsParams(choice=["a"])))
    masker = GrammarMasker(compiler.vocab_size)
    with pytest.raises(ValueError, match=r"logits must be \[rows, 49152\]"):
        masker.apply(torch.zeros(1, compiler.vocab_size + 1), [0], [state])
    with pytest.raises(ValueError, match="1 rows but 2 grammar states"):
        masker.apply(torch.zeros(2, compiler.vocab_size), [0], [state, state])


@pytest.mark.parametrize("model_vocab", [49152 + 64, 49000], ids=["padded-logits", "narrower-logits"])
def test_model_vocab_differs_from_tokenizer(tokenizer, steering, model_vocab):
    compiler = StructuredOutputsCompiler(tokenizer, model_vocab, [EOS])
    state = GrammarState(compiler.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 5})))
    allowed = state.allowed_token_ids()
    assert allowed and max(allowed) < min(model_vocab, len(tokenizer))
    texts = drive(compiler, StructuredOutputsParams(choice=["alpha", "beta"]), tokenizer,
                  steering[steering < model_vocab], "random", rows=2)
    assert set(texts) <= {"alpha", "beta"}


def test_mask_cost_for_32_rows(compiler, tokenizer):
    """Prints (does not assert) what filling and applying one bitmask costs for 32 JSON rows."""
    constraint = compiler.compile(StructuredOutputsParams(json=PERSON))
    doc = tokenizer.encode('{"name": "Bob", "age": 42, "tags": ["a"], "address": {"city": "Rome", "zip": "0',
                           add_special_tokens=False)
    states = []
    for r in range(32):
        state = GrammarState(constraint)
        for token in doc[: r * len(doc) // 32]:
            assert state.accept(token)
        states.append(state)
    masker = GrammarMasker(compiler.vocab_size)
    logits = torch.randn(32, compiler.vocab_size)
    rows = list(range(32))
    masker.apply(logits.clone(), rows, states)  # warm up
    times = []
    for _ in range(10):
        step_logits = logits.clone()
        start = time.perf_counter()
        masker.apply(step_logits, rows, states)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"\nbitmask fill + apply for 32 rows x {compiler.vocab_size}: median {times[5] * 1e3:.2f} ms, "
          f"min {times[0] * 1e3:.2f} ms")


# ---- params and compilation ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON schema object"),
    ({"json": '"a string"'}, "must be a JSON schema object"),
    ({"regex": 5}, "regex must be a string"),
    ({"choice": []}, "choice must not be empty"),
    ({"choice": "yes"}, "choice must be a list of strings"),
    ({"choice": ["a", 1]}, "choice must hold only strings"),
    ({"grammar": "  "}, "grammar must not be empty"),
    ({"json_object": False}, "json_object must be True"),
    ({"regex": "a", "whitespace_pattern": " *"}, "whitespace_pattern is not supported"),
    ({"structural_tag": "{}"}, "structural_tag is not supported"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a boolean"),
])
def test_bad_params_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(json={"type": "foo"}), 'invalid structured_outputs.json: Unsupported type "foo"'),
    (StructuredOutputsParams(regex="a(b"), "invalid structured_outputs.regex: Regex parsing error"),
    (StructuredOutputsParams(regex="(?=a)b"), "Lookahead is not supported"),
    (StructuredOutputsParams(grammar="root ::= foo"), 'invalid structured_outputs.grammar: EBNF parser error'),
    (StructuredOutputsParams(grammar="start: foo"), "invalid structured_outputs.grammar: Lark error"),
], ids=["schema", "regex", "lookahead", "ebnf", "lark"])
def test_compile_errors_are_value_errors(compiler, params, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        compiler.validate(params)
    assert ".cc:" not in str(info.value)  # no C++ source location


def test_front_values_and_old_names():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = structured_outputs_from(json.dumps({"json": schema, "backend": None}))
    assert params.kind == "json" and params.schema == schema
    assert structured_outputs_from({"choice": ["x"], "regex": None}).choice == ["x"]
    assert structured_outputs_from(None) is None
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        structured_outputs_from({"guided_json": schema})
    with pytest.raises(ValueError, match="must be an object"):
        structured_outputs_from(["x"])
    old = GuidedDecodingParams(json=schema, backend="xgrammar", disable_fallback=True)
    assert isinstance(old, StructuredOutputsParams) and old.cache_key() == StructuredOutputsParams(json=schema).cache_key()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(backend="xgrammar")


def test_pydantic_model_as_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    params = StructuredOutputsParams(json=Point)
    assert params.schema["required"] == ["x", "y"]


def test_compile_cache(tokenizer):
    compiler = StructuredOutputsCompiler(tokenizer, len(tokenizer), [EOS], cache_size=2)
    first = compiler.compile(StructuredOutputsParams(json=REVIEW))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(REVIEW))) is first
    assert (compiler.stats.compiled, compiler.stats.hits) == (1, 1)
    compact = compiler.compile(StructuredOutputsParams(json=REVIEW, disable_any_whitespace=True))
    assert compact is not first and compiler.stats.compiled == 2
    compiler.compile(StructuredOutputsParams(regex="a"))       # evicts the least recently used: `first`
    assert compiler.compile(StructuredOutputsParams(json=REVIEW)) is not first
    assert compiler.stats.compiled == 4


def test_one_compiler_per_tokenizer_and_vocab(tokenizer, compiler):
    assert compiler_for(tokenizer, len(tokenizer), [EOS]) is compiler
    assert compiler_for(tokenizer, len(tokenizer), [EOS, 0]) is not compiler
    with pytest.raises(ValueError, match="outside the vocabulary"):
        StructuredOutputsCompiler(tokenizer, 100, [EOS, 500])
    with pytest.raises(ValueError, match="at least one stop"):
        StructuredOutputsCompiler(tokenizer, 100, [])


def test_unhashable_tokenizer_gets_its_own_compiler(tokenizer):
    import copy

    unhashable = copy.copy(tokenizer)
    unhashable.__class__ = type("Unhashable", (type(tokenizer),), {"__hash__": None})
    first = compiler_for(unhashable, len(tokenizer), [EOS])
    assert first is not compiler_for(unhashable, len(tokenizer), [EOS])
    assert GrammarState(first.compile(StructuredOutputsParams(choice=["ok"]))).allowed_token_ids()
