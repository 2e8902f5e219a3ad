"""The request contract every front shares: vLLM's parameter dict -> SamplingParams, typed refusals, the
room a prompt has for new tokens, token constraints, delta outputs and the engine's per-request metrics."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams
from paged_backend.errors import CannotFit, InvalidParameter, InvalidRequest, PromptTooLong, UnsupportedParameter
from paged_backend.engine.request_params import SAMPLING_PARAMETERS, sampling_params_from_dict
from paged_backend.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine():
    model, tok = get_model("tiny-llama", torch.float32)
    eng = LLMEngine(model, tokenizer=tok, num_blocks=32, block_size=8, max_model_len=200, max_logprobs=5)
    yield eng
    assert_no_leaks(eng)


def run(engine, prompt, params, rid="r"):
    engine.add_request(rid, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


# ---- the parameter mapping --------------------------------------------------------------------
def test_values_may_be_strings_and_null_means_the_default():
    p = sampling_params_from_dict({"temperature": "0.5", "max_tokens": "16", "ignore_eos": "true", "n": 2,
                                   "stop": '["a", "b"]', "stop_token_ids": "[1, 2]", "seed": None,
                                   "logit_bias": '{"5": -1.5}', "allowed_token_ids": [3, 4], "bad_words": ["x"]})
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.n, p.seed) == (0.5, 16, True, 2, None)
    assert p.stop_strings == ["a", "b"] and p.stop_token_ids == [1, 2]
    assert p.logit_bias == {5: -1.5} and p.allowed_token_ids == [3, 4] and p.bad_words == ["x"]
    assert sampling_params_from_dict({}) == SamplingParams()


def test_vllm_spellings_fold_onto_one_meaning():
    assert sampling_params_from_dict({"top_k": 0}).top_k == -1 == sampling_params_from_dict({"top_k": -1}).top_k
    assert sampling_params_from_dict({"logprobs": True}).logprobs == 0
    assert sampling_params_from_dict({"logprobs": True, "top_logprobs": 3}).logprobs == 3
    beams = sampling_params_from_dict({"use_beam_search": True, "n": 2, "best_of": 3})
    assert (beams.beam_width, beams.n, beams.temperature) == (3, 2, 0.0)
    assert sampling_params_from_dict({"use_beam_search": "true", "n": 2}).beam_width == 2
    with pytest.raises(InvalidParameter, match="use_beam_search needs best_of") as info:
        sampling_params_from_dict({"use_beam_search": True})  # n=1: vLLM refused a beam of one too
    assert info.value.param == "best_of"


@pytest.mark.parametrize("values, error, param", [
    ({"temperature": "hot"}, InvalidParameter, "temperature"),
    ({"temperature": "1e400"}, InvalidParameter, "temperature"),
    ({"top_p": 0}, InvalidParameter, "top_p"),
    ({"stop_token_ids": ["a"]}, InvalidParameter, "stop_token_ids"),
    ({"seed": 2 ** 64}, InvalidParameter, "seed"),
    ({"frobnicate": 1}, InvalidParameter, "frobnicate"),
    ({"prompt_logprobs": 1}, UnsupportedParameter, "prompt_logprobs"),
    ({"spaces_between_special_tokens": "false"}, UnsupportedParameter, "spaces_between_special_tokens"),
    ({"logit_bias": {"x": 1}}, InvalidParameter, "logit_bias"),
    ({"logprobs": 2, "top_logprobs": 3}, InvalidParameter, "top_logprobs"),
])
def test_bad_values_name_their_parameter(values, error, param):
    with pytest.raises(error) as info:
        sampling_params_from_dict(values)
    assert info.value.param == param and param in str(info.value)


def test_the_table_covers_the_documented_names():
    assert {"n", "temperature", "top_k", "max_tokens", "logprobs", "top_logprobs", "bad_words",
            "allowed_token_ids", "logit_bias", "truncate_prompt_tokens", "use_beam_search"} <= set(SAMPLING_PARAMETERS)


# ---- typed refusals and the room for new tokens -----------------------------------------------
def test_refusals_are_typed(engine):
    cases = [
        ("", SamplingParams(), InvalidRequest, "prompt"),
        ([1, 10 ** 6], SamplingParams(), InvalidRequest, "prompt"),
        (list(range(5, 205)), SamplingParams(), PromptTooLong, "prompt"),
        ([5, 6], SamplingParams(stop_token_ids=[10 ** 6]), InvalidParameter, "stop_token_ids"),
        ([5, 6], SamplingParams(logprobs=6), InvalidParameter, "logprobs"),
        ([5, 6], SamplingParams(allowed_token_ids=[10 ** 6]), InvalidParameter, "allowed_token_ids"),
        ([5, 6], SamplingParams(logit_bias={10 ** 6: 1.0}), InvalidParameter, "logit_bias"),
        ([5, 6], SamplingParams(n=300, temperature=1.0), CannotFit, "best_of"),
    ]
    for prompt, params, error, param in cases:
        with pytest.raises(error) as info:
            engine.validate_request(prompt, params)
        assert info.value.param == param, (prompt, params)


def test_a_prompt_longer_than_any_that_fits_is_refused_without_tokenizing(engine):
    calls = []
    tokenizer = engine.tokenizer
    original = type(tokenizer).__call__
    try:
        type(tokenizer).__call__ = lambda self, *a, **k: calls.append(a) or original(self, *a, **k)
        with pytest.raises(PromptTooLong, match="characters"):
            engine.validate_request("x" * (engine.max_prompt_chars + 1), SamplingParams())
        assert calls == []
        # with truncation the text is tokenized and its last tokens kept
        ids = engine.validate_request("word " * 300, SamplingParams(truncate_prompt_tokens=7))
        assert len(ids) == 7 and len(calls) == 1
    finally:
        type(tokenizer).__call__ = original


def test_room_for_new_tokens_counts_context_and_kv_cache(engine):
    # 32 blocks of 8 tokens, context 200: a 10-token prompt may get 190 (context), 20 branches 4 each
    assert engine.max_new_tokens(10) == 190
    assert engine.max_new_tokens(10, 20) == (1 + (32 - 1) // 20) * 8 - 10
    p = engine.fit_max_tokens(10, SamplingParams())
    assert p.max_tokens == 190
    assert engine.fit_max_tokens(10, SamplingParams(), default=16).max_tokens == 16
    assert engine.fit_max_tokens(10, SamplingParams(max_tokens=5), default=16).max_tokens == 5
    with pytest.raises(PromptTooLong, match="context length") as info:
        engine.fit_max_tokens(10, SamplingParams(max_tokens=191), param="max_new_tokens")
    assert info.value.param == "max_new_tokens"
    with pytest.raises(CannotFit, match="KV cache"):
        engine.fit_max_tokens(10, SamplingParams(n=20, temperature=1.0, max_tokens=10))
    with pytest.raises(PromptTooLong, match="no room"):
        engine.fit_max_tokens(200, SamplingParams())


# ---- token constraints ------------------------------------------------------------------------
def test_allowed_token_ids_logit_bias_and_bad_words_shape_the_output(engine):
    prompt = [5, 6, 7, 8]
    allowed = run(engine, prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True,
                                                 allowed_token_ids=[40, 41, 42]))[-1]
    assert set(allowed.outputs[0].token_ids) <= {40, 41, 42}
    forced = run(engine, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logit_bias={77: 100.0}))[-1]
    assert forced.outputs[0].token_ids == [77] * 6
    greedy = run(engine, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[-1]
    first = engine.tokenizer.decode([greedy.outputs[0].token_ids[0]]).strip()
    assert first, "the first greedy token should spell a word"
    banned = run(engine, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                bad_words=[first]))[-1]
    assert banned.outputs[0].token_ids[0] != greedy.outputs[0].token_ids[0]


# ---- delta outputs ----------------------------------------------------------------------------
def test_delta_pieces_add_up_and_hold_back_stop_strings(engine):
    prompt = "The capital of France is"
    base = run(engine, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[-1].outputs[0]
    stop = base.text[8:11]  # a stop string the greedy text reaches
    params = dict(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    full = run(engine, prompt, SamplingParams(**params))[-1].outputs[0]
    deltas = run(engine, prompt, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    assert "".join(c.text for d in deltas for c in d.outputs) == full.text
    assert [t for d in deltas for c in d.outputs for t in c.token_ids] == full.token_ids
    assert deltas[-1].finished and deltas[-1].outputs[-1].finish_reason == "stop"
    sent = ""
    for d in deltas:  # text sent is never taken back: the start of the stop string was held back
        sent += "".join(c.text for c in d.outputs)
        assert full.text.startswith(sent)
    assert len(deltas) > 2


def test_final_only_and_beam_search_report_once(engine):
    finals = run(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                   output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(finals) == 1 and finals[0].finished
    beams = run(engine, [5, 6, 7], SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=5,
                                                  output_kind=RequestOutputKind.DELTA))
    whole = run(engine, [5, 6, 7], SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=5))[-1]
    assert len(beams) == 1 and [c.token_ids for c in beams[0].outputs] == [c.token_ids for c in whole.outputs]


def test_samples_stream_their_own_pieces(engine):
    params = dict(n=3, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)
    full = run(engine, [9, 10, 11], SamplingParams(**params))[-1]
    deltas = run(engine, [9, 10, 11], SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    for comp in full.outputs:
        pieces = [c for d in deltas for c in d.outputs if c.index == comp.index]
        assert [t for c in pieces for t in c.token_ids] == comp.token_ids
        assert "".join(c.text for c in pieces) == comp.text
        assert [c.finish_reason for c in pieces].count("length") == 1


# ---- metrics ----------------------------------------------------------------------------------
def test_the_engine_observes_per_request_histograms():
    model, tok = get_model("tiny-llama", torch.float32)
    eng = LLMEngine(model, tokenizer=tok, num_blocks=32, block_size=8)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.add_request("b", [5, 6, 7, 8], SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True))
    eng.add_request("c", [5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort_request("c")
    run_to_completion(eng)
    stats = eng.get_stats()
    h = stats.histograms
    assert h["request_prompt_tokens"].count == 3 and h["request_prompt_tokens"].sum == 3 + 4 + 2
    assert h["request_generation_tokens"].sum == 4 + 2 * 3 + 1
    assert h["time_to_first_token_seconds"].count == 3 and h["e2e_request_latency_seconds"].count == 3
    # one gap per later step of each request: a: 3, b: 2 (its two samples step together), c: 0
    assert h["time_per_output_token_seconds"].count == 5
    assert h["request_params_n"].sum == 1 + 2 + 1
    assert stats.finish_reasons == {"stop": 0, "length": 2, "abort": 1, "error": 0}
    cumulative = h["request_prompt_tokens"].cumulative()
    assert cumulative[-1] == ("+Inf", 3) and dict(cumulative)["2.0"] == 1 and dict(cumulative)["5.0"] == 3
    assert sorted(h["request_prompt_tokens"].new_values(0)) == [2, 3, 4]
    assert len(h["request_prompt_tokens"].new_values(2)) == 1 and h["request_prompt_tokens"].new_values(3) == ()


def test_a_windowed_model_has_room_beyond_its_kv_cache():
    """Every layer of tiny-mistral attends through a window of 8 tokens: blocks behind it are released, so
    a request may generate more tokens than the cache holds."""
    model, tok = get_model("tiny-mistral", torch.float32)
    eng = LLMEngine(model, tokenizer=tok, num_blocks=8, block_size=4)
    assert eng.max_new_tokens(5) == eng.max_model_len - 5  # 8 blocks hold 32 tokens; the window needs 3
    params = eng.fit_max_tokens(5, SamplingParams(temperature=0, ignore_eos=True), default=100)
    eng.add_request("long", [5, 6, 7, 8, 9], params)
    (out,) = [o for o in run_to_completion(eng).values()]
    assert out.error is None and len(out.outputs[0].token_ids) == 100
    assert_no_leaks(eng)


def test_a_histogram_snapshot_keeps_its_values_while_the_histogram_observes_and_compacts():
    """The engine snapshots its histograms every step without copying their value logs: an older snapshot must
    still replay exactly the values observed before it, after later observations and after the log starts a new
    list (every 2 * RECENT_VALUES observations), and keep at most RECENT_VALUES of them."""
    from paged_backend.engine.metrics import RECENT_VALUES, Histogram

    h = Histogram((1.0, 10.0))
    for i in range(5):
        h.observe(float(i))
    early = h.snapshot()
    assert early.recent == (0.0, 1.0, 2.0, 3.0, 4.0) and early.new_values(3) == (3.0, 4.0)
    for i in range(5, 3 * RECENT_VALUES):
        h.observe(float(i))
        if i == 2 * RECENT_VALUES - 2:
            before_compaction = h.snapshot()
    assert early.recent == (0.0, 1.0, 2.0, 3.0, 4.0) and early.count == 5 and early.new_values(0) == early.recent
    assert before_compaction.count == 2 * RECENT_VALUES - 1
    assert before_compaction.recent == tuple(float(i) for i in range(RECENT_VALUES - 1, 2 * RECENT_VALUES - 1))
    late = h.snapshot()
    assert late.count == 3 * RECENT_VALUES and late.counts == (2, 9, 3 * RECENT_VALUES - 11)
    assert late.recent == tuple(float(i) for i in range(2 * RECENT_VALUES, 3 * RECENT_VALUES))
    assert late.new_values(late.count - 2) == (3 * RECENT_VALUES - 2.0, 3 * RECENT_VALUES - 1.0)
    assert late.new_values(0) == late.recent and late.new_values(late.count) == ()
