"""What the real-clock tests (tests/test_core_real_clock.py) check Redis against.

`Ledger` is the reference: a plain-Python account of what the scripts replied (tasks created,
released, ended by a finish, counted by the reaper) from which it predicts Redis' own records
once everything has ended. Nothing in it reads a clock: on Redis TIME the order in which a
finish, a renewal and a reap land around a lease's expiry is up to the machine, and every
order must keep the same books.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import redis.asyncio as aioredis

from admission.keys import PoolKeys
from admission.outcomes import AdmitOutcome, AdmitResult, FinishResult, ReapResult, ReleasedTask
from admission.store import PoolStore, TenantQuota
from admission.tiers import Tier

MICRO = 1_000_000
TENANTS = (TenantQuota("acme", rate=0, burst=10**9, max_queued=10_000),
           TenantQuota("umbra", rate=0, burst=10**9, max_queued=10_000))
"""Refill rate 0: only refunds raise a bucket (see `Ledger.check_redis`)."""
TIER_TIMEOUT_MS = 500


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def redis_now_us(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * MICRO + int(micros)


async def sleep_until_redis_us(client: aioredis.Redis, target_us: int) -> None:
    """Until Redis' own clock reads `target_us`: a lease expires only as real time passes, so
    this is the one wait that has no event to await. (Sleeping the gap the server reports
    needs one round, or a second when the local clock runs a little fast.)"""
    for _ in range(100):
        now = await redis_now_us(client)
        if now >= target_us:
            return
        await asyncio.sleep((target_us - now) / MICRO)
    raise AssertionError(f"Redis' clock did not reach {target_us} µs")


async def admit(store: PoolStore, ledger: Ledger, task_id: str, gateway: str, *,
                 prompt: int = 40, out: int = 60, tenant: TenantQuota = TENANTS[0],
                 tier: Tier = Tier.NORMAL, timeout_ms: int = TIER_TIMEOUT_MS,
                 tier_timeout_ms: int = TIER_TIMEOUT_MS) -> AdmitOutcome:
    """Admit one task (on the calling gateway's lease) and book it."""
    result = await store.admit(task_id=task_id, tenant=tenant, tier=tier, prompt_tokens=prompt,
                               max_tokens=out, gateway=gateway, queue_timeout_ms=timeout_ms,
                               tier_timeout_ms=tier_timeout_ms)
    ledger.admitted(task_id, tenant.name, prompt + out, result)
    return result.outcome


async def lease_expiry(store: PoolStore, gateway: str) -> int | None:
    """The gateway's lease expiry, µs of Redis TIME; None when it holds no lease."""
    score = await store.client.zscore(store.keys.leases, gateway)
    return None if score is None else int(score)


class Ledger:
    """The scripts' replies, added up; `check_redis` compares Redis with what they imply."""

    def __init__(self, tenants: tuple[TenantQuota, ...]) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.costs: dict[str, int] = {}
        self.tenant_of: dict[str, str] = {}
        self.released: set[str] = set()
        self.ended_by_finish: dict[str, FinishResult] = {}
        self.charged: Counter[str] = Counter()
        """Usage (tokens) charged to each tenant by finishes of released tasks."""
        self.noop_finishes: Counter[str] = Counter()
        """Finishes that found the task already ended, by the state they found."""
        self.learned = 0
        self.reaped = 0
        self.expired = 0
        self.returned = 0
        self.reap_calls = 0
        self.expired_in_release: set[str] = set()

    def admitted(self, task_id: str, tenant: str, cost: int, result: AdmitResult) -> None:
        if result.outcome not in (AdmitOutcome.RELEASED, AdmitOutcome.QUEUED):
            return
        assert task_id not in self.costs, f"{task_id} created twice"
        self.costs[task_id] = cost
        self.tenant_of[task_id] = tenant
        if result.outcome is AdmitOutcome.RELEASED:
            self.released.add(task_id)

    def released_by_scheduler(self, out: list[ReleasedTask]) -> None:
        # (An admit's reply may be booked after the release of the task it queued.)
        for task in out:
            if task.node is None:
                assert task.task_id not in self.expired_in_release
                self.expired_in_release.add(task.task_id)
            else:
                assert task.task_id not in self.released, f"{task.task_id} released twice"
                self.released.add(task.task_id)

    def finished(self, task_id: str, usage: int | None, cancelled: bool,
                 result: FinishResult) -> None:
        if result.outcome == "noop":
            assert result.refunded == 0, result
            self.noop_finishes[result.previous] += 1
            return
        assert task_id not in self.ended_by_finish, f"{task_id} ended twice by a finish"
        self.ended_by_finish[task_id] = result
        cost = self.costs[task_id]
        if result.previous == "released":
            assert result.outcome == ("cancelled" if cancelled else "settled"), result
            assert result.refunded == (cost if usage is None else cost - usage), result
            self.charged[self.tenant_of[task_id]] += usage or 0
            if usage is not None and not cancelled:
                self.learned += 1
        else:
            assert (result.outcome, result.previous, result.refunded) == (
                "cancelled", "queued", cost), result

    def reaped_by(self, result: ReapResult) -> None:
        self.reap_calls += 1
        self.reaped += result.reaped
        self.expired += result.expired
        self.returned += result.returned_tokens

    @property
    def ends(self) -> int:
        """Tasks the replies say ended: each task counted once per refund it got."""
        return (len(self.ended_by_finish) + self.reaped + self.expired
                + len(self.expired_in_release))

    def summary(self) -> str:
        return (f"created {len(self.costs)}, released {len(self.released)}, finished "
                f"{len(self.ended_by_finish)}, reaped {self.reaped}, expired "
                f"{self.expired + len(self.expired_in_release)}, late finishes "
                f"{dict(self.noop_finishes)}, reap calls {self.reap_calls}")

    async def check_redis(self, client: aioredis.Redis, keys: PoolKeys) -> None:
        """Everything has ended: Redis' records must be what the replies imply, and empty."""
        ids = sorted(self.costs)
        tenants = sorted(self.tenants)
        async with client.pipeline(transaction=True) as pipe:
            for task_id in ids:
                pipe.hget(keys.task_key(task_id), "state")
            for tenant in tenants:
                pipe.hget(keys.bucket_key(tenant), "micro_tokens")
            pipe.hgetall(keys.stats)
            rows: list[Any] = await pipe.execute()
        states = {task_id: text(row) for task_id, row in zip(ids, rows, strict=False)}
        buckets = dict(zip(tenants, rows[len(ids):len(ids) + len(tenants)], strict=True))
        stats = {text(k): int(v) for k, v in rows[-1].items()}

        assert self.released <= set(self.costs) >= self.expired_in_release
        # Exactly once: a task refunded twice is counted twice here, one never ended not at all.
        assert self.ends == len(self.costs), self.summary()
        for task_id, result in self.ended_by_finish.items():
            assert states[task_id] == result.outcome, task_id
        others = Counter(states[t] for t in ids if t not in self.ended_by_finish)
        expected = Counter({"reaped": self.reaped,
                            "expired": self.expired + len(self.expired_in_release)})
        assert others == +expected, self.summary()
        assert stats.get("reaped", 0) == self.reaped
        # Every expiry is counted, by the reaper or by the release that found it past due.
        assert stats.get("expired", 0) == self.expired + len(self.expired_in_release)
        assert stats.get("settled", 0) == self.learned

        # The pool got back exactly what it reserved: by finishes, and by the reaper's count.
        by_finish = sum(self.costs[t] for t, r in self.ended_by_finish.items()
                        if r.previous == "released")
        assert by_finish + self.returned == sum(self.costs[t] for t in self.released)

        # Refill rate 0: only refunds raise a bucket, so a refund paid twice shows to the
        # micro-token (the burst is far above what the tests take, so no cap hides it).
        for tenant in tenants:
            if any(self.tenant_of[t] == tenant for t in ids):
                level = self.tenants[tenant].burst - self.charged[tenant]
                assert int(buckets[tenant]) == level * MICRO, tenant
        await assert_nothing_left(client, keys)


async def assert_nothing_left(client: aioredis.Redis, keys: PoolKeys) -> None:
    """No reservation, guest slot, running entry, lease, queue entry or gateway set left."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.node_reserved)
        pipe.hgetall(keys.node_guests)
        pipe.hgetall(keys.tenant_queued)
        pipe.zcard(keys.running)
        pipe.zcard(keys.leases)
        pipe.zcard(keys.deadlines)
        for queue in keys.queues:
            pipe.zcard(queue)
        pipe.hget(keys.clock, "frozen_us")
        rows: list[Any] = await pipe.execute()
    assert rows[:3] == [{}, {}, {}]
    assert rows[3:-1] == [0] * 6
    assert rows[-1] is None, "these tests run on Redis TIME, never on a frozen clock"
    sets = [key async for key in client.scan_iter(match=keys.gateway_tasks_key("*"))]
    assert sets == []


async def check_reservations(client: aioredis.Redis, keys: PoolKeys, capacity: int) -> None:
    """At any instant (one MULTI), each node's reserved tokens are the sizes of the tasks
    released to it and not ended (the running index), and within its capacity. A second
    refund of a task takes its cost off the node again while the index no longer has it; a
    refund missed leaves the cost on the node after the task left the index."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.node_reserved)
        pipe.zrange(keys.running, 0, -1)
        reserved_raw, running = await pipe.execute()
    reserved = {text(node): int(tokens) for node, tokens in reserved_raw.items()}
    from_index: Counter[str] = Counter()
    for member in running:
        node, prompt, out, _ = text(member).split(" ")
        from_index[node] += int(prompt) + int(out)
    assert reserved == dict(from_index), (reserved, dict(from_index))
    assert all(0 < tokens <= capacity for tokens in reserved.values()), reserved
