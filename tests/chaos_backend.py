"""A vLLM stand-in process for the chaos tests: bench.common.instant_backend's API and metrics, plus
a fixed delay before each generation answers (so that requests are in flight when something
is killed) and, optionally, streams that stop after some tokens until the client leaves.

    python -m tests.chaos_backend [--port 0] [--model demo] [--delay-ms N] [--hold-after N]

Prints ``instant backend listening on http://HOST:PORT`` once it serves, like the instant
backend. Every generation it receives is counted in ``chaos:requests_total`` on /metrics, by
X-Request-Id, so a test can tell whether a task reached a node twice.

Its page reports the generations in flight as running, and counts each one answered in
``vllm:generation_tokens_total``. ``POST /chaos/stuck`` makes it a stuck engine whose API
server still answers, as a vLLM engine hung inside a step: once a generation is in flight (it
waits for one), no generation answers again (those in flight and those that come wait until
their client leaves), and the page is frozen as it was then (the requests it held stay counted
as running after their clients leave; those that come are not counted).
``POST /chaos/stuck?idle=1`` freezes it the same way at a moment it holds no generation (it
waits for one), as a vLLM engine that hung between two requests: its frozen page says it holds
nothing, and every generation that comes waits until its client leaves. ``POST
/chaos/resume`` lets generations that come answer again, as an engine paused, not hung; its
page stays frozen until it answers one, since vLLM's page changes only at a step. ``POST
/chaos/ghost`` leaves the page a vLLM engine leaves when every request it held was aborted
at once: 106 running, 15 waiting and its KV cache at 90.4%, frozen until it answers a
generation, which shows it empty again.
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


class Engine:
    """What the page reports beyond the instant backend's, and the stuck switch."""

    def __init__(self) -> None:
        self.active = 0
        self.answered = 0
        self.stuck = asyncio.Event()
        self.held = 0
        """Generations in flight when it got stuck: the frozen page's running count."""
        self.answered_then = 0
        """Generations answered when it got stuck: the frozen page's counter."""
        self.in_flight = asyncio.Event()
        """Set while a generation is in flight."""
        self.idle = asyncio.Event()
        """Set while none is."""
        self.frozen_page = False
        """The page shows what it showed when it got stuck: from then until it answers a
        generation."""
        self.idle.set()


def make_app(delay_s: float, hold_after: int | None, model: str) -> web.Application:
    backend = InstantBackend(model=model, hold_after=hold_after, record=False)
    app = backend.app()
    seen: collections.Counter[str] = collections.Counter()
    app[SEEN] = seen
    engine = Engine()

    async def stuck(request: web.Request) -> web.Response:
        if not engine.stuck.is_set():
            if request.query.get("idle"):
                while engine.active:  # one may come between the event and this task's turn
                    await engine.idle.wait()
            else:
                await engine.in_flight.wait()
            engine.held, engine.answered_then = engine.active, engine.answered
            engine.stuck.set()
            engine.frozen_page = True
        return web.json_response({"held": engine.held})

    async def resume(request: web.Request) -> web.Response:
        engine.stuck.clear()
        return web.json_response({"frozen_page": engine.frozen_page})

    async def ghost(request: web.Request) -> web.Response:
        engine.held, engine.answered_then = 106, engine.answered
        backend.waiting, backend.kv_usage = 15, 0.904
        engine.frozen_page = True
        return web.json_response({"held": engine.held})

    app.router.add_post("/chaos/stuck", stuck)
    app.router.add_post("/chaos/ghost", ghost)
    app.router.add_post("/chaos/resume", resume)

    @web.middleware
    async def delay(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") and request.method == "POST":
            seen[request.headers.get("X-Request-Id", "")] += 1
            engine.active += 1
            engine.in_flight.set()
            engine.idle.clear()
            try:
                if delay_s:
                    await asyncio.sleep(delay_s)
                if engine.stuck.is_set():
                    await asyncio.Event().wait()  # until the client leaves
                response = await handler(request)
                engine.answered += 1
                if engine.frozen_page:  # a step: the page tells the truth again
                    engine.frozen_page = False
                    backend.waiting, backend.kv_usage = 0, 0.0
                return response
            finally:
                engine.active -= 1
                if not engine.active:
                    engine.in_flight.clear()
                    engine.idle.set()
        elif request.path == "/metrics":
            frozen = engine.frozen_page
            backend.running = engine.held if frozen else engine.active
            answered = engine.answered_then if frozen else engine.answered
            response = await handler(request)
            assert isinstance(response, web.Response) and response.text is not None
            twice = sum(1 for n in seen.values() if n > 1)
            response.text = (response.text
                             + "# TYPE vllm:generation_tokens counter\n"
                             + f'vllm:generation_tokens_total{{engine="0",model_name="{model}"}} '
                             + f"{float(answered)}\n"
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
