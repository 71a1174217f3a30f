"""A vLLM stand-in process for the chaos tests: bench.common.instant_backend's API and metrics, plus
a fixed delay before each generation answers (so that requests are in flight when something
is killed) and, optionally, streams that stop after some tokens until the client leaves.

    python -m tests.chaos_backend [--port 0] [--model demo] [--delay-ms N] [--hold-after N]

Prints ``instant backend listening on http://HOST:PORT`` once it serves, like the instant
backend. Every generation it receives is counted in ``chaos:requests_total`` on /metrics, by
X-Request-Id, so a test can tell whether a task reached a node twice.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from collections.abc import Sequence
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from bench.common.instant_backend import InstantBackend

SEEN: Final = web.AppKey("chaos_seen", collections.Counter)


def make_app(delay_s: float, hold_after: int | None, model: str) -> web.Application:
    backend = InstantBackend(model=model, hold_after=hold_after, record=False)
    app = backend.app()
    seen: collections.Counter[str] = collections.Counter()
    app[SEEN] = seen

    @web.middleware
    async def delay(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") and request.method == "POST":
            seen[request.headers.get("X-Request-Id", "")] += 1
            if delay_s:
                await asyncio.sleep(delay_s)
        elif request.path == "/metrics":
            response = await handler(request)
            assert isinstance(response, web.Response) and response.text is not None
            twice = sum(1 for n in seen.values() if n > 1)
            response.text = (response.text
                             + "# TYPE chaos:requests counter\n"
                             + f"chaos:requests_total {sum(seen.values())}\n"
                             + "# TYPE chaos:tasks_seen_twice gauge\n"
                             + f"chaos:tasks_seen_twice {twice}\n")
            return response
        return await handler(request)

    app.middlewares.append(delay)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos_backend")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="demo")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--hold-after", type=int, default=None)
    args = p.parse_args(argv)

    async def serve() -> None:
        app = make_app(args.delay_ms / 1000, args.hold_after, args.model)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        print(f"instant backend listening on http://{args.host}:{port}", flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
