"""Per-tenant caps through a real gateway (real sockets, the session's redis-server, the test
playing the scheduler): the cap on queued tokens answers the 429 protocol with a code of the
rate_limit_exceeded family, `X-RateLimit-Scope: key` and a Retry-After from the tenant's own
drain rate; the cap on queued requests with `capacity_exceeded`, the same scope and a
Retry-After from the same drain; the cap on in-flight tokens holds the tenant's next request
in the queue while the release serves another tenant."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from tests.gateway_harness import KEYS, Harness, eventually, running_gateway, sha

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def adjust(data: dict[str, Any]) -> None:
    data["tenants"] += [
        {"name": "flood", "tier": "normal", "key_sha256": [sha(KEYS["flood"])],
         "rate": 1_000_000, "burst": 1_000, "max_queued": 100,
         "max_queued_tokens": 1_000, "max_inflight_tokens": 1_000},
        {"name": "calm", "tier": "normal", "key_sha256": [sha(KEYS["calm"])],
         "rate": 1_000_000, "burst": 1_000, "max_queued": 100},
        {"name": "few", "tier": "normal", "key_sha256": [sha(KEYS["few"])],
         "rate": 1_000_000, "burst": 1_000, "max_queued": 2},
    ]


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis,
             monkeypatch: pytest.MonkeyPatch) -> Any:
    # The harness's key table is shared by every test module: the two tenants join it for
    # this test only (another module counts its entries).
    monkeypatch.setitem(KEYS, "flood", "sk-test-flood")
    monkeypatch.setitem(KEYS, "calm", "sk-test-calm")
    monkeypatch.setitem(KEYS, "few", "sk-test-few")
    async with running_gateway(redis_url, adjust=adjust) as harness:
        yield harness


async def _start(gw: Harness, who: str, max_tokens: int) -> asyncio.Task[Any]:
    """A request sent in the background (it may wait in the queue)."""
    client = gw.openai(who)
    return asyncio.create_task(client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=max_tokens))


async def test_over_its_queued_tokens_a_tenant_gets_a_429_timed_by_its_own_drain(
        gw: Harness) -> None:
    # Real clock: the bucket (1,000 tokens, refilled at 1e6 tokens/s) is full again at once,
    # so the cap on queued tokens is what binds.
    await gw.publish(Zone.YELLOW)  # Normal never takes the fast path: everything queues
    queued = [await _start(gw, "flood", 300) for _ in range(3)]  # ~3 x 310 tokens

    async def three_queued() -> bool:
        return await gw.queued(1) == 3
    await eventually(three_queued)
    with pytest.raises(openai.RateLimitError) as info:
        await gw.openai("flood").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=300)
    headers = info.value.response.headers
    body = info.value.response.json()["error"]
    assert body["code"] == "rate_limit_exceeded_queued_tokens"
    assert body["type"] == "rate_limit_error"
    assert headers["x-ratelimit-scope"] == "key"
    assert headers["x-ratelimit-backpressure-level"] == "YELLOW"
    assert int(headers["x-queue-depth"]) == 3
    # Nothing of its queue drained yet: the hint is the floor (1 s), jittered upward.
    assert 1_000 <= int(headers["retry-after-ms"]) <= 1_250
    assert int(headers["retry-after"]) == -(-int(headers["retry-after-ms"]) // 1000)
    # One task released (~310 tokens): its drain rate is then 310 / 5 s = 62 tokens/s, decaying
    # by exp(-t / 5 s); a request of ~510 tokens is ~130 over the cap, drained in ~2.1 s or a
    # little more.
    [released] = await gw.release((0, 1, 0))
    record = await gw.task(released.task_id)
    cost = int(record["cost"])
    with pytest.raises(openai.RateLimitError) as again:
        await gw.openai("flood").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=500)
    assert again.value.response.json()["error"]["code"] == "rate_limit_exceeded_queued_tokens"
    excess = 2 * cost + (cost + 200) - 1_000  # two still queued and this one, over the cap
    exact_ms = -(-excess * 1000 * 5 // cost)
    retry_ms = int(again.value.response.headers["retry-after-ms"])
    assert exact_ms <= retry_ms <= exact_ms * 1.25 * 1.1, (exact_ms, retry_ms)
    await gw.release((0, 10, 0))
    await asyncio.gather(*queued)


async def test_at_its_queued_requests_cap_a_tenant_gets_a_429_of_its_own_scope_and_drain(
        gw: Harness) -> None:
    """The pool's own drain says nothing leaves (drain_1 = 0: a capacity hint of 60 s); the
    key's cap of 2 queued requests is its own limit, answered by its own queue's drain."""
    await gw.publish(Zone.YELLOW, extra={"drain_1": 0})  # Normal queues; the pool drains none
    queued = [await _start(gw, "few", 300) for _ in range(2)]

    async def at_cap() -> bool:
        return await gw.queued(1) == 2

    async def refused() -> openai.RateLimitError:
        with pytest.raises(openai.RateLimitError) as info:
            await gw.openai("few").chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=300)
        return info.value

    await eventually(at_cap)
    error = await refused()
    headers = error.response.headers
    body = error.response.json()["error"]
    assert body["code"] == "capacity_exceeded"
    assert "too many requests queued (2 now)" in body["message"]
    assert headers["x-ratelimit-scope"] == "key"
    assert headers["x-ratelimit-backpressure-level"] == "YELLOW"
    assert int(headers["x-queue-depth"]) == 2
    # Nothing of its queue drained yet: the floor (1 s), jittered upward; not the pool's 60 s.
    assert 1_000 <= int(headers["retry-after-ms"]) <= 1_250
    assert gw.gateway.metrics.registry.get_sample_value("kvgate_gateway_rejections_total", {
        "pool": "demo", "tier": "normal", "reason": "tenant_queue_full"}) == 1
    # One released (its drain: one task's cost per 5 s, decaying), one more queued: at the cap
    # again, a place opens once one task's cost has drained, in 5 s or a little more (the
    # drain decays with a 5 s time constant from the release: e^(t/5) more, t the seconds
    # this test takes from the release to the refusal; up to 3.5 s on a loaded machine).
    assert len(await gw.release((0, 1, 0))) == 1
    queued.append(await _start(gw, "few", 300))
    await eventually(at_cap)
    retry_ms = int((await refused()).response.headers["retry-after-ms"])
    assert 5_000 <= retry_ms <= 5_000 * 1.25 * 2, retry_ms  # far from the pool's 60 s
    await gw.release((0, 10, 0))
    await asyncio.gather(*queued)


async def test_at_its_in_flight_cap_a_tenant_waits_while_another_is_released(
        gw: Harness) -> None:
    gw.backends[0].hold_after = 1  # streams stay open (in flight) until the gate opens
    await gw.publish(Zone.YELLOW)

    async def stream(who: str) -> int:
        client = gw.openai(who)
        chunks = 0
        async for _ in await client.chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=400, stream=True):
            chunks += 1
        return chunks

    first = [asyncio.create_task(stream("flood")) for _ in range(2)]

    async def queued(n: int) -> bool:
        return await gw.queued(1) == n
    await eventually(lambda: queued(2))
    assert len(await gw.release((0, 10, 0))) == 2  # ~2 x 420 tokens: under the 1,000 cap
    await gw.backends[0].held.wait()
    third = asyncio.create_task(stream("flood"))
    await eventually(lambda: queued(1))
    other = asyncio.create_task(stream("calm"))
    await eventually(lambda: queued(2))
    # The pool has room for both, but flood is at its cap: only calm's request is released.
    released = await gw.release((0, 10, 0))
    assert [(await gw.task(r.task_id))["tenant"] for r in released] == ["calm"]
    assert await gw.queued(1) == 1
    gw.backends[0].gate.set()
    await asyncio.gather(*first, other)
    await gw.settled()
    [last] = await gw.release((0, 10, 0))
    assert (await gw.task(last.task_id))["tenant"] == "flood"
    assert await third > 0
