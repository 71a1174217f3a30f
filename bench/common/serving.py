"""Running a lab HTTP server as a child process: serve an aiohttp app until SIGTERM or SIGINT,
after printing one JSON line that names the bound port, which the parent waits for
(bench.common.procs) so that port 0 can be used and no one polls for readiness."""

from __future__ import annotations

import asyncio
import signal
import sys

import orjson
from aiohttp import web


async def serve_until_signal(app: web.Application, host: str, port: int, ready_key: str, *,
                             backlog: int = 128) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=backlog)
        await site.start()
        bound = runner.addresses[0][1]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sys.stdout.write(orjson.dumps({ready_key: True, "host": host, "port": bound}).decode())
        sys.stdout.write("\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await runner.cleanup()
