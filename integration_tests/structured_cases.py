"""Constraints the structured-output tests send through every front, and the checks of their outputs:
JSON schemas with nested objects, arrays, enums and required fields (validated with `jsonschema`), a regex
(outputs must fullmatch) and a choice (outputs must be members). Strings and arrays are bounded so that
SmolLM2 finishes them in few tokens."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List

import jsonschema

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
STATUS = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
                   "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["ok", "level"],
}
SCHEMAS = {"person": PERSON, "items": ITEMS, "status": STATUS}
PROMPTS = {"person": "Describe a person as JSON.", "items": "List some items as JSON.",
           "status": "Report the system status as JSON."}
PHONE = r"\d{3}-\d{4}"
COLORS = ["red", "green", "blue"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER_TOOL, ADD_TOOL]


def check_json(text: str, schema: Dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def check_regex(text: str, pattern: str = PHONE) -> None:
    assert re.fullmatch(pattern, text), text


def check_choice(text: str, choices: List[str] = COLORS) -> None:
    assert text in choices, text


def check_tool_call(name: str, arguments: str) -> None:
    """A call names one of TOOLS and its arguments validate against that tool's parameters."""
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    check_json(arguments, tool["function"]["parameters"])
