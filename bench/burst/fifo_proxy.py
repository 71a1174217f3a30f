"""Arm (b) of the burst experiment: a plain FIFO concurrency limiter in front of the nodes.

What many deployments put in front of vLLM today: one global FIFO queue and a fixed number of
requests in flight per node. It knows nothing of tiers, tokens or KV-cache: a 32 KB document
and a 20-token chat each take one slot. Requests are forwarded byte for byte and responses
streamed back as they come.

``python -m bench.burst.fifo_proxy --backend URL ... --max-inflight N [--port 0]`` prints one
JSON line ``{"fifo_ready": true, "port": P}`` once it serves. ``GET /stats`` returns the queue
depth (per ``X-Bench-Tier`` value, a statistics-only header from the load generator) and
in-flight counts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp
import orjson
from aiohttp import web

from bench.common.serving import serve_until_signal

READY_KEY = "fifo_ready"
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[int]
    tier: str


class FifoLimiter:
    """A global FIFO queue in front of ``len(backends)`` nodes of ``max_inflight`` slots each."""

    def __init__(self, backends: Sequence[str], max_inflight: int) -> None:
        if not backends or max_inflight < 1:
            raise ValueError("need at least one backend and max_inflight >= 1")
        self.backends = [b.rstrip("/") for b in backends]
        self.max_inflight = max_inflight
        self.inflight = [0] * len(self.backends)
        self.queue: collections.deque[_Waiter] = collections.deque()

    def queued_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = collections.Counter(w.tier for w in self.queue)
        return dict(out)

    def _free_node(self) -> int | None:
        best = min(range(len(self.backends)), key=lambda i: self.inflight[i])
        return best if self.inflight[best] < self.max_inflight else None

    async def acquire(self, tier: str) -> int:
        """Wait for a slot, first come first served; returns the node index."""
        if not self.queue:
            node = self._free_node()
            if node is not None:
                self.inflight[node] += 1
                return node
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tier)
        self.queue.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted a slot in the same instant the client left: hand it on.
                self.release(waiter.future.result())
            else:
                with contextlib.suppress(ValueError):
                    self.queue.remove(waiter)
            raise

    def release(self, node: int) -> None:
        self.inflight[node] -= 1
        while self.queue:
            free = self._free_node()
            if free is None:
                return
            waiter = self.queue.popleft()
            if waiter.future.done():
                continue
            self.inflight[free] += 1
            waiter.future.set_result(free)


LIMITER: Final = web.AppKey("limiter", FifoLimiter)
SESSION: Final = web.AppKey("session", aiohttp.ClientSession)


def create_app(backends: Sequence[str], max_inflight: int) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[LIMITER] = FifoLimiter(backends, max_inflight)
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/chat/completions", _proxy)
    app.router.add_post("/v1/completions", _proxy)
    app.router.add_get("/stats", _stats)
    app.router.add_get("/health", _health)
    return app


async def _session(app: web.Application) -> AsyncIterator[None]:
    # No pool limit: the limiter is the only thing that bounds concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    session = aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
    )
    app[SESSION] = session
    yield
    await session.close()


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _stats(request: web.Request) -> web.Response:
    limiter = request.app[LIMITER]
    body = {"queued": len(limiter.queue), "queued_by_tier": limiter.queued_by_tier(),
            "inflight": limiter.inflight, "max_inflight": limiter.max_inflight}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _proxy(request: web.Request) -> web.StreamResponse:
    limiter = request.app[LIMITER]
    body = await request.read()
    tier = request.headers.get("X-Bench-Tier", "unknown")
    node = await limiter.acquire(tier)
    try:
        url = limiter.backends[node] + request.path
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                })
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, OSError) as exc:
            error = {"error": {"message": f"upstream failed: {exc}", "type": "upstream_error",
                               "param": None, "code": 502}}
            return web.Response(status=502, body=orjson.dumps(error),
                                content_type="application/json")
    finally:
        limiter.release(node)


async def serve(backends: Sequence[str], max_inflight: int, host: str, port: int) -> None:
    await serve_until_signal(create_app(backends, max_inflight), host, port, READY_KEY,
                             backlog=2048)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst.fifo_proxy", description=__doc__)
    p.add_argument("--backend", action="append", required=True, help="node base URL (repeat)")
    p.add_argument("--max-inflight", type=int, required=True, help="requests in flight per node")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    coro = serve(args.backend, args.max_inflight, args.host, args.port)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
