"""The gateway and the scheduler on a real 3-master Redis Cluster, as deployed with
`redis.cluster = true` and `redis.sharded_pubsub = true`: two model pools whose keys live on
different shards, requests through the gateway with the `openai` SDK on both pools, on the fast
path and queued (held in YELLOW, released by the scheduler, woken over sharded pub/sub).

Each pool's backend is an instant vLLM-speaking server whose `/metrics` page is a `FakeVllm`
the test sets, so the scheduler polls the same URL the gateway sends requests to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer
from redis.asyncio.cluster import RedisCluster

from admission.config import Config, parse_config
from admission.keys import PoolKeys, SchedulerKeys
from admission.tiers import Tier
from bench.common.instant_backend import InstantBackend
from bench.common.localredis import LocalCluster, start_cluster
from gateway.app import create_app as create_gateway
from gateway.state import GATEWAY
from gateway.state import Gateway as GatewayRuntime
from scheduler.app import SERVICE
from scheduler.app import create_app as create_scheduler
from scheduler.service import SchedulerService
from tests.gateway_harness import KEYS, serve_app, sha
from tests.scheduler_stub import FakeVllm

# Hash tags on slots owned by different primaries of a 3-way split (tests/test_core_cluster.py).
POOLS = ("llama", "qwen")
GATEWAY_ID = "gw-c1"
IDLE, BUSY = 0.10, 0.75
"""KV usage figures: GREEN, and YELLOW (between yellow 0.70 and red 0.85), which holds Batch."""


@pytest.fixture
def client(cluster_client: RedisCluster) -> RedisCluster:
    return cluster_client


def cluster_config(
    redis_url: str, backends: dict[str, str], *, sharded: bool = True, leader_ttl_ms: int = 1500
) -> Config:
    tenant = {"rate": 1_000_000, "burst": 1_000_000, "max_queued": 100}
    return parse_config({
        "redis": {"url": redis_url, "cluster": True, "sharded_pubsub": sharded},
        # A long fallback period: a queued request that is not woken by its message waits
        # seconds, and the fallback counter shows it.
        "gateway": {"wake_fallback_ms": 10_000, "renew_interval_ms": 1000,
                    "lease_ttl_ms": 5000},
        "scheduler": {"poll_interval_ms": 25, "leader_ttl_ms": leader_ttl_ms},
        "pools": [{
            "name": pool, "default_max_tokens": 16, "stale_after_ms": 0,
            "backends": [{"name": f"gpu-{pool}", "url": url}],
        } for pool, url in backends.items()],
        "tenants": [
            {"name": who, "tier": who, "key_sha256": [sha(KEYS[who])], **tenant}
            for who in ("vip", "normal", "batch")
        ],
    }, env={})


@asynccontextmanager
async def serve_node(backend: InstantBackend, fake: FakeVllm) -> AsyncIterator[str]:
    """The instant backend, with `fake` answering `/metrics`."""

    @web.middleware
    async def fake_metrics(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/metrics":
            return web.Response(text=fake.render(), content_type="text/plain")
        response: web.StreamResponse = await handler(request)
        return response

    app = backend.app()
    app.middlewares.append(fake_metrics)
    async with serve_app(app) as url:
        yield url


@dataclass
class Stack:
    config: Config
    redis: RedisCluster
    gateway_app: web.Application
    gateway_server: TestServer
    scheduler_app: web.Application
    scheduler_server: TestServer
    fakes: dict[str, FakeVllm]
    backends: dict[str, InstantBackend]
    sdks: list[openai.AsyncOpenAI] = field(default_factory=list)

    @property
    def gateway(self) -> GatewayRuntime:
        return self.gateway_app[GATEWAY]

    @property
    def scheduler(self) -> SchedulerService:
        return self.scheduler_app[SERVICE]

    def sdk(self, who: str) -> openai.AsyncOpenAI:
        url = str(self.gateway_server.make_url("/v1"))
        client = openai.AsyncOpenAI(base_url=url, api_key=KEYS[who], max_retries=0,
                                    timeout=10)
        self.sdks.append(client)
        return client

    async def zone(self, pool: str) -> str | None:
        raw = await self.redis.hget(PoolKeys(pool).state, "zone")
        return _text(raw) if raw is not None else None

    async def stats(self, pool: str) -> dict[str, int]:
        raw = await self.redis.hgetall(PoolKeys(pool).stats)
        return {_text(k): int(v) for k, v in raw.items()}

    def fallbacks(self, pool: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(
            "kvgate_gateway_wake_fallbacks_total", {"pool": pool})
        return value or 0.0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def owner_port(client: RedisCluster, key: str) -> int:
    node = client.get_node_from_key(key)
    assert node is not None
    return int(node.port)


async def until(check: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    """Until the coroutine function `check` returns true (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not await check():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def running_stack(
    cluster: LocalCluster, redis: RedisCluster, *, sharded: bool = True,
    leader_ttl_ms: int = 1500,
) -> AsyncIterator[Stack]:
    fakes = {pool: FakeVllm(usage=IDLE) for pool in POOLS}
    backends = {pool: InstantBackend(model=pool, output_tokens=4) for pool in POOLS}
    async with AsyncExitStack() as stack:
        urls = {pool: await stack.enter_async_context(serve_node(backends[pool], fakes[pool]))
                for pool in POOLS}
        config = cluster_config(cluster.url, urls, sharded=sharded,
                                leader_ttl_ms=leader_ttl_ms)
        scheduler_app = create_scheduler(config, me="sched-1")
        scheduler_server = TestServer(scheduler_app, host="127.0.0.1")
        await scheduler_server.start_server()
        stack.push_async_callback(scheduler_server.close)
        gateway_app = create_gateway(config, gateway_id=GATEWAY_ID, settle_drain_s=0.5)
        gateway_server = TestServer(gateway_app, host="127.0.0.1")
        await gateway_server.start_server()
        stack.push_async_callback(gateway_server.close)
        s = Stack(config, redis, gateway_app, gateway_server, scheduler_app, scheduler_server,
                  fakes, backends)
        try:
            await asyncio.wait_for(s.gateway.hub.subscribed.wait(), 5)

            async def published() -> bool:
                return all([await s.zone(p) == "GREEN" for p in POOLS])

            await until(published)
            yield s
        finally:
            for sdk in s.sdks:
                await sdk.close()


async def test_pools_live_on_different_shards_and_the_mux_is_not_used(
    cluster: LocalCluster, client: RedisCluster
) -> None:
    async with running_stack(cluster, client) as s:
        assert len({owner_port(client, PoolKeys(p).state) for p in POOLS}) == 2
        # No multiplexed connection on a cluster: the admission scripts are redis-py's.
        for pool in s.gateway.pools.values():
            assert pool.store.scripts.admit.transport is pool.store.client
        async with aiohttp.ClientSession() as http:
            async with http.get(s.gateway_server.make_url("/readyz")) as ready:
                assert ready.status == 200, await ready.text()
            async with http.get(s.scheduler_server.make_url("/healthz")) as health:
                body = await health.json()
        assert body["leading"] is True
        assert {p: body["pools"][p]["zone"] for p in POOLS} == {p: "GREEN" for p in POOLS}


async def test_fast_path_on_both_pools(cluster: LocalCluster, client: RedisCluster) -> None:
    async with running_stack(cluster, client) as s:
        sdk = s.sdk("normal")
        for pool in POOLS:
            reply = await sdk.chat.completions.create(
                model=pool, messages=[{"role": "user", "content": f"hello {pool}"}])
            assert reply.usage is not None and reply.usage.completion_tokens == 4
            assert len(s.backends[pool].received) == 1
        await s.gateway.settler.idle()
        for pool in POOLS:
            stats = await s.stats(pool)
            assert stats.get("fast_path") == 1 and stats.get("settled") == 1
            assert await client.hgetall(PoolKeys(pool).node_reserved) in ({}, {
                f"gpu-{pool}".encode(): b"0"})


async def queue_and_release(s: Stack, client: RedisCluster) -> None:
    """A Batch request per pool, held in the queue while the pools are YELLOW, released by the
    scheduler when they turn GREEN, its gateway woken by the message (not the fallback)."""
    for fake in s.fakes.values():
        fake.usage = BUSY

    async def yellow() -> bool:
        return all([await s.zone(p) == "YELLOW" for p in POOLS])

    await until(yellow)
    before = {pool: await s.stats(pool) for pool in POOLS}
    fallbacks = {pool: s.fallbacks(pool) for pool in POOLS}
    sdk = s.sdk("batch")
    calls = {
        pool: asyncio.create_task(sdk.chat.completions.create(
            model=pool, messages=[{"role": "user", "content": "later"}]))
        for pool in POOLS
    }

    async def both_queued() -> bool:
        return all([await client.zcard(PoolKeys(p).queue(Tier.BATCH)) == 1 for p in POOLS])

    await until(both_queued)
    await asyncio.sleep(0.2)  # several ticks in YELLOW: Batch stays queued
    assert not any(call.done() for call in calls.values())
    loop = asyncio.get_running_loop()
    started = loop.time()
    for fake in s.fakes.values():
        fake.usage = IDLE
    replies = await asyncio.wait_for(asyncio.gather(*calls.values()), 5)
    assert loop.time() - started < 2.0  # far below the 10 s fallback period
    for pool, reply in zip(calls, replies, strict=True):
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        assert s.fallbacks(pool) == fallbacks[pool], "woken by the fallback, not a message"
        stats = await s.stats(pool)
        assert stats.get("released_2", 0) == before[pool].get("released_2", 0) + 1
        assert stats.get("fast_path", 0) == before[pool].get("fast_path", 0)


async def test_queued_requests_are_woken_over_sharded_pubsub(
    cluster: LocalCluster, client: RedisCluster
) -> None:
    async with running_stack(cluster, client) as s:
        # The wake channels are shard channels on the pools' own primaries.
        for pool in POOLS:
            channel = PoolKeys(pool).wake_channel(GATEWAY_ID)
            node = client.get_node_from_key(channel)
            shard = await client.execute_command("PUBSUB", "SHARDCHANNELS", target_nodes=node)
            assert channel.encode() in shard
            for primary in client.get_primaries():
                classic = await client.execute_command("PUBSUB", "CHANNELS",
                                                       target_nodes=primary)
                assert channel.encode() not in classic
        await queue_and_release(s, client)


async def test_classic_pubsub_on_a_cluster(cluster: LocalCluster, client: RedisCluster) -> None:
    async with running_stack(cluster, client, sharded=False) as s:
        await queue_and_release(s, client)


async def test_the_gateway_resubscribes_after_its_shard_connections_are_killed(
    cluster: LocalCluster, client: RedisCluster
) -> None:
    async with running_stack(cluster, client) as s:
        for pool in POOLS:
            owner = client.get_node_from_key(PoolKeys(pool).wake_channel(GATEWAY_ID))
            killed = await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub",
                                                  target_nodes=owner)
            assert int(killed) >= 1

        async def resubscribed() -> bool:
            # Both listeners heard their new subscription confirmed (redis-py may reconnect a
            # shard connection by itself; either way the confirmation comes again).
            return s.gateway.hub.subscribed.is_set()

        await until(resubscribed)
        await queue_and_release(s, client)


async def numsub(host: str, port: int, channel: str) -> int:
    """Subscribers of a classic channel on one cluster node, asked of that node alone (the
    cluster client's parsing of a targeted PUBSUB NUMSUB differs between redis-py releases)."""
    node = aioredis.Redis(host=host, port=port)
    try:
        reply = await node.pubsub_numsub(channel)
    finally:
        await node.aclose()
    return sum(int(n) for _, n in reply)


async def test_a_resigning_leader_hands_over_on_the_cluster(
    cluster: LocalCluster, client: RedisCluster
) -> None:
    # A 6 s lease: a standby retries every 2 s on its own, so taking over well within a second
    # of the resignation means it heard the handover (a classic channel: any node relays it).
    async with running_stack(cluster, client, leader_ttl_ms=6000) as s:
        standby_app = create_scheduler(s.config, me="sched-2")
        standby = TestServer(standby_app, host="127.0.0.1")
        await standby.start_server()
        try:
            async def both_listening() -> bool:
                total = 0
                for node in client.get_primaries():
                    total += await numsub(node.host, int(node.port), SchedulerKeys().handover)
                elector = standby_app[SERVICE].elector
                return total == 2 and elector is not None and elector.holder == "sched-1"

            await until(both_listening)
            assert not standby_app[SERVICE].leading
            loop = asyncio.get_running_loop()
            started = loop.time()
            await s.scheduler.stop()  # resigns and publishes the handover

            async def taken_over() -> bool:
                return standby_app[SERVICE].leading

            await until(taken_over, within_s=3)
            assert loop.time() - started < 1.0
            await queue_and_release(s, client)  # the new leader releases and wakes
        finally:
            await standby.close()


async def test_a_cluster_that_goes_down_is_an_outage_for_both_services() -> None:
    """Every node of the cluster stops under a running stack. redis-py's cluster client then
    raises RedisClusterUnreachableError, a RedisClusterException and no RedisError: the
    scheduler's tick and leadership loops must count it and go on (caught as RedisError alone
    it ended them: only a restart brought the replica back), and the gateway must answer
    503 `admission_unavailable`, not 500 `internal_error`. A private cluster: the module's
    own serves the other tests."""
    private = start_cluster(3)
    stopped = False
    redis = RedisCluster.from_url(private.url)
    try:
        await redis.initialize()
        async with running_stack(private, redis) as s:
            assert s.scheduler.leading
            private.stop()
            stopped = True
            elector = s.scheduler.elector
            assert elector is not None

            async def failing() -> bool:
                return elector.failures >= 5 and all(
                    p in s.scheduler._redis_failed_at for p in POOLS)

            await until(failing, within_s=15)
            sdk = s.sdk("normal")
            for _ in range(3):
                with pytest.raises(openai.InternalServerError) as info:
                    await sdk.chat.completions.create(
                        model=POOLS[0], messages=[{"role": "user", "content": "hello"}])
                assert info.value.status_code == 503
                assert info.value.response.json()["error"]["code"] == "admission_unavailable"
            failures = elector.failures

            async def still_trying() -> bool:  # the leadership loop goes on, with its backoff
                return elector.failures > failures

            await until(still_trying, within_s=15)
            assert s.scheduler.ended_loops == []
            async with aiohttp.ClientSession() as http:
                async with http.get(s.scheduler_server.make_url("/healthz")) as health:
                    assert health.status == 200, await health.text()
                async with http.get(s.gateway_server.make_url("/readyz")) as ready:
                    assert ready.status == 503
    finally:
        await redis.aclose()
        if not stopped:
            private.stop()
