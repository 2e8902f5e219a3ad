"""`--api-key`: requests must carry `Authorization: Bearer KEY`, except the health and metrics probes.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware) so streaming replies and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Iterable

from .errors import error_response

OPEN_PATHS = ("/health", "/metrics")


class APIKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode("utf-8")
        self._open = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self._expected):
            reason = "missing" if not given else "invalid"
            response = error_response(scope["path"], 401,
                                      f"{reason} API key: send the header 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
