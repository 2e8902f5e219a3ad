"""Error responses in each API's own shape, and the handlers that keep every failure a JSON reply.

TGI clients read `{"error": ..., "error_type": ...}`; OpenAI clients read
`{"error": {"message", "type", "param", "code"}}`. Which shape a reply takes follows the path:
routes under `/v1` speak OpenAI, everything else speaks TGI.
"""

from __future__ import annotations

import logging
from typing import Mapping, NoReturn, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_backend.errors import CannotFit, InvalidRequest, PromptTooLong, UnsupportedParameter

logger = logging.getLogger("paged_backend.http")

OPENAI_PREFIX = "/v1"


def is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


class APIError(Exception):
    """An error reply: HTTP status, message, and the fields each API's body needs."""

    def __init__(self, status: int, message: str, error_type: Optional[str] = None,
                 param: Optional[str] = None, code: Optional[str] = None,
                 openai_status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status
        self.openai_status = openai_status or status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def tgi_body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type or _TGI_TYPES.get(self.status, "error")}

    def openai_body(self) -> dict:
        kind = self.error_type if self.error_type in _OPENAI_TYPES else \
            _OPENAI_KIND.get(self.openai_status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, path: str) -> JSONResponse:
        openai = is_openai_path(path)
        status = self.openai_status if openai else self.status
        body = self.openai_body() if openai else self.tgi_body()
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(body, status_code=status, headers=headers)


class ValidationFailed(APIError):
    """Bad input: TGI answers 422 ("validation"), OpenAI 400 ("invalid_request_error")."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value") -> None:
        super().__init__(422, message, "validation", param, code, openai_status=400)


def fail(message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value") -> NoReturn:
    """Refuse a request body: 422 for TGI, 400 for OpenAI, naming the parameter at fault."""
    raise ValidationFailed(message, param=param, code=code)


def refusal(exc: InvalidRequest, names: Optional[Mapping[str, str]] = None) -> ValidationFailed:
    """The engine's typed refusal in the API's terms: `names` maps the engine's parameter names to the API's
    (e.g. TGI's `max_new_tokens` for `max_tokens`)."""
    param = (names or {}).get(exc.param, exc.param) if exc.param else None
    if isinstance(exc, PromptTooLong):
        code = "context_length_exceeded"
    elif isinstance(exc, CannotFit):
        code = "kv_cache_exceeded"
    elif isinstance(exc, UnsupportedParameter):
        code = "unsupported_parameter"
    else:
        code = "invalid_value"
    return ValidationFailed(str(exc), param=param, code=code)


class PayloadTooLarge(APIError):
    """The request body is larger than the server's limit (`--payload-limit`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes",
                         "validation", code="payload_too_large", openai_status=413)


class GenerationFailed(APIError):
    """The engine gave up on a request it had accepted (TGI's 424 "generation", OpenAI 500)."""

    def __init__(self, message: str) -> None:
        super().__init__(424, message, "generation", code="generation_failed", openai_status=500)


class RequestAborted(APIError):
    """The engine aborted the request before it finished (the server is shutting down)."""

    def __init__(self) -> None:
        super().__init__(503, "the request was aborted before it finished: the server is shutting down",
                         "incomplete_generation", code="request_aborted")


class Overloaded(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(429, f"Model is overloaded: {limit} requests are already in flight", "overloaded",
                         code="rate_limit_exceeded")


class ClientDisconnected(Exception):
    """The client went away before its reply was ready; the request was aborted."""


_TGI_TYPES = {400: "validation", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
              413: "validation", 422: "validation", 424: "generation", 429: "overloaded", 500: "internal",
              503: "unavailable"}
_OPENAI_KIND = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
                424: "server_error", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}
_OPENAI_TYPES = set(_OPENAI_KIND.values())


def error_response(path: str, status: int, message: str, code: Optional[str] = None) -> JSONResponse:
    return APIError(status, message, code=code).response(path)


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response(request.url.path)


async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    path = request.url.path
    if exc.status_code == 404:
        return error_response(path, 404, f"unknown route {request.method} {path}", code="unknown_url")
    if exc.status_code == 405:
        return error_response(path, 405, f"method {request.method} is not allowed on {path}",
                              code="method_not_allowed")
    return error_response(path, exc.status_code, str(exc.detail))


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure to a JSON body in the caller's API shape (no tracebacks in replies)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
