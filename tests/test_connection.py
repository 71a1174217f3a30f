"""A client from `admission.connection.connect` owns its connections: closing it closes them on
the server's side too (a real redis-server counts its clients); and it leaves a server that a
failover demoted for the one its URL names now."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from admission.config import RedisSettings
from admission.connection import connect
from admission.keys import SchedulerKeys
from admission.scripts import register_scripts
from bench.common.localredis import LocalRedis
from scheduler.leader import Elector
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


async def test_a_primary_demoted_by_a_failover_is_left_for_the_one_the_url_names_now(
        redis_factory: Callable[..., LocalRedis]) -> None:
    """Without Sentinel, a failover moves the name `redis.url` gives (a managed Redis's DNS
    name, a Kubernetes Service) to the promoted replica, and the old primary lives on as its
    replica, keeping its clients connected. redis-py kept the pooled connection after its
    READONLY reply, so the scheduler's every leadership call was refused for as long as it ran:
    no leader, no release. The name here is a symlink to a unix socket, moved as DNS would be."""
    where = Path(tempfile.mkdtemp(prefix="kvgate-fo-"))  # short: a socket path is <= 107 bytes
    sockets = {side: where / f"{side}.sock" for side in ("old", "new")}
    old, new = (redis_factory(args=["--unixsocket", str(sockets[side]), "--unixsocketperm",
                                    "700"]) for side in ("old", "new"))
    name = where / "redis.sock"
    name.symlink_to(sockets["old"])
    # One connection, so that the demoted one is the one every call gets.
    client = connect(RedisSettings(url=f"unix://{name}", max_connections=1))
    old_admin: Any = aioredis.Redis.from_url(old.url)
    new_admin = aioredis.Redis.from_url(new.url)
    elector = Elector(client, register_scripts(client), "a", 2_000)
    try:
        await elector.attempt()
        assert elector.leading and await old_admin.get(SchedulerKeys().leader) == b"a"
        # The failover: `new` is the primary now, `old` its replica, the name points at `new`.
        await old_admin.execute_command("REPLICAOF", "127.0.0.1", str(new.port))

        async def synced() -> bool:
            info = await old_admin.info("replication")
            return bool(info.get("master_link_status") == "up")

        await eventually(synced, within_s=10)
        moving = where / "moving.sock"
        moving.symlink_to(sockets["new"])
        os.replace(moving, name)
        for _ in range(3):  # the call on the demoted connection may fail, once
            await elector.attempt()
            if elector.failures == 0:
                break
        assert elector.failures == 0, "still refused READONLY by the demoted primary"
        assert await new_admin.get(SchedulerKeys().leader) == b"a"
    finally:
        await client.aclose()
        await old_admin.aclose()
        await new_admin.aclose()
        shutil.rmtree(where, ignore_errors=True)
