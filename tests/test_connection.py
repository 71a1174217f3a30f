"""A client from `admission.connection.connect` owns its connections: closing it closes them on
the server's side too (a real redis-server counts its clients)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis

from admission.config import RedisSettings
from admission.connection import connect
from bench.common.localredis import LocalRedis
from tests.gateway_harness import eventually

CLOSE_DEADLINE_S = 5.0


async def _other_clients(observer: aioredis.Redis) -> int:
    me = await observer.client_id()
    return sum(1 for c in await observer.client_list() if int(c["id"]) != me)


async def test_closing_the_client_closes_every_connection_it_opened(
        redis_factory: Callable[..., LocalRedis]) -> None:
    server = redis_factory()
    observer = aioredis.Redis.from_url(server.url)
    client = connect(RedisSettings(url=server.url))
    try:
        # Concurrent commands make the pool open more than one connection.
        await asyncio.gather(*(client.ping() for _ in range(4)))
        assert await _other_clients(observer) >= 2
        await client.aclose()

        async def all_closed() -> bool:
            return await _other_clients(observer) == 0

        # The server notices a closed socket on its next event-loop turn; wait for that.
        await eventually(all_closed, within_s=CLOSE_DEADLINE_S)
    finally:
        await observer.aclose()
