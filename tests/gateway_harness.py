"""Shared set-up of the gateway tests: a real gateway on a real socket (aiohttp TestServer,
handler cancellation on), instant vLLM-speaking backends on real sockets, the session's
redis-server, and the test playing the scheduler (publish a zone, release, notify)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Set
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

from admission.config import Config, parse_config
from admission.outcomes import ReleasedTask
from admission.scripts import register_scripts
from admission.store import PoolStore
from admission.tiers import Zone
from bench.common.instant_backend import InstantBackend
from gateway.app import create_app
from gateway.state import GATEWAY
from gateway.state import Gateway as GatewayRuntime

ROOT = Path(__file__).resolve().parent.parent
POOL = "demo"
EPOCH = 1
BIG = 10_000_000

KEYS = {
    "vip": "sk-test-vip",
    "normal": "sk-test-normal",
    "batch": "sk-test-batch",
    "small": "sk-test-small",
    "frozen": "sk-test-frozen",
}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config_data(redis_url: str, backend_urls: list[str], **gateway: Any) -> dict[str, Any]:
    """A full config as parsed TOML; tests adjust sections before `parse_config`."""
    tenant = {"rate": 1_000_000, "burst": 1_000_000, "max_queued": 100}
    return {
        "redis": {"url": redis_url},
        "gateway": {"wake_fallback_ms": 100, "renew_interval_ms": 1000, "lease_ttl_ms": 5000,
                    **gateway},
        "tiers": {"vip": {"queue_timeout_ms": 20_000}, "normal": {"queue_timeout_ms": 20_000},
                  "batch": {"queue_timeout_ms": 20_000}},
        "pools": [{
            "name": POOL,
            "context_length": 4096,
            "default_max_tokens": 64,
            "max_max_tokens": 1024,
            "stale_after_ms": 0,
            "backends": [{"name": f"node-{i}", "url": url} for i, url in enumerate(backend_urls)],
        }],
        "tenants": [
            {"name": "vip", "tier": "vip", "key_sha256": [sha(KEYS["vip"])], **tenant},
            {"name": "normal", "tier": "normal", "key_sha256": [sha(KEYS["normal"])], **tenant},
            {"name": "batch", "tier": "batch", "key_sha256": [sha(KEYS["batch"])], **tenant},
            # 1,000-token bucket refilled at 10 tokens/s: quota rejections with long hints.
            {"name": "small", "tier": "normal", "key_sha256": [sha(KEYS["small"])],
             "rate": 10, "burst": 1000, "max_queued": 10},
            # Never refills: once spent, no retry can succeed.
            {"name": "frozen", "tier": "normal", "key_sha256": [sha(KEYS["frozen"])],
             "rate": 0, "burst": 1000, "max_queued": 10},
        ],
    }


async def open_held_stream(http: aiohttp.ClientSession, url: str, key: str, *, content: str,
                           max_tokens: int) -> tuple[str, aiohttp.ClientResponse]:
    """A streamed chat through the gateway at `url`, read until two chunks arrived (the node
    then holds it): its X-Request-Id and the response, still open."""
    response = await http.post(url + "/v1/chat/completions", json={
        "model": POOL, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "stream": True}, headers={"Authorization": f"Bearer {key}"})
    assert response.status == 200
    events = 0
    while events < 2:
        line = await asyncio.wait_for(response.content.readline(), 5)
        events += line.startswith(b"data: {")
    return response.headers["X-Request-Id"], response


async def start_gateway_process(config: Path, redis_url: str, *args: str
                                ) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m gateway --config CONFIG --port 0 ARGS` with `REDIS_URL`, its stdout and
    stderr piped; returns once it printed its listening line: (process, base URL). Stopping it
    is the caller's (SIGTERM and what the test reads after it differ from test to test)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--config", str(config), "--port", "0", *args,
        cwd=ROOT, env={**os.environ, "REDIS_URL": redis_url},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert "listening on http://" in line, line
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return process, line.rsplit(" ", 1)[1].strip()


@asynccontextmanager
async def serve_app(app: web.Application, *, before_cleanup: Callable[[], None] | None = None,
                    ) -> AsyncIterator[str]:
    """`app` on a free loopback port; yields its base URL. `before_cleanup` runs before the
    runner stops (to release what would hold a handler open)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        if before_cleanup is not None:
            before_cleanup()
        await runner.cleanup()


@asynccontextmanager
async def serve_backend(backend: InstantBackend) -> AsyncIterator[str]:
    # The gate: let any held stream finish so the runner can stop.
    async with serve_app(backend.app(), before_cleanup=backend.gate.set) as url:
        yield url


@dataclass
class Harness:
    config: Config
    app: web.Application
    server: TestServer
    redis: aioredis.Redis
    store: PoolStore
    backends: list[InstantBackend]
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def gateway(self) -> GatewayRuntime:
        return self.app[GATEWAY]

    def openai(self, who: str = "vip", **kwargs: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEYS.get(who, who),
                                    max_retries=0, **kwargs)
        self.clients.append(client)
        return client

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[who]}"}

    async def publish(self, zone: Zone, capacity: int = BIG,
                      extra: Mapping[str, str | int | float] | None = None) -> None:
        nodes = {f"node-{i}": capacity for i in range(len(self.backends))}
        await self.store.publish_state(EPOCH, zone, nodes, extra)

    async def release(self, limits: tuple[int, int, int] = (100, 100, 100),
                      *, notify: bool = True) -> list[ReleasedTask]:
        released = await self.store.release(EPOCH, limits)
        if notify:
            await self.store.notify(released)
        return released

    async def freeze_clock(self) -> None:
        """Stop the scripts' clock: buckets stop refilling, so balances are exact."""
        seconds, micros = await self.redis.time()
        await self.redis.hset(self.store.keys.clock, "frozen_us", seconds * 1_000_000 + micros)

    async def queued(self, tier: int) -> int:
        keys = self.store.keys
        return int(await self.redis.zcard(keys.queues[tier]))

    async def bucket(self, tenant: str) -> float:
        raw = await self.redis.hget(self.store.keys.bucket_key(tenant), "micro_tokens")
        return int(raw) / 1_000_000 if raw is not None else float("nan")

    async def task(self, task_id: str) -> dict[str, str]:
        record = await self.store.task(task_id)
        assert record is not None, f"no record for task {task_id}"
        return record

    async def settled(self) -> None:
        await self.gateway.settler.idle()

    async def new_task_deadline_s(self, before: Set[str]) -> float:
        """Seconds, by Redis's clock, until the deadline of the one task the gateway holds
        that is not in `before` (a `settler.live.snapshot()` taken before sending it), once
        it is there."""
        live = self.gateway.settler.live

        async def one_more() -> bool:
            return len(live.snapshot() - before) == 1

        await eventually(one_more)
        [task_id] = live.snapshot() - before
        record = await self.task(task_id)
        seconds, micros = await self.redis.time()
        return (int(record["deadline_us"]) - seconds * 1_000_000 - micros) / 1e6


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 5.0,
                     interval_s: float = 0.01) -> None:
    """Until `check()` holds: for conditions only observable in Redis or over a socket."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not await check():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def running_gateway(
    redis_url: str,
    *,
    backends: int = 1,
    adjust: Callable[[dict[str, Any]], None] | None = None,
    backend_options: Mapping[str, Any] | None = None,
    wait_subscribed: bool = True,
    **gateway: Any,
) -> AsyncIterator[Harness]:
    options = {"model": POOL, "max_model_len": 4096, **(backend_options or {})}
    instants = [InstantBackend(**options) for _ in range(backends)]
    async with _backends(instants) as urls:
        data = config_data(redis_url, urls, **gateway)
        if adjust is not None:
            adjust(data)
        config = parse_config(data, env={})
        app = create_app(config, gateway_id="gw-test", settle_drain_s=0.5)
        server = TestServer(app, host="127.0.0.1")
        client = aioredis.Redis.from_url(redis_url)
        store = PoolStore(client, register_scripts(client), POOL, config.pool_policy(POOL))
        harness = Harness(config, app, server, client, store, instants)
        await server.start_server()
        try:
            if wait_subscribed:
                await app[GATEWAY].hub.subscribed.wait()
            yield harness
        finally:
            for sdk in harness.clients:
                await sdk.close()
            await server.close()
            await client.aclose()


@asynccontextmanager
async def _backends(instants: list[InstantBackend]) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_backend(b)) for b in instants]


@asynccontextmanager
async def hostile_gateway(
    redis_url: str, node: Callable[[web.Request], Awaitable[web.StreamResponse]], **gateway: Any
) -> AsyncIterator[tuple[str, Any]]:
    """A gateway whose one node answers every generation with `node`; yields (URL, harness
    pieces: the app) with the pool GREEN and room everywhere."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", node)
    async with serve_app(app) as node_url:
        config = parse_config(config_data(redis_url, [node_url], **gateway), env={})
        gw_app = create_app(config, gateway_id="gw-audit", settle_drain_s=0.5)
        async with serve_app(gw_app) as url:
            gw = gw_app[GATEWAY]
            await gw.hub.subscribed.wait()
            store = gw.pools[POOL].store
            await store.publish_state(1, Zone.GREEN, {"node-0": BIG})
            yield url, gw_app


def queued_tokens_tenant(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], None]:
    """A `running_gateway` adjustment adding tenant "flood" (Normal, a cap of 1,000 queued
    tokens), whose key joins `KEYS` for the calling test only: the table is shared by every
    test module."""
    monkeypatch.setitem(KEYS, "flood", "sk-test-flood")

    def adjust(data: dict[str, Any]) -> None:
        data["tenants"].append(
            {"name": "flood", "tier": "normal", "key_sha256": [sha(KEYS["flood"])],
             "rate": 1_000_000, "burst": 1_000, "max_queued": 100, "max_queued_tokens": 1_000})
    return adjust

