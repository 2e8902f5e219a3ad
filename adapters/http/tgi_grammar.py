"""TGI's `parameters.grammar` -> the engine's `structured_outputs`, validated as TGI validates it.

TGI's grammar is `{"type": "json", "value": <JSON schema, as an object or a string>}` (`"json_object"` is an
alias), `{"type": "regex", "value": <pattern>}`, or (TGI 3) `{"type": "json_schema", "value": {"name", "schema"}}`.
A JSON schema must be a valid JSON Schema (draft 2020-12) and, as TGI requires, have `properties`. Failures
are 422 `validation` errors worded as TGI words them ("grammar is not valid: ..."). JSON comes out without
free whitespace (`disable_any_whitespace`): TGI's grammars allow at most one optional space between JSON
tokens and no newlines; here the separators are json.dumps's (", " and ": ").
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from paged_backend import MAX_SCHEMA_DEPTH, check_json_depth

from .errors import ValidationFailed

GRAMMAR_TYPES = ("json", "json_object", "regex", "json_schema")


def invalid(reason: str) -> ValidationFailed:
    return ValidationFailed(f"grammar is not valid: {reason}", param="grammar")


def _schema(value: Any) -> Dict[str, Any]:
    try:
        if isinstance(value, str):
            value = json.loads(value)
        check_json_depth(value, "the schema", MAX_SCHEMA_DEPTH)
    except RecursionError:  # a string nested thousands of levels deep
        raise invalid(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
    except ValueError as exc:  # worded as TGI words it: the JSON parser's message
        raise invalid(str(exc)) from None
    if not isinstance(value, dict):
        raise invalid(f"a JSON grammar's value must be a JSON schema object (or a string holding one), got "
                      f"{type(value).__name__}")
    import jsonschema  # the server extra

    try:
        jsonschema.Draft202012Validator.check_schema(value)
    except jsonschema.SchemaError as exc:
        raise invalid(exc.message) from None
    if "properties" not in value:
        raise invalid("Grammar must have a 'properties' field")
    return value


def grammar_constraint(grammar: Any) -> Optional[Dict[str, Any]]:
    """The `structured_outputs` value for a TGI grammar (None for none); a 422 ValidationFailed otherwise."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict) or grammar.get("type") not in GRAMMAR_TYPES or "value" not in grammar:
        raise ValidationFailed(f"`grammar` must be an object {{\"type\": \"json\" | \"regex\" | \"json_schema\", "
                               f"\"value\": ...}}, got {json.dumps(grammar)[:200]}", param="grammar")
    kind, value = grammar["type"], grammar["value"]
    if kind == "regex":
        if not isinstance(value, str):
            raise invalid(f"a regex grammar's value must be a string, got {type(value).__name__}")
        return {"regex": value}
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise invalid("a json_schema grammar's value must be an object {\"name\", \"schema\"}")
        value = value["schema"]
    return {"json": _schema(value), "disable_any_whitespace": True}
