"""`python -m paged_backend.benchmarks.paper.baseline_server --policy P [MODEL]`: the project's HTTP app
(the same TGI/OpenAI routes as `paged-backend serve`) over an engine whose block manager is a
reservation baseline, so the serving benchmark can compare both through the same front.

Prints the same ready banner as `paged-backend serve` once it listens; stops on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from typing import List, Optional

from paged_backend.cli import add_engine_args, engine_kwargs

from paged_backend.benchmarks.paper.reservation import POLICIES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baseline_server", description=__doc__)
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--policy", choices=POLICIES, required=True, help="what each request reserves on admission")
    p.add_argument("--allocator", default="first-fit", choices=["first-fit", "buddy"])
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0 picks a free one)")
    add_engine_args(p)
    return p


async def _serve(server, sock: socket.socket, banner: str) -> None:
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(banner, flush=True)
    await task


def main(argv: Optional[List[str]] = None) -> int:
    import uvicorn

    from paged_backend import AsyncLLMEngine, LLMEngine
    from paged_backend.adapters.http.app import create_app
    from paged_backend.adapters.http.cli import ready_message

    from paged_backend.benchmarks.paper.reservation import install_reservation

    args = _parser().parse_args(argv)
    engine = LLMEngine(args.model, **engine_kwargs(args))
    install_reservation(engine, args.policy, args.allocator)
    async_engine = AsyncLLMEngine.from_engine(engine)
    app = create_app(async_engine, f"{args.model}-reserve-{args.policy}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", args.port))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        banner = ready_message(f"http://127.0.0.1:{port}", args.model, None, async_engine.get_stats())
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)  # uvicorn re-raises the stop signal once it has shut down
        asyncio.run(_serve(server, sock, banner))
    return 0


if __name__ == "__main__":
    sys.exit(main())
