"""Request bodies under hostile input: a size limit, strict JSON parsing off the event loop, and pydantic
validation, every failure a `ValidationFailed` (or `PayloadTooLarge`) naming the problem.

- `BodyLimit` (ASGI middleware) answers 413 as soon as a body is, or announces to be, over the limit.
- `decode_body` (run in a worker thread) parses and refuses what Python's json module accepts but no client may
  send: NaN / Infinity (also as `1e400`), lone surrogates (`"\\ud800"`), nesting deeper than MAX_DEPTH and
  integers of more than 64 bits; then validates the fields strictly (no "5" for 5).
"""

from __future__ import annotations

import json
import math
from typing import Any, Awaitable, Callable, Type, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import APIError, PayloadTooLarge, ValidationFailed

Model = TypeVar("Model", bound=BaseModel)
DEFAULT_PAYLOAD_LIMIT = 2_000_000  # bytes, TGI's default --payload-limit
MAX_DEPTH = 32
_INT_LIMIT = 2 ** 64


class StrictBody(BaseModel):
    """Base of request bodies: no type coercion ("5" is not 5), unknown fields ignored (as TGI and vLLM do)."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---- size limit -------------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: bodies over `limit` bytes get 413 (checked on Content-Length, then while reading)."""

    def __init__(self, app, limit: int, error_response: Callable[[str, APIError], Any]) -> None:
        self.app, self.limit, self._error = app, limit, error_response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._error(scope["path"], PayloadTooLarge(self.limit))(scope, receive, send)
                return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise PayloadTooLarge(self.limit)
            return message
        return counted


# ---- parsing ----------------------------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


def _check_tree(data: Any) -> None:
    """Depth, strings and integers of a parsed body, without recursion."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ValidationFailed(f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((item, depth + 1, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _INT_LIMIT:
            raise ValidationFailed(f"`{path}`: the integer is out of range (more than 64 bits)",
                                   param=path.split(".")[0] or None)


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationFailed(f"`{path or 'body'}` is not valid Unicode (it contains a lone surrogate such as "
                               f"\\ud800)", param=path.split(".")[0] or None, code="invalid_json") from None


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


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names for union branches


def decode_body(raw: bytes, model: Type[Model]) -> Model:
    """`raw` parsed and validated as `model` (runs in a worker thread: bodies may be large)."""
    return validate_body(decode_json_object(raw), model)


def decode_json_object(raw: bytes) -> dict:
    """`raw` parsed as a JSON object within the bounds above (runs in a worker thread)."""
    if not raw.strip():
        raise ValidationFailed("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValidationFailed(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)",
                               code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", "validation", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ValidationFailed(f"the request body must be a JSON object, got a JSON {type(data).__name__}",
                               code="invalid_type")
    _check_tree(data)
    return data


def validate_body(data: dict, model: Type[Model]) -> Model:
    """A parsed body validated as `model`; a ValidationFailed naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _describe(exc.errors())
        raise ValidationFailed(message, param=param, code="invalid_type") from None
