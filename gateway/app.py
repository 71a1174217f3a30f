"""The application factory: routes, middleware and the resources built at startup.

`create_app(config)` does no I/O. Starting the app (its cleanup context) loads each pool's
tokenizer off the event loop, connects to Redis (a failure there does not stop the start:
/readyz says not ready and requests fail closed until Redis answers), subscribes to this
gateway's wake channels and starts the lease renewer. Stopping it waits for pending settles
before closing Redis. How a process stops within its bound: `gateway.shutdown`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from admission.config import Config
from admission.connection import (
    connect,
    eviction_warning,
    primary_locator,
    redis_address,
    version_error,
)
from admission.errors import describe
from admission.keys import check_name
from admission.scripts import load_scripts, register_scripts
from admission.servicemetrics import probe as probe_loop_lag
from admission.servicemetrics import watch_gc
from admission.store import PoolStore
from gateway import handlers
from gateway.admin import ADMIN_POOLS_PATH, admin_pools
from gateway.admit import STORE_ERRORS, Admitter
from gateway.auth import AdminToken, TenantDirectory
from gateway.errors import expect_continue, openai_errors
from gateway.estimator import ChatFormat, TokenCounter
from gateway.metrics import GatewayMetrics
from gateway.nodeclient import NodeClient
from gateway.openapi import openapi_document
from gateway.pools import PoolRuntime, backend_credentials
from gateway.proxy import Upstream
from gateway.redismux import RedisMux
from gateway.settle import LiveTasks, Settler, renew_leases
from gateway.shutdown import BACKGROUND_STOP_S, SETTLE_DRAIN_S, InFlight
from gateway.state import (
    ADMIN,
    BACKEND_HEADERS,
    CONFIG,
    GATEWAY,
    GATEWAY_ID,
    IN_FLIGHT,
    METRICS,
    OPENAPI,
    SETTLE_DRAIN,
    Gateway,
)
from gateway.stucknodes import cut_stuck_requests
from gateway.waiter import WakeHub

log = logging.getLogger("kvgate.gateway")


def default_gateway_id() -> str:
    """Unique per process: replicas sharing one config file must not share an id."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:32].strip("-.") or "host"
    return f"gw-{host}-{os.getpid()}-{secrets.token_hex(3)}"


def _gateway_id(config: Config, flag: str | None) -> str:
    if flag is not None:
        option, value = "--id", flag
    elif config.gateway.id is not None:
        option, value = "gateway.id", config.gateway.id
    else:
        return default_gateway_id()
    try:
        return check_name("gateway", value)
    except ValueError as exc:
        raise ValueError(f"{option} (the gateway id): {exc}") from None


def create_app(
    config: Config, *, gateway_id: str | None = None, settle_drain_s: float = SETTLE_DRAIN_S
) -> web.Application:
    """`gateway_id`: the `--id` flag's value, which overrides `gateway.id`. `settle_drain_s`:
    how long stopping waits for settles still failing (Redis down). ValueError naming the
    option if the id cannot be one (the config's own was checked when it was loaded, but a
    Config built in code was not)."""
    gid = _gateway_id(config, gateway_id)
    # Outermost: shutdown waits for, then cancels, whole requests.
    in_flight = InFlight(config.gateway.retry_jitter)
    app = web.Application(
        client_max_size=config.gateway.max_body_bytes,
        middlewares=[in_flight.middleware, openai_errors],
    )
    app[IN_FLIGHT] = in_flight
    app[CONFIG] = config
    app[GATEWAY_ID] = gid
    app[METRICS] = GatewayMetrics.of(config)
    app[OPENAPI] = orjson.dumps(openapi_document(config))
    app[SETTLE_DRAIN] = settle_drain_s
    app[ADMIN] = AdminToken(config.gateway.admin_token_sha256)
    app[BACKEND_HEADERS] = backend_credentials(config, os.environ)
    app.cleanup_ctx.append(_runtime)
    post = functools.partial(app.router.add_post, expect_handler=expect_continue)
    get = functools.partial(app.router.add_get, expect_handler=expect_continue)
    post("/v1/chat/completions", handlers.chat_completions)
    post("/v1/completions", handlers.completions)
    get("/v1/models", handlers.models)
    get("/v1/models/{model}", handlers.model)
    get("/healthz", handlers.healthz)
    get("/readyz", handlers.readyz)
    get("/metrics", handlers.metrics_endpoint)
    get("/openapi.json", handlers.openapi)
    get(ADMIN_POOLS_PATH, admin_pools)
    return app


async def _counters(config: Config) -> dict[str, TokenCounter]:
    loop = asyncio.get_running_loop()
    counters: dict[str, TokenCounter] = {}
    for name, pool in config.pools.items():
        if pool.tokenizer is None:
            # Admission decides on these counts (does the prompt fit the context, what to
            # reserve), so a pool serving another model must not get them silently.
            log.warning(
                "pool %s has no tokenizer: its prompt tokens are counted with the bundled "
                "Qwen2 tokenizer and a ChatML template, which can differ from the served "
                "model's; set the pool's `tokenizer` to the served model's tokenizer.json "
                "for exact counts", name)
        make = functools.partial(
            TokenCounter.from_path, pool.tokenizer,
            chat_format=ChatFormat(default_system_prompt=pool.default_system_prompt),
        )
        counters[name] = await loop.run_in_executor(None, make)
    return counters


def _node_client(config: Config) -> NodeClient:
    g = config.gateway
    return NodeClient(connect_timeout_s=g.upstream_connect_timeout_ms / 1000,
                      read_timeout_s=g.upstream_timeout_ms / 1000,
                      ssl_context=config.backend_ssl_context())


async def _runtime(app: web.Application) -> AsyncIterator[None]:
    config, metrics, gid = app[CONFIG], app[METRICS], app[GATEWAY_ID]
    counters = await _counters(config)
    client = connect(config.redis)
    scripts = register_scripts(client)
    try:
        await load_scripts(client, scripts)
    except STORE_ERRORS as exc:
        log.warning("Redis unavailable at start (%s at %s): not ready until it answers",
                    describe(exc), redis_address(config.redis))
    # Script calls (admit, settle, renew) go through one multiplexed connection.
    mux = None if config.redis.cluster else RedisMux(config.redis,
                                                      locate=primary_locator(client))
    hot = scripts if mux is None else scripts.via_connection(mux)
    pools = {
        name: PoolRuntime(settings, PoolStore(client, hot, name, config.pool_policy(name)),
                          counters[name], backend_headers=app[BACKEND_HEADERS][name])
        for name, settings in config.pools.items()
    }
    stores = [pool.store for pool in pools.values()]
    hub = WakeHub(client, [s.wake_channel(gid) for s in stores], metrics,
                  poll_s=config.gateway.wake_fallback_ms / 1000,
                  sharded=config.redis.sharded_pubsub)
    live = LiveTasks()
    settler = Settler(metrics, live)
    nodes = _node_client(config)
    gateway = Gateway(
        id=gid,
        config=config,
        metrics=metrics,
        tenants=TenantDirectory(config.tenants),
        pools=pools,
        redis=client,
        scripts=scripts,
        hub=hub,
        settler=settler,
        admitter=Admitter(gid, config, hub, settler, metrics),
        upstream=Upstream(nodes, metrics, jitter=config.gateway.retry_jitter,
                          whole_answer_s_per_token=(
                              config.gateway.upstream_ms_per_output_token / 1000)),
    )
    app[GATEWAY] = gateway
    stop_renewing = asyncio.Event()
    background = [
        asyncio.create_task(hub.run(), name="kvgate-wake"),
        asyncio.create_task(probe_loop_lag(metrics.loop_lag.observe), name="kvgate-loop-lag"),
        asyncio.create_task(hub.poll_forever(), name="kvgate-wake-fallback"),
        asyncio.create_task(
            renew_leases(stores, gid, config.gateway.renew_interval_ms / 1000, settler,
                         stop_renewing),
            name="kvgate-renew",
        ),
        asyncio.create_task(
            cut_stuck_requests(pools, nodes, metrics, config.gateway.renew_interval_ms / 1000,
                               stop_renewing),
            name="kvgate-stuck-nodes",
        ),
    ]
    log.info("gateway %s serving pools %s, Redis %s", gid, ", ".join(sorted(pools)),
             redis_address(config.redis))
    if problem := await version_error(client, config.redis):
        log.error("%s", problem)
    if warning := await eviction_warning(client):
        log.warning("%s", warning)
    stop_watching_gc = watch_gc(metrics.gc_pause)
    try:
        yield
    finally:
        stop_watching_gc()
        await settler.drain(app[SETTLE_DRAIN])
        hub.stop.set()
        stop_renewing.set()
        for task in background:
            task.cancel()
        _, stuck = await asyncio.wait(background, timeout=BACKGROUND_STOP_S)
        for task in stuck:
            log.warning("background task %s did not stop", task.get_name())
        await nodes.close()
        if mux is not None:
            await mux.close()
        await client.aclose()
