"""Triton adapter without a server: request parsing, response building, model.json options, repository files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged_backend import CompletionOutput, RequestOutput
from paged_backend.adapters.triton.options import load_model_options, parse_model_options
from paged_backend.adapters.triton.outputs import StreamState, build_outputs
from paged_backend.adapters.triton.params import (GenerateRequest, parse_generate_request,
                                                  parse_sampling_parameters, sampling_params_from_dict)
from paged_backend.adapters.triton.repo import write_model_repository


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


# ---- sampling_parameters ----------------------------------------------------------------------
def test_values_given_as_strings_are_converted():
    params = parse_sampling_parameters(json.dumps({
        "temperature": "0.5", "top_p": "0.9", "top_k": "5", "max_tokens": "16", "min_tokens": "2",
        "ignore_eos": "true", "skip_special_tokens": "false", "stop": '["a", "b"]', "stop_token_ids": "[2, 3]",
        "seed": "7", "n": "2", "presence_penalty": "0.5", "repetition_penalty": "1.1"}))
    assert params.temperature == 0.5 and params.top_p == 0.9 and params.top_k == 5
    assert params.max_tokens == 16 and params.min_tokens == 2 and params.seed == 7 and params.n == 2
    assert params.ignore_eos is True and params.skip_special_tokens is False
    assert params.stop_strings == ["a", "b"] and params.stop_token_ids == [2, 3]
    assert params.presence_penalty == 0.5 and params.repetition_penalty == pytest.approx(1.1)


def test_native_json_types_and_nulls():
    params = parse_sampling_parameters('{"temperature": 0, "max_tokens": 8, "stop": "x", "seed": null, '
                                       '"best_of": null, "ignore_eos": false}')
    assert params.is_greedy and params.max_tokens == 8 and params.stop_strings == ["x"] and params.seed is None
    assert params.best_of == 1


def test_empty_or_missing_parameters_give_the_defaults():
    assert parse_sampling_parameters("").max_tokens is None
    assert parse_sampling_parameters("{}").temperature == 1.0


@pytest.mark.parametrize("raw, message", [
    ("{bad json", "not valid JSON"),
    ('{"max_tokens": 16', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('"text"', "must be a JSON object"),
    ('{"temperature": -1}', "temperature"),
    ('{"temperature": "hot"}', "temperature must be a finite number"),
    ('{"temperature": "nan"}', "temperature must be a finite number"),
    ('{"top_p": 1.5}', "top_p"),
    ('{"top_k": 0}', "top_k"),
    ('{"n": 0}', "n must be"),
    ('{"max_tokens": 0}', "max_tokens"),
    ('{"max_tokens": "many"}', "max_tokens must be an integer"),
    ('{"max_tokens": 1.5}', "max_tokens must be an integer"),
    ('{"max_tokens": true}', "max_tokens must be an integer"),
    ('{"ignore_eos": "maybe"}', "ignore_eos must be a boolean"),
    ('{"stop": 5}', "stop must be a string or a list of strings"),
    ('{"stop_token_ids": ["x"]}', "stop_token_ids[0] must be an integer"),
    ('{"presence_penalty": 3}', "presence_penalty"),
    ('{"frobnicate": 1}', "unsupported sampling parameter 'frobnicate'"),
    ('{"n": 2, "temperature": 0}', "best_of=2 needs sampling"),
])
def test_bad_sampling_parameters_raise_clear_errors(raw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_sampling_parameters(raw)


def test_beam_search_switches():
    legacy = sampling_params_from_dict({"use_beam_search": "true", "best_of": 3, "n": 2})
    assert legacy.use_beam_search and legacy.beam_width == 3 and legacy.n == 2 and legacy.is_greedy
    direct = sampling_params_from_dict({"beam_width": "4", "early_stopping": "never", "length_penalty": "0.5"})
    assert direct.beam_width == 4 and direct.early_stopping == "never" and direct.length_penalty == 0.5


def test_openai_style_boolean_logprobs():
    assert sampling_params_from_dict({"logprobs": False}).logprobs is None
    assert sampling_params_from_dict({"logprobs": True}).logprobs == 0
    assert sampling_params_from_dict({"logprobs": "3"}).logprobs == 3


# ---- whole requests ---------------------------------------------------------------------------
def test_defaults_follow_the_vllm_backend():
    req = parse_generate_request({"text_input": text("Hello")})
    assert req.prompt == "Hello" and not req.stream and req.prepend_input
    assert not (req.return_finish_reason or req.return_cumulative_logprob or req.return_num_input_tokens
                or req.return_num_output_tokens)
    streaming = parse_generate_request({"text_input": text("Hello"), "stream": flag(True)})
    assert streaming.stream and not streaming.prepend_input
    excluded = parse_generate_request({"text_input": text("Hello"), "exclude_input_in_output": flag(True),
                                       "return_finish_reason": flag(True), "return_num_output_tokens": flag(True)})
    assert not excluded.prepend_input and excluded.return_finish_reason and excluded.return_num_output_tokens


def test_sampling_parameters_tensor_wins_over_request_parameters():
    req = parse_generate_request({"text_input": text("Hi"), "sampling_parameters": text('{"max_tokens": "4"}')},
                                 '{"max_tokens": 9}')
    assert req.params.max_tokens == 4


def test_request_parameters_are_used_without_the_tensor():
    """Triton's generate endpoint passes the JSON `parameters` object as request parameters."""
    req = parse_generate_request({"text_input": text("Hi")},
                                 '{"max_tokens": 5, "temperature": 0, "stream": true, "return_finish_reason": true}')
    assert req.params.max_tokens == 5 and req.params.is_greedy
    assert req.stream and not req.prepend_input and req.return_finish_reason


def test_input_shapes_and_encodings():
    req = parse_generate_request({"text_input": np.array([[b"two dims"]], dtype=np.object_)})
    assert req.prompt == "two dims"
    assert parse_generate_request({"text_input": np.array(["héllo"], dtype=np.object_)}).prompt == "héllo"


@pytest.mark.parametrize("inputs, params, message", [
    ({}, None, "missing required input tensor 'text_input'"),
    ({"text_input": None}, None, "missing required input tensor 'text_input'"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "exactly one element, got 2"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, None, "not valid UTF-8"),
    ({"text_input": np.array([3], dtype=np.int32)}, None, "text_input must be a string"),
    ({"text_input": text("x"), "sampling_parameters": text("{oops")}, None, "sampling_parameters is not valid JSON"),
    ({"text_input": text("x")}, "{oops", "request parameters is not valid JSON"),
    ({"text_input": text("x"), "stream": flag(True), "exclude_input_in_output": flag(False)}, None,
     "not allowed when streaming"),
    ({"text_input": text("x"), "stream": flag(True),
      "sampling_parameters": text('{"n": 1, "best_of": 2}')}, None, "cannot be streamed"),
    ({"text_input": text("x"), "stream": np.array([b"sometimes"], dtype=np.object_)}, None,
     "stream must be a boolean"),
])
def test_bad_requests_raise_clear_errors(inputs, params, message):
    with pytest.raises(ValueError, match=message):
        parse_generate_request(inputs, params)


# ---- responses --------------------------------------------------------------------------------
def _output(texts, finished, prompt="P:", reasons=None, tokens=None):
    reasons = reasons or [("stop" if finished else None)] * len(texts)
    tokens = tokens or [list(range(len(t))) for t in texts]
    outs = [CompletionOutput(i, t, tokens[i], -1.5 * (i + 1), finish_reason=reasons[i]) for i, t in enumerate(texts)]
    return RequestOutput("r", prompt, [1, 2, 3], outs, finished)


def _texts(arrays):
    return [v.decode() for v in arrays["text_output"]]


def test_streaming_sends_only_new_text_per_sequence():
    req = GenerateRequest(prompt="P:", params=sampling_params_from_dict({"n": 2}), stream=True,
                          prepend_input=False, return_num_output_tokens=True)
    state = StreamState()
    steps = [_output(["a", "x"], False), _output(["ab", "xy"], False), _output(["abc", "xy!"], True)]
    pieces = [build_outputs(req, out, state) for out in steps]
    assert [_texts(p) for p in pieces] == [["a", "x"], ["b", "y"], ["c", "!"]]
    assert [p["num_output_tokens"].tolist() for p in pieces] == [[1, 1], [1, 1], [1, 1]]
    assert pieces[0]["num_output_tokens"].dtype == np.uint32


def test_non_streaming_prepends_the_prompt_and_returns_everything_asked():
    req = GenerateRequest(prompt="P:", params=sampling_params_from_dict({}), return_finish_reason=True,
                          return_cumulative_logprob=True, return_num_input_tokens=True, return_num_output_tokens=True)
    arrays = build_outputs(req, _output([" done"], True, reasons=["length"]), StreamState())
    assert _texts(arrays) == ["P: done"]
    assert [v.decode() for v in arrays["finish_reason"]] == ["length"]
    assert arrays["cumulative_logprob"].dtype == np.float32 and arrays["cumulative_logprob"].tolist() == [-1.5]
    assert arrays["num_input_tokens"].tolist() == [3] and arrays["num_input_tokens"].dtype == np.uint32
    assert arrays["num_output_tokens"].tolist() == [5]
    bare = build_outputs(GenerateRequest(prompt="P:", params=req.params), _output(["x"], True), StreamState())
    assert set(bare) == {"text_output"}


def test_text_a_stop_string_may_still_cut_is_held_back():
    req = GenerateRequest(prompt="P", params=sampling_params_from_dict({"stop": "END"}), stream=True,
                          prepend_input=False)
    state = StreamState()
    first = build_outputs(req, _output(["hello E"], False), state)
    second = build_outputs(req, _output(["hello EN"], False), state)
    last = build_outputs(req, _output(["hello "], True), state)  # the engine cut "END" off
    pieces = _texts(first) + _texts(second) + _texts(last)
    assert "".join(pieces) == "hello "
    assert all("E" not in p for p in pieces)


def test_beam_search_streams_its_beams_at_the_end():
    req = GenerateRequest(prompt="P", params=sampling_params_from_dict({"beam_width": 2, "n": 2}), stream=True,
                          prepend_input=False, return_num_output_tokens=True)
    state = StreamState()
    running = build_outputs(req, _output(["par", "tial"], False), state)
    assert _texts(running) == ["", ""] and running["num_output_tokens"].tolist() == [0, 0]
    final = build_outputs(req, _output(["best one", "second"], True), state)
    assert _texts(final) == ["best one", "second"]


# ---- model.json and the repository ------------------------------------------------------------
def test_model_options_accept_strings_and_aliases():
    opts = parse_model_options({"model": "tiny-llama", "dtype": "fp32", "block_size": "8", "num_blocks": "32",
                                "enable_prefix_caching": "true", "preemption_mode": "swap", "max_num_seqs": 4})
    assert opts.dtype == "float32" and opts.engine["block_size"] == 8 and opts.engine["num_blocks"] == 32
    assert opts.engine["enable_prefix_caching"] is True and opts.engine["preemption_mode"] == "swap"
    kwargs = opts.engine_kwargs()
    assert str(kwargs["dtype"]) == "torch.float32" and kwargs["max_num_seqs"] == 4


@pytest.mark.parametrize("values, message", [
    ({"model": "tiny-llama", "gpu_memory_utilization": 0.9}, "unknown option"),
    ({"block_size": 3}, "block_size must be a positive power of two"),
    ({"block_size": "sixteen"}, "block_size must be an integer"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"preemption_mode": "evict"}, "preemption_mode must be"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot parse"),
    ({"num_blocks": 8, "kv_cache_memory": "1MiB"}, "either num_blocks or kv_cache_memory"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
    ({"enable_prefix_caching": "sometimes"}, "enable_prefix_caching must be a boolean"),
    ({"model": ""}, "model in model.json"),
])
def test_invalid_model_options_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        parse_model_options(values)


def test_repository_layout(tmp_path):
    model_dir = write_model_repository(tmp_path, "my_llm", {"model": "tiny-llama", "num_blocks": 16})
    config = (model_dir / "config.pbtxt").read_text()
    assert 'name: "my_llm"' in config and 'backend: "python"' in config and "decoupled: true" in config
    for name in ("text_input", "sampling_parameters", "exclude_input_in_output", "text_output", "finish_reason",
                 "cumulative_logprob", "num_input_tokens", "num_output_tokens"):
        assert f'name: "{name}"' in config
    assert "paged_backend.adapters.triton.model import TritonPythonModel" in (model_dir / "1" / "model.py").read_text()
    opts = load_model_options(model_dir / "1")
    assert opts.model == "tiny-llama" and opts.engine["num_blocks"] == 16
    with pytest.raises(ValueError, match="block_size"):
        write_model_repository(tmp_path, "bad", {"block_size": 5})
    with pytest.raises(ValueError, match="model name"):
        write_model_repository(tmp_path, "../escape", {})
    with pytest.raises(ValueError, match="not found"):
        load_model_options(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_options(tmp_path / "broken")
