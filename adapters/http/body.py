"""Request bodies: strict JSON parsing and pydantic validation turned into `ValidationFailed` errors.

Bodies are parsed here rather than by FastAPI so that every failure (bad JSON, a non-finite number,
a wrong type) gets a message naming the field, in the caller's API shape, with one code path.
"""

from __future__ import annotations

import json
from typing import Type, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import APIError, ValidationFailed

Model = TypeVar("Model", bound=BaseModel)


class StrictBody(BaseModel):
    """Base of request bodies: no type coercion ("5" is not 5), unknown fields ignored (as TGI and vLLM do)."""

    model_config = ConfigDict(strict=True, extra="ignore")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names for union branches


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON number")


def _describe(errors: list) -> tuple:
    """(message, param) for the first failing field; union types report one line, not one per branch."""
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    if not loc:
        return "the request body must be a JSON object", None
    field = loc[0]
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    if len(same_field) > 1 and first["type"] != "missing":
        return f"`{field}` has an invalid type or value", field
    path = ".".join(part for part in loc if part not in _UNION_TAGS and "[" not in part)
    if first["type"] == "missing":
        return f"`{path}` is required", field
    return f"`{path}`: {first['msg']}", field


async def parse_body(request: Request, model: Type[Model]) -> Model:
    """The request's JSON body validated as `model`, or a ValidationFailed naming the problem."""
    raw = await request.body()
    if not raw.strip():
        raise ValidationFailed("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", "validation", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ValidationFailed(f"the request body must be a JSON object, got a JSON {type(data).__name__}",
                               code="invalid_type")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _describe(exc.errors())
        raise ValidationFailed(message, param=param, code="invalid_type") from None
