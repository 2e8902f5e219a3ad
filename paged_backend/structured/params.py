"""`StructuredOutputsParams`: what a request's output must match (vLLM's names), checked at construction.

Exactly one constraint: `json` (a JSON schema), `regex`, `choice`, `grammar` (xgrammar EBNF with a `root`
rule, or Lark with a `start` rule) or `json_object=True` (any JSON object). Compiling the constraint against
a tokenizer happens in `structured_compiler.py`; this module needs neither a tokenizer nor xgrammar.
`GuidedDecodingParams` is vLLM's older name for the same thing (its extra `backend` and `disable_fallback`
fields are accepted and ignored: xgrammar is the only backend here).
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from paged_backend.structured.bounded_json import check_depth, loads

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# Bounds on one constraint (far above what vLLM or TGI users send; compiling grows with them): a schema's
# nesting (JSON levels: each nested object schema is two), the characters of a schema (as JSON), regex,
# grammar or all choices together, and the number of choices.
MAX_SCHEMA_DEPTH = 128
MAX_CONSTRAINT_CHARS = 262_144
MAX_CHOICES = 4096


def _check_size(name: str, chars: int) -> None:
    if chars > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured_outputs.{name} has {chars} characters; at most {MAX_CONSTRAINT_CHARS} are "
                         f"accepted")


def _schema_from(value: Any) -> Dict[str, Any]:
    """A JSON schema as a dict, from a dict, a JSON string or a pydantic model class (bounded in nesting and
    size: a schema nested thousands of levels deep is a ValueError, not a RecursionError)."""
    if hasattr(value, "model_json_schema"):  # a pydantic model (vLLM accepts these too)
        value = value.model_json_schema()
    if isinstance(value, (str, bytes)):
        _check_size("json", len(value))
        value = loads(value, "structured_outputs.json", MAX_SCHEMA_DEPTH)
    if not isinstance(value, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object (a dict or a JSON string "
                         f"of an object), got {type(value).__name__}")
    check_depth(value, "structured_outputs.json", MAX_SCHEMA_DEPTH)
    try:
        text = jsonlib.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json cannot be serialized as JSON: {exc}") from None
    _check_size("json", len(text))
    return value


def _check_text(name: str, value: Any, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ValueError(f"structured_outputs.{name} must not be empty")
    _check_size(name, len(value))


def _check_choice(value: Any) -> List[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"structured_outputs.choice must be a list of strings, got {type(value).__name__}")
    if not value:
        raise ValueError("structured_outputs.choice must not be empty")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice has {len(value)} choices; at most {MAX_CHOICES} are accepted")
    bad = [c for c in value if not isinstance(c, str)]
    if bad:
        raise ValueError(f"structured_outputs.choice must hold only strings, got {bad[0]!r}")
    _check_size("choice", sum(len(c) for c in value))
    return list(value)


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams` names).

    `disable_any_whitespace=True` gives JSON in `json.dumps`'s layout (", " and ": " separators, no other
    whitespace); by default any whitespace may separate JSON tokens (capped per gap by the compiler). `disable_additional_properties` is accepted for vLLM compatibility: xgrammar's
    strict JSON-schema mode already refuses properties that a schema does not list.
    """

    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    schema: Optional[Dict[str, Any]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported by this engine; "
                             "use json, regex, choice, grammar or json_object")
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {what}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (xgrammar has no "
                             "whitespace patterns); use disable_any_whitespace=True for compact JSON")
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs.{flag} must be a boolean, got {getattr(self, flag)!r}")
        self._check_constraint(given[0])

    def _check_constraint(self, kind: str) -> None:
        if kind == "json":
            self.schema = _schema_from(self.json)
        elif kind == "regex":
            _check_text("regex", self.regex, allow_empty=True)
        elif kind == "choice":
            self.choice = _check_choice(self.choice)
        elif kind == "grammar":
            _check_text("grammar", self.grammar, allow_empty=False)
        elif self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True when given, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def cache_key(self) -> Tuple:
        """A hashable key that is equal for constraints that compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            value: Any = jsonlib.dumps(self.schema, ensure_ascii=False)  # key order matters to the grammar
        elif kind == "choice":
            value = tuple(self.choice)
        elif kind == "json_object":
            value = True
        else:
            value = getattr(self, kind)
        return (kind, value, self.disable_any_whitespace)


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name (`SamplingParams(guided_decoding=...)`), with its extra fields."""

    backend: Optional[str] = None
    disable_fallback: bool = False


def structured_outputs_from(value: Any) -> Optional[StructuredOutputsParams]:
    """A front's value (None, a params object, or a dict / JSON string of vLLM's fields) -> params.

    Unknown fields are a ValueError naming them; `backend` and `disable_fallback` are ignored (vLLM's older
    fields), as are keys whose value is None.
    """
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, (str, bytes)):
        value = loads(value, "structured_outputs", MAX_SCHEMA_DEPTH + 1)
    if not isinstance(value, Mapping):
        raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
    known = {f.name for f in fields(StructuredOutputsParams) if f.init}
    ignored = {"backend", "disable_fallback"}
    unknown = sorted(set(value) - known - ignored)
    if unknown:
        raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
    return StructuredOutputsParams(**{k: v for k, v in value.items() if k in known and v is not None})
