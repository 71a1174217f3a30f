"""A client from `admission.connection.connect` owns its connections: closing it closes them on
the server's side too (a real redis-server counts its clients)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis

from admission.config import RedisSettings
from admission.connection import connect
from bench.common.localredis import LocalRedis

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
        # The server notices a closed socket on its next event-loop turn; wait for that.
        deadline = asyncio.get_running_loop().time() + CLOSE_DEADLINE_S
        while (left := await _other_clients(observer)) and (
                asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.01)
        assert left == 0, f"{left} connection(s) still open after the client was closed"
    finally:
        await observer.aclose()
