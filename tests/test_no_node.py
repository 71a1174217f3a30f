"""A pool RED because none of its nodes is usable is an outage, not a full cache, and its 429s
say so: the leader publishes `pool_usage` empty, the admit script answers reason `no_node`
instead of `zone_red`, and the gateway's message names the cause. Both are still the 429
protocol's `capacity_exceeded` with a RED backpressure level: clients back off the same way.

The real pool scheduler ticks against real Redis and stand-in vLLM servers on loopback; the
gateway test publishes the state the leader publishes (the harness plays the scheduler)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from admission.outcomes import AdmitOutcome, RejectReason
from admission.tiers import Tier, Zone
from tests.gateway_harness import BIG, Harness, running_gateway
from tests.scheduler_stub import FakeVllm, admit, always, make_config, pool_scheduler, serve_fake


async def test_the_leader_of_a_pool_with_no_usable_node_makes_admit_say_no_node(
    redis_client: Any, redis_url: str
) -> None:
    n1, n2 = FakeVllm(usage=0.3), FakeVllm(usage=0.3)
    async with serve_fake(n1) as u1, serve_fake(n2) as u2:
        config = make_config(redis_url, [{"name": "n1", "url": u1}, {"name": "n2", "url": u2}],
                             scheduler={"eject_after_failures": 2})
        async with pool_scheduler(redis_client, config) as ps:
            store = ps.store
            await ps.tick(1, always)
            n1.status = n2.status = 503
            for _ in range(2):
                await ps.tick(1, always)
            state = await store.published_state()
            assert state["zone"] == "RED" and state["pool_usage"] == ""
            normal = await admit(store, "a1", Tier.NORMAL, 100)
            assert (normal.outcome, normal.reason) == (AdmitOutcome.REJECTED,
                                                       RejectReason.NO_NODE)
            assert normal.retry_after_ms is not None and normal.retry_after_ms > 0
            vip = await admit(store, "a2", Tier.VIP, 100)
            assert vip.outcome is AdmitOutcome.QUEUED  # VIP waits for a node to come back

            # RED with nodes that answer and a full cache: the usual reason.
            n1.status = n2.status = 200
            n1.usage = n2.usage = 0.95
            await ps.tick(1, always)
            state = await store.published_state()
            assert state["zone"] == "RED" and float(state["pool_usage"]) >= 0.9
            full = await admit(store, "a3", Tier.BATCH, 100)
            assert (full.outcome, full.reason) == (AdmitOutcome.REJECTED, RejectReason.ZONE_RED)


async def test_a_pool_without_backends_is_published_red_with_no_node(
    redis_client: Any, redis_url: str
) -> None:
    """Nothing to hear from is no reason to wait: without a published state every request
    would queue until its tier's timeout before its 429."""
    config = make_config(redis_url, [])
    async with pool_scheduler(redis_client, config) as ps:
        await ps.tick(1, always)
        state = await ps.store.published_state()
        assert state["zone"] == "RED" and state["pool_usage"] == ""
        normal = await admit(ps.store, "a1", Tier.NORMAL, 100)
        assert (normal.outcome, normal.reason) == (AdmitOutcome.REJECTED, RejectReason.NO_NODE)


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> Any:
    async with running_gateway(redis_url) as harness:
        yield harness


@pytest.mark.parametrize(("pool_usage", "reason", "words"), [
    ("", "no_node", "No inference node"),
    ("0.9100", "zone_red", "saturated"),
])
async def test_a_red_429_names_its_cause(gw: Harness, pool_usage: str, reason: str,
                                         words: str) -> None:
    await gw.publish(Zone.RED, capacity=BIG, extra={"pool_usage": pool_usage})
    with pytest.raises(openai.RateLimitError) as info:
        await gw.openai("normal").chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    error = info.value.response.json()["error"]
    assert error["code"] == "capacity_exceeded" and words in error["message"]
    assert info.value.response.headers["x-ratelimit-backpressure-level"] == "RED"
    assert int(info.value.response.headers["retry-after-ms"]) > 0
    counted = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_rejections_total", {"pool": "demo", "tier": "normal", "reason": reason})
    assert counted == 1
