"""Structured output and tool calls on the HTTP fronts without a server process: OpenAI's `response_format`,
vLLM's `structured_outputs` / `guided_*` extras and `tools` become the engine's constraint; TGI's `grammar` is
validated as TGI validates it; tool calls are read back (and streamed) from the text; tool_choice "auto"
through the real `openai` client on a tiny model given a Hermes-style chat template."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import openai
import pytest
import torch

from conftest import get_model
from paged_backend import AsyncLLMEngine
from paged_backend.adapters.http.app import create_app
from paged_backend.adapters.http.errors import ValidationFailed
from paged_backend.adapters.http.openai_request import ChatRequest, CompletionRequest, plan_chat, plan_completion
from paged_backend.adapters.http.openai_tools import ToolCallStream, ToolPlan, read_tool_calls, recognises_hermes
from paged_backend.adapters.http.tgi_request import TGIRequest, plan_tgi

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": SCHEMA}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
# A Hermes-style chat template (the format of Qwen2.5 and Hermes 2/3), written for these tests.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "You may call functions. Answer with <tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call> for "
    "each call.\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == \"assistant\" and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n"
    "{% elif message.role == \"tool\" %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def app():
    model, tokenizer = get_model("tiny-llama", torch.float32)
    engine = AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=64, num_swap_blocks=0)
    yield create_app(engine, "tiny")
    engine.engine.shutdown()


@pytest.fixture(scope="module")
def ctx(app):
    return app.state.ctx


@pytest.fixture(scope="module")
def hermes_app():
    """tiny-llama whose tokenizer (a copy) carries a Hermes-style template."""
    model, tokenizer = get_model("tiny-llama", torch.float32)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=64, num_swap_blocks=0)
    yield create_app(engine, "tiny-hermes")
    engine.engine.shutdown()


def chat(**fields) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=8, **fields)


def constraint_of(plan):
    return plan.params[0].structured_outputs


# ---- OpenAI: response_format and vLLM's extras ----------------------------------------------------
@pytest.mark.parametrize("response_format, kind, value", [
    ({"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}, "json", SCHEMA),
    ({"type": "json_object"}, "json_object", True),
    ({"type": "json_schema", "json_schema": {"name": "anything"}}, "json_object", True),
    ({"type": "json", "value": SCHEMA}, "json", SCHEMA),                    # TGI's shape (huggingface_hub)
    ({"type": "json", "value": json.dumps(SCHEMA)}, "json", SCHEMA),
    ({"type": "regex", "value": "[0-9]{3}"}, "regex", "[0-9]{3}"),
])
def test_response_format_on_both_routes(ctx, response_format, kind, value):
    for plan in (plan_chat(ctx, chat(response_format=response_format)),
                 plan_completion(ctx, CompletionRequest(prompt="x", response_format=response_format))):
        so = constraint_of(plan)
        assert so.kind == kind and (so.schema if kind == "json" else getattr(so, kind)) == value
    assert constraint_of(plan_chat(ctx, chat(response_format={"type": "text"}))) is None


def test_vllm_extras_and_options(ctx):
    guided = {"guided_json": SCHEMA, "guided_regex": "a+", "guided_choice": ["x", "y"],
              "guided_grammar": 'root ::= "yes" | "no"'}
    for name, value in guided.items():
        so = constraint_of(plan_completion(ctx, CompletionRequest(prompt="x", **{name: value},
                                                                  guided_decoding_backend="xgrammar")))
        assert so.kind == name[len("guided_"):]
    so = constraint_of(plan_completion(ctx, CompletionRequest(prompt="x", structured_outputs={"choice": ["a", "b"]})))
    assert so.choice == ["a", "b"]
    # the options of `structured_outputs` apply to the constraint another field asks for
    so = constraint_of(plan_chat(ctx, chat(response_format={"type": "json_object"},
                                           structured_outputs={"disable_any_whitespace": True})))
    assert so.json_object and so.disable_any_whitespace


@pytest.mark.parametrize("fields, param, needle", [
    (dict(guided_regex="(unclosed"), "guided_regex", "`guided_regex`: invalid structured_outputs.regex"),
    (dict(guided_json={"type": "nonsense"}), "guided_json", "`guided_json`"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "minProperties": "a"}}}),
     "response_format", "`response_format`"),
    (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "one constraint"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "response_format",
     "structured_outputs.regex, response_format"),
    (dict(structured_outputs={"disable_any_whitespace": True}), "structured_outputs", "needs one of"),
    (dict(guided_regex="a", guided_whitespace_pattern=" *"), "guided_whitespace_pattern", "not supported"),
    (dict(response_format={"type": "xml"}), "response_format", "not supported"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": 3}}), "response_format",
     "JSON schema object"),
    (dict(guided_regex="a+", ignore_eos=True), "ignore_eos", "ignore_eos"),
])
def test_bad_constraints_are_400s_naming_the_field(ctx, fields, param, needle):
    with pytest.raises(ValidationFailed, match=None) as info:
        plan_completion(ctx, CompletionRequest(prompt="x", **fields))
    assert info.value.openai_status == 400 and info.value.param == param, (info.value.param, info.value.message)
    assert needle in info.value.message, info.value.message


# ---- OpenAI: tools ----------------------------------------------------------------------------------
def test_tool_choices_become_constraints(ctx):
    named = plan_chat(ctx, chat(tools=[WEATHER, ADD], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}))
    assert named.tools.mode == "named" and constraint_of(named).schema == SCHEMA
    required = plan_chat(ctx, chat(tools=[WEATHER, ADD], tool_choice="required"))
    schema = constraint_of(required).schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    single = plan_chat(ctx, chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert constraint_of(single).schema["maxItems"] == 1
    no_params = {"type": "function", "function": {"name": "now"}}
    assert constraint_of(plan_chat(ctx, chat(tools=[no_params], tool_choice={
        "type": "function", "function": {"name": "now"}}))).schema == {"type": "object", "properties": {}}
    none = plan_chat(ctx, chat(tools=[WEATHER], tool_choice="none"))
    assert none.tools.mode == "none" and constraint_of(none) is None


def test_required_schema_hoists_the_tools_defs(ctx):
    with_defs = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
        "$defs": {"Place": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}
    schema = constraint_of(plan_chat(ctx, chat(tools=[with_defs, WEATHER], tool_choice="required"))).schema
    assert schema["$defs"] == {"Place": with_defs["function"]["parameters"]["$defs"]["Place"]}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


@pytest.mark.parametrize("fields, param, needle", [
    (dict(tools=[WEATHER]), "tool_choice", "Hermes-style"),           # "auto" by default; smollm2's template
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "Hermes-style"),
    (dict(tool_choice="required"), "tool_choice", "needs `tools`"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not among `tools`"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}], tool_choice="required"), "tools", "function"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools", "two tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tools",
     "one constraint"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}], tool_choice="required"), "tools", "`tools`"),
])
def test_bad_tool_requests_are_400s(ctx, fields, param, needle):
    with pytest.raises(ValidationFailed) as info:
        plan_chat(ctx, chat(**fields))
    assert info.value.param == param and needle in info.value.message, (info.value.param, info.value.message)


def test_reading_tool_calls_back():
    required = ToolPlan("required", schema={})
    reply = read_tool_calls(required, '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", '
                                      '"parameters": {}}]', "stop")
    assert reply.finish_reason == "tool_calls" and reply.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("add", {"a": 1, "b": 2}), ("now", {})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in reply.tool_calls)
    cut = read_tool_calls(required, '[{"name": "add", "param', "length")
    assert (cut.content, cut.tool_calls, cut.finish_reason) == ('[{"name": "add", "param', None, "length")
    single = read_tool_calls(ToolPlan("required", schema={}, parallel=False), '[{"name": "a", "parameters": {}}, '
                                                                             '{"name": "b", "parameters": {}}]', "stop")
    assert [c["function"]["name"] for c in single.tool_calls] == ["a"]
    named = read_tool_calls(ToolPlan("named", function="get_weather"), '{"city": "Par', "length")
    assert named.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert named.finish_reason == "length"
    auto = ToolPlan("auto")
    text = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    reply = read_tool_calls(auto, text, "stop")
    assert reply.content == "Let me look." and reply.finish_reason == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in reply.tool_calls] == [{"city": "Paris"}, {"a": 1, "b": 2}]
    unclosed = read_tool_calls(auto, '<tool_call>{"name": "now", "arguments": {}}', "stop")
    assert unclosed.content is None and unclosed.tool_calls[0]["function"]["name"] == "now"
    for broken in ('<tool_call>{"name": "now", "argu', "no call here", '<tool_call>["not", "an object"]</tool_call>'):
        plain = read_tool_calls(auto, broken, "length")
        assert (plain.content, plain.tool_calls, plain.finish_reason) == (broken, None, "length")


def _streamed(plan: ToolPlan, text: str, finish: str, step: int):
    """Feed `text` in pieces of `step` characters; (concatenated content, tool calls by index, finish reason)."""
    stream = ToolCallStream(plan)
    content, calls, reason = "", {}, None
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        deltas, reason = stream.feed(piece, finish if k == len(pieces) - 1 else None)
        for delta in deltas:
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return content, calls, reason


@pytest.mark.parametrize("step", [1, 3, 50])
def test_streamed_tool_calls_add_up_to_the_reply(step):
    cases = [
        (ToolPlan("named", function="get_weather"), '{"city": "Paris"}', "stop"),
        (ToolPlan("required", schema={}), '[{"name": "add", "parameters": {"a": 1}}]', "stop"),
        (ToolPlan("required", schema={}), '[{"name": "add", "par', "length"),
        (ToolPlan("auto"), 'Sure <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "stop"),
        (ToolPlan("auto"), "Just text with a < sign and <tool", "stop"),
        (ToolPlan("auto"), "Text  \n<tool_call>{broken", "length"),
    ]
    for plan, text, finish in cases:
        reply = read_tool_calls(plan, text, finish)
        content, calls, reason = _streamed(plan, text, finish, step)
        assert content == (reply.content or ""), (text, content)
        assert reason == reply.finish_reason
        expected = {k: {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for k, c in enumerate(reply.tool_calls or [])}
        assert calls == expected, (text, calls)


def test_auto_streams_content_before_a_call_starts():
    stream = ToolCallStream(ToolPlan("auto"))
    assert stream.feed("Hello there", None) == ([{"content": "Hello there"}], None)
    assert stream.feed(" <tool", None) == ([], None)     # could be a call: held
    assert stream.feed("_call>{", None) == ([], None)
    assert not recognises_hermes(type("Tok", (), {"chat_template": "{{ messages }}"})())
    assert recognises_hermes(type("Tok", (), {"chat_template": {"tool_use": HERMES_TEMPLATE}})())


# ---- TGI: grammar --------------------------------------------------------------------------------------
@pytest.mark.parametrize("grammar, kind", [
    ({"type": "json", "value": SCHEMA}, "json"), ({"type": "json", "value": json.dumps(SCHEMA)}, "json"),
    ({"type": "json_object", "value": SCHEMA}, "json"),
    ({"type": "json_schema", "value": {"name": "city", "schema": SCHEMA}}, "json"),
    ({"type": "regex", "value": "[0-9]{3}"}, "regex"),
])
def test_tgi_grammar_becomes_a_constraint(ctx, grammar, kind):
    plan = plan_tgi(ctx, TGIRequest(inputs="x", parameters={"grammar": grammar, "max_new_tokens": 4}), stream=False)
    so = plan.params.structured_outputs
    assert so.kind == kind
    if kind == "json":
        assert so.schema == SCHEMA and so.disable_any_whitespace  # TGI's JSON grammar has no free whitespace


@pytest.mark.parametrize("grammar, needle", [
    ({"type": "json", "value": {"type": "object"}}, "grammar is not valid: Grammar must have a 'properties' field"),
    ({"type": "json", "value": "{not json"}, "grammar is not valid: Expecting property name"),
    ({"type": "json", "value": {"properties": {"a": {"type": 5}}}}, "grammar is not valid: 5 is not valid"),
    ({"type": "json", "value": 7}, "grammar is not valid: a JSON grammar's value"),
    ({"type": "regex", "value": "(unclosed"}, "grammar is not valid: Regex parsing error"),
    ({"type": "regex", "value": ["a"]}, "grammar is not valid: a regex grammar's value must be a string"),
    ({"type": "json_schema", "value": {"name": "x"}}, "grammar is not valid"),
    ({"type": "xml", "value": "<a/>"}, "`grammar` must be an object"),
    ("json", "`grammar` must be an object"),
])
def test_tgi_bad_grammars_are_422s(ctx, grammar, needle):
    with pytest.raises(ValidationFailed) as info:
        plan_tgi(ctx, TGIRequest(inputs="x", parameters={"grammar": grammar}), stream=False)
    assert info.value.status == 422 and info.value.param == "grammar" and needle in info.value.message, \
        info.value.message
    assert info.value.tgi_body()["error_type"] == "validation"


# ---- tool_choice "auto" through the openai client ----------------------------------------------------
FORCED_CALL = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'


def _client(app) -> tuple:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return http, openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)


def test_auto_tool_calls_through_the_openai_client(hermes_app):
    """The template renders the tools and the earlier turns' calls; the model's Hermes-style call (forced by a
    regex: the tiny model's weights are random) comes back as `tool_calls`, streamed or not."""
    ctx = hermes_app.state.ctx
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "user", "content": "And in Paris?"}]
    rendered = ctx.tokenizer.decode(plan_chat(ctx, ChatRequest(messages=history, tools=[WEATHER, ADD],
                                                               max_tokens=4)).prompts[0])
    assert '"name": "get_weather"' in rendered and '"arguments": {"city": "Rome"}' in rendered
    assert "<tool_response>sunny</tool_response>" in rendered and "<tools>" in rendered

    async def run():
        http, client = _client(hermes_app)
        async with http:
            called = await client.chat.completions.create(
                model="tiny", messages=history, tools=[WEATHER, ADD], max_tokens=120, temperature=1.0, n=2, seed=3,
                extra_body={"guided_regex": FORCED_CALL})
            plain = await client.chat.completions.create(
                model="tiny", messages=history, tools=[WEATHER], tool_choice="auto", max_tokens=30, temperature=0,
                extra_body={"guided_regex": "Sunny, I think"})
            stream = await client.chat.completions.create(
                model="tiny", messages=history, tools=[WEATHER, ADD], max_tokens=120, temperature=0, stream=True,
                extra_body={"guided_regex": FORCED_CALL})
            chunks = [chunk async for chunk in stream]
        return called, plain, chunks

    called, plain, chunks = asyncio.run(run())
    for choice in called.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert plain.choices[0].message.content == "Sunny, I think" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking." and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert ctx.engine.get_stats().num_free_blocks == ctx.engine.get_stats().num_blocks
