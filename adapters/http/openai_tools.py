"""OpenAI tool calling on the chat route: which tool choice a request makes, the JSON schema that constrains
generation for `"required"` and a named function, and the `tool_calls` read back from the generated text.

- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to that
  function's `parameters` schema and returned as one call whose `arguments` are the generated text;
- `"required"`: the output is constrained to a JSON array (at least one item; one at most when
  `parallel_tool_calls` is false) of `{"name": <one of the tools>, "parameters": <its schema>}` objects, vLLM's
  shape, and each item becomes a call;
- `"auto"`: generation is free; calls are read from the text in the format the model's chat template teaches
  it. Only Hermes-style templates (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, as Qwen2.5 and
  Hermes 2/3 use) are recognised; other templates are refused for "auto" with a 400;
- `"none"`: plain text (the tools still reach the chat template, as in vLLM).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from .body import StrictBody
from .errors import fail

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|$)", re.S)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(StrictBody):
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(StrictBody):
    type: str = "function"
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: str = "function"
    function: FunctionName


ToolChoice = Union[str, NamedToolChoice]


class CalledFunction(StrictBody):
    """The function of an earlier call in an assistant message (`arguments`: a JSON string, or an object)."""

    name: str
    arguments: Optional[Union[str, Dict[str, Any]]] = None


class EarlierToolCall(StrictBody):
    """One entry of an assistant message's `tool_calls` in the conversation history."""

    id: Optional[str] = None
    type: str = "function"
    function: CalledFunction


@dataclass
class ToolPlan:
    """What a chat request asks of its tools: `mode` is "none", "auto", "required" or "named"."""

    mode: str
    tools: List[Dict[str, Any]] = field(default_factory=list)  # as the chat template receives them
    function: Optional[str] = None                              # the named function
    schema: Optional[Dict[str, Any]] = None                      # the constraint ("required", "named")
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")


def _check_tools(tools: List[ToolDefinition]) -> None:
    names = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            fail(f"tools[{i}].type must be \"function\" (the only kind of tool), got {tool.type!r}", "tools")
        if not tool.function.name:
            fail(f"tools[{i}].function.name must not be empty", "tools")
        if tool.function.name in names:
            fail(f"tools[{i}]: two tools are named {tool.function.name!r}", "tools")
        names.add(tool.function.name)


def _parameters(tool: ToolDefinition) -> Dict[str, Any]:
    return tool.function.parameters or dict(EMPTY_PARAMETERS)


def _hoist_defs(schemas: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The tools' `$defs` moved to the top of the combined schema, where their `#/$defs/...` references point."""
    defs: Dict[str, Any] = {}
    bare = []
    for schema in schemas:
        schema = dict(schema)
        for name, definition in (schema.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                fail(f"two tools define `$defs/{name}` differently; give the definitions distinct names", "tools")
            defs[name] = definition
        bare.append(schema)
    return bare, defs


def required_schema(tools: List[ToolDefinition], parallel: bool) -> Dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty array of {"name", "parameters"} objects."""
    parameters, defs = _hoist_defs([_parameters(t) for t in tools])
    variants = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                  "parameters": p},
                 "required": ["name", "parameters"]} for t, p in zip(tools, parameters)]
    schema: Dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_text(tokenizer) -> str:
    """The chat template transformers renders a request with tools through (a named "tool_use" one if any)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def recognises_hermes(tokenizer) -> bool:
    """True when the chat template teaches Hermes-style calls (`<tool_call>` ... `</tool_call>`)."""
    text = template_text(tokenizer)
    return HERMES_START in text and HERMES_END in text


def plan_tools(tools: Optional[List[ToolDefinition]], tool_choice: Optional[ToolChoice],
               parallel_tool_calls: Optional[bool], tokenizer) -> ToolPlan:
    """The request's tool plan; a 400 for choices it cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            fail("`tool_choice` needs `tools`", "tool_choice")
        return ToolPlan("none")
    _check_tools(tools)
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            fail(f"tool_choice.type must be \"function\", got {choice.type!r}", "tool_choice")
        chosen = next((t for t in tools if t.function.name == choice.function.name), None)
        if chosen is None:
            fail(f"tool_choice names the function {choice.function.name!r}, which is not among `tools` "
                  f"({', '.join(t.function.name for t in tools)})", "tool_choice")
        return ToolPlan("named", as_dicts, chosen.function.name, _parameters(chosen), parallel)
    if choice == "none":
        return ToolPlan("none", as_dicts)
    if choice == "required":
        return ToolPlan("required", as_dicts, None, required_schema(tools, parallel), parallel)
    if choice == "auto":
        if not recognises_hermes(tokenizer):
            fail("tool_choice \"auto\" needs a chat template that teaches the model a tool-call format this server "
                  "can read (Hermes-style <tool_call>...</tool_call>); this model's template has none. Use "
                  "tool_choice \"required\" or a named function, which constrain the output to the tools' schemas",
                  "tool_choice")
        return ToolPlan("auto", as_dicts, parallel=parallel)
    fail(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": "
          f"{{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    raise AssertionError("unreachable")


# ---- reading calls back ------------------------------------------------------------------------
def tool_call(name: str, arguments: str) -> Dict[str, Any]:
    """One entry of a message's `tool_calls`."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _required_calls(text: str) -> Optional[List[Dict[str, Any]]]:
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):  # generated text, possibly nested thousands deep
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [tool_call(i["name"], _arguments(i.get("parameters", {}))) for i in items]


def _hermes_calls(text: str) -> Optional[List[Dict[str, Any]]]:
    calls = []
    for match in _HERMES_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except (ValueError, RecursionError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        calls.append(tool_call(body["name"], _arguments(body.get("arguments", {}))))
    return calls or None


@dataclass
class ToolReply:
    """A choice's message fields and finish reason once its text is read for tool calls."""

    content: Optional[str]
    tool_calls: Optional[List[Dict[str, Any]]]
    finish_reason: Optional[str]


def read_tool_calls(plan: ToolPlan, text: str, finish_reason: Optional[str]) -> ToolReply:
    """The calls in a finished choice's text. A call the text does not hold completely (cut by max_tokens, or
    a malformed auto call) leaves the text as `content` with the engine's finish reason."""
    if plan.mode == "named":
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return ToolReply(None, [tool_call(plan.function, text)], reason)
    if plan.mode == "required":
        calls = _required_calls(text)
    elif plan.mode == "auto":
        calls = _hermes_calls(text)
    else:
        calls = None
    if not calls:
        return ToolReply(text, None, finish_reason)
    if not plan.parallel:
        calls = calls[:1]
    content = text[:text.find(HERMES_START)].rstrip() if plan.mode == "auto" else ""
    return ToolReply(content or None, calls, "tool_calls" if finish_reason == "stop" else finish_reason)


def _held_suffix(text: str) -> int:
    """How many trailing characters could still be the start of a call (a prefix of the marker) or whitespace
    before one: content is only streamed once it is known not to be."""
    keep = next((n for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                 if HERMES_START.startswith(text[-n:])), 0)
    return len(text) - len(text[:len(text) - keep].rstrip())


class ToolCallStream:
    """One streamed choice under a tool plan: its text deltas become chat deltas. A named function streams its
    arguments as they come; "required" holds the text and sends the calls at the end; "auto" streams content
    until a call starts, then holds the rest. The pieces add up to the non-streamed message."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0          # characters of `text` already sent as content (auto)
        self.call_id: Optional[str] = None

    def feed(self, piece: str, finish_reason: Optional[str]) -> Tuple[List[Dict[str, Any]], Optional[str]]:
        """The deltas for a new piece of text (and the choice's finish reason when it ends)."""
        self.text += piece
        if self.plan.mode == "named":
            return self._named(piece), ("tool_calls" if finish_reason == "stop" else finish_reason)
        if finish_reason is None:
            return self._auto_content(), None
        reply = read_tool_calls(self.plan, self.text, finish_reason)
        if reply.tool_calls is None:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return ([{"content": rest}] if rest else []), reply.finish_reason
        deltas = []
        unsent = (reply.content or "")[self.sent:]
        if unsent:
            deltas.append({"content": unsent})
        deltas.append({"tool_calls": [{"index": k, **call} for k, call in enumerate(reply.tool_calls)]})
        return deltas, reply.finish_reason

    def _named(self, piece: str) -> List[Dict[str, Any]]:
        if self.call_id is None:
            call = tool_call(self.plan.function, piece)
            self.call_id = call["id"]
            return [{"tool_calls": [{"index": 0, **call}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []

    def _auto_content(self) -> List[Dict[str, Any]]:
        if self.plan.mode != "auto" or HERMES_START in self.text[self.sent:] or not self.text:
            return []
        safe = len(self.text) - _held_suffix(self.text)
        if safe <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:safe], safe
        return [{"content": piece}]
