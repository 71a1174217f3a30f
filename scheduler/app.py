"""The scheduler's HTTP face: ``/healthz`` (JSON, 200 while the loops run) and ``/metrics``.

`create_app` builds the application without I/O; the service starts with the app and stops
(resigning leadership) when the app is cleaned up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from admission.config import Config
from scheduler.service import SchedulerService

SERVICE = web.AppKey("service", SchedulerService)


async def healthz(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.Response(body=orjson.dumps(service.health()), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = generate_latest(service.metrics.registry)
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
