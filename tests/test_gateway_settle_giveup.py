"""A settle that can never succeed is given up, and the budget comes back through the lease.

Real gateway (in process, on a socket, Redis ACL user `kvgw`), real backend, the real
scheduler (in process, default user: it publishes the zone, and its reaper returns the budget
of expired leases), a private redis-server. After the request is admitted and while its
stream is held by the backend, the gateway's user loses access to that task's record key
(ACL key patterns that match every key but that one): the finish script then fails with
NOPERM however often it is retried, while everything else the gateway does (renewing its
lease, other tasks) keeps working. (Revoking EVALSHA instead would also stop the renewals, so
the whole gateway's lease would lapse and the case would not be told from a dead gateway.)

The settle must be given up at once (counted, logged once), the task must leave the renewed
set, and the reaper must return its whole reservation within one lease TTL plus one reap
interval; once access is restored, nothing is refunded a second time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from admission.keys import PoolKeys, abandoned_lease
from admission.store import MICRO
from bench.common.localredis import LocalRedis
from scheduler.service import SchedulerService
from tests.gateway_harness import KEYS, POOL, eventually, open_held_stream, running_gateway

LEASE_TTL_MS = 1000
RENEW_MS = 300
REAP_MS = 200
MARGIN_S = 0.3
"""Scheduling slack on a loaded machine, on top of one lease TTL and one reap interval."""
BURST = 1000
"""The "frozen" tenant's bucket: 1,000 tokens, never refilled, so every level is exact."""
KEYS_OF = PoolKeys(POOL)


def every_key_but(key: str) -> list[str]:
    """ACL key patterns (globs) matching every key except `key`: keys that differ from it at
    some position, or extend it."""
    assert not set(key) & set("*?[]^\\"), key
    patterns = [f"~{key[:i]}[^{key[i]}]*" for i in range(len(key))]
    return [*patterns, f"~{key}?*"]


async def _stream_held(http: aiohttp.ClientSession, url: str) -> tuple[str, Any]:
    """A streaming request of the 'frozen' tenant, read until the backend holds it."""
    return await open_held_stream(http, url, KEYS["frozen"], content="Tell me a story.",
                                  max_tokens=100)


async def _level(admin: Any) -> int:
    return int(await admin.hget(KEYS_OF.bucket_key("frozen"), "micro_tokens"))


async def test_a_settle_that_fails_permanently_is_given_up_and_reaped_once(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory()
    admin: Any = aioredis.Redis.from_url(server.url)
    await admin.execute_command("ACL", "SETUSER", "kvgw", "on", ">gw-pass", "~*", "&*", "+@all")
    gateway_url = f"redis://kvgw:gw-pass@127.0.0.1:{server.port}/0"
    loop = asyncio.get_running_loop()
    scheduler: SchedulerService | None = None
    try:
        async with running_gateway(gateway_url, backend_options={"hold_after": 2},
                                   lease_ttl_ms=LEASE_TTL_MS,
                                   renew_interval_ms=RENEW_MS) as gw, aiohttp.ClientSession(
                                   ) as http:
            config = dataclasses.replace(gw.config, scheduler=dataclasses.replace(
                gw.config.scheduler, reap_interval_ms=REAP_MS, leader_ttl_ms=1000))
            scheduler = SchedulerService(config, me="sched", client=admin)
            await scheduler.start()

            async def published() -> bool:
                return await admin.hget(KEYS_OF.state, "zone") == b"GREEN" and bool(
                    await admin.hlen(KEYS_OF.node_capacity))

            await eventually(published, 10)
            task_id, stream = await _stream_held(http, gw.url)
            record = await admin.hgetall(KEYS_OF.task_key(task_id))
            assert record[b"state"] == b"released"
            cost = int(record[b"cost"])
            assert await _level(admin) == (BURST - cost) * MICRO
            assert await admin.hgetall(KEYS_OF.node_reserved) == {b"node-0": str(cost).encode()}

            # After admission, before the settle: the gateway may no longer touch this task.
            await admin.execute_command("ACL", "SETUSER", "kvgw", "resetkeys",
                                        *every_key_but(KEYS_OF.task_key(task_id)))
            gw.backends[0].gate.set()
            with caplog.at_level(logging.INFO, logger="kvgate.gateway"):
                body = await asyncio.wait_for(stream.read(), 5)
                assert body.rstrip().endswith(b"data: [DONE]")
                ended = loop.time()
                # Reaped: the reaper returned the reservation after the task's lease ran out.
                await eventually(lambda: _state_is(admin, task_id, b"reaped"), 10)
                back_s = loop.time() - ended
                await asyncio.wait_for(gw.settled(), 5)  # given up, not retrying
            print(f"budget back {back_s:.3f} s after the answer "
                  f"(lease TTL {LEASE_TTL_MS} ms + reap interval {REAP_MS} ms)")
            assert back_s <= (LEASE_TTL_MS + REAP_MS) / 1000 + MARGIN_S, back_s

            registry = gw.gateway.metrics.registry
            assert registry.get_sample_value("kvgate_gateway_settles_abandoned_total", {
                "op": "settle", "reason": "permanent"}) == 1
            assert (registry.get_sample_value("kvgate_gateway_settle_retries_total")
                    or 0) == 0
            logged = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
            assert len(logged) == 1 and task_id in logged[0] and "NOPERM" in logged[0]
            assert "Tell me a story" not in caplog.text and "sk-test" not in caplog.text
            await _assert_returned_once(admin, task_id, settled=0)
            assert scheduler.metrics.registry.get_sample_value(
                "kvgate_scheduler_reaped_total", {"pool": POOL, "kind": "reaped"}) == 1

            # Access restored: the gateway works again, and nothing about the reaped task
            # happens a second time.
            await admin.execute_command("ACL", "SETUSER", "kvgw", "resetkeys", "~*")
            gw.backends[0].hold_after = None
            second = await gw.openai("frozen").chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": "Again."}], max_tokens=5)
            assert second.usage is not None
            await asyncio.wait_for(gw.settled(), 5)
            # A renewal round after the restore: the gateway dropped its lease entry (it holds
            # nothing), after moving anything it had given up.
            await eventually(lambda: _no_lease(admin, "gw-test"), 5)
            await _assert_returned_once(admin, task_id, settled=1)
            assert await _level(admin) == (BURST - second.usage.total_tokens) * MICRO
            assert gw.gateway.settler.given_up == frozenset()
            assert task_id not in gw.gateway.settler.live
    finally:
        if scheduler is not None:
            await scheduler.stop()
        await admin.aclose()


async def _state_is(admin: Any, task_id: str, state: bytes) -> bool:
    return bool(await admin.hget(KEYS_OF.task_key(task_id), "state") == state)


async def _no_lease(admin: Any, gateway: str) -> bool:
    return await admin.zscore(KEYS_OF.leases, gateway) is None


async def _assert_returned_once(admin: Any, task_id: str, *, settled: int) -> None:
    """Redis' own state: the task reaped once (full refund, no usage), nothing reserved or
    running, no abandoned set or lease left, the bucket full but for settled work."""
    record = await admin.hgetall(KEYS_OF.task_key(task_id))
    assert record[b"state"] == b"reaped" and b"usage" not in record
    stats = {k.decode(): int(v) for k, v in (await admin.hgetall(KEYS_OF.stats)).items()}
    assert stats.get("reaped") == 1 and stats.get("settled", 0) == settled, stats
    assert await admin.hgetall(KEYS_OF.node_reserved) == {}
    assert await admin.zcard(KEYS_OF.running) == 0
    assert await admin.exists(KEYS_OF.abandoned_tasks_key("gw-test"),
                              KEYS_OF.gateway_tasks_key("gw-test")) == 0
    assert await admin.zscore(KEYS_OF.leases, abandoned_lease("gw-test")) is None
    if settled == 0:
        assert await _level(admin) == BURST * MICRO
