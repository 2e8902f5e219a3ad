"""The ways an OpenAI-style request asks for structured output, folded into the one `structured_outputs`
value the engine reads (vLLM's `StructuredOutputsParams` fields).

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (a missing `schema` means any JSON object); also TGI's shapes,
  which `huggingface_hub`'s `chat_completion` sends: `{"type": "json" | "json_object", "value": schema}` and
  `{"type": "regex", "value": pattern}`;
- vLLM's extras: `structured_outputs` (an object of its fields; options such as `disable_any_whitespace`
  also apply to the other ways), and the older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` (`guided_decoding_backend` is accepted and ignored: xgrammar is the only backend;
  `guided_whitespace_pattern` is refused: xgrammar has no whitespace patterns);
- the chat route's tools (`tool_choice` "required" or a named function): their schema.

Exactly one constraint may result; two ways asking for different things are a 400 naming both.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from paged_backend import CONSTRAINT_FIELDS, MAX_SCHEMA_DEPTH, load_json

from .errors import fail

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}

Constraint = Tuple[str, str, Any]  # (the request's field, the StructuredOutputsParams field, value)


def _schema_value(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            value = load_json(value, where, MAX_SCHEMA_DEPTH)
        except ValueError as exc:
            fail(str(exc), "response_format")
    if not isinstance(value, dict):
        fail(f"{where} must be a JSON schema object", "response_format")
    return value


def response_format_constraint(response_format: Optional[Dict[str, Any]]) -> Optional[Constraint]:
    """The constraint OpenAI's (or TGI's) `response_format` asks for; None for text."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object" and "value" not in response_format:
        return ("response_format", "json_object", True)
    if kind == "json_schema" and "json_schema" in response_format:
        spec = response_format["json_schema"]
        if not isinstance(spec, dict):
            fail("response_format.json_schema must be an object {\"name\", \"schema\", \"strict\"}", "response_format")
        if spec.get("schema") is None:
            return ("response_format", "json_object", True)
        return ("response_format", "json", _schema_value(spec["schema"], "response_format.json_schema.schema"))
    if kind in ("json", "json_object") and "value" in response_format:  # TGI's shape
        return ("response_format", "json", _schema_value(response_format["value"], "response_format.value"))
    if kind == "json_schema" and isinstance(response_format.get("value"), dict):  # TGI 3's shape
        return ("response_format", "json", _schema_value(response_format["value"].get("schema"),
                                                         "response_format.value.schema"))
    if kind == "regex" and isinstance(response_format.get("value"), str):
        return ("response_format", "regex", response_format["value"])
    fail(f"response_format {json.dumps(response_format)[:200]} is not supported: use {{\"type\": \"text\"}}, "
          f"{{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., "
          f"\"schema\": ...}}}}", "response_format")
    raise AssertionError("unreachable")


def structured_outputs_value(options: Optional[Dict[str, Any]], guided: Dict[str, Any],
                             response_format: Optional[Dict[str, Any]],
                             tool_schema: Optional[Dict[str, Any]] = None) -> Tuple[Optional[dict], Optional[str]]:
    """(the `structured_outputs` dict for the engine or None, the request field it came from)."""
    base = dict(options or {})
    constraints: List[Constraint] = [("structured_outputs", name, base.pop(name)) for name in CONSTRAINT_FIELDS
                                     if base.get(name) is not None]
    if guided.get("guided_whitespace_pattern") is not None:
        fail("`guided_whitespace_pattern` is not supported (xgrammar has no whitespace patterns); use "
              "structured_outputs {\"disable_any_whitespace\": true} for compact JSON", "guided_whitespace_pattern",
              "unsupported_parameter")
    constraints += [(name, GUIDED_FIELDS[name], value) for name, value in guided.items()
                    if value is not None and name in GUIDED_FIELDS]
    from_format = response_format_constraint(response_format)
    if from_format is not None:
        constraints.append(from_format)
    if tool_schema is not None:
        constraints.append(("tools", "json", tool_schema))
    if len(constraints) > 1:
        names = ", ".join(dict.fromkeys(c[0] if c[0] != "structured_outputs" else f"structured_outputs.{c[1]}"
                                        for c in constraints))
        fail(f"the output can follow one constraint, but several were given ({names})", constraints[1][0])
    if not constraints:
        if base:
            fail("structured_outputs needs one of json, regex, choice, grammar, json_object", "structured_outputs")
        return None, None
    source, name, value = constraints[0]
    return {**base, name: value}, source
