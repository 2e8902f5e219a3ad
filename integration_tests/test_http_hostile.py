"""The HTTP server under hostile input: a body limit answered with 413 in each API's shape, large bodies
parsed and tokenized off the event loop, and a hypothesis fuzz test posting random JSON of the right and
wrong types to every route: never a 5xx (or an engine failure), never a hang, and afterwards the server
still serves with every KV block free."""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_fixtures import http, http_reference, http_server  # noqa: F401 (fixtures)
from http_helpers import greedy, sse_events, wait_idle
from http_server_process import AUTH, HTTP_NUM_BLOCKS

PAYLOAD_LIMIT = 2_000_000  # the server's default (TGI's)


def test_bodies_over_the_limit_get_413_in_each_shape(http):
    body = json.dumps({"inputs": "word " * (PAYLOAD_LIMIT // 5 + 10)}).encode()
    tgi = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert tgi.status_code == 413 and tgi.json()["error_type"] == "validation"
    assert str(PAYLOAD_LIMIT) in tgi.json()["error"]
    oai = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert oai.status_code == 413 and oai.json()["error"]["code"] == "payload_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for start in range(0, len(body), 65536):
            yield body[start:start + 65536]

    chunked = http.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and set(chunked.json()) == {"error", "error_type"}
    assert http.get("/health").status_code == 200


def test_tokenizing_a_large_body_leaves_the_event_loop_free(http_server, http):
    # ~1.9 MB of text, truncated to its last tokens: it must be tokenized whole (about a second here)
    body = {"inputs": "word " * 380_000, "parameters": {"max_new_tokens": 2, "truncate": 8}}
    response, seconds, probes = _probe_health_while(
        http, lambda: httpx.post(http_server.url + "/generate", json=body, headers=AUTH, timeout=120))
    assert response.status_code == 200, response.text
    assert len(probes) >= 3, (seconds, probes)
    assert max(probes) < seconds / 2, (seconds, probes)  # /health never waited for it


def _probe_health_while(http, post) -> tuple:
    """Run `post()` in a thread and time /health probes meanwhile: (response, seconds, probe times). The probes
    time the server, not this process: late in the suite a full collection of this process's garbage collector
    takes over half a second (seen in CI), so it is held off while they run."""
    done = {}

    def run():
        start = time.monotonic()
        done["response"] = post()
        done["seconds"] = time.monotonic() - start

    gc.collect()
    gc.disable()
    try:
        thread = threading.Thread(target=run)
        thread.start()
        probes = []
        while thread.is_alive():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            probes.append(time.monotonic() - start)
            time.sleep(0.02)
        thread.join()
    finally:
        gc.enable()
    return done["response"], done["seconds"], probes


def test_validating_thousands_of_bad_words_leaves_the_event_loop_free(http_server, http):
    # 4,096 words (the cap) of ~110 characters: tokenized once, in a worker thread, never on the event loop
    words = [f"w{i} " + "lorem ipsum dolor sit amet " * 4 for i in range(4096)]
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "bad_words": words}
    response, seconds, probes = _probe_health_while(
        http, lambda: httpx.post(http_server.url + "/v1/completions", json=body, headers=AUTH, timeout=120))
    assert response.status_code == 200, response.text
    assert len(probes) >= 3, (seconds, probes)
    assert max(probes) < seconds / 2, (seconds, probes)  # /health never waited for it
    wait_idle(http)


# ---- fuzzing --------------------------------------------------------------------------------
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2))  # lone surrogates
_any = st.recursive(_scalar, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                         max_size=3),
                    max_leaves=8)


_surrogate = st.characters(categories=["Cs"])  # a lone surrogate: valid JSON ("\\ud800"), not valid Unicode


def _text(min_size: int, max_size: int):
    """Strings: mostly well-formed, sometimes with a lone surrogate inside."""
    clean = st.text(st.characters(codec="utf-8"), min_size=min_size, max_size=max_size)
    broken = st.tuples(clean, _surrogate, clean).map("".join)
    return st.one_of(clean, clean, clean, broken)


_words = _text(0, 16)
_prompt = _text(1, 40)
_small = st.integers(1, 12)
_TGI_PARAMETERS = {
    "max_new_tokens": _small, "temperature": st.floats(0.05, 2.0), "top_k": st.integers(0, 60),
    "top_p": st.floats(0.0, 1.0), "do_sample": st.booleans(), "best_of": st.integers(1, 3),
    "seed": st.integers(0, 2 ** 64 - 1), "stop": st.lists(_words, max_size=5), "details": st.booleans(),
    "decoder_input_details": st.booleans(), "return_full_text": st.booleans(), "truncate": st.integers(0, 2000),
    "top_n_tokens": st.integers(0, 6), "repetition_penalty": st.floats(0.1, 3.0),
    "frequency_penalty": st.floats(-3.0, 3.0), "typical_p": st.floats(0.0, 1.0), "watermark": st.booleans()}
_SAMPLING = {
    "max_tokens": _small, "temperature": st.floats(0.0, 2.5), "top_p": st.floats(0.0, 1.0),
    "n": st.integers(0, 3), "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}), "stop": st.one_of(_words, st.lists(_words, max_size=5)),
    "presence_penalty": st.floats(-3.0, 3.0), "frequency_penalty": st.floats(-3.0, 3.0),
    "seed": st.integers(-(2 ** 63), 2 ** 64), "logit_bias": st.dictionaries(st.integers(0, 50000).map(str),
                                                                            st.floats(-120, 120), max_size=3),
    "best_of": st.integers(1, 4), "top_k": st.integers(-2, 60), "min_p": st.floats(0.0, 1.0),
    "repetition_penalty": st.floats(0.1, 3.0), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 20),
    "stop_token_ids": st.lists(st.integers(0, 60000), max_size=3), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "use_beam_search": st.booleans(), "length_penalty": st.floats(-2, 2),
    "allowed_token_ids": st.lists(st.integers(0, 60000), max_size=3), "bad_words": st.lists(_words, max_size=2),
    "truncate_prompt_tokens": st.integers(0, 40), "user": _words}
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                  "content": st.one_of(_words, st.lists(st.fixed_dictionaries(
                                      {"type": st.sampled_from(["text", "image_url"]), "text": _words}),
                                      max_size=2))})


def _body(required, optional):
    """A JSON object: every field of the right type, or one field (perhaps a missing one) of any value."""
    right = st.fixed_dictionaries(required, optional=optional)
    names = sorted(required) + sorted(optional)
    one_wrong = st.tuples(right, st.sampled_from(names), _any).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(right, right, one_wrong)


_ROUTES = {
    "/generate": _body({"inputs": _prompt}, {"parameters": _body({}, _TGI_PARAMETERS)}),
    "/generate_stream": _body({"inputs": _prompt}, {"parameters": _body({}, _TGI_PARAMETERS)}),
    "/": _body({"inputs": _prompt}, {"parameters": _body({}, _TGI_PARAMETERS), "stream": st.booleans()}),
    "/tokenize": _body({"inputs": _prompt}, {}),
    "/v1/completions": _body({"prompt": st.one_of(_prompt, st.lists(_prompt, max_size=2),
                                                  st.lists(st.integers(-5, 60000), max_size=4))},
                             {**_SAMPLING, "logprobs": st.integers(0, 6), "echo": st.booleans(),
                              "suffix": _words}),
    "/v1/chat/completions": _body({"messages": st.lists(_MESSAGE, max_size=3)},
                                  {**_SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 21),
                                   "max_completion_tokens": _small, "response_format": st.fixed_dictionaries(
                                       {"type": st.sampled_from(["text", "json_object"])})}),
}
_ACCEPTED = {200, 400, 413, 422}  # never 5xx, and never 424 (the engine failing a request it accepted)


def _post(http, path: str, body) -> None:
    # NaN as Python writes it; infinities as numbers too large for a double (1e999 parses as inf)
    raw = json.dumps(body, allow_nan=True).replace("Infinity", "1e999").encode()
    with http.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
        text = "".join(r.iter_text())
    assert r.status_code in _ACCEPTED, (path, body, r.status_code, text)
    payload_is_stream = r.headers.get("content-type", "").startswith("text/event-stream")
    if r.status_code == 200 and payload_is_stream:
        events = sse_events(text.splitlines())
        assert events and not any("error" in e for e in events), (path, body, text[-500:])
    else:
        json.loads(text)  # every reply is JSON


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(_ROUTES))
def test_fuzz_every_route(http, path):
    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large])
    @given(body=st.one_of(_ROUTES[path], _ROUTES[path], _ROUTES[path], _any))
    def fuzz(body):
        _post(http, path, body)

    fuzz()


def test_the_server_serves_with_every_block_free_after_the_fuzzing(http, http_reference):
    m = wait_idle(http)
    assert m["paged_backend:kv_blocks_free"] == HTTP_NUM_BLOCKS
    assert m["paged_backend:requests_failed_total"] == 0
    ref = greedy(http_reference, "Still serving?", 4)
    r = http.post("/generate", json={"inputs": "Still serving?", "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.json()["generated_text"] == ref.text
    for path in ("/health", "/info", "/metrics", "/v1/models"):
        assert http.get(path).status_code == 200
