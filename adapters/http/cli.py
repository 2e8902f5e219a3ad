"""`paged-backend serve [MODEL]`: the TGI/OpenAI-compatible HTTP server on uvicorn.

Binds 127.0.0.1:8000 unless told otherwise (`--port 0` picks a free port), prints a ready line
and copy-paste `curl` commands once it listens, and shuts down gracefully on SIGTERM / SIGINT:
in-flight requests get `--shutdown-timeout` seconds to finish, the rest are aborted and their KV
blocks freed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import socket
import sys
from typing import Optional

from paged_backend import add_engine_args, engine_kwargs, format_stats

from .body import DEFAULT_PAYLOAD_LIMIT
from .loras import parse_lora_module


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="serve a model over TGI- and OpenAI-compatible HTTP routes")
    p.add_argument("model", nargs="?", default="smollm2", help="preset name or Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but "
                                                   "/health and /metrics")
    p.add_argument("--served-model-name", default=None, help="model name in replies (default: MODEL)")
    p.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="requests in flight before new ones get 429")
    p.add_argument("--payload-limit", type=int, default=DEFAULT_PAYLOAD_LIMIT,
                   help=f"largest request body in bytes; larger ones get 413 (default {DEFAULT_PAYLOAD_LIMIT}, as TGI)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under their names, as vLLM takes them: name=path "
                        "or '{\"name\": ..., \"path\": ...}'; requests name one as `model` (OpenAI) or `adapter_id` "
                        "(TGI); needs --enable-lora")
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _base_url(host: str, port: int) -> str:
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def ready_message(base_url: str, model_name: str, api_key: Optional[str], stats) -> str:
    """The banner printed once the server listens: a ready line and curl commands to paste."""
    auth = f" -H {shlex.quote('Authorization: Bearer ' + api_key)}" if api_key else ""
    generate = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 32}}
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Write a haiku about memory pages."}],
            "max_tokens": 48}
    lines = [
        f"paged-backend: ready on {base_url} serving {model_name} "
        f"(KV cache: {stats.num_blocks} blocks of {stats.block_size} tokens)",
        "Try:",
        f"  curl {base_url}/generate -H 'Content-Type: application/json'{auth} -d {shlex.quote(json.dumps(generate))}",
        f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(json.dumps(chat))}",
    ]
    return "\n".join(lines)


async def _serve(server, sock: socket.socket, banner: str, ctx, grace: float) -> None:
    """Run uvicorn; once it starts shutting down, give in-flight requests `grace` seconds, then abort them
    so that their streams end with an error event and their KV blocks are freed."""
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(banner, flush=True)
    while not server.should_exit and not task.done():
        await asyncio.sleep(0.1)
    if not task.done():
        try:
            await asyncio.wait_for(asyncio.shield(task), grace)
        except asyncio.TimeoutError:
            aborted = await ctx.abort_all()
            print(f"paged-backend: aborted {aborted} request(s) still running after {grace:g}s", flush=True)
    await task


def _lora_modules(args: argparse.Namespace) -> list:
    """The `--lora-modules` entries with ids 1, 2, ...; refused without --enable-lora or with a name twice."""
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    modules = [parse_lora_module(text) for text in args.lora_modules]
    names = [m.lora_name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    from paged_backend import LoRARequest

    return [LoRARequest(m.lora_name, i + 1, m.lora_path) for i, m in enumerate(modules)]


async def _load_adapters(engine, modules: list) -> None:
    """Read and check every adapter before the server listens (a bad one stops it with the reason)."""
    for lora in modules:
        await engine.add_lora(lora)


def _ignore_signal_after_shutdown(signum, frame) -> None:
    """uvicorn re-raises the signal that stopped it; by then shutdown is done, so exit normally."""


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from paged_backend import AsyncLLMEngine, maybe_run_worker_loop

    from .app import create_app

    # Under `torchrun ... paged-backend serve --tensor-parallel-size N`, ranks other than 0 become
    # tensor-parallel workers here (before binding the port) and exit; rank 0 serves. (`main()` does it too.)
    maybe_run_worker_loop()
    if args.max_concurrent_requests < 1:
        raise ValueError("--max-concurrent-requests must be >= 1")
    if args.payload_limit < 1:
        raise ValueError("--payload-limit must be >= 1")
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"paged-backend: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    modules = _lora_modules(args)
    with sock:
        engine = AsyncLLMEngine(args.model, **engine_kwargs(args))
        name = args.served_model_name or args.model
        asyncio.run(_load_adapters(engine, modules))

        def report(eng: AsyncLLMEngine) -> None:
            print(f"paged-backend: shut down. {format_stats(eng.get_stats())}", flush=True)

        app = create_app(engine, name, args.api_key, args.max_concurrent_requests, on_shutdown=report,
                         payload_limit=args.payload_limit, lora_modules=modules)
        # uvicorn's own timeout is only a backstop: _serve aborts what is left after --shutdown-timeout
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout + 30,
                                access_log=args.log_level == "debug")
        server = uvicorn.Server(config)
        port = sock.getsockname()[1]
        banner = ready_message(_base_url(args.host, port), name, args.api_key, engine.get_stats())
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore_signal_after_shutdown)
        asyncio.run(_serve(server, sock, banner, app.state.ctx, args.shutdown_timeout))
    return 0
