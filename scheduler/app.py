"""The scheduler's HTTP face: ``/healthz`` and ``/metrics``.

``/healthz`` answers JSON, 200 while every loop of the service runs, leader or standby, with
Redis reachable or not (a restart fixes neither: a standby is healthy, and one cut off from
Redis keeps retrying); 503 once one of its loops ended (`ended_loops`), which only a restart
repairs, so that a liveness probe restarts the replica (which resigns the lease it may hold).
Its `redis` field says what the latest leadership call met: `{"state": "ok"}`, `"unreachable"`
(an outage: it passes), or `"refused"` with the error's class (a wrong password, an ACL
without the scripts' commands, a certificate that does not verify: a restart repairs none of
these, so the probe stays 200 and the replica heals once the operator fixes the secret).

`create_app` builds the application without I/O; the service starts with the app and stops
(resigning leadership) when the app is cleaned up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from admission.config import Config
from scheduler.service import SchedulerService

SERVICE = web.AppKey("service", SchedulerService)


async def healthz(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    health = service.health()
    return web.Response(body=orjson.dumps(health), content_type="application/json",
                        status=503 if health["ended_loops"] else 200)


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    # Rendered in a thread: a leader's page of many pools and nodes takes up to a second or
    # more of Python, which on the event loop would delay its ticks and its lease renewals.
    body = await asyncio.to_thread(generate_latest, service.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: Config, *, me: str | None = None) -> web.Application:
    app = web.Application()
    app[SERVICE] = SchedulerService(config, me=me)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await app[SERVICE].start()
        yield
        await app[SERVICE].stop()

    app.cleanup_ctx.append(lifecycle)
    return app
