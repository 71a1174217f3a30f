"""YELLOW's Normal rate shared with light tenants, on a real redis-server.

In YELLOW the leader releases Normal at `yellow_normal_rate`. In a pool that holds room back
for light tenants, each release call leaves a credit of that rate in the pool's stats hash
(`normal_credit`), which a light tenant's request (first in the fair order beside others'
backlog) takes on the fast path at once; what they take is owed by the leader's rate bucket,
so the flood's next releases wait while the refill pays it (lua/release.lua ARGV[11..12],
scheduler/policy.py `light_credit`).

- directed: the credit is set, taken and charged as the scripts' headers say; without one (or
  in FIFO order) nothing of it applies;
- property: any sequence of light arrivals and leader ticks gives the replies and the credit
  of a plain-Python reference, and the Normal tasks released in a YELLOW spell (queue and fast
  path) never exceed the credit plus the rate times the time elapsed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from admission.config import ZoneSettings
from admission.outcomes import Released
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from scheduler.policy import ReleasePolicy
from tests.properties import PROPERTIES, examples

START_US = 1_800_000_000_000_000
BIG = 10**9


def quota(name: str) -> TenantQuota:
    return TenantQuota(name, rate=BIG, burst=BIG, max_queued=10_000)


def fair_store(client: aioredis.Redis, fair: bool = True, pool: str = "fair") -> PoolStore:
    policy = PoolPolicy(tier_queue_caps=(10_000, 10_000, 10_000), stale_after_ms=0,
                        fair=fair, fair_headroom=0.1 if fair else 0.0,
                        fair_light_window_ms=5_000)
    return PoolStore(client, register_scripts(client), pool, policy)


async def admit(store: PoolStore, task_id: str, tenant: str, cost: int = 100) -> str:
    got = await store.admit(task_id=task_id, tenant=quota(tenant), tier=Tier.NORMAL,
                            prompt_tokens=cost // 2, max_tokens=cost - cost // 2, gateway="gw",
                            queue_timeout_ms=600_000)
    return got.outcome.value


async def flood(store: PoolStore, client: aioredis.Redis, queued: int) -> None:
    """Tenant a holds 5 x 10,000 tokens in flight (released in GREEN) and queues `queued` more
    in YELLOW: far above its share of the in-flight tokens whenever a light tenant shows up."""
    await client.hset(store.keys.clock, "frozen_us", START_US)
    await store.publish_state(1, Zone.GREEN, {"node": BIG})
    assert [await admit(store, f"a-{i}", "a", 10_000) for i in range(5)] == ["released"] * 5
    await store.publish_state(1, Zone.YELLOW, {"node": BIG})
    for i in range(queued):
        assert await admit(store, f"a-q{i}", "a") == "queued"


async def credit(client: aioredis.Redis, store: PoolStore) -> int:
    return int(await client.hget(store.keys.stats, "normal_credit") or 0)


def ids(released: Released) -> list[str]:
    return [t.task_id for t in released]


async def test_light_tenants_take_the_credit_at_once_and_it_is_charged(
        redis_client: aioredis.Redis) -> None:
    store = fair_store(redis_client)
    await flood(store, redis_client, 10)
    assert await admit(store, "b-0", "b") == "queued"  # no credit yet; b is light from here
    # b's queued task first (light), then a's: the credit holds nothing back from the limit.
    got = await store.release(1, (0, 3, 0), credit=(2, 0))
    assert ids(got) == ["b-0", "a-q0", "a-q1"]
    assert (got.credit_before, got.credit_after) == (0, 2)
    assert await credit(redis_client, store) == 2
    # Light tenants' requests take it on the fast path, one task each; a's keeps queuing.
    assert [await admit(store, t, t[0]) for t in ("b-1", "c-0", "a-x", "b-2")] == [
        "released", "released", "queued", "queued"]
    assert await credit(redis_client, store) == 0
    assert int(await redis_client.hget(store.keys.stats, "credit_used") or 0) == 2
    # The next call was told the last credit was 2 and finds 0: both were taken, so a new
    # credit of 2 is 0 until the leader's bucket has paid them (it owes what was taken).
    got = await store.release(1, (0, 1, 0), credit=(2, 2))
    assert ids(got) == ["b-2"]
    assert (got.credit_before, got.credit_after) == (0, 0)
    got = await store.release(1, (0, 1, 0), credit=(2, 0))
    assert ids(got) == ["a-q2"]
    assert (got.credit_before, got.credit_after) == (0, 2)
    # Nothing taken: a credit of 0 (RED) clears it.
    got = await store.release(1, (0, 0, 0), credit=(0, 2))
    assert (got.credit_before, got.credit_after) == (2, 0)
    assert await credit(redis_client, store) == 0


async def test_no_credit_leaves_it_alone_and_fifo_and_green_take_none(
        redis_client: aioredis.Redis) -> None:
    store = fair_store(redis_client)
    await flood(store, redis_client, 5)
    assert await admit(store, "b-0", "b") == "queued"
    await redis_client.hset(store.keys.stats, "normal_credit", 3)
    got = await store.release(1, (0, 3, 0))
    assert ids(got) == ["b-0", "a-q0", "a-q1"]
    assert (got.credit_before, got.credit_after) == (0, 0)
    assert await credit(redis_client, store) == 3
    # A light tenant takes it; in GREEN the fast path needs none (and takes none).
    assert await admit(store, "c-0", "c") == "released"
    assert await credit(redis_client, store) == 2
    await store.publish_state(1, Zone.GREEN, {"node": BIG})
    assert await admit(store, "d-0", "d") == "released"
    assert await credit(redis_client, store) == 2
    # FIFO order: YELLOW queues Normal whatever credit the stats hash holds.
    fifo = fair_store(redis_client, fair=False, pool="fifo")
    await fifo.publish_state(1, Zone.YELLOW, {"node": BIG})
    await redis_client.hset(fifo.keys.stats, "normal_credit", 3)
    await flood(fifo, redis_client, 1)
    assert await admit(fifo, "e-0", "e") == "queued"
    assert await credit(redis_client, fifo) == 3


@dataclass
class Reference:
    """The credit and the light tenants' queue as the scripts' headers describe them."""

    credit: int = 0
    queued: list[str] = field(default_factory=list)
    """Light tenants' queued tasks, oldest first (each tenant's own oldest first)."""

    def admit(self, tenant: str, zone: Zone) -> str:
        if tenant in self.queued or (zone is Zone.YELLOW and self.credit < 1):
            self.queued.append(tenant)
            return "queued"
        if zone is Zone.YELLOW:
            self.credit -= 1
        return "released"

    def release(self, limit: int, allowance: int, last: int) -> tuple[int, int, int, int]:
        """(light released, a's released, credit found, credit left) of one call."""
        before = self.credit
        light = min(limit, len(self.queued))
        del self.queued[:light]
        self.credit = max(0, allowance - max(0, last - before))
        return light, limit - light, before, self.credit


BATCH = 4
"""The leader's release batch: GREEN's limit per call (a's 200 queued last the run)."""
steps = st.lists(st.tuples(st.integers(0, 100), st.sampled_from([Zone.YELLOW] * 3 + [Zone.GREEN]),
                           st.lists(st.sampled_from("bc"), max_size=4), st.booleans()),
                 min_size=1, max_size=30)


@settings(PROPERTIES, max_examples=examples(25))
@given(rate=st.sampled_from([5.0, 20.0, 50.0]), plan=steps)
def test_the_yellow_rate_holds_with_the_light_tenants_credit(
        redis_url: str, rate: float, plan: list[tuple[int, Zone, list[str], bool]]) -> None:
    """A GREEN tick leaves the credit whole; then each step: `dt` ms pass, the pool is in
    `zone` (GREEN or YELLOW), light tenants b and c send requests (each settled at once when
    released, so they stay under their share), and the leader may tick (limits, a release with
    the credit, the policy told what it took). a floods with 200 queued. What YELLOW released
    (fast path and leader) never exceeds a second of the rate plus the rate times the time
    spent in YELLOW, however the spells alternate."""

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.flushdb()
            store = fair_store(client)
            await flood(store, client, 200)
            await store.publish_state(1, Zone.GREEN, {"node": BIG})
            policy = ReleasePolicy(ZoneSettings(yellow_normal_rate=rate), batch_size=BATCH,
                                   now=0.0, light=True)
            whole = policy.light_credit(Zone.GREEN, 0)
            got = await store.release(1, (0, 0, 0), credit=(whole, policy.credit_out))
            policy.released(Zone.GREEN, [0, 0, 0], credit=(got.credit_before, got.credit_after))
            ref = Reference(credit=whole)
            counts = {"in_yellow": 0}

            async def leader_tick(zone: Zone, now_ms: int) -> None:
                limits = policy.limits(zone, now_ms / 1000)
                allowance = policy.light_credit(zone, limits[Tier.NORMAL])
                last = policy.credit_out
                out = await store.release(1, limits, credit=(allowance, last))
                light, heavy, before, after = ref.release(limits[Tier.NORMAL], allowance, last)
                assert sum(1 for t in out if t.task_id.startswith("a-")) == heavy
                assert len(out) == light + heavy
                assert (out.credit_before, out.credit_after) == (before, after)
                policy.released(zone, [0, len(out), 0],
                                credit=(out.credit_before, out.credit_after))
                counts["in_yellow"] += len(out) if zone is Zone.YELLOW else 0
                for t in out:
                    if not t.task_id.startswith("a-"):
                        await store.settle(t.task_id, 100)

            now_ms, yellow_ms, n, zone_was = 0, 0, 0, Zone.GREEN
            for dt, zone, senders, tick in plan:
                now_ms += dt
                if zone_was is Zone.YELLOW:
                    yellow_ms += dt
                await client.hset(store.keys.clock, "frozen_us", START_US + now_ms * 1000)
                if zone is not zone_was:
                    # The zone changes at a tick of the leader, which publishes it and releases.
                    await store.publish_state(1, zone, {"node": BIG})
                    zone_was = zone
                    await leader_tick(zone, now_ms)
                for tenant in senders:
                    n += 1
                    got_one = await admit(store, f"{tenant}-{n}", tenant)
                    assert got_one == ref.admit(tenant, zone)
                    if got_one == "released":
                        counts["in_yellow"] += zone is Zone.YELLOW
                        await store.settle(f"{tenant}-{n}", 100)
                if tick:
                    await leader_tick(zone, now_ms)
                assert await credit(client, store) == ref.credit
                # The rate's bound: a second of it plus what it refilled in YELLOW.
                assert counts["in_yellow"] <= whole + rate * yellow_ms / 1000 + 1e-9
        finally:
            await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("light", [True, False])
def test_the_credit_is_a_second_of_the_rate_and_what_is_taken_is_owed(light: bool) -> None:
    policy = ReleasePolicy(ZoneSettings(yellow_normal_rate=10.0), batch_size=500, now=0.0,
                           light=light)
    assert policy.limits(Zone.GREEN, 0.0) == (500, 500, 500)
    # A second of 10/s, kept in GREEN too (whole when the pool turns YELLOW), none in RED.
    assert policy.light_credit(Zone.GREEN, 500) == (10 if light else 0)
    assert policy.light_credit(Zone.RED, 0) == 0
    policy.released(Zone.GREEN, [0, 0, 0], credit=(0, policy.light_credit(Zone.GREEN, 500)))
    # Entering YELLOW the bucket starts empty, credit or not.
    assert policy.limits(Zone.YELLOW, 0.0) == (500, 0, 0)
    if not light:
        assert policy.light_credit(Zone.YELLOW, 0) == 0
        return
    assert policy.light_credit(Zone.YELLOW, 0) == 10
    # Light tenants took 6 of the 10: the bucket owes 6 and the next credit is 4 less...
    policy.released(Zone.YELLOW, [0, 0, 0], credit=(4, 4))
    assert policy.limits(Zone.YELLOW, 0.5) == (500, 0, 0)  # -6 + 5
    assert policy.light_credit(Zone.YELLOW, 0) == 9
    # ...and the flood gets nothing until the refill has paid the debt.
    assert policy.limits(Zone.YELLOW, 0.75) == (500, 1, 0)  # -1 + 2.5
    policy.released(Zone.YELLOW, [0, 1, 0], credit=(4, 9))  # none taken since
    assert policy.limits(Zone.YELLOW, 0.75) == (500, 0, 0)
    # A debt outlives a spell in GREEN: taken ahead in one spell, paid in the next.
    policy.released(Zone.YELLOW, [0, 0, 0], credit=(2, 2))  # 7 of the 9 taken: 0.5 - 7
    assert policy.limits(Zone.GREEN, 1.0) == (500, 500, 500)
    assert policy.light_credit(Zone.GREEN, 500) == 3  # 10 less the 7 owed (-6.5)
    assert policy.limits(Zone.YELLOW, 1.0) == (500, 0, 0)
    assert policy.limits(Zone.YELLOW, 1.5) == (500, 0, 0)  # -6.5 + 5
    assert policy.limits(Zone.YELLOW, 1.75) == (500, 1, 0)  # -1.5 + 2.5
