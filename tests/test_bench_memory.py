"""The memory benchmark's measurement (bench/perf/memory.py) and the instant backend's spaced
streams it relies on. No timings are asserted: the machine's load would make them flaky."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from admission.keys import PoolKeys
from bench.common import instant_backend
from bench.common.instant_backend import InstantBackend
from bench.perf.queue_memory import CLIENT_DEADLINE_EVERY, measure_queue_memory


async def test_bytes_per_queued_task(redis_client: aioredis.Redis, redis_url: str) -> None:
    result = await measure_queue_memory(redis_url, 2_000, pool="memtest", window=500)
    assert result.bytes_per_task > 0
    assert result.queued == 2_000
    keys = PoolKeys("memtest")
    depths = [int(await redis_client.zcard(q)) for q in keys.queues]
    assert sum(depths) == 2_000 and all(depths)  # every tier got some
    # Only the tasks whose client shortened their deadline are in the deadlines index.
    assert await redis_client.zcard(keys.deadlines) == 2_000 // CLIENT_DEADLINE_EVERY
    kinds = {row["key"] for row in result.breakdown}
    assert {"task:<id>", "deadlines", "gateway:<gw>"} <= kinds
    assert result.record["state"] == "queued"


async def test_token_interval_spaces_a_streams_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: object) -> None:
        pauses.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    backend = InstantBackend(record=False, token_interval_ms=20)
    runner = web.AppRunner(backend.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    body = {"model": "demo", "stream": True, "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
            text = (await resp.read()).decode()
            assert resp.status == 200
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={**body, "stream": False}) as resp:
            assert resp.status == 200
    finally:
        await runner.cleanup()
    assert [text.count(f" t{i}") for i in range(3)] == [1, 1, 1]
    assert text.endswith("data: [DONE]\n\n")
    # One pause between each two tokens of the stream, none for the non-streaming answer.
    assert pauses.count(0.02) == 2


def test_token_interval_option(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        instant_backend.main(["--token-interval-ms", "-1"])
    built: list[InstantBackend] = []

    def make(**options: Any) -> InstantBackend:
        built.append(InstantBackend(**options))
        return built[-1]

    def run(coro: Coroutine[Any, Any, None]) -> None:
        coro.close()  # parse and build only: do not serve

    monkeypatch.setattr(instant_backend, "InstantBackend", make)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # so that main() uses asyncio.run
    monkeypatch.setattr(asyncio, "run", run)
    assert instant_backend.main(["--token-interval-ms", "250"]) == 0
    assert built[0].token_interval_ms == 250
