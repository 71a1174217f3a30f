"""The admission core on Redis' own clock: leases that really run out, racing the reaper.

The stateful property test drives the scripts on a frozen clock (the pool clock's
`frozen_us`), so the `TIME` path, and the races around a lease's expiry, never run there.
Here nothing sets `frozen_us`: every script reads Redis TIME, leases last a few hundred
milliseconds, and real time passes for them to expire. Whichever of a finish, a renewal and a
reap lands first at an expiry is up to the machine; what is asserted holds for every order,
on Redis' own records, against the scripts' replies (`tests/realclock_support.Ledger`):

- each task created ends exactly once: finishes that ended one, plus the tasks the reaper
  and the release script report ended, add up to the tasks created (a task refunded twice
  is counted twice), and each record's final state is the one its ender reported;
- the pool gets back exactly the tokens it reserved, and each tenant's bucket (refill rate 0,
  so only refunds raise it) ends at its burst minus the usage charged, to the micro-token;
- during the run, each node's reservation equals the released tasks in the running index and
  stays within its capacity (sampled atomically, many times);
- afterwards no reservation, lease, queue entry, gateway set or frozen clock is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission.scripts import register_scripts
from admission.store import (
    AdmitOutcome,
    FinishResult,
    PoolPolicy,
    PoolStore,
    ReapResult,
    TenantQuota,
)
from admission.tiers import Tier, Zone
from gateway.metrics import GatewayMetrics
from gateway.settle import LiveTasks, Settler, renew_leases
from scheduler.service import REAP_BATCH, REAP_CALLS
from tests.conftest import PoolRedis, delete_prefix
from tests.realclock_support import (
    Ledger,
    assert_nothing_left,
    check_reservations,
    redis_now_us,
    sleep_until_redis_us,
    text,
)

LEASE_MS = 250
POLICY = PoolPolicy(tier_queue_caps=(500, 500, 500), lease_ttl_ms=LEASE_MS, retention_s=600)
LONG_LEASE = PoolPolicy(tier_queue_caps=(500, 500, 500), lease_ttl_ms=60_000, retention_s=600)
"""For a renewal whose effect a test asserts right after: a minute of margin, not 250 ms."""
TENANTS = (TenantQuota("acme", rate=0, burst=10**9, max_queued=10_000),
           TenantQuota("umbra", rate=0, burst=10**9, max_queued=10_000))
ACME = TENANTS[0]
TIER_TIMEOUT_MS = 500
EPOCH = 1


def _store(client: aioredis.Redis, pool: str, policy: PoolPolicy = POLICY) -> PoolStore:
    return PoolStore(client, register_scripts(client), pool, policy)


async def _admit(store: PoolStore, ledger: Ledger, task_id: str, gateway: str, *,
                 prompt: int = 40, out: int = 60, tenant: TenantQuota = ACME,
                 tier: Tier = Tier.NORMAL, timeout_ms: int = TIER_TIMEOUT_MS) -> AdmitOutcome:
    result = await store.admit(task_id=task_id, tenant=tenant, tier=tier, prompt_tokens=prompt,
                               max_tokens=out, gateway=gateway, queue_timeout_ms=timeout_ms,
                               tier_timeout_ms=TIER_TIMEOUT_MS)
    ledger.admitted(task_id, tenant.name, prompt + out, result)
    return result.outcome


async def _lease_expiry(store: PoolStore, gateway: str) -> int | None:
    score = await store.client.zscore(store.keys.leases, gateway)
    return None if score is None else int(score)


async def _settle(store: PoolStore, ledger: Ledger, task_id: str, usage: int) -> FinishResult:
    result = await store.settle(task_id, usage)
    ledger.finished(task_id, usage, False, result)
    return result


async def _reap(store: PoolStore, ledger: Ledger, max_tasks: int = REAP_BATCH) -> int:
    result = await store.reap(max_tasks)
    ledger.reaped_by(result)
    return result.reaped


# --- deterministic races at one expiry --------------------------------------------------------


async def test_the_lease_is_set_from_redis_time_and_expires_with_it(pool_redis: PoolRedis) -> None:
    client, ledger = pool_redis.client, Ledger(TENANTS)
    store = _store(client, pool_redis.pool)
    await store.publish_state(EPOCH, Zone.GREEN, {"n1": 10_000})
    before = await redis_now_us(client)
    assert await _admit(store, ledger, "t", "gw") is AdmitOutcome.RELEASED
    after = await redis_now_us(client)
    expiry = await _lease_expiry(store, "gw")
    assert expiry is not None and before <= expiry - LEASE_MS * 1000 <= after
    await sleep_until_redis_us(client, expiry)
    assert await _reap(store, ledger) == 1
    await ledger.check_redis(client, store.keys)


async def test_a_just_expired_task_finished_then_reaped_or_reaped_then_finished_is_refunded_once(
        pool_redis: PoolRedis) -> None:
    client, ledger = pool_redis.client, Ledger(TENANTS)
    store = _store(client, pool_redis.pool)
    await store.publish_state(EPOCH, Zone.GREEN, {"n1": 10_000})
    await _admit(store, ledger, "settled-first", "gw-a", prompt=30, out=70)
    await _admit(store, ledger, "reaped-first", "gw-b", prompt=50, out=50)
    assert ledger.released == {"settled-first", "reaped-first"}
    expiries = [await _lease_expiry(store, gw) for gw in ("gw-a", "gw-b")]
    await sleep_until_redis_us(client, max(e or 0 for e in expiries) + 1)

    # Both leases are past: the first call on a task ends it, the second finds it ended.
    first = await _settle(store, ledger, "settled-first", 40)
    assert (first.outcome, first.previous, first.refunded) == ("settled", "released", 60)
    result = await store.reap(REAP_BATCH)
    ledger.reaped_by(result)
    assert (result.reaped, result.returned_tokens) == (1, 100)
    late = await _settle(store, ledger, "reaped-first", 40)
    assert (late.outcome, late.previous, late.refunded) == ("noop", "reaped", 0)
    assert ledger.charged["acme"] == 40
    await ledger.check_redis(client, store.keys)


async def test_finishes_and_reaps_sent_together_at_an_expiry_refund_each_task_once(
        pool_redis: PoolRedis) -> None:
    """Forty calls on as many connections, all after the lease ran out: every task ends once,
    by its finish or by one of the reaps, whatever order Redis runs them in."""
    client, ledger = pool_redis.client, Ledger(TENANTS)
    store = _store(client, pool_redis.pool)
    await store.publish_state(EPOCH, Zone.GREEN, {"n1": 10_000, "n2": 10_000})
    ids = [f"race-{i}" for i in range(20)]
    for i, task_id in enumerate(ids):
        await _admit(store, ledger, task_id, "gw", prompt=10 + i, out=50)
    expiry = await _lease_expiry(store, "gw")
    assert expiry is not None and len(ledger.released) == 20
    await sleep_until_redis_us(client, expiry + 1)

    usage = {task_id: 7 + i for i, task_id in enumerate(ids)}
    calls = []
    for task_id in ids:
        calls += [store.settle(task_id, usage[task_id]), store.reap(1)]
    replies = await asyncio.gather(*calls)
    for task_id, finish, reap in zip(ids, replies[0::2], replies[1::2], strict=True):
        assert isinstance(finish, FinishResult) and isinstance(reap, ReapResult)
        ledger.finished(task_id, usage[task_id], False, finish)
        ledger.reaped_by(reap)
    settled = sum(r.outcome == "settled" for r in replies[0::2] if isinstance(r, FinishResult))
    assert settled + ledger.reaped == 20
    assert ledger.noop_finishes["reaped"] == ledger.reaped
    await ledger.check_redis(client, store.keys)


async def test_a_renewal_and_a_reap_at_an_expiry_keep_or_end_the_gateways_tasks_whole(
        pool_redis: PoolRedis) -> None:
    """A renewal that lands after the expiry but before the reaper saves the gateway's tasks;
    one that lands after it finds none left and drops the lease; a reap cut short by its batch
    leaves the rest of a gateway's tasks to a renewal. Sent together, the renewal and the reap
    each act on the whole gateway: all its tasks live on, or all are reaped."""
    client, ledger = pool_redis.client, Ledger(TENANTS)
    store = _store(client, pool_redis.pool)
    renewer = _store(client, pool_redis.pool, LONG_LEASE)
    await store.publish_state(EPOCH, Zone.GREEN, {"n1": 100_000})
    # Admitted in this order, so the leases expire in it and the reaper meets them in it.
    gateways = {"gw-partial": 6, "gw-renewed": 5, "gw-reaped": 5}
    for gateway, count in gateways.items():
        for i in range(count):
            await _admit(store, ledger, f"{gateway}-{i}", gateway)
    last = await _lease_expiry(store, "gw-reaped")
    assert last is not None
    await sleep_until_redis_us(client, last + 1)

    partial = await store.reap(2)
    ledger.reaped_by(partial)
    assert (partial.reaped, partial.more) == (2, True)
    assert await renewer.renew("gw-partial") == 4
    assert await renewer.renew("gw-renewed") == 5
    assert await _reap(store, ledger) == 5
    assert await renewer.renew("gw-reaped") == 0
    assert await _lease_expiry(store, "gw-reaped") is None

    for i in range(10):
        await _admit(store, ledger, f"gw-race-{i}", "gw-race")
    race = await _lease_expiry(store, "gw-race")
    assert race is not None
    await sleep_until_redis_us(client, race + 1)
    live, reap = await asyncio.gather(renewer.renew("gw-race"), store.reap(REAP_BATCH))
    ledger.reaped_by(reap)
    assert (live, reap.reaped) in ((10, 0), (0, 10))

    for gateway, count in {**gateways, "gw-race": 10}.items():
        for i in range(count):
            await _settle(store, ledger, f"{gateway}-{i}", 25)
    assert len(ledger.ended_by_finish) == 4 + 5 + live
    assert ledger.noop_finishes["reaped"] == ledger.reaped == 2 + 5 + reap.reaped
    # A renewal of a gateway that holds nothing drops its lease.
    for gateway in ("gw-partial", "gw-renewed", "gw-race"):
        assert await renewer.renew(gateway) == 0
    await ledger.check_redis(client, store.keys)
