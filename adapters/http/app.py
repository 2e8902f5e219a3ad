"""The FastAPI app: TGI and OpenAI routes over one `AsyncLLMEngine`, /metrics, auth, error shapes.

`create_app(engine, ...)` builds the app; uvicorn (see `cli.py`) serves it. Bodies over `payload_limit`
bytes get 413; parsing and tokenizing run in worker threads. On shutdown the lifespan hook aborts whatever
is still in flight and frees its KV blocks (`AsyncLLMEngine.shutdown`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response

from paged_backend import AsyncLLMEngine, LoRARequest

from . import lora_routes, openai_routes, tgi_routes, tokenize_routes
from .auth import APIKeyMiddleware
from .body import DEFAULT_PAYLOAD_LIMIT, BodyLimit
from .context import ServerContext
from .errors import APIError, install_error_handlers
from .loras import served_adapters
from .metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("paged_backend.http")


def _special_ids(tokenizer) -> frozenset:
    return frozenset(getattr(tokenizer, "all_special_ids", []) or [])


def _error_reply(path: str, error: APIError) -> Response:
    return error.response(path)


def create_app(engine: AsyncLLMEngine, model_name: str = "model", api_key: Optional[str] = None,
               max_concurrent_requests: int = 512,
               on_shutdown: Optional[Callable[[AsyncLLMEngine], None]] = None,
               payload_limit: int = DEFAULT_PAYLOAD_LIMIT, lora_modules: Sequence[LoRARequest] = ()) -> FastAPI:
    """A TGI- and OpenAI-compatible app serving `engine` under the name `model_name`, and the LoRA adapters
    `lora_modules` (loaded into the engine already) under their names."""
    if engine.tokenizer is None:
        raise ValueError("the HTTP server needs an engine with a tokenizer")
    if max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
    if payload_limit < 1:
        raise ValueError(f"payload_limit must be >= 1 byte, got {payload_limit}")
    lora_enabled = engine.lora_enabled
    if lora_modules and not lora_enabled:
        raise ValueError("LoRA modules need an engine with enable_lora=True (--enable-lora)")
    ctx = ServerContext(engine, model_name, ServerMetrics(engine, model_name), max_concurrent_requests,
                        special_ids=_special_ids(engine.tokenizer),
                        loras=served_adapters(model_name, lora_enabled, lora_modules))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        logger.info("shutting down: aborting %d request(s) still in flight", ctx.in_flight)
        await engine.shutdown()
        ctx.close()
        if on_shutdown is not None:
            on_shutdown(engine)

    app = FastAPI(title="paged-backend", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    app.state.started_at = time.time()
    install_error_handlers(app)
    app.include_router(tgi_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(lora_routes.router)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimit, limit=payload_limit, error_response=_error_reply)  # outermost: runs first
    return app
