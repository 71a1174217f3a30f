"""The multiplexed Redis connection of the hot path: order, scripts, failures, recovery."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError, TimeoutError

from admission.config import RedisSettings
from admission.errors import describe, is_transient
from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.localredis import LocalRedis, free_port, start_replica
from gateway.redismux import RedisMux, mux_scripts, pack


def test_pack_is_resp() -> None:
    assert pack(["SET", b"k", 12]) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n"
    assert pack(["ECHO", "é"]) == b"*2\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n"


async def test_concurrent_calls_each_get_their_own_reply(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    mux = RedisMux(RedisSettings(url=redis_url))
    try:
        await redis_client.mset({f"k{i}": f"v{i}" for i in range(300)})
        replies = await asyncio.gather(*(mux.execute("GET", f"k{i}") for i in range(300)))
        assert replies == [f"v{i}".encode() for i in range(300)]
        # A caller that gives up does not shift the replies of the next ones.
        abandoned = asyncio.ensure_future(mux.execute("GET", "k1"))
        await asyncio.sleep(0)
        abandoned.cancel()
        assert await mux.execute("GET", "k2") == b"v2"
        with pytest.raises(Exception, match=r"WRONGTYPE|ERR"):
            await mux.execute("HGET", "k3", "field")
        assert await mux.execute("GET", "k4") == b"v4"
    finally:
        await mux.close()


async def test_scripts_through_the_mux_survive_a_flushed_script_cache(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    mux = RedisMux(RedisSettings(url=redis_url))
    store = PoolStore(redis_client, mux_scripts(register_scripts(redis_client), mux), "p",
                      PoolPolicy(stale_after_ms=0))
    tenant = TenantQuota("t", 1000, 100_000, 10)
    try:
        await store.publish_state(1, Zone.GREEN, {"n": 100_000})  # loads on NOSCRIPT
        for i in range(3):
            await redis_client.script_flush()
            result = await store.admit(task_id=f"task{i}", tenant=tenant, tier=Tier.VIP,
                                       prompt_tokens=10, max_tokens=10, gateway="g",
                                       queue_timeout_ms=1000)
            assert result.outcome is AdmitOutcome.RELEASED and result.node == "n"
            assert (await store.settle(f"task{i}", 15)).outcome == "settled"
    finally:
        await mux.close()


async def test_reconnects_after_a_redis_restart(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = redis_factory()
    mux = RedisMux(RedisSettings(url=server.url))
    try:
        assert await mux.execute("PING") == b"PONG"
        server.kill()
        with pytest.raises(ConnectionError):
            await mux.execute("PING")
        restarted = redis_factory(port=server.port)
        assert restarted.port == server.port
        assert await mux.execute("PING") == b"PONG"
    finally:
        await mux.close()


async def test_a_stuck_redis_times_out_and_the_next_call_recovers(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    mux = RedisMux(RedisSettings(url=redis_url, socket_timeout_ms=200))
    try:
        assert await mux.execute("PING") == b"PONG"
        await redis_client.client_pause(600, all=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await mux.execute("SET", "x", "1")
        assert 0.15 < loop.time() - started < 0.5
        await redis_client.client_unpause()
        assert await mux.execute("PING") == b"PONG"
    finally:
        await mux.close()


async def test_auth_and_database_from_the_url(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = redis_factory(password="s3cret")
    good = RedisMux(RedisSettings(url=f"redis://:s3cret@127.0.0.1:{server.port}/2"))
    bad = RedisMux(RedisSettings(url=f"redis://:wrong@127.0.0.1:{server.port}/0"))
    try:
        await good.execute("SET", "where", "db2")
        client = aioredis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/2")
        assert await client.get("where") == b"db2"
        await client.aclose()
        with pytest.raises(AuthenticationError):
            await bad.execute("PING")
    finally:
        await good.close()
        await bad.close()


async def refusal(mux: RedisMux) -> Exception:
    """What the mux's next call raises (it must raise)."""
    try:
        await mux.execute("PING")
    except Exception as exc:
        return exc
    raise AssertionError("the call succeeded")


async def test_a_busy_or_full_server_refuses_a_new_connection_as_an_outage_not_as_bad_credentials(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    """A handshake that Redis refuses for a while (BUSY: a script runs past its time limit and
    SELECT waits for it) was raised as an AuthenticationError, and `maxclients` reached as an
    ERR reply: both permanent for is_transient, so every settle then in flight was given up at
    once. Both pass by themselves, as redis-py reports them."""
    server = redis_factory(args=["--lua-time-limit", "20"])
    admin, blocker = aioredis.Redis.from_url(server.url), aioredis.Redis.from_url(server.url)
    # A database in the URL: the handshake sends SELECT (no password: no AUTH).
    db1 = RedisMux(RedisSettings(url=f"redis://127.0.0.1:{server.port}/1"))
    busy = asyncio.ensure_future(blocker.eval("while true do end", 0))
    try:
        while True:  # until the script is past its limit: other clients get BUSY
            try:
                await admin.ping()
            except ResponseError:
                break
            await asyncio.sleep(0.01)
        refused = await refusal(db1)
        assert not isinstance(refused, AuthenticationError), describe(refused)
        assert isinstance(refused, ConnectionError) and is_transient(refused), describe(refused)
    finally:
        await admin.script_kill()
        await asyncio.wait((busy,))
        await db1.close()
        for client in (admin, blocker):
            await client.aclose()

    full = redis_factory()
    holder = aioredis.Redis.from_url(full.url)
    mux = RedisMux(RedisSettings(url=full.url))
    try:
        # The server takes no client beyond those connected now (the fixture's included).
        await holder.config_set("maxclients", len(await holder.client_list()))
        refused = await refusal(mux)
        assert isinstance(refused, ConnectionError) and is_transient(refused), describe(refused)
        await holder.config_set("maxclients", 10_000)  # room again: the next connection is taken

        async def answers() -> bool:
            try:
                return bool(await mux.execute("PING") == b"PONG")
            except ConnectionError:
                return False

        for _ in range(100):
            if await answers():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the mux did not reconnect once a client left")
    finally:
        await mux.close()
        await holder.aclose()


async def test_an_unreachable_redis_opens_the_circuit() -> None:
    mux = RedisMux(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        with pytest.raises(ConnectionError):
            await mux.execute("PING")
        assert mux.connects == 1
        for _ in range(20):  # fail at once, without a connection attempt each
            with pytest.raises(ConnectionError, match="circuit open"):
                await mux.execute("PING")
        assert mux.connects == 1
    finally:
        await mux.close()


async def test_a_demoted_primary_is_left_for_the_one_the_locator_names(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    """With Sentinel, each connect asks where the primary is; a server that answers READONLY
    (a failover made it a replica) is dropped, and the next call goes to the new primary."""
    primary = redis_factory()
    replica = start_replica(primary)
    try:
        where = [replica.port]  # the locator is behind: it still names the old primary

        async def locate() -> tuple[str, int]:
            return "127.0.0.1", where[0]

        # The URL's host and port are not used once there is a locator.
        mux = RedisMux(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"), locate=locate)
        try:
            with pytest.raises(ConnectionError, match="replica"):
                await mux.execute("SET", "k", "v")
            where[0] = primary.port
            assert await mux.execute("SET", "k", "v") == b"OK"
            assert mux.connects == 2
        finally:
            await mux.close()
    finally:
        replica.stop()
        shutil.rmtree(replica.workdir, ignore_errors=True)
