"""Load zones as the gateway's clients see them; the test plays the scheduler (publishes the
zone and node capacities, releases queued tasks and announces them)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from tests.gateway_harness import BIG, Harness, eventually, running_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Summarise the plot of Hamlet."}]


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> Any:
    async with running_gateway(redis_url) as harness:
        yield harness


def _chat(gw: Harness, who: str, **kwargs: Any) -> Any:
    return gw.openai(who).chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=8, **kwargs)


def _assert_429_protocol(error: openai.RateLimitError, zone: str, depth: int,
                         hint_ms: tuple[int, int], code: str = "capacity_exceeded") -> None:
    headers = error.response.headers
    retry_ms = int(headers["retry-after-ms"])
    assert hint_ms[0] <= retry_ms <= hint_ms[1]
    assert headers["retry-after"].isdigit()
    assert int(headers["retry-after"]) == -(-retry_ms // 1000)
    assert headers["x-ratelimit-backpressure-level"] == zone
    assert int(headers["x-queue-depth"]) == depth
    assert headers["content-type"].startswith("application/json")
    body = error.response.json()["error"]
    assert body["code"] == code
    assert body["retry_after_ms"] == retry_ms
    assert isinstance(body["message"], str) and body["type"]


async def test_red_rejects_normal_and_batch_and_queues_vip_until_it_clears(gw: Harness) -> None:
    # Saturated: RED and no room on the node, so even VIP cannot take the fast path.
    await gw.publish(Zone.RED, capacity=0, extra={"drain_0": 0, "drain_1": 0.5, "drain_2": 0})
    vip = asyncio.create_task(_chat(gw, "vip"))
    await eventually(lambda: _is(gw.queued(0), 1))
    for who in ("normal", "batch"):
        with pytest.raises(openai.RateLimitError) as info:
            await _chat(gw, who)
        # One VIP ahead, draining at 0.5/s: (1 + 1) / 0.5 = 4 s, plus up to 25% jitter.
        _assert_429_protocol(info.value, "RED", depth=1, hint_ms=(4000, 5000))
        assert "saturated" in info.value.response.json()["error"]["message"]
    assert not vip.done()
    await gw.publish(Zone.GREEN, capacity=BIG)
    released = await gw.release()
    assert [t.tier for t in released] == [0]
    raw = await vip
    completion = raw.parse()
    assert completion.choices[0].message.content
    await gw.settled()
    record = await gw.task(raw.headers["x-request-id"])
    assert record["state"] == "settled" and int(record["usage"]) == completion.usage.total_tokens
    assert await gw.queued(0) == 0
    samples = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_queue_wait_seconds_count", {"pool": "demo", "tier": "vip"})
    assert samples == 1
    rejected = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_rejections_total", {"pool": "demo", "tier": "batch", "reason": "zone_red"})
    assert rejected == 1


async def test_yellow_holds_batch_and_passes_vip(gw: Harness) -> None:
    await gw.publish(Zone.YELLOW, capacity=BIG)
    batch = asyncio.create_task(_chat(gw, "batch"))
    await eventually(lambda: _is(gw.queued(2), 1))
    vip = await _chat(gw, "vip")  # fast path, while Batch waits
    assert vip.parse().choices
    assert not batch.done()
    assert len(gw.backends[0].received) == 1
    released = await gw.release((0, 0, 1))
    assert [t.tier for t in released] == [2]
    assert (await batch).parse().choices
    await gw.settled()
    assert await gw.queued(2) == 0


async def test_a_lost_wake_up_is_covered_by_polling_the_task_record(gw: Harness) -> None:
    await gw.publish(Zone.YELLOW, capacity=BIG)
    batch = asyncio.create_task(_chat(gw, "batch"))
    await eventually(lambda: _is(gw.queued(2), 1))
    await gw.release(notify=False)  # released, but no message: as if pub/sub dropped it
    assert (await batch).parse().choices
    polled = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_wake_fallbacks_total", {"pool": "demo"})
    assert polled == 1


async def test_client_deadline_bounds_the_wait_and_leaves_the_queue(gw: Harness) -> None:
    await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(openai.RateLimitError) as info:
        await _chat(gw, "batch", extra_headers={"X-Request-Timeout": "0.3"})
    waited = loop.time() - started
    assert 0.3 <= waited < 2.0
    # Batch held in YELLOW, measured draining at 0 tasks/s: no room soon, the longest hint,
    # its jitter kept below the 60 s cap rather than clamped into it.
    low = int(60_000 / (1 + gw.config.gateway.retry_jitter))
    _assert_429_protocol(info.value, "YELLOW", depth=0, hint_ms=(low, 60_000))
    await gw.settled()
    assert await gw.queued(2) == 0
    assert await gw.redis.hget(gw.store.keys.tenant_queued, "batch") is None
    timeouts = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_requests_total",
        {"pool": "demo", "tier": "batch", "outcome": "queue_timeout"})
    assert timeouts == 1


async def test_expiry_announced_by_the_scheduler_answers_at_once(gw: Harness) -> None:
    await gw.freeze_clock()
    await gw.publish(Zone.YELLOW, capacity=BIG)
    batch = asyncio.create_task(_chat(gw, "batch"))  # tier timeout: 20 s
    await eventually(lambda: _is(gw.queued(2), 1))
    # Move the scripts' clock past the deadline; the release pass expires the task.
    frozen = int(await gw.redis.hget(gw.store.keys.clock, "frozen_us") or 0)
    await gw.redis.hset(gw.store.keys.clock, "frozen_us", frozen + 30_000_000)
    expired = await gw.release((0, 0, 1))
    assert [t.node for t in expired] == [None]
    with pytest.raises(openai.RateLimitError) as info:
        await asyncio.wait_for(batch, 5)
    assert info.value.response.json()["error"]["code"] == "capacity_exceeded"
    assert gw.backends[0].received == []


async def test_full_tier_queue_is_a_capacity_429(redis_url: str,
                                                redis_client: aioredis.Redis) -> None:
    def adjust(data: dict[str, Any]) -> None:
        data["tiers"]["batch"]["max_queued"] = 1

    async with running_gateway(redis_url, adjust=adjust) as gw:
        await gw.publish(Zone.YELLOW, capacity=BIG)
        first = asyncio.create_task(_chat(gw, "batch"))
        await eventually(lambda: _is(gw.queued(2), 1))
        with pytest.raises(openai.RateLimitError) as info:
            await _chat(gw, "batch")
        _assert_429_protocol(info.value, "YELLOW", depth=1, hint_ms=(1000, 1250))
        await gw.release()
        assert (await first).parse().choices


async def _is(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def test_a_release_while_the_subscription_is_down_still_completes(gw: Harness) -> None:
    await gw.publish(Zone.YELLOW, capacity=BIG)
    batch = asyncio.create_task(_chat(gw, "batch"))
    await eventually(lambda: _is(gw.queued(2), 1))
    killed = await gw.redis.client_kill_filter(_type="pubsub")
    assert killed == 1
    await gw.release()  # published while the gateway's subscriber is reconnecting
    assert (await asyncio.wait_for(batch, 5)).parse().choices
    assert await gw.queued(2) == 0


async def test_a_timed_out_request_gets_the_hint_a_rejected_one_gets_in_the_same_state(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    """Both 429 paths compute their hint by one rule: a Batch request that times out in the
    queue of a RED pool, and one rejected on arrival, see the same queue and state."""
    async with running_gateway(redis_url, retry_jitter=0.0) as gw:
        await gw.freeze_clock()  # the state's age stays 0 between the two reads
        rates = {"drain_0": 0.5, "drain_1": 0.1, "drain_2": 0.1}  # 0.7 tasks/s for Batch
        await gw.publish(Zone.YELLOW, capacity=0, extra=rates)
        vip = asyncio.create_task(_chat(gw, "vip"))  # no room: it queues, ahead of Batch
        await eventually(lambda: _is(gw.queued(0), 1))
        # Without the leader's RED estimate: the drain rule, (1 + 1) / 0.7 s rounded up; with
        # it: the estimate.
        for red_extra, expected_ms in (({}, 2_858), ({"red_clear_s": "12.5"}, 12_500)):
            await gw.publish(Zone.YELLOW, capacity=0, extra=rates)
            waiting = asyncio.create_task(
                _chat(gw, "batch", extra_headers={"X-Request-Timeout": "1"}))
            await eventually(lambda: _is(gw.queued(2), 1))
            await gw.publish(Zone.RED, capacity=0, extra={**rates, **red_extra})
            with pytest.raises(openai.RateLimitError) as timed_out:
                await waiting
            assert "waited" in timed_out.value.response.json()["error"]["message"]
            with pytest.raises(openai.RateLimitError) as rejected:
                await _chat(gw, "batch")
            assert "saturated" in rejected.value.response.json()["error"]["message"]
            for error in (timed_out.value, rejected.value):
                _assert_429_protocol(error, "RED", depth=1, hint_ms=(expected_ms, expected_ms))
        await gw.publish(Zone.GREEN, capacity=BIG)
        await gw.release()
        assert (await vip).parse().choices
