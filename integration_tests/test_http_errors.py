"""Every bad input gets the documented 4xx with a JSON body in its API's shape, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from http_fixtures import http, http_reference, http_server  # noqa: F401 (fixtures)
from http_helpers import client, greedy, wait_idle
from http_server_process import AUTH, HTTP_MODEL, HTTP_NUM_BLOCKS

LONG_FOR_CONTEXT = "word " * 1100   # > 1024 tokens: longer than the model's context
LONG_FOR_KV = "word " * 790         # < 1024 tokens but > 48 blocks x 16 tokens of KV cache
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 5000 + '{"type": "string"}' + "}}" * 5000  # as a string
DEEP_ARRAY = "[" * 5000 + "]" * 5000
MANY_WORDS = [f"w{i}" for i in range(4097)]  # one more than the cap on bad_words


def _tgi(params=None, inputs="Hello there"):
    return {"inputs": inputs, "parameters": params or {}}


# (path, JSON body or raw bytes, expected status, text the error message must contain)
TGI_CASES = [
    ("/generate", b"{not json", 400, "not valid JSON"),
    ("/generate", b"", 422, "empty"),
    ("/generate", b"[1, 2]", 422, "JSON object"),
    ("/generate", b'{"inputs": "x", "parameters": {"temperature": NaN}}', 400, "NaN"),
    ("/generate", {"parameters": {}}, 422, "`inputs` is required"),
    ("/generate", {"inputs": 42}, 422, "inputs"),
    ("/generate", _tgi(inputs=""), 422, "`inputs` cannot be empty"),
    ("/generate", _tgi({"temperature": "hot"}), 422, "parameters.temperature"),
    ("/generate", _tgi({"max_new_tokens": "5"}), 422, "parameters.max_new_tokens"),
    ("/generate", _tgi({"details": "yes"}), 422, "parameters.details"),
    ("/generate", _tgi({"temperature": 0}), 422, "`temperature` must be strictly positive"),
    ("/generate", _tgi({"top_p": 1.0}), 422, "`top_p` must be > 0.0 and < 1.0"),
    ("/generate", _tgi({"top_k": 0}), 422, "`top_k` must be strictly positive"),
    ("/generate", _tgi({"repetition_penalty": -1}), 422, "`repetition_penalty`"),
    ("/generate", _tgi({"frequency_penalty": 3}), 422, "`frequency_penalty`"),
    ("/generate", _tgi({"max_new_tokens": 0}), 422, "`max_new_tokens` must be strictly positive"),
    ("/generate", _tgi({"max_new_tokens": 2000}), 422, "context length"),
    ("/generate", _tgi({"max_new_tokens": 900}), 422, "KV cache"),
    ("/generate", _tgi({"max_new_tokens": 5}, LONG_FOR_CONTEXT), 422, "the model's context is 1024 tokens"),
    ("/generate", _tgi(inputs="x" * 200_000), 422, "characters, more than any prompt that fits"),
    ("/generate", _tgi({"max_new_tokens": 900, "truncate": 100}), 422, "KV cache"),
    ("/generate", _tgi({"max_new_tokens": 5}, LONG_FOR_KV), 422, "KV blocks"),
    ("/generate", _tgi({"best_of": 2}), 422, "you must use sampling"),
    ("/generate", _tgi({"best_of": 9, "do_sample": True}), 422, "`best_of` must be > 0 and <= 4"),
    ("/generate", _tgi({"best_of": 2, "do_sample": True, "seed": 3}), 422, "`seed` must not be set"),
    ("/generate", _tgi({"seed": -1}), 422, "`seed`"),
    ("/generate", _tgi({"stop": ["a", "b", "c", "d", "e"]}), 422, "up to 4 stop sequences"),
    ("/generate", _tgi({"stop": "a"}), 422, "parameters.stop"),
    ("/generate", _tgi({"truncate": 0}), 422, "`truncate`"),
    ("/generate", _tgi({"top_n_tokens": 10}), 422, "`top_n_tokens`"),
    ("/generate", _tgi({"typical_p": 0.5}), 422, "not supported"),
    ("/generate", _tgi({"grammar": {"type": "regex", "value": "(a"}}), 422, "grammar is not valid"),
    ("/generate", _tgi({"grammar": {"type": "json", "value": {"type": "object"}}}), 422, "'properties' field"),
    ("/generate_stream", _tgi({"best_of": 2, "do_sample": True}), 422, "not supported when streaming"),
    ("/generate_stream", _tgi({"decoder_input_details": True}), 422, "not supported when streaming"),
    ("/generate_stream", _tgi({"temperature": -1}), 422, "`temperature`"),
    ("/", {"inputs": "x", "stream": "yes"}, 422, "stream"),
    ("/generate", _tgi({"grammar": {"type": "json", "value": DEEP_SCHEMA}}), 422,
     "grammar is not valid: the schema is nested more than 128 levels deep"),
    ("/generate", _tgi({"grammar": {"type": "json_schema", "value": {"name": "x", "schema": DEEP_ARRAY}}}), 422,
     "nested more than 128 levels"),
    ("/tokenize", {"inputs": 5}, 422, "inputs"),
    ("/tokenize", {"prompt": LONG_FOR_CONTEXT * 4}, 422, "the model's context is 1024 tokens"),
    ("/tokenize", {"prompt": 5}, 422, "prompt"),
    ("/detokenize", {"tokens": [10 ** 9]}, 422, "outside the tokenizer's vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 422, "tokens"),
    ("/tokenize", {"inputs": "x" * 200_000}, 422, "characters"),
    # malformed but valid JSON: never a 500
    ("/generate", b'{"inputs": "\\ud800"}', 422, "lone surrogate"),
    ("/generate", b'{"inputs": "x", "parameters": {"stop": ["\\udfff"]}}', 422, "parameters.stop"),
    ("/generate", b'{"inputs": "x", "parameters": {"temperature": 1e400}}', 400, "out of range"),
    ("/generate", b'{"inputs": "x", "parameters": {"seed": 1' + b"0" * 30 + b'}}', 422, "more than 64 bits"),
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 422, "nested too deeply"),
    ("/generate", b'{"inputs": "x", "parameters": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, 422, "nested deeper"),
    ("/generate", b'\xff\xfe{"inputs": "x"}', 400, "not valid JSON"),
]


def _chat(**extra):
    return {"model": HTTP_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def _completion(**extra):
    return {"model": HTTP_MODEL, "prompt": "Hello", "max_tokens": 4, **extra}


# (path, JSON body or raw bytes, expected status, param, text the message must contain)
OPENAI_CASES = [
    ("/v1/completions", b"{oops", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": HTTP_MODEL}, 400, "prompt", "`prompt` is required"),
    ("/v1/completions", _completion(prompt=5), 400, "prompt", "invalid type"),
    ("/v1/completions", _completion(prompt=[]), 400, "prompt", "must not be empty"),
    ("/v1/completions", _completion(prompt=""), 400, "prompt", "empty"),
    ("/v1/completions", _completion(prompt=[[1, 2], [99999999]]), 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", _completion(temperature=3), 400, "temperature", "between 0.0 and 2.0"),
    ("/v1/completions", _completion(temperature="warm"), 400, "temperature", "valid number"),
    ("/v1/completions", _completion(top_p=0), 400, "top_p", "top_p"),
    ("/v1/completions", _completion(n=0), 400, "n", "`n`"),
    ("/v1/completions", _completion(max_tokens=0), 400, "max_tokens", "at least 1"),
    ("/v1/completions", _completion(max_tokens=2000), 400, "max_tokens", "context length"),
    ("/v1/completions", _completion(max_tokens=900), 400, "max_tokens", "KV cache"),
    ("/v1/completions", _completion(prompt=LONG_FOR_CONTEXT), 400, "prompt", "context"),
    ("/v1/completions", _completion(logprobs=6), 400, "logprobs", "between 0 and 5"),
    ("/v1/completions", _completion(n=129, temperature=1), 400, "n", "between 1 and 128"),
    ("/v1/completions", _completion(best_of=21, n=1), 400, "best_of", "between 1 and 20"),
    ("/v1/completions", _completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", "up to 4"),
    ("/v1/completions", _completion(use_beam_search=True), 400, "best_of", "use_beam_search needs best_of"),
    ("/v1/completions", _completion(prompt_logprobs=1), 400, "prompt_logprobs", "not supported"),
    ("/v1/completions", _completion(top_k=-5), 400, "top_k", "top_k"),
    ("/v1/completions", _completion(stop_token_ids=[10 ** 9]), 400, "stop_token_ids", "outside the vocabulary"),
    ("/v1/completions", _completion(n=40, temperature=1, max_tokens=16), 400, "max_tokens", "KV cache"),
    ("/v1/completions", b'{"prompt": "\\ud83d", "max_tokens": 2}', 400, "prompt", "lone surrogate"),
    ("/v1/completions", _completion(n=2, temperature=0), 400, "n", "n=2 needs sampling"),
    ("/v1/completions", _completion(stream_options={"include_usage": True}), 400, "stream_options",
     "only be used when `stream` is true"),
    ("/v1/completions", _completion(truncate_prompt_tokens=1025), 400, "truncate_prompt_tokens",
     "greater than the model's context of 1024 tokens"),
    ("/v1/completions", _completion(guided_json=DEEP_SCHEMA), 400, "guided_json", "nested more than 128 levels"),
    ("/v1/completions", _completion(structured_outputs={"json": DEEP_SCHEMA}), 400, "structured_outputs",
     "nested more than 128 levels"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP_ARRAY}}), 400, "response_format", "nested more than 128 levels"),
    ("/v1/completions", _completion(bad_words=MANY_WORDS), 400, "bad_words", "at most 4096 are accepted"),
    ("/v1/completions", _completion(guided_choice=[str(i) for i in range(4097)]), 400, "guided_choice",
     "at most 4096 are accepted"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "tool_calls": [{"function": "abc"}]}]), 400,
     "messages", "messages.1.tool_calls.0.function"),
    ("/v1/chat/completions", _chat(messages=[{"role": "assistant", "tool_calls": [{"function": {}}]}]), 400,
     "messages", "messages.0.tool_calls.0.function.name"),
    ("/v1/completions", _completion(best_of=1, n=2), 400, "best_of", "must be >= `n`"),
    ("/v1/completions", _completion(logit_bias={"5": 101}), 400, "logit_bias", "between -100.0 and 100.0"),
    ("/v1/completions", _completion(logit_bias={"five": 1}), 400, "logit_bias", "token ids"),
    ("/v1/completions", _completion(logit_bias={"99999999": 1}), 400, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", _completion(suffix="x"), 400, "suffix", "not supported"),
    ("/v1/completions", _completion(stop=""), 400, "stop", "must not be empty"),
    ("/v1/completions", _completion(use_beam_search=True, n=2, stream=True), 400, "use_beam_search",
     "cannot be streamed"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages", "must not be empty"),
    ("/v1/chat/completions", {"model": HTTP_MODEL}, 400, "messages", "`messages` is required"),
    ("/v1/chat/completions", _chat(messages=[{"content": "hi"}]), 400, "messages", "messages.0.role"),
    ("/v1/chat/completions", _chat(messages="hi"), 400, "messages", "messages"),
    ("/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs", "needs `logprobs`"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), 400, "tools", "tools.0.function"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
     "Hermes-style"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "nonsense"}}}), 400, "response_format", "`response_format`"),
    ("/v1/completions", _completion(guided_regex="(a"), 400, "guided_regex", "Regex parsing error"),
    ("/v1/chat/completions", _chat(tool_choice="auto"), 400, "tool_choice", "needs `tools`"),
    ("/v1/chat/completions", _chat(stream="yes"), 400, "stream", "valid boolean"),
    ("/v1/chat/completions", _chat(presence_penalty=-3), 400, "presence_penalty", "between"),
    ("/v1/chat/completions", _chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", "between 0 and 20"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "x" * 200_000}]), 400, "messages",
     "characters"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages", "only text content"),
]


def _post(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


@pytest.mark.parametrize("path,body,status,needle", TGI_CASES)
def test_tgi_bad_input(http, path, body, status, needle):
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    payload = r.json()
    assert set(payload) == {"error", "error_type"} and payload["error_type"] == "validation"
    assert needle in payload["error"]


@pytest.mark.parametrize("path,body,status,param,needle", OPENAI_CASES)
def test_openai_bad_input(http, path, body, status, param, needle):
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and needle in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404), ("POST", "/v2/generate", 404), ("GET", "/generate", 405), ("DELETE", "/info", 405)])
def test_tgi_unknown_routes(http, method, path, status):
    r = http.request(method, path)
    assert r.status_code == status and set(r.json()) == {"error", "error_type"}


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)])
def test_openai_unknown_routes(http, method, path, status):
    r = http.request(method, path)
    assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-123"}])
def test_api_key_required(http_server, headers):
    tgi = httpx.post(http_server.url + "/generate", json=_tgi(), headers=headers)
    assert tgi.status_code == 401 and tgi.json()["error_type"] == "unauthorized"
    oai = httpx.post(http_server.url + "/v1/chat/completions", json=_chat(), headers=headers)
    assert oai.status_code == 401 and oai.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(http_server.url + "/info", headers=headers).status_code == 401
    assert httpx.get(http_server.url + "/metrics", headers=headers).status_code == 200  # probes stay open


def test_server_keeps_serving_after_errors(http, http_reference):
    m = wait_idle(http)
    assert m["paged_backend:kv_blocks_free"] == HTTP_NUM_BLOCKS and m["paged_backend:requests_failed_total"] == 0
    ref = greedy(http_reference, "Still alive?", 5)
    r = http.post("/generate", json=_tgi({"max_new_tokens": 5}, "Still alive?"), headers=AUTH)
    assert r.status_code == 200 and r.json()["generated_text"] == ref.text
