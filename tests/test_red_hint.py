"""The RED hint over a long RED: the leader's estimate of when the pool leaves RED
(scheduler.zones.RedClearance, published as `red_clear_s`) and the Retry-After a Normal request
gets for it, on a real stack: the gateway on a real socket, the pool's scheduler polling a
vLLM-format metrics page whose KV usage the test sets, the session's redis-server. The
scheduler is ticked by the test on a clock it moves a second at a time, so minutes of RED take
a few seconds; the scripts' clock is frozen, so the state is never older than its last tick."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from gateway.errors import MAX_RETRY_MS
from scheduler.pool import PoolScheduler
from tests.gateway_harness import POOL, Harness, running_gateway
from tests.scheduler_stub import (
    FakeClock,
    FakeVllm,
    always,
    make_config,
    pool_scheduler,
    serve_fake,
)

MESSAGES: list[Any] = [{"role": "user", "content": "Summarise the plot of Hamlet."}]


@dataclass
class Stack:
    gw: Harness
    node: FakeVllm
    scheduler: PoolScheduler
    clock: FakeClock
    sdks: dict[str, openai.AsyncOpenAI] = field(default_factory=dict)

    async def tick(self, seconds: float = 1.0) -> Zone:
        self.clock.advance(seconds)
        result = await self.scheduler.tick(1, always)
        assert result.published
        return result.zone

    async def red_hint_ms(self) -> int:
        """A Normal request's Retry-After (ms) in RED; the gateway adds no jitter here."""
        with pytest.raises(openai.RateLimitError) as info:
            await self.chat("normal")
        headers = info.value.response.headers
        assert headers["x-ratelimit-backpressure-level"] == "RED"
        assert info.value.response.json()["error"]["code"] == "capacity_exceeded"
        return int(headers["retry-after-ms"])

    async def chat(self, who: str) -> Any:
        sdk = self.sdks.get(who)
        if sdk is None:
            sdk = self.sdks[who] = self.gw.openai(who)
        return await sdk.chat.completions.create(model=POOL, messages=MESSAGES, max_tokens=8)


@asynccontextmanager
async def red_stack(redis_url: str) -> AsyncIterator[Stack]:
    node = FakeVllm(usage=0.10)
    async with serve_fake(node) as metrics_url, \
            running_gateway(redis_url, retry_jitter=0.0) as gw:
        # The gateway's node-0 is its instant backend; the scheduler reads node-0's KV usage
        # from the metrics page the test sets.
        config = make_config(redis_url, [{"name": "node-0", "url": metrics_url}], pool=POOL)
        clock = FakeClock()
        await gw.freeze_clock()
        async with pool_scheduler(gw.redis, config, clock=clock) as scheduler:
            stack = Stack(gw, node, scheduler, clock)
            assert await stack.tick() is Zone.GREEN
            yield stack


async def test_the_red_hint_never_drops_while_nothing_drains_and_recovers_as_kv_falls(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with red_stack(redis_url) as s:
        # VIP traffic before the overload: the VIP queue's drain rate is well above 0 when RED
        # begins, and decays to 0 while RED lets nothing out (what the hint once followed).
        for _ in range(5):
            replies = await asyncio.gather(*(s.chat("vip") for _ in range(20)))
            assert all(r.choices for r in replies)
            await s.gw.settled()
            assert await s.tick() is Zone.GREEN
        assert float((await s.gw.redis.hget(s.gw.store.keys.state, "drain_0")) or 0) > 5.0

        s.node.usage = 0.95  # held in RED: nothing running, nothing frees KV
        assert await s.tick() is Zone.RED
        held = [await s.red_hint_ms()]
        for _ in range(90):
            assert await s.tick() is Zone.RED
            held.append(await s.red_hint_ms())
        assert held == sorted(held), (
            f"the RED hint dropped while nothing drained: {held}")
        assert held[0] <= 1_000 and held[30] == 30_000 and held[-1] == MAX_RETRY_MS, held

        falling = []
        for usage in (0.90, 0.86, 0.83):  # KV falls towards the exit line (0.82)
            s.node.usage = usage
            assert await s.tick() is Zone.RED
            falling.append(await s.red_hint_ms())
        assert held[-1] > falling[0] > falling[1] > falling[2], falling
        assert falling[-1] < 10_000

        s.node.usage = 0.50
        assert await s.tick() is Zone.GREEN
        assert (await s.chat("normal")).choices
        assert await s.gw.redis.hget(s.gw.store.keys.state, "red_clear_s") is None


async def test_without_an_estimate_the_red_hint_falls_back_to_the_drain_rule_capped(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    """A state with no `red_clear_s` (a leader that publishes none) is unknown, not 0: the
    queue's drain rule answers, and a measured rate of 0 there is the longest hint."""
    async with running_gateway(redis_url, retry_jitter=0.0) as gw:
        await gw.publish(Zone.RED, extra={"drain_0": 0, "drain_1": 0})
        with pytest.raises(openai.RateLimitError) as info:
            await gw.openai("normal").chat.completions.create(
                model=POOL, messages=MESSAGES, max_tokens=8)
        assert int(info.value.response.headers["retry-after-ms"]) == MAX_RETRY_MS
        await gw.publish(Zone.RED, extra={"drain_0": 0, "drain_1": 0, "red_clear_s": "0.000"})
        with pytest.raises(openai.RateLimitError) as info:
            await gw.openai("normal").chat.completions.create(
                model=POOL, messages=MESSAGES, max_tokens=8)
        # An estimate of 0 (about to leave RED) is the shortest hint.
        assert int(info.value.response.headers["retry-after-ms"]) == 1_000
