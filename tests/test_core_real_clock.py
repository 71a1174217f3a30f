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
import random
import time
import uuid

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission.outcomes import AdmitOutcome, FinishResult, ReapResult
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore
from admission.tiers import Tier, Zone
from scheduler.service import REAP_BATCH, REAP_CALLS
from tests.conftest import PoolRedis, delete_prefix
from tests.realclock_gateway import Gateway, every
from tests.realclock_support import (
    TENANTS,
    Ledger,
    admit,
    check_reservations,
    lease_expiry,
    redis_now_us,
    sleep_until_redis_us,
)

LEASE_MS = 250
POLICY = PoolPolicy(tier_queue_caps=(500, 500, 500), lease_ttl_ms=LEASE_MS, retention_s=600)
LONG_LEASE = PoolPolicy(tier_queue_caps=(500, 500, 500), lease_ttl_ms=60_000, retention_s=600)
"""For a renewal whose effect a test asserts right after: a minute of margin, not 250 ms."""
EPOCH = 1


def _store(client: aioredis.Redis, pool: str, policy: PoolPolicy = POLICY) -> PoolStore:
    return PoolStore(client, register_scripts(client), pool, policy)


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
    assert await admit(store, ledger, "t", "gw") is AdmitOutcome.RELEASED
    after = await redis_now_us(client)
    expiry = await lease_expiry(store, "gw")
    assert expiry is not None and before <= expiry - LEASE_MS * 1000 <= after
    await sleep_until_redis_us(client, expiry)
    assert await _reap(store, ledger) == 1
    await ledger.check_redis(client, store.keys)


async def test_a_just_expired_task_finished_then_reaped_or_reaped_then_finished_is_refunded_once(
        pool_redis: PoolRedis) -> None:
    client, ledger = pool_redis.client, Ledger(TENANTS)
    store = _store(client, pool_redis.pool)
    await store.publish_state(EPOCH, Zone.GREEN, {"n1": 10_000})
    await admit(store, ledger, "settled-first", "gw-a", prompt=30, out=70)
    await admit(store, ledger, "reaped-first", "gw-b", prompt=50, out=50)
    assert ledger.released == {"settled-first", "reaped-first"}
    expiries = [await lease_expiry(store, gw) for gw in ("gw-a", "gw-b")]
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
        await admit(store, ledger, task_id, "gw", prompt=10 + i, out=50)
    expiry = await lease_expiry(store, "gw")
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
            await admit(store, ledger, f"{gateway}-{i}", gateway)
    last = await lease_expiry(store, "gw-reaped")
    assert last is not None
    await sleep_until_redis_us(client, last + 1)

    partial = await store.reap(2)
    ledger.reaped_by(partial)
    assert (partial.reaped, partial.more) == (2, True)
    assert await renewer.renew("gw-partial") == 4
    assert await renewer.renew("gw-renewed") == 5
    assert await _reap(store, ledger) == 5
    assert await renewer.renew("gw-reaped") == 0
    assert await lease_expiry(store, "gw-reaped") is None

    for i in range(10):
        await admit(store, ledger, f"gw-race-{i}", "gw-race")
    race = await lease_expiry(store, "gw-race")
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


# --- gateways, a scheduler and a reaper for a few seconds --------------------------------------

NODES = ("n1", "n2", "n3")
CAPACITY = 1_500
"""Per node: about what the gateways hold at once, so some work queues for the scheduler."""
RUN_S = 2.5


async def test_gateways_that_renew_stall_and_die_race_the_reaper_without_losing_a_token(
        pool_redis: PoolRedis) -> None:
    """Four gateways for a few seconds, with a scheduler releasing queued work and the reaper
    reaping every 10 ms; the reservations are sampled every 5 ms. Then nobody renews, every
    lease runs out, the reaper ends what is left, and the books must balance."""
    client, ledger = pool_redis.client, Ledger(TENANTS)
    store = _store(client, pool_redis.pool)
    keys = store.keys
    await store.publish_state(EPOCH, Zone.GREEN, dict.fromkeys(NODES, CAPACITY))
    rng = random.Random(20_240_917)
    gateways = [Gateway(n, store, ledger, random.Random(rng.random())) for n in range(4)]

    async def release() -> None:
        ledger.released_by_scheduler(await store.release(EPOCH, (4, 4, 4)))

    async def reap(batch: int | None = None) -> None:
        # As the scheduler's reap loop does, with batches that may be small enough to stop
        # inside a gateway's tasks and leave the rest to a renewal.
        for _ in range(REAP_CALLS):
            result = await store.reap(batch or rng.choice((1, 3, REAP_BATCH)))
            ledger.reaped_by(result)
            if not result.more:
                return

    async def sample() -> None:
        await check_reservations(client, keys, CAPACITY)

    stop = asyncio.Event()
    background = [asyncio.create_task(every(period, stop, step))
                  for period, step in ((0.015, release), (0.01, reap), (0.005, sample))]
    until = asyncio.get_running_loop().time() + RUN_S
    await asyncio.gather(*(g.run(until) for g in gateways))
    for g in gateways:
        for settler in g.settlers:
            await settler.idle()
    stop.set()
    releases, reap_rounds, samples = await asyncio.gather(*background)

    # Quiesce: nobody renews any more; once the last lease has expired the reaper ends it all.
    for _ in range(100):
        last = await client.zrange(keys.leases, -1, -1, withscores=True)
        if not last:
            break
        await sleep_until_redis_us(client, int(last[0][1]) + 1)
        await reap(REAP_BATCH)
    await check_reservations(client, keys, CAPACITY)
    for g in gateways:
        g.book_finishes()
    print(f"\n{ledger.summary()}; {releases} release and {reap_rounds} reap rounds, "
          f"{samples} samples; stalls {sum(g.stalls for g in gateways)}, deaths "
          f"{sum(g.deaths for g in gateways)}, abandons {sum(g.abandons for g in gateways)}")
    assert samples > 0 and len(ledger.costs) > 0
    assert sum(g.orphans_cancelled() for g in gateways) == 0
    await ledger.check_redis(client, keys)


# --- finish, renew, release and reap at random moments around one expiry -----------------------

QUICK_LEASE_MS = 120
QUICK = PoolPolicy(tier_queue_caps=(500, 500, 500), lease_ttl_ms=QUICK_LEASE_MS, retention_s=600)
QUICK_TIER_TIMEOUT_MS = QUICK_LEASE_MS + 10
AROUND_EXPIRY_MS = st.integers(-40, 40)
"""When a call is sent, in ms from the lease's expiry (Redis runs it a little later)."""
TASK_PLANS = st.tuples(
    st.integers(1, 120), st.integers(1, 120), st.sampled_from(list(Tier)),
    # Queue timeouts around the lease's, so that expiring in the queue races the rest too:
    # the tier's own (expires from the queue's head) or a shorter or longer one of its own.
    st.just(QUICK_TIER_TIMEOUT_MS) | st.integers(QUICK_LEASE_MS - 60, QUICK_LEASE_MS + 60),
    # None: the gateway never finishes it; else (when, usage in % of the cost, cancelled)
    st.none() | st.tuples(AROUND_EXPIRY_MS, st.integers(0, 100) | st.none(), st.booleans()),
)


TaskPlan = tuple[int, int, Tier, int, tuple[int, int | None, bool] | None]


async def _around_one_expiry(redis_url: str, tasks: list[TaskPlan], renews: list[int],
                             releases: list[int], reaps: list[tuple[int, int]]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = _store(client, f"realclock-{uuid.uuid4().hex[:12]}", QUICK)
    ledger = Ledger(TENANTS)
    try:
        # One node with room for a few of the tasks: the rest queue, for the release or reaper.
        await store.publish_state(EPOCH, Zone.GREEN, {"n1": 300})
        for i, (prompt, out, tier, timeout_ms, _) in enumerate(tasks):
            await admit(store, ledger, f"t{i}", "gw", prompt=prompt, out=out, tier=tier,
                         timeout_ms=timeout_ms, tier_timeout_ms=QUICK_TIER_TIMEOUT_MS)
        expiry = await lease_expiry(store, "gw")
        now_us = await redis_now_us(client)
        # Local monotonic time at which Redis' clock reads the expiry (to within a round trip).
        at_expiry = time.monotonic() + ((expiry or now_us) - now_us) / 1e6

        async def at(offset_ms: int) -> None:
            await asyncio.sleep(max(0.0, at_expiry + offset_ms / 1000 - time.monotonic()))

        async def finish(task_id: str, cost: int, plan: tuple[int, int | None, bool]) -> None:
            offset, percent, cancelled = plan
            usage = None if percent is None else cost * percent // 100
            if usage is None and not cancelled:
                usage = 0
            await at(offset)
            result = await store.finish(task_id, usage, cancelled=cancelled)
            ledger.finished(task_id, usage, cancelled, result)

        async def renew(offset: int) -> None:
            await at(offset)
            await store.renew("gw")

        async def release(offset: int) -> None:
            await at(offset)
            ledger.released_by_scheduler(await store.release(EPOCH, (9, 9, 9)))

        async def reap(offset: int, batch: int) -> None:
            await at(offset)
            ledger.reaped_by(await store.reap(batch))

        await asyncio.gather(
            *(finish(f"t{i}", prompt + out, plan)
              for i, (prompt, out, _, _, plan) in enumerate(tasks) if plan is not None),
            *(renew(offset) for offset in renews),
            *(release(offset) for offset in releases),
            *(reap(offset, batch) for offset, batch in reaps))
        for _ in range(20):
            last = await lease_expiry(store, "gw")
            if last is None:
                break
            await sleep_until_redis_us(client, last + 1)
            ledger.reaped_by(await store.reap(REAP_BATCH))
        await ledger.check_redis(client, store.keys)
    finally:
        await delete_prefix(client, store.keys.prefix)
        await client.aclose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tasks=st.lists(TASK_PLANS, min_size=1, max_size=6),
       renews=st.lists(AROUND_EXPIRY_MS, max_size=2),
       releases=st.lists(AROUND_EXPIRY_MS, max_size=2),
       reaps=st.lists(st.tuples(AROUND_EXPIRY_MS, st.sampled_from((1, 2, REAP_BATCH))),
                      min_size=1, max_size=3))
def test_finish_renew_release_and_reap_around_an_expiry_end_each_task_once(
        redis_url: str, tasks: list[TaskPlan], renews: list[int], releases: list[int],
        reaps: list[tuple[int, int]]) -> None:
    asyncio.run(_around_one_expiry(redis_url, tasks, renews, releases, reaps))
