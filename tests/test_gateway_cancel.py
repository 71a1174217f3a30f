"""Requests that end early never leak budget: client gone while queued or mid-stream, node
failing or unreachable. Clock frozen, so bucket balances are exact."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from admission.outcomes import AdmitOutcome
from admission.tiers import Tier, Zone
from bench.common.localredis import free_port
from tests.gateway_harness import BIG, Harness, eventually, running_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Write a long story about a lighthouse."}]


async def _state(gw: Harness, task_id: str) -> str:
    record = await gw.store.task(task_id)
    return record["state"] if record else "unknown"


async def _baseline(gw: Harness, who: str) -> float:
    """Make the tenant's bucket exist (one finished request) and return its level."""
    await gw.publish(Zone.GREEN, BIG)
    await gw.openai(who).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
    await gw.settled()
    return await gw.bucket(who)


async def test_disconnect_while_queued_removes_the_task_at_once(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with running_gateway(redis_url) as gw, aiohttp.ClientSession() as http:
        await gw.freeze_clock()
        before = await _baseline(gw, "batch")
        await gw.publish(Zone.YELLOW, BIG)  # Batch has no fast path in YELLOW: it queues
        request = asyncio.create_task(http.post(
            gw.url + "/v1/chat/completions", headers=gw.auth("batch"),
            json={"model": "demo", "messages": MESSAGES, "max_tokens": 100}))
        await eventually(lambda: _equals(gw.queued(2), 1))
        head = (await gw.redis.zrange(gw.store.keys.queues[2], 0, 0))[0]
        assert isinstance(head, bytes)
        task_id = head.decode()
        cost = int((await gw.task(task_id))["cost"])
        assert await gw.bucket("batch") == before - cost  # reserved while queued
        assert int(await gw.redis.hget(gw.store.keys.tenant_queued, "batch") or 0) == 1

        request.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await request
        await eventually(lambda: _equals(gw.queued(2), 0))
        await gw.settled()
        assert await _state(gw, task_id) == "cancelled"
        assert await gw.bucket("batch") == before
        assert await gw.redis.hget(gw.store.keys.tenant_queued, "batch") is None
        assert gw.backends[0].received[-1].body["max_tokens"] == 1  # never forwarded
        assert await gw.redis.scard(gw.store.keys.gateway_tasks_key("gw-test")) == 0
        # Counted as the client's leaving, not as a rejection (no 429 was sent).
        registry = gw.gateway.metrics.registry

        async def counted() -> bool:  # the handler's last step, after the cancellation's
            return registry.get_sample_value("kvgate_gateway_requests_total", {
                "pool": "demo", "tier": "batch", "outcome": "client_gone"}) == 1

        await eventually(counted)
        assert not registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "demo", "tier": "batch", "outcome": "rejected"})


async def test_disconnect_mid_stream_aborts_upstream_and_settles_partial_usage(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with running_gateway(redis_url, backend_options={"hold_after": 3}) as gw, \
            aiohttp.ClientSession() as http:
        await gw.freeze_clock()
        await gw.publish(Zone.GREEN, BIG)
        backend = gw.backends[0]
        response = await http.post(
            gw.url + "/v1/chat/completions", headers=gw.auth("normal"),
            json={"model": "demo", "messages": MESSAGES, "max_tokens": 200, "stream": True})
        assert response.status == 200
        task_id = response.headers["X-Request-Id"]
        await backend.held.wait()  # three tokens generated, the node now waits on the gate
        tokens = 0
        while tokens < 3:
            line = await response.content.readline()
            if line.startswith(b"data: {") and b'"content":" t' in line:
                tokens += 1
        response.close()  # the client leaves mid-stream
        await asyncio.wait_for(backend.aborted.wait(), 5)  # the node's request was aborted
        await eventually(lambda: _differs(_state(gw, task_id), "released"))
        await gw.settled()
        record = await gw.task(task_id)
        prompt = gw.gateway.pools["demo"].counter.count_chat(MESSAGES)
        assert record["state"] == "cancelled"
        assert int(record["usage"]) == prompt + 3 < int(record["cost"]) == prompt + 200
        assert await gw.bucket("normal") == 1_000_000 - (prompt + 3)
        assert await gw.redis.hget(gw.store.keys.node_reserved, "node-0") is None
        # A client that leaves is not a node that broke off its stream.
        assert gw.gateway.metrics.registry.get_sample_value(
            "kvgate_gateway_upstream_errors_total",
            {"pool": "demo", "node": "node-0", "kind": "broken_stream"}) == 0


async def test_node_error_is_a_502_with_retry_after_and_refunds(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with running_gateway(redis_url, backend_options={"fail_status": 500}) as gw:
        await gw.freeze_clock()
        await gw.publish(Zone.GREEN, BIG)
        with pytest.raises(openai.InternalServerError) as info:
            await gw.openai("vip").chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=10)
        assert info.value.status_code == 502
        headers = info.value.response.headers
        assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1000
        assert info.value.response.json()["error"]["code"] == "upstream_error"
        await gw.settled()
        record = await gw.task(headers["x-request-id"])
        assert record["state"] == "cancelled" and "usage" not in record  # nothing charged
        assert await gw.bucket("vip") == 1_000_000
        assert await gw.redis.hget(gw.store.keys.node_reserved, "node-0") is None


async def test_unreachable_node_is_a_503_and_refunds(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    def adjust(data: dict[str, Any]) -> None:
        data["pools"][0]["backends"] = [{"name": "node-0", "url": dead}]

    async with running_gateway(redis_url, adjust=adjust) as gw:
        await gw.freeze_clock()
        await gw.publish(Zone.GREEN, BIG)
        with pytest.raises(openai.InternalServerError) as info:
            await gw.openai("vip").chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=10)
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["code"] == "upstream_unreachable"
        assert "retry-after" in info.value.response.headers
        await gw.settled()
        assert await gw.bucket("vip") == 1_000_000
        assert await gw.redis.hget(gw.store.keys.node_reserved, "node-0") is None
        errors = gw.gateway.metrics.registry.get_sample_value(
            "kvgate_gateway_upstream_errors_total",
            {"pool": "demo", "node": "node-0", "kind": "unreachable"})
        assert errors == 1


async def _equals(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def _differs(value: Any, unexpected: str) -> bool:
    return bool(await value != unexpected)


async def test_a_task_the_process_does_not_hold_is_cancelled_by_the_lease_sweep(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    # As if an admit ran in Redis but its reply never reached the gateway.
    async with running_gateway(redis_url, renew_interval_ms=100) as gw:
        await gw.publish(Zone.YELLOW, BIG)
        waiting = asyncio.create_task(gw.openai("batch").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=5))  # a live, queued request
        await eventually(lambda: _equals(gw.queued(2), 1))
        tenant = gw.config.tenants[1].quota
        orphan = await gw.store.admit(task_id="lost-reply", tenant=tenant, tier=Tier.NORMAL,
                                      prompt_tokens=10, max_tokens=10, gateway="gw-test",
                                      queue_timeout_ms=60_000)
        assert orphan.outcome is AdmitOutcome.QUEUED
        await eventually(lambda: _differs(_state(gw, "lost-reply"), "queued"))
        assert await _state(gw, "lost-reply") == "cancelled"
        assert await gw.queued(1) == 0
        assert await gw.queued(2) == 1  # the live request was left alone
        assert gw.gateway.metrics.registry.get_sample_value(
            "kvgate_gateway_orphans_total", {"pool": "demo"}) == 1
        await gw.release()
        assert (await waiting).choices
