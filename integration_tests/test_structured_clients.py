"""Structured output through `paged-backend serve smollm2` and clients nobody here wrote: `openai` with
`response_format`, vLLM's `guided_*` extras and `tools`; TGI's `grammar` through huggingface_hub's
InferenceClient. JSON outputs validate against their schemas, regex outputs fullmatch, choices are members,
tool calls name a tool and their arguments validate against its parameters, at temperature 0 and 1 with
n = 3; invalid schemas and regexes fail their own request only.

Every request is sent at once (one engine batch, a few seconds of SmolLM2) to a KV cache too small to hold
them all, so the engine preempts some while their grammars are mid-way (48 MiB: 68 blocks of 16); the tests then check the replies. The
server is this module's own: the shared HTTP server runs the random-weight tiny-llama.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Callable, Dict

import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HFValidationError

from http_fixtures import local_inference_client
from http_helpers import client, wait_idle
from http_server_process import HTTP_API_KEY, ServerProcess
from structured_cases import (COLORS, PHONE, PROMPTS, SCHEMAS, TOOLS, check_choice, check_json, check_regex,
                              check_tool_call)

COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = {name: [{"role": "user", "content": prompt}] for name, prompt in PROMPTS.items()}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


@pytest.fixture(scope="module")
def server(request):
    srv = ServerProcess(["smollm2", "--kv-cache-memory", "48MiB", "--api-key", HTTP_API_KEY, "--log-level",
                         "warning"])
    request.addfinalizer(srv.stop)
    srv.wait_ready()
    return srv


def _openai_requests(oai: openai.OpenAI) -> Dict[str, Callable]:
    chat, complete = oai.chat.completions.create, oai.completions.create
    requests: Dict[str, Callable] = {}
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        requests[f"chat-{name}-t0"] = lambda m=MESSAGES[name], f=fmt: chat(
            model="smollm2", messages=m, response_format=f, temperature=0, max_tokens=90, extra_body=COMPACT)
        requests[f"chat-{name}-t1"] = lambda m=MESSAGES[name], f=fmt: chat(
            model="smollm2", messages=m, response_format=f, temperature=1, n=3, seed=7, max_tokens=90,
            extra_body=COMPACT)
    requests.update({
        "chat-json-object": lambda: chat(model="smollm2", messages=MESSAGES["status"], temperature=0, max_tokens=90,
                                         response_format={"type": "json_object"}, extra_body=COMPACT),
        "completion-items": lambda: complete(  # vLLM's completions take response_format too (the client has no
            model="smollm2", prompt=PROMPTS["items"] + "\n", temperature=1, n=3, seed=3, max_tokens=90,  # argument)
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "items", "schema": SCHEMAS["items"]}}, **COMPACT}),
        "completion-guided-json": lambda: complete(model="smollm2", prompt=PROMPTS["status"] + "\n", temperature=0,
                                                   max_tokens=60, extra_body={"guided_json": SCHEMAS["status"],
                                                                              **COMPACT}),
        "completion-regex-t1": lambda: complete(model="smollm2", prompt="My phone number is ", temperature=1, n=3,
                                                seed=5, max_tokens=12, extra_body={"guided_regex": PHONE}),
        "completion-choice-t0": lambda: complete(model="smollm2", prompt="My favourite colour is", temperature=0,
                                                 max_tokens=5, extra_body={"guided_choice": COLORS}),
        "completion-choice-t1": lambda: complete(model="smollm2", prompt="Pick a colour:", temperature=1, n=3,
                                                 seed=2, max_tokens=5, extra_body={"guided_choice": COLORS}),
        "tools-required-t0": lambda: chat(model="smollm2", messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=80, extra_body=COMPACT),
        "tools-required-t1": lambda: chat(model="smollm2", messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1, n=3, seed=11, max_tokens=80, parallel_tool_calls=False,
                                          extra_body=COMPACT),
        "tools-named-t1": lambda: chat(model="smollm2", messages=WEATHER_ASK, tools=TOOLS, temperature=1, n=3,
                                       seed=13, max_tokens=60, extra_body=COMPACT,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "tools-named-stream": lambda: list(chat(
            model="smollm2", messages=WEATHER_ASK, tools=TOOLS, temperature=0, max_tokens=60, stream=True,
            extra_body=COMPACT, tool_choice={"type": "function", "function": {"name": "add"}})),
        "bad-schema": lambda: chat(model="smollm2", messages=WEATHER_ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "minProperties": "x"}}}),
        "bad-regex": lambda: complete(model="smollm2", prompt="x", max_tokens=5, extra_body={"guided_regex": "(a"}),
    })
    return requests


def _tgi_requests(hf: InferenceClient) -> Dict[str, Callable]:
    person = {"type": "json", "value": SCHEMAS["person"]}
    return {
        "tgi-person-t0": lambda: hf.text_generation(PROMPTS["person"] + "\n", max_new_tokens=90, grammar=person,
                                                    details=True),
        "tgi-status-best-of": lambda: hf.text_generation(
            PROMPTS["status"] + "\n", max_new_tokens=60, do_sample=True, best_of=3, details=True,
            grammar={"type": "json", "value": json.dumps(SCHEMAS["status"])}),
        "tgi-regex-t1": lambda: hf.text_generation("My phone number is ", max_new_tokens=12, do_sample=True, seed=4,
                                                   grammar={"type": "regex", "value": PHONE}),
        "tgi-chat-json": lambda: hf.chat_completion(MESSAGES["items"], max_tokens=90, temperature=0,
                                                    response_format={"type": "json", "value": SCHEMAS["items"]}),
        "tgi-bad-regex": lambda: hf.text_generation("x", max_new_tokens=4, grammar={"type": "regex", "value": "(a"}),
    }


@pytest.fixture(scope="module")
def replies(server):
    """Every request at once; request name -> its reply or the exception it raised."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=HTTP_API_KEY, max_retries=0, timeout=300)
    with local_inference_client(server.url, HTTP_API_KEY, timeout=300) as hf:
        requests = {**_openai_requests(oai), **_tgi_requests(hf)}
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
            futures = {name: pool.submit(call) for name, call in requests.items()}
            results = {}
            for name, future in futures.items():
                try:
                    results[name] = future.result()
                except Exception as exc:  # noqa: BLE001 - the tests below look at what each request got
                    results[name] = exc
    return results


def _ok(replies, name):
    reply = replies[name]
    assert not isinstance(reply, Exception), f"{name}: {reply!r}"
    return reply


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", ["t0", "t1"])
def test_openai_response_format_json_schema(replies, schema, temperature):
    reply = _ok(replies, f"chat-{schema}-{temperature}")
    assert len(reply.choices) == (1 if temperature == "t0" else 3)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        check_json(choice.message.content, SCHEMAS[schema])


def test_openai_json_object_and_completions(replies):
    status = _ok(replies, "chat-json-object").choices[0]
    assert status.finish_reason == "stop" and isinstance(json.loads(status.message.content), dict)
    items = _ok(replies, "completion-items")
    assert len(items.choices) == 3
    for choice in items.choices:
        check_json(choice.text, SCHEMAS["items"])
    check_json(_ok(replies, "completion-guided-json").choices[0].text, SCHEMAS["status"])


def test_openai_guided_regex_and_choice(replies):
    regex = _ok(replies, "completion-regex-t1")
    assert len(regex.choices) == 3
    for choice in regex.choices:
        check_regex(choice.text)
    check_choice(_ok(replies, "completion-choice-t0").choices[0].text)
    sampled = _ok(replies, "completion-choice-t1").choices
    assert len(sampled) == 3
    for choice in sampled:
        check_choice(choice.text)


def test_openai_tools_required_and_named(replies):
    for name, n in (("tools-required-t0", 1), ("tools-required-t1", 3), ("tools-named-t1", 3)):
        reply = _ok(replies, name)
        assert len(reply.choices) == n
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            assert choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                check_tool_call(call.function.name, call.function.arguments)
                assert call.type == "function" and call.id
            if name == "tools-required-t1":  # parallel_tool_calls=false: one call
                assert len(choice.message.tool_calls) == 1
            if name == "tools-named-t1":
                assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_openai_named_tool_streams_its_arguments(replies):
    chunks = _ok(replies, "tools-named-stream")
    calls = [call for chunk in chunks if chunk.choices for call in (chunk.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "add" and calls[0].id and len(calls) > 1  # streamed in pieces
    check_tool_call("add", "".join(c.function.arguments or "" for c in calls))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_invalid_constraints_fail_their_own_request(replies):
    for name, param in (("bad-schema", "response_format"), ("bad-regex", "guided_regex")):
        error = replies[name]
        assert isinstance(error, openai.BadRequestError), error
        assert error.status_code == 400 and error.body["param"] == param, error.body
    error = replies["tgi-bad-regex"]
    assert isinstance(error, HFValidationError) and "grammar is not valid" in str(error), error


def test_tgi_grammar_through_the_inference_client(replies):
    person = _ok(replies, "tgi-person-t0")
    assert person.details.finish_reason == "eos_token"
    check_json(person.generated_text, SCHEMAS["person"])
    best = _ok(replies, "tgi-status-best-of")
    assert len(best.details.best_of_sequences) == 2
    for text in [best.generated_text] + [s.generated_text for s in best.details.best_of_sequences]:
        check_json(text, SCHEMAS["status"])
    check_regex(_ok(replies, "tgi-regex-t1"))
    check_json(_ok(replies, "tgi-chat-json").choices[0].message.content, SCHEMAS["items"])


def test_every_block_is_free_and_nothing_failed(server, replies):
    with client(server) as http:
        m = wait_idle(http)
    assert m["paged_backend:kv_blocks_free"] == m["paged_backend:kv_blocks_total"]
    assert m["paged_backend:requests_failed_total"] == 0
    assert m["paged_backend:num_preemptions_total"] > 0   # constrained requests were preempted and came back
