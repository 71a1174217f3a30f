"""The admission core against a real redis-server: concurrency, crashes, script cache loss."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from admission.errors import FencedError
from admission.keys import PoolKeys, SchedulerKeys
from admission.leadership import leadership
from admission.outcomes import AdmitOutcome, RejectReason, TaskState
from admission.reads import RunningMember, running_member
from admission.scripts import load_scripts, register_scripts, script_source
from admission.store import MAX_USAGE, PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from tests.conftest import PoolRedis

POOL = "core"


@pytest.fixture
async def store(pool_redis: PoolRedis) -> PoolStore:
    """A pool of its own; on an opted-in external Redis when the test asks for nothing else."""
    client = pool_redis.client
    return PoolStore(client, register_scripts(client), pool_redis.pool, PoolPolicy())


def _int(raw: bytes | str | None) -> int:
    assert raw is not None
    return int(raw)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


async def _give_capacity(store: PoolStore, caps: dict[str, int], epoch: int = 1) -> None:
    await store.publish_state(epoch, Zone.GREEN, caps)


async def _wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.05)


async def test_200_concurrent_admits_from_3_clients_admit_exactly_k(redis_url: str) -> None:
    """Check-and-debit is one script: no interleaving lets a 6th request through."""
    k_requests, cost = 5, 100
    tenant = TenantQuota("acme", rate=0, burst=k_requests * cost, max_queued=1000)
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(3)]
    await clients[0].flushdb()
    stores = [PoolStore(c, register_scripts(c), POOL, PoolPolicy()) for c in clients]
    await _give_capacity(stores[0], {"n1": 10**9})

    async def one(i: int) -> Any:
        return await stores[i % 3].admit(
            task_id=f"c{i}", tenant=tenant, tier=Tier.NORMAL, prompt_tokens=60,
            max_tokens=40, gateway=f"gw{i % 3}", queue_timeout_ms=10_000,
        )

    results = await asyncio.gather(*(one(i) for i in range(200)))
    admitted = [f"c{i}" for i, r in enumerate(results) if r.outcome is AdmitOutcome.RELEASED]
    rejected = [r for r in results if r.outcome is AdmitOutcome.REJECTED]
    assert len(admitted) == k_requests
    assert len(rejected) == 200 - k_requests
    # The bucket never refills, but the admitted five hold their reservations until they end:
    # come back (429, the floor hint), not spent for good (429 insufficient_quota).
    assert all(r.reason is RejectReason.QUOTA and r.limit == "held"
               and r.retry_after_ms == PoolPolicy().default_retry_ms for r in rejected)

    keys = PoolKeys(POOL)
    await asyncio.gather(*(stores[i % 3].settle(tid, 37) for i, tid in enumerate(admitted)))
    bucket = await clients[1].hget(keys.bucket_key("acme"), "micro_tokens")
    # Settling refunds cost - usage, so the bucket holds burst - 5 x usage, exactly.
    assert _int(bucket) == (k_requests * cost - k_requests * 37) * 1_000_000
    assert await clients[2].hgetall(keys.node_reserved) == {}
    stats = await clients[0].hgetall(keys.stats)
    assert int(stats[b"settled"]) == k_requests and int(stats[b"settled_usage"]) == 5 * 37
    for c in clients:
        await c.aclose()


async def test_cancel_returns_every_balance_to_its_start(store: PoolStore) -> None:
    redis_client = store.client
    tenant = TenantQuota("acme", rate=0, burst=1_000, max_queued=10)
    await _give_capacity(store, {"n1": 250})
    ids = [f"t{i}" for i in range(6)]
    outcomes = [
        (await store.admit(task_id=tid, tenant=tenant, tier=Tier.BATCH, prompt_tokens=50,
                           max_tokens=50, gateway="gw", queue_timeout_ms=60_000)).outcome
        for tid in ids
    ]
    assert outcomes[:2] == [AdmitOutcome.RELEASED] * 2 and AdmitOutcome.QUEUED in outcomes
    for tid in ids:
        assert (await store.cancel(tid)).outcome == "cancelled"
        assert (await store.cancel(tid)).outcome == "noop"
    keys = store.keys
    assert _int(await redis_client.hget(keys.bucket_key("acme"), "micro_tokens")) == 10**9
    assert await redis_client.hgetall(keys.node_reserved) == {}
    assert await redis_client.hgetall(keys.tenant_queued) == {}
    assert all([await redis_client.zcard(q) == 0 for q in keys.queues])
    assert await redis_client.zcard(keys.deadlines) == 0


@pytest.mark.parametrize("usage", [2**62, 2**63 + 5])
async def test_an_absurd_usage_settles_whole_never_half(store: PoolStore, usage: int) -> None:
    """The script's counters would overflow past 2^63 after the reservation was returned:
    the store bounds what it passes, so the task ends settled, its tokens all charged."""
    tenant = TenantQuota("acme", rate=0, burst=10_000, max_queued=10)
    await _give_capacity(store, {"n1": 10_000})
    outcome = (await store.admit(task_id="big", tenant=tenant, tier=Tier.NORMAL,
                                 prompt_tokens=100, max_tokens=900, gateway="gw",
                                 queue_timeout_ms=60_000)).outcome
    assert outcome is AdmitOutcome.RELEASED
    result = await store.settle("big", usage)
    assert (result.outcome, result.refunded) == ("settled", 1000 - MAX_USAGE)
    assert (await store.task("big") or {}).get("state") == TaskState.SETTLED
    keys = store.keys
    assert await store.client.hgetall(keys.node_reserved) == {}
    assert _int(await store.client.hget(keys.bucket_key("acme"), "micro_tokens")) == 0
    assert _int(await store.client.hget(keys.stats, "settled_usage")) == MAX_USAGE


async def test_only_tasks_that_ran_to_their_end_are_learned_from(
        store: PoolStore, redis_client: aioredis.Redis) -> None:
    """A cancelled task is charged what it used, but its usage does not enter the counters the
    scheduler's usage ratio comes from: it was cut short, not sized that way."""
    tenant = TenantQuota("acme", rate=0, burst=10_000, max_queued=10)
    await _give_capacity(store, {"n1": 10_000})
    for tid in ("done", "cut", "lost"):
        outcome = (await store.admit(task_id=tid, tenant=tenant, tier=Tier.NORMAL,
                                     prompt_tokens=100, max_tokens=900, gateway="gw",
                                     queue_timeout_ms=60_000)).outcome
        assert outcome is AdmitOutcome.RELEASED
    assert (await store.settle("done", 700)).refunded == 300
    assert (await store.cancel("cut", 150)).refunded == 850  # charged its 150 tokens
    assert (await store.cancel("lost")).refunded == 1000
    stats = await redis_client.hgetall(store.keys.stats)
    assert (_int(stats[b"settled"]), _int(stats[b"settled_cost"]),
            _int(stats[b"settled_usage"])) == (1, 1000, 700)
    balance = _int(await redis_client.hget(store.keys.bucket_key("acme"), "micro_tokens"))
    assert balance == (10_000 - 700 - 150) * 1_000_000


GATEWAY_THAT_DIES = """
import asyncio, sys
import redis.asyncio as aioredis
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier

async def main() -> None:
    client = aioredis.Redis.from_url(sys.argv[1])
    store = PoolStore(client, register_scripts(client), sys.argv[2], PoolPolicy(lease_ttl_ms=400))
    tenant = TenantQuota("acme", rate=0, burst=10_000, max_queued=10)
    for i in range(4):
        await store.admit(task_id=f"dead{i}", tenant=tenant, tier=Tier.NORMAL,
                          prompt_tokens=100, max_tokens=200, gateway="gw-doomed",
                          queue_timeout_ms=600_000)
    print("admitted", flush=True)
    while True:  # a live gateway would renew here; this one only waits to be killed
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_killed_gateway_tasks_are_reaped_and_late_settle_is_noop(
    store: PoolStore, redis_client: aioredis.Redis, redis_url: str
) -> None:
    await _give_capacity(store, {"n1": 600})  # two of the four fit; two stay queued
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", GATEWAY_THAT_DIES, redis_url, store.pool,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 10)).strip() == b"admitted"
    proc.send_signal(signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), 5)
    keys = store.keys
    assert _int(await redis_client.hget(keys.node_reserved, "n1")) == 600
    assert await redis_client.zcard(keys.queue(Tier.NORMAL)) == 2

    reaped: list[int] = []

    async def reaped_all() -> bool:
        result = await store.reap()
        reaped.append(result.reaped)
        return sum(reaped) == 4

    await _wait_for(reaped_all, timeout_s=5)
    assert await redis_client.hgetall(keys.node_reserved) == {}
    assert await redis_client.zcard(keys.queue(Tier.NORMAL)) == 0
    assert await redis_client.zcard(keys.leases) == 0
    assert _int(await redis_client.hget(keys.bucket_key("acme"), "micro_tokens")) == 10**10
    for i in range(4):
        assert (await store.task(f"dead{i}") or {}).get("state") == TaskState.REAPED
        late = await store.settle(f"dead{i}", 120)
        assert (late.outcome, late.previous) == ("noop", "reaped")
    assert _int(await redis_client.hget(keys.bucket_key("acme"), "micro_tokens")) == 10**10


async def test_renewing_gateway_keeps_its_tasks(store: PoolStore,
                                                redis_client: aioredis.Redis) -> None:
    await redis_client.hset(store.keys.clock, "frozen_us", 10**15)
    tenant = TenantQuota("acme", rate=0, burst=10_000, max_queued=10)
    await _give_capacity(store, {"n1": 10_000})
    await store.admit(task_id="live", tenant=tenant, tier=Tier.VIP, prompt_tokens=10,
                      max_tokens=10, gateway="gw-live", queue_timeout_ms=1_000)
    ttl_us = store.policy.lease_ttl_ms * 1000
    for step in range(1, 4):  # three TTLs pass, renewed each time before expiry
        await redis_client.hset(store.keys.clock, "frozen_us", 10**15 + step * ttl_us - 1)
        assert await store.renew("gw-live") == 1
        assert (await store.reap()).reaped == 0
    await redis_client.hset(store.keys.clock, "frozen_us", 10**15 + 5 * ttl_us)
    assert (await store.reap()).reaped == 1


async def test_script_flush_mid_test_does_not_break_later_calls(
    store: PoolStore, redis_client: aioredis.Redis
) -> None:
    tenant = TenantQuota("acme", rate=1000, burst=10_000, max_queued=10)
    await _give_capacity(store, {"n1": 10_000})
    await load_scripts(redis_client, store.scripts)
    first = await store.admit(task_id="a", tenant=tenant, tier=Tier.VIP, prompt_tokens=10,
                              max_tokens=10, gateway="gw", queue_timeout_ms=1_000)
    assert first.outcome is AdmitOutcome.RELEASED
    await redis_client.script_flush()
    assert not any(await redis_client.script_exists(store.scripts.admit.sha))
    second = await store.admit(task_id="b", tenant=tenant, tier=Tier.VIP, prompt_tokens=10,
                               max_tokens=10, gateway="gw", queue_timeout_ms=1_000)
    assert second.outcome is AdmitOutcome.RELEASED
    await redis_client.script_flush()
    assert (await store.settle("a", 5)).outcome == "settled"
    await redis_client.script_flush()
    assert (await store.release(1, (5, 5, 5))) == []
    await redis_client.script_flush()
    assert (await store.finish("b", 7, cancelled=False)).outcome == "settled"
    assert all(await redis_client.script_exists(store.scripts.finish.sha))


async def test_lua_key_formats_match_the_key_schema(store: PoolStore,
                                                    redis_client: aioredis.Redis) -> None:
    """Scripts build task, bucket and gateway keys from the prefix; they must be keys.py's."""
    tenant = TenantQuota("t-1", rate=0, burst=1_000, max_queued=5)
    await store.admit(task_id="x1", tenant=tenant, tier=Tier.NORMAL, prompt_tokens=1,
                      max_tokens=1, gateway="gw-9", queue_timeout_ms=60_000)
    await _give_capacity(store, {"n1": 100})
    [released] = await store.release(1, (1, 1, 1))
    assert released.task_id == "x1" and released.node == "n1"
    keys = store.keys
    assert await redis_client.hget(keys.task_key("x1"), "state") == b"released"
    assert await redis_client.smembers(keys.gateway_tasks_key("gw-9")) == {b"x1"}
    await store.settle("x1", 1)  # the refund goes through bucket_key() built in Lua
    assert _int(await redis_client.hget(keys.bucket_key("t-1"), "micro_tokens")) == 999_000_000
    assert await redis_client.smembers(keys.gateway_tasks_key("gw-9")) == set()
    for name in ("task", "bucket", "gateway"):
        assert f"prefix .. '{name}:'" in script_source("release")
    for key in (keys.running, keys.node_guests, keys.node_guest_pace, keys.tenant_inflight):
        assert f"prefix .. '{key.removeprefix(keys.prefix)}'" in script_source("release")


async def test_the_running_index_reads_back_as_the_scripts_wrote_it(
        store: PoolStore, redis_client: aioredis.Redis) -> None:
    """The member format is the scripts' and admission.reads' alone: what admit and release
    write into the running index, running_member parses back (node, sizes, release time)."""
    await redis_client.hset(store.keys.clock, "frozen_us", 10**15)
    tenant = TenantQuota("t", rate=0, burst=10**6, max_queued=10)
    queued = await store.admit(task_id="late", tenant=tenant, tier=Tier.BATCH,
                               prompt_tokens=300, max_tokens=40, gateway="gw",
                               queue_timeout_ms=60_000)
    assert queued.outcome is AdmitOutcome.QUEUED
    await _give_capacity(store, {"n1": 10**6})
    admitted = await store.admit(task_id="now", tenant=tenant, tier=Tier.VIP, prompt_tokens=70,
                                 max_tokens=9, gateway="gw", queue_timeout_ms=60_000)
    assert (admitted.outcome, admitted.node) == (AdmitOutcome.RELEASED, "n1")
    await redis_client.hset(store.keys.clock, "frozen_us", 10**15 + 5)
    [released] = await store.release(1, (0, 0, 1))
    assert (released.task_id, released.node) == ("late", "n1")
    reading = await store.read_tick(control=False, running=True)
    assert reading.running is not None
    parsed = sorted(m for m in (running_member(raw, score) for raw, score in reading.running)
                    if m is not None)
    assert parsed == [RunningMember("n1", 70, 9, 10**15), RunningMember("n1", 300, 40, 10**15 + 5)]
    assert running_member(b"written-by-another-version", 1.0) is None


async def test_retry_hints_come_from_the_state(store: PoolStore,
                                               redis_client: aioredis.Redis) -> None:
    await redis_client.hset(store.keys.clock, "frozen_us", 10**15)
    slow = TenantQuota("slow", rate=40, burst=400, max_queued=10)
    await store.publish_state(1, Zone.GREEN, {"n1": 10**6}, {"drain_0": 4, "drain_1": 6})
    ok = await store.admit(task_id="q1", tenant=slow, tier=Tier.NORMAL, prompt_tokens=100,
                           max_tokens=200, gateway="gw", queue_timeout_ms=1_000)
    assert ok.outcome is AdmitOutcome.RELEASED
    # 100 left, 300 needed: 200 tokens at 40/s is exactly 5 s.
    denied = await store.admit(task_id="q2", tenant=slow, tier=Tier.NORMAL, prompt_tokens=100,
                               max_tokens=200, gateway="gw", queue_timeout_ms=1_000)
    assert (denied.reason, denied.retry_after_ms) == (RejectReason.QUOTA, 5_000)
    huge = await store.admit(task_id="q3", tenant=slow, tier=Tier.NORMAL, prompt_tokens=300,
                             max_tokens=200, gateway="gw", queue_timeout_ms=1_000)
    assert (huge.reason, huge.retry_after_ms) == (RejectReason.EXCEEDS_BURST, None)

    big = TenantQuota("big", rate=0, burst=10**6, max_queued=100)
    await store.publish_state(1, Zone.YELLOW, {"n1": 10**6}, {"drain_0": 4, "drain_1": 6})
    for i in range(29):
        queued = await store.admit(task_id=f"w{i}", tenant=big, tier=Tier.NORMAL,
                                   prompt_tokens=1, max_tokens=1, gateway="gw",
                                   queue_timeout_ms=60_000)
        assert queued.outcome is AdmitOutcome.QUEUED and queued.depth == i + 1
    await store.publish_state(1, Zone.RED, {"n1": 10**6}, {"drain_0": 4, "drain_1": 6})
    red = await store.admit(task_id="r1", tenant=big, tier=Tier.NORMAL, prompt_tokens=1,
                            max_tokens=1, gateway="gw", queue_timeout_ms=60_000)
    # 29 ahead + itself, drained at 4 + 6 tasks/s: 3 s.
    assert (red.reason, red.retry_after_ms, red.depth, red.zone) == (
        RejectReason.ZONE_RED, 3_000, 29, Zone.RED)
    vip = await store.admit(task_id="v1", tenant=big, tier=Tier.VIP, prompt_tokens=1,
                            max_tokens=1, gateway="gw", queue_timeout_ms=60_000)
    assert vip.outcome is AdmitOutcome.RELEASED  # VIP still takes the fast path in RED


async def test_tenant_queue_cap_protects_other_tenants(store: PoolStore) -> None:
    await store.publish_state(1, Zone.YELLOW, {"n1": 10**6})
    flood = TenantQuota("flood", rate=0, burst=10**6, max_queued=3)
    other = TenantQuota("other", rate=0, burst=10**6, max_queued=3)
    results = [
        await store.admit(task_id=f"f{i}", tenant=flood, tier=Tier.NORMAL, prompt_tokens=1,
                          max_tokens=1, gateway="gw", queue_timeout_ms=60_000)
        for i in range(5)
    ]
    assert [r.outcome for r in results].count(AdmitOutcome.QUEUED) == 3
    assert results[-1].reason is RejectReason.TENANT_QUEUE_FULL
    fine = await store.admit(task_id="o1", tenant=other, tier=Tier.NORMAL, prompt_tokens=1,
                             max_tokens=1, gateway="gw", queue_timeout_ms=60_000)
    assert fine.outcome is AdmitOutcome.QUEUED


async def test_leader_lease_and_fencing(redis_client: aioredis.Redis, store: PoolStore) -> None:
    scripts = store.scripts
    a = await leadership(redis_client, scripts, "sched-a", 10_000)
    b = await leadership(redis_client, scripts, "sched-b", 10_000)
    assert a.leading and not b.leading and b.holder == "sched-a"
    await store.publish_state(a.epoch, Zone.GREEN, {"n1": 1})
    await leadership(redis_client, scripts, "sched-b", 10_000, resign=True)  # not the holder
    assert await redis_client.get(SchedulerKeys().leader) == b"sched-a"
    await leadership(redis_client, scripts, "sched-a", 10_000, resign=True)
    b = await leadership(redis_client, scripts, "sched-b", 10_000)
    assert b.leading and b.epoch > a.epoch
    await store.release(b.epoch, (1, 1, 1))
    with pytest.raises(FencedError):
        await store.release(a.epoch, (1, 1, 1))
    with pytest.raises(FencedError):
        await store.publish_state(a.epoch, Zone.RED, {})


async def test_lease_expiry_hands_over(redis_client: aioredis.Redis, store: PoolStore) -> None:
    a = await leadership(redis_client, store.scripts, "sched-a", 150)
    assert a.leading

    async def b_leads() -> bool:
        return (await leadership(redis_client, store.scripts, "sched-b", 150)).leading

    await _wait_for(b_leads, timeout_s=3)
    assert _int(await redis_client.get(SchedulerKeys().epoch)) > a.epoch


async def test_epochs_never_go_backwards_when_redis_loses_its_data(
    redis_client: aioredis.Redis, store: PoolStore
) -> None:
    """A paused leader from before a data loss must not outrank the leader elected after it."""
    old = await leadership(redis_client, store.scripts, "sched-old", 10_000)
    await leadership(redis_client, store.scripts, "sched-old", 10_000, resign=True)
    second = await leadership(redis_client, store.scripts, "sched-2", 10_000)
    assert second.epoch > old.epoch
    await redis_client.flushall()  # a restart without persistence
    new = await leadership(redis_client, store.scripts, "sched-new", 10_000)
    assert new.leading and new.epoch > second.epoch
    await store.publish_state(new.epoch, Zone.GREEN, {"n1": 1})
    with pytest.raises(FencedError):
        await store.release(second.epoch, (1, 1, 1))


async def test_a_failover_that_lost_the_last_increment_cannot_share_an_epoch(
    redis_client: aioredis.Redis, store: PoolStore
) -> None:
    """An asynchronous failover can promote a replica that has the epoch key but not its last
    raise: the next leader must still get a number above the deposed one's, or the scripts
    (which refuse only older epochs) would take both leaders' writes."""
    old = await leadership(redis_client, store.scripts, "sched-old", 10_000)
    await store.publish_state(old.epoch, Zone.GREEN, {"n1": 1})
    # The promoted replica holds the value from before the old leader's raise, and no lease
    # (the lease was set by the same lost write, or expired during the failover).
    await redis_client.set(SchedulerKeys().epoch, old.epoch - 1)
    await redis_client.delete(SchedulerKeys().leader)
    new = await leadership(redis_client, store.scripts, "sched-new", 10_000)
    assert new.leading and new.epoch > old.epoch
    await store.publish_state(new.epoch, Zone.GREEN, {"n1": 1})
    with pytest.raises(FencedError):
        await store.release(old.epoch, (1, 1, 1))


async def test_dedicated_nodes_serve_only_their_tiers_which_try_them_first(
        store: PoolStore) -> None:
    """A node dedicated to VIP takes no Batch even with the most room; VIP fills it first, then
    spills to the shared nodes; the release script places the same way as the fast path."""
    tenant = TenantQuota("acme", rate=0, burst=10**9, max_queued=1000)
    await store.publish_state(1, Zone.GREEN, {"vip-node": 1_000, "shared": 600},
                              {"dedicated_nodes": "vip-node", "dedicated_tiers": 1})

    async def admit(task_id: str, tier: Tier, cost: int) -> Any:
        return await store.admit(task_id=task_id, tenant=tenant, tier=tier,
                                 prompt_tokens=cost // 2, max_tokens=cost - cost // 2,
                                 gateway="gw", queue_timeout_ms=60_000)

    batch = await admit("b1", Tier.BATCH, 400)
    assert (batch.outcome, batch.node) == (AdmitOutcome.RELEASED, "shared")
    vip = await admit("v1", Tier.VIP, 700)
    assert (vip.outcome, vip.node) == (AdmitOutcome.RELEASED, "vip-node")
    spill = await admit("v2", Tier.VIP, 200)  # 300 left on vip-node, 200 on shared
    assert (spill.outcome, spill.node) == (AdmitOutcome.RELEASED, "vip-node")
    spill = await admit("v3", Tier.VIP, 150)  # 100 left on vip-node: the shared node
    assert (spill.outcome, spill.node) == (AdmitOutcome.RELEASED, "shared")
    # 100 free on vip-node, 50 on shared: a Batch task of 80 waits though vip-node has room.
    queued = await admit("b2", Tier.BATCH, 80)
    assert queued.outcome is AdmitOutcome.QUEUED
    assert await store.release(1, (10, 10, 10)) == []
    await store.settle("b1", 400)  # shared has 450 free now
    released = await store.release(1, (10, 10, 10))
    assert [(t.task_id, t.node) for t in released] == [("b2", "shared")]


async def test_paced_guests_wait_their_prompts_share_of_the_rate(
        store: PoolStore, redis_client: aioredis.Redis) -> None:
    """With `dedicated_guest_rate` = 1,000 prompt tokens/s, a guest of 500 tokens keeps the
    dedicated node from taking another guest for 0.5 s (Redis time), on the fast path and in the
    release script alike; VIP is never paced."""
    start = 10**15
    clock = store.keys.clock
    await redis_client.hset(clock, "frozen_us", start)
    tenant = TenantQuota("acme", rate=0, burst=10**9, max_queued=1000)
    extra: dict[str, str | int | float] = {"dedicated_nodes": "vip-node", "dedicated_tiers": 1,
                                           "dedicated_guest_prompt": 1_000,
                                           "dedicated_guest_cap": 10,
                                           "dedicated_guest_rate": 1_000}
    await store.publish_state(1, Zone.GREEN, {"vip-node": 10_000, "shared": 10_000}, extra)

    async def admit(task_id: str, tier: Tier, prompt: int) -> Any:
        return await store.admit(task_id=task_id, tenant=tenant, tier=tier, prompt_tokens=prompt,
                                 max_tokens=10, gateway="gw", queue_timeout_ms=60_000)

    async def paced_until() -> int:
        return _int(await redis_client.hget(store.keys.node_guest_pace, "vip-node"))

    assert (await admit("g1", Tier.NORMAL, 500)).node == "vip-node"
    assert await paced_until() == start + 500_000
    assert (await admit("g2", Tier.NORMAL, 20)).node == "shared"  # paced: not a guest
    assert (await admit("v1", Tier.VIP, 20)).node == "vip-node"
    await redis_client.hset(clock, "frozen_us", start + 499_999)
    assert (await admit("g3", Tier.BATCH, 20)).node == "shared"
    await redis_client.hset(clock, "frozen_us", start + 500_000)
    assert (await admit("g4", Tier.BATCH, 250)).node == "vip-node"
    assert await paced_until() == start + 750_000
    # The release script: a queued guest goes to the dedicated node once the pace allows it.
    await store.publish_state(1, Zone.YELLOW, {"vip-node": 10_000, "shared": 0}, extra)
    assert (await admit("q1", Tier.NORMAL, 100)).outcome is AdmitOutcome.QUEUED
    await store.publish_state(1, Zone.GREEN, {"vip-node": 10_000, "shared": 0}, extra)
    assert await store.release(1, (10, 10, 10)) == []  # paced until +750 ms, shared full
    await redis_client.hset(clock, "frozen_us", start + 800_000)
    released = await store.release(1, (10, 10, 10))
    assert [(t.task_id, t.node) for t in released] == [("q1", "vip-node")]
    # Paced from now, not from the earlier end: the node was idle in between.
    assert await paced_until() == start + 900_000
    assert await redis_client.hget(store.keys.task_key("q1"), "guest") == b"1"


async def test_guests_with_long_outputs_stay_off_the_dedicated_node(store: PoolStore) -> None:
    """With `dedicated_guest_output` = 100, a short prompt asking for 101 output tokens is not a
    guest (a long generation would fill the dedicated node's batch), on the fast path and in the
    release script alike; 100 is; VIP is never bounded."""
    tenant = TenantQuota("acme", rate=0, burst=10**9, max_queued=1000)
    extra: dict[str, str | int | float] = {"dedicated_nodes": "vip-node", "dedicated_tiers": 1,
                                           "dedicated_guest_prompt": 1_000,
                                           "dedicated_guest_cap": 10,
                                           "dedicated_guest_output": 100}
    await store.publish_state(1, Zone.GREEN, {"vip-node": 10_000, "shared": 10_000}, extra)

    async def admit(task_id: str, tier: Tier, max_tokens: int) -> Any:
        return await store.admit(task_id=task_id, tenant=tenant, tier=tier, prompt_tokens=50,
                                 max_tokens=max_tokens, gateway="gw", queue_timeout_ms=60_000)

    assert (await admit("long", Tier.BATCH, 101)).node == "shared"
    assert (await admit("short", Tier.BATCH, 100)).node == "vip-node"
    assert (await admit("vip", Tier.VIP, 4_000)).node == "vip-node"
    # The release script, the shared node full: the long one waits for it, the short one not.
    full = {"vip-node": 10_000, "shared": 0}
    await store.publish_state(1, Zone.YELLOW, full, extra)
    assert (await admit("q-long", Tier.BATCH, 101)).outcome is AdmitOutcome.QUEUED
    await store.publish_state(1, Zone.GREEN, full, extra)
    assert await store.release(1, (10, 10, 10)) == []
    await store.publish_state(1, Zone.GREEN, {"vip-node": 10_000, "shared": 10_000}, extra)
    released = await store.release(1, (10, 10, 10))
    assert [(t.task_id, t.node) for t in released] == [("q-long", "shared")]
    await store.publish_state(1, Zone.YELLOW, full, extra)
    assert (await admit("q-short", Tier.BATCH, 100)).outcome is AdmitOutcome.QUEUED
    await store.publish_state(1, Zone.GREEN, full, extra)
    released = await store.release(1, (10, 10, 10))
    assert [(t.task_id, t.node) for t in released] == [("q-short", "vip-node")]


async def test_guests_of_a_dedicated_node_have_short_prompts_fill_it_first_and_respect_the_cap(
        store: PoolStore, redis_client: aioredis.Redis) -> None:
    """Work of other tiers with a short prompt goes to the node dedicated to VIP first, as a guest,
    at most `dedicated_guest_cap` alive there; each ending (settle, cancel, reap) frees its
    slot exactly once; long prompts never go there."""
    await redis_client.hset(store.keys.clock, "frozen_us", 10**15)
    tenant = TenantQuota("acme", rate=0, burst=10**9, max_queued=1000)
    await store.publish_state(1, Zone.GREEN, {"vip-node": 10_000, "shared": 10_000},
                              {"dedicated_nodes": "vip-node", "dedicated_tiers": 1,
                               "dedicated_guest_prompt": 500, "dedicated_guest_cap": 2})

    async def admit(task_id: str, tier: Tier, prompt: int, gateway: str = "gw") -> Any:
        return await store.admit(task_id=task_id, tenant=tenant, tier=tier, prompt_tokens=prompt,
                                 max_tokens=100, gateway=gateway, queue_timeout_ms=60_000)

    async def guests() -> dict[str, int]:
        raw = await redis_client.hgetall(store.keys.node_guests)
        return {_text(k): int(v) for k, v in raw.items()}

    long = await admit("long", Tier.NORMAL, 501)
    assert long.node == "shared"
    first = await admit("g1", Tier.BATCH, 500)
    second = await admit("g2", Tier.NORMAL, 20, gateway="gw-dies")
    # The cap is reached: the next short one goes to the shared node, with less room.
    third = await admit("g3", Tier.NORMAL, 20)
    assert [first.node, second.node, third.node] == ["vip-node", "vip-node", "shared"]
    assert await guests() == {"vip-node": 2}
    assert await redis_client.hget(store.keys.task_key("g3"), "guest") is None
    # VIP is no guest: it takes its node whatever the guests.
    assert (await admit("v1", Tier.VIP, 20)).node == "vip-node"
    assert await guests() == {"vip-node": 2}

    await store.settle("g1", 300)
    await store.settle("g1", 300)  # a repeat frees nothing more
    assert await guests() == {"vip-node": 1}
    # Queued work released by the scheduler takes the slot the same way.
    await store.publish_state(1, Zone.YELLOW, {"vip-node": 10_000, "shared": 10_000},
                              {"dedicated_nodes": "vip-node", "dedicated_tiers": 1,
                               "dedicated_guest_prompt": 500, "dedicated_guest_cap": 2})
    assert (await admit("q1", Tier.BATCH, 400)).outcome is AdmitOutcome.QUEUED
    assert (await admit("q2", Tier.BATCH, 400)).outcome is AdmitOutcome.QUEUED
    released = await store.release(1, (10, 10, 10))
    assert [(t.task_id, t.node) for t in released] == [("q1", "vip-node"), ("q2", "shared")]
    assert await guests() == {"vip-node": 2}
    await store.cancel("q1")
    # The gateway holding g2 dies: the reaper frees its slot; nothing is left on the node.
    await redis_client.hset(store.keys.clock, "frozen_us",
                            10**15 + store.policy.lease_ttl_ms * 1000 + 1)
    await store.renew("gw")
    assert (await store.reap()).reaped == 1
    assert await guests() == {}


async def test_tasks_with_their_tiers_timeout_expire_from_the_queue_head_without_an_index(
        store: PoolStore, redis_client: aioredis.Redis) -> None:
    tenant = TenantQuota("acme", rate=0, burst=10**9, max_queued=1000)
    keys = store.keys
    start = 1_700_000_000_000_000
    await redis_client.hset(keys.clock, "frozen_us", start)

    async def queue(task_id: str, timeout_ms: int) -> None:
        result = await store.admit(task_id=task_id, tenant=tenant, tier=Tier.BATCH,
                                   prompt_tokens=10, max_tokens=10, gateway="gw",
                                   queue_timeout_ms=timeout_ms, tier_timeout_ms=10_000)
        assert result.outcome is AdmitOutcome.QUEUED  # no capacity published: all queue

    await queue("own-1", 10_000)
    await queue("own-2", 10_000)
    await queue("short", 2_000)  # a client's shorter deadline, behind two that wait longer
    assert await redis_client.zrange(keys.deadlines, 0, -1) == [b"short"]
    await redis_client.hset(keys.clock, "frozen_us", start + 3_000_000)
    assert (await store.reap()).expired == 1
    assert (await store.task("short") or {}).get("state") == "expired"
    await redis_client.hset(keys.clock, "frozen_us", start + 10_000_000)
    await store.renew("gw")  # the gateway is alive: its tasks expire, they are not reaped
    assert (await store.reap()).expired == 2
    assert await redis_client.zcard(keys.queue(Tier.BATCH)) == 0
    assert await redis_client.hgetall(keys.tenant_queued) == {}


async def test_every_expiry_is_counted_in_stats_whoever_finds_it(
        store: PoolStore, redis_client: aioredis.Redis) -> None:
    """Queued tasks past their deadline end as 'expired' when the reaper or a release meets
    them first; operators read the total with HGETALL stats, so both count it."""
    tenant = TenantQuota("t", rate=1_000_000, burst=1_000_000_000, max_queued=100)
    keys = store.keys
    start = 1_700_000_000_000_000
    await redis_client.hset(keys.clock, "frozen_us", start)
    for task_id in ("a", "b", "c"):
        result = await store.admit(task_id=task_id, tenant=tenant, tier=Tier.NORMAL,
                                   prompt_tokens=10, max_tokens=10, gateway="gw",
                                   queue_timeout_ms=1_000, tier_timeout_ms=10_000)
        assert result.outcome is AdmitOutcome.QUEUED
    await redis_client.hset(keys.clock, "frozen_us", start + 2_000_000)
    await store.renew("gw")
    released = await store.release(1, (10, 10, 10))
    assert sorted(t.task_id for t in released if t.node is None) == ["a", "b", "c"]
    stats = await redis_client.hgetall(keys.stats)
    assert int(stats[b"expired"]) == 3


async def test_a_large_pools_state_is_published_whole(store: PoolStore) -> None:
    """The leader publishes about eleven figures per node beside the zone: past a few hundred
    nodes, passing them to one HSET overran Lua's stack (8,000 values) after the capacities
    and the state hash had been rewritten, leaving the hash without its placement fields, and
    every tick failed before it could release anything."""
    nodes = [f"n{i}" for i in range(600)]
    extra: dict[str, str | int | float] = {"dedicated_nodes": "", "pool_usage": "0.4100"}
    for node in nodes:
        extra.update({f"{name}:{node}": 1 for name in (
            "usage", "projected", "prefill_window", "prefill_backlog", "prefill_room",
            "prefill_rate", "prefill_gain", "running_limit", "decode_step_ms",
            "calm_step_ms", "vip_miss")})
    await store.publish_state(1, Zone.GREEN, {node: 1000 for node in nodes}, extra)
    published = await store.client.hgetall(store.keys.state)
    assert len(published) == 3 + len(extra)  # epoch, zone, updated_us and every extra field
    assert published[b"pool_usage"] == b"0.4100" and published[b"vip_miss:n599"] == b"1"
