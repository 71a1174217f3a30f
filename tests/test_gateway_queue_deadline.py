"""A queued request's deadline is the client's, also while Redis is gone: the 429 goes out at
the deadline (plus `QUEUE_ANSWER_GRACE_S`), and the cancel of the task finishes in the
background once Redis answers again.

Real gateway (in process, on a socket), real backend, a private redis-server that the test
stops: SIGSTOP (a hanging Redis: connections open, no replies, each call waits out its socket
timeout) or SIGKILL (refused connections). The test plays the scheduler: a YELLOW zone, in
which Batch requests queue.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from bench.common.localredis import LocalRedis
from tests.gateway_harness import BIG, Harness, eventually, running_gateway

DEADLINE_S = 4.0
MARGIN_S = 0.5
"""The answer must come before the deadline plus this: `QUEUE_ANSWER_GRACE_S` (0.2 s) and the
HTTP round trip, with room for a loaded machine."""


async def _queued(gw: Harness) -> bool:
    return await gw.queued(2) == 1


@pytest.mark.parametrize("outage", ["hanging", "down"])
async def test_a_queued_request_is_answered_at_its_deadline_while_redis_is_unreachable(
    redis_factory: Callable[..., LocalRedis], outage: str
) -> None:
    server = redis_factory()
    async with running_gateway(server.url) as gw:
        await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})
        client = gw.openai("batch")
        await client.models.list()  # connected: the time measured below is the gateway's
        loop = asyncio.get_running_loop()
        started = loop.time()
        request = asyncio.ensure_future(client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Queue me."}], max_tokens=8,
            extra_headers={"X-Request-Timeout": str(DEADLINE_S)}))
        await eventually(lambda: _queued(gw))
        task_id = next(iter(gw.gateway.settler.live.snapshot()))
        if outage == "hanging":
            os.kill(server.process.pid, signal.SIGSTOP)
        else:
            server.kill()
        try:
            with pytest.raises(openai.RateLimitError) as info:
                await asyncio.wait_for(request, DEADLINE_S + 10)
            answered_s = loop.time() - started
        finally:
            if outage == "hanging":
                os.kill(server.process.pid, signal.SIGCONT)
        print(f"{outage}: answered after {answered_s:.3f} s for a {DEADLINE_S} s deadline")
        assert DEADLINE_S <= answered_s < DEADLINE_S + MARGIN_S, answered_s
        # The shape of a queue timeout: OpenAI error body, retry hints, no zone to report.
        response = info.value.response
        assert response.status_code == 429
        body = response.json()["error"]
        assert body["code"] == "capacity_exceeded" and body["type"]
        assert "waited" in body["message"]
        retry_ms = int(response.headers["retry-after-ms"])
        assert body["retry_after_ms"] == retry_ms
        assert int(response.headers["retry-after"]) == -(-retry_ms // 1000)
        # No sooner than the 503 of the same outage; no queue depth, which is unknown.
        floor_ms = max(gw.config.pool_policy("demo").default_retry_ms,
                       gw.config.gateway.unavailable_retry_ms)
        jitter = gw.config.gateway.retry_jitter
        assert floor_ms <= retry_ms <= floor_ms * (1 + jitter) + 1
        assert response.headers["x-ratelimit-backpressure-level"] == "UNKNOWN"
        assert "x-queue-depth" not in response.headers
        assert response.headers["x-request-id"] == task_id
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "demo", "tier": "batch", "outcome": "queue_timeout"}) == 1
        if outage == "hanging":
            # Redis is back: the cancel, still retrying in the settler, takes the task out of
            # the queue with a full refund.
            await asyncio.wait_for(gw.settled(), 10)
            admin = aioredis.Redis.from_url(server.url)
            try:
                record = await admin.hgetall(gw.store.keys.task_key(task_id))
                assert record[b"state"] == b"cancelled"
                assert await admin.zcard(gw.store.keys.queues[2]) == 0
                assert await admin.hget(gw.store.keys.tenant_queued, "batch") is None
            finally:
                await admin.aclose()
            assert task_id not in gw.gateway.settler.live



SDK_TIMEOUT_S = 3.0
MS_PER_TOKEN = 50
"""The gateway's `upstream_ms_per_output_token` in these tests: what a whole answer's
generation is taken to need per decode step."""


async def test_an_sdk_that_would_give_up_gets_its_429_before_it_does(redis_url: str) -> None:
    """The OpenAI SDK declares its read timeout with every request (`x-stainless-read-timeout`).
    A request still queued when that time nears is answered with its 429 and hint while the
    client listens; before, the SDK timed out first, and with its default retries sent the
    request again, to the back of the queue, with no hint to wait for. The answer being whole
    (not streamed), its generation time comes off the wait too."""
    async with running_gateway(redis_url, upstream_ms_per_output_token=MS_PER_TOKEN) as gw:
        await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})
        client = gw.openai("batch", timeout=SDK_TIMEOUT_S)
        await client.models.list()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Queue me."}],
                max_tokens=8)
        answered_s = loop.time() - started
        # As long as the client let it wait, less the margin for the answer's way back and
        # the time its 8 tokens may take.
        expected_s = SDK_TIMEOUT_S - 0.5 - 8 * MS_PER_TOKEN / 1000
        assert expected_s <= answered_s < expected_s + 0.5, answered_s
        assert info.value.code == "capacity_exceeded"
        assert int(info.value.response.headers["retry-after-ms"]) >= 1
        assert gw.gateway.metrics.registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "demo", "tier": "batch", "outcome": "queue_timeout"}) == 1


async def test_a_whole_answer_leaves_its_generation_time_before_the_sdks_read_timeout(
    redis_url: str,
) -> None:
    """A non-streamed answer's first byte is all of it: the queue deadline an SDK's 600 s read
    timeout leaves (540 s for a stream) loses the time the answer may take (1,000 steps at
    `MS_PER_TOKEN`: 50 s), and never more than half the timeout (10,000 steps: 300 s). Read
    from the tasks' deadlines in Redis, against its clock."""
    def adjust(data: dict[str, Any]) -> None:
        data["tiers"]["batch"]["queue_timeout_ms"] = 3_600_000  # the client's deadline binds
        data["pools"][0]["context_length"] = 16_384
        data["pools"][0]["max_max_tokens"] = 10_000

    async with running_gateway(redis_url, adjust=adjust,
                               upstream_ms_per_output_token=MS_PER_TOKEN,
                               backend_options={"max_model_len": 16_384}) as gw, \
            aiohttp.ClientSession() as http:
        await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})
        live = gw.gateway.settler.live
        pending = []

        async def deadline_s(stream: bool, max_tokens: int) -> float:
            before = live.snapshot()
            pending.append(asyncio.ensure_future(http.post(
                gw.url + "/v1/chat/completions",
                json={"model": "demo", "messages": [{"role": "user", "content": "Queue me."}],
                      "max_tokens": max_tokens, "stream": stream},
                headers={**gw.auth("batch"), "x-stainless-read-timeout": "600"})))
            return await gw.new_task_deadline_s(before)

        for stream, max_tokens, expected in ((True, 1_000, 540), (False, 1_000, 490),
                                             (False, 10_000, 300)):
            left = await deadline_s(stream, max_tokens)
            assert expected - 2 < left <= expected, (stream, max_tokens, left)
        for request in pending:
            request.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
