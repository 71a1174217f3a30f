"""Stateful property test: random interleavings against real Redis and the reference model.

After every step the whole pool state in Redis is compared with the model, and the invariants
are checked on Redis' own data: budget conservation, exactly-once, FIFO within a tier, strict
tier order, RED rejects new Normal and Batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from admission.errors import FencedError
from admission.outcomes import AdmitOutcome, RejectReason
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, QuotaLevel, TenantQuota
from admission.tiers import Tier, Zone
from tests.fairmodel import expected_fair, read_fair
from tests.model import MICRO, Model
from tests.properties import PROPERTIES, examples
from tests.quotamodel import DAY_US, next_month_day

START_US = 1_700_000_000_000_000
POLICY = PoolPolicy(tier_queue_caps=(4, 5, 6), lease_ttl_ms=3_000, stale_after_ms=4_000,
                    default_retry_ms=500, retention_s=3600, fair_headroom=0.25,
                    fair_light_window_ms=2_000)
CORP = QuotaLevel("corp", rate=300, burst=6_000, monthly_tokens=2_000)
CREW = QuotaLevel("crew", rate=100, burst=1_500, daily_tokens=900)
TENANTS = {
    "alpha": TenantQuota("alpha", rate=50, burst=600, max_queued=4, weight=3.0,
                         max_queued_tokens=900, levels=(CREW, CORP)),
    "beta": TenantQuota("beta", rate=0, burst=500, max_queued=3, daily_tokens=1_200),
    "gamma": TenantQuota("gamma", rate=2_000, burst=5_000, max_queued=8, weight=0.7,
                         max_inflight_tokens=1_000, monthly_tokens=30_000, levels=(CORP,)),
}
BUCKETS = (*sorted(TENANTS), CREW.scope, CORP.scope)
"""Every bucket of the model: the tenants' (key level) and the teams' (enclosing levels)."""
GATEWAYS = ("gw-a", "gw-b", "gw-c")
NODES = ("node-1", "node-2", "node-3")
TIER_TIMEOUT_MS = 8_000
"""Every tier's own queue timeout: tasks queued with it expire in queue order (no deadlines
entry), shorter ones through the deadlines index; the model expires both alike."""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class CoreMachine(RuleBasedStateMachine):
    redis_url = ""
    task_ids = Bundle("task_ids")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.client = aioredis.Redis.from_url(self.redis_url)
        self.store = PoolStore(self.client, register_scripts(self.client), "prop", POLICY)
        self.model = Model(now=START_US, tier_caps=POLICY.tier_queue_caps,
                           lease_ttl_ms=POLICY.lease_ttl_ms,
                           stale_after_ms=POLICY.stale_after_ms,
                           default_retry_ms=POLICY.default_retry_ms,
                           fair_headroom=POLICY.fair_headroom,
                           fair_light_window_ms=POLICY.fair_light_window_ms)
        self.counter = 0
        self.released_ever: set[str] = set()
        self.run(self.client.flushdb())
        self.run(self.client.hset(self.store.keys.clock, "frozen_us", START_US))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.client.aclose())
        self.loop.close()

    # --- rules -----------------------------------------------------------------------------
    @initialize()
    def first_leader_publishes(self) -> None:
        self._publish(1, Zone.GREEN, {"node-1": 800, "node-2": 500}, (0, 0, 0))

    def _publish(self, epoch: int, zone: Zone, caps: Mapping[str, int | tuple[int, int, int]],
                 drain: tuple[int, int, int],
                 dedicated: tuple[frozenset[str], int] = (frozenset(), 0),
                 guests: tuple[int, int] = (0, 0), guest_rate: int = 0,
                 guest_output: int = 0,
                 guests_closed: frozenset[str] = frozenset()) -> None:
        guest_rate = guest_rate if guests[1] else 0
        guest_output = guest_output if guests[1] else 0
        guests_closed = guests_closed if guests[1] else frozenset()
        accepted = self.model.publish_state(epoch, zone.value, caps, drain, dedicated, guests,
                                            guest_rate, guest_output, guests_closed)
        extra: dict[str, str | int | float] = {f"drain_{t}": d for t, d in enumerate(drain)}
        if dedicated[0]:
            extra["dedicated_nodes"] = " ".join(sorted(dedicated[0]))
            extra["dedicated_tiers"] = dedicated[1]
        if guests[1]:
            extra["dedicated_guest_prompt"], extra["dedicated_guest_cap"] = guests
        if guest_rate:
            extra["dedicated_guest_rate"] = guest_rate
        if guest_output:
            extra["dedicated_guest_output"] = guest_output
        if guests_closed:
            extra["dedicated_guests_closed"] = " ".join(sorted(guests_closed))
        if accepted:
            self.run(self.store.publish_state(epoch, zone, caps, extra))
        else:
            with pytest.raises(FencedError):
                self.run(self.store.publish_state(epoch, zone, caps, extra))

    @rule(target=task_ids, tenant=st.sampled_from(sorted(TENANTS)),
          tier=st.sampled_from(list(Tier)), prompt=st.integers(1, 300),
          out=st.integers(0, 300), gateway=st.sampled_from(GATEWAYS),
          timeout_ms=st.one_of(st.just(TIER_TIMEOUT_MS), st.integers(100, TIER_TIMEOUT_MS)))
    def admit(self, tenant: str, tier: Tier, prompt: int, out: int, gateway: str,
              timeout_ms: int) -> str:
        self.counter += 1
        tid = f"t{self.counter}"
        return self._admit(tid, tenant, tier, prompt, out, gateway, timeout_ms)

    @rule(target=task_ids, tier=st.sampled_from([Tier.NORMAL, Tier.BATCH]),
          prompt=st.integers(1, 40), out=st.sampled_from([10, 200]),
          gateway=st.sampled_from(GATEWAYS))
    def admit_short(self, tier: Tier, prompt: int, out: int, gateway: str) -> str:
        """Short prompts of the lower tiers, from the tenant with room: what guests are made of
        (or, asking for 200 output tokens, what a bound on their outputs keeps out)."""
        self.counter += 1
        return self._admit(f"t{self.counter}", "gamma", tier, prompt, out, gateway,
                           TIER_TIMEOUT_MS)

    @rule(tid=task_ids, tenant=st.sampled_from(sorted(TENANTS)))
    def admit_again(self, tid: str, tenant: str) -> None:
        self._admit(tid, tenant, Tier.VIP, 5, 5, "gw-a", 1000)

    def _admit(self, tid: str, tenant: str, tier: Tier, prompt: int, out: int, gateway: str,
               timeout_ms: int) -> str:
        q = TENANTS[tenant]
        zone = self.model.zone
        expected = self.model.admit(tid, tenant, int(tier), prompt + out, q.rate, q.burst,
                                    q.max_queued, timeout_ms, gateway, prompt, q.weight,
                                    q.max_queued_tokens, q.max_inflight_tokens,
                                    q.daily_tokens, q.monthly_tokens, q.levels)
        got = self.run(self.store.admit(task_id=tid, tenant=q, tier=tier, prompt_tokens=prompt,
                                        max_tokens=out, gateway=gateway,
                                        queue_timeout_ms=timeout_ms,
                                        tier_timeout_ms=TIER_TIMEOUT_MS))
        detail = got.node or (got.reason.value if got.reason else "") or (
            got.state.value if got.state else "")
        retry = -1 if got.retry_after_ms is None else got.retry_after_ms
        if got.outcome is not AdmitOutcome.REJECTED:
            retry = 0
        assert (got.outcome.value, detail, retry, got.depth) == expected
        if got.reason is RejectReason.QUOTA:
            assert (got.scope, got.limit) == self.model.last_scope
        if zone == "RED" and tier > 0:
            assert got.outcome in (AdmitOutcome.REJECTED, AdmitOutcome.DUPLICATE)
        if got.outcome is AdmitOutcome.RELEASED:
            self._released_once(tid)
        return tid

    def _released_once(self, tid: str) -> None:
        assert tid not in self.released_ever, f"{tid} released twice"
        self.released_ever.add(tid)

    @rule(limits=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)),
          guests_only=st.frozensets(st.sampled_from((1, 2))))
    def release(self, limits: tuple[int, int, int], guests_only: frozenset[int]) -> None:
        expected = self.model.release(self.model.epoch, limits, guests_only)
        got = self.run(self.store.release(self.model.epoch, limits,
                                          [Tier(t) for t in guests_only]))
        assert [(r.task_id, r.gateway, r.node, int(r.tier)) for r in got] == expected
        # Each release reports the tokens it reserved (the leader counts Batch's share by them).
        assert [r.cost for r in got] == [self.model.tasks[r.task_id].cost if r.node else 0
                                         for r in got]
        released = [r for r in got if r.node is not None]
        for r in released:
            self._released_once(r.task_id)
            if int(r.tier) in guests_only:
                assert r.node in self.model.dedicated_nodes, "held off the shared nodes"
        tiers = [int(r.tier) for r in released]
        assert tiers == sorted(tiers), "a lower tier overtook a higher one"

    @rule()
    def deposed_leader_release_is_refused(self) -> None:
        if self.model.epoch == 0:
            return
        with pytest.raises(FencedError):
            self.run(self.store.release(self.model.epoch - 1, (9, 9, 9)))

    @rule(tid=task_ids, usage=st.one_of(st.none(), st.integers(0, 700)),
          cancelled=st.booleans())
    def finish(self, tid: str, usage: int | None, cancelled: bool) -> None:
        if usage is None and not cancelled:
            usage = 0
        expected = self.model.finish(tid, usage, cancelled)
        got = self.run(self.store.finish(tid, usage, cancelled=cancelled))
        assert (got.outcome, got.previous, got.refunded) == expected

    @rule(tid=task_ids, gateway=st.sampled_from(GATEWAYS))
    def abandon(self, tid: str, gateway: str) -> None:
        expected = self.model.abandon(gateway, tid)
        assert self.run(self.store.abandon(gateway, tid)) == expected

    @rule(gateway=st.sampled_from(GATEWAYS))
    def renew(self, gateway: str) -> None:
        assert self.run(self.store.renew(gateway)) == self.model.renew(gateway)

    @rule()
    def reap(self) -> None:
        got = self.run(self.store.reap(max_tasks=10_000))
        assert (got.reaped, got.expired, got.returned_tokens) == self.model.reap()
        assert not got.more

    @rule(name=st.sampled_from(BUCKETS), min_idle_ms=st.sampled_from([0, 0, 1_000, 60_000]),
          apply=st.booleans(), spent=st.booleans())
    def forget(self, name: str, min_idle_ms: int, apply: bool, spent: bool) -> None:
        """kvgate-prune on a name as if it had left the configuration: only one with nothing
        alive, nothing spent (unless `spent`) and idle long enough loses its keys, and it comes
        back (the next admit) as a name never seen, in Redis as in the model."""
        kind, plain = ("level", name.removeprefix("team:")) if name.startswith("team:") else (
            "tenant", name)
        expected = self.model.forget(kind, plain, min_idle_ms * 1000, apply, spent)
        got = self.run(self.store.forget(kind, plain, min_idle_ms * 1000, apply, spent))
        assert (got.verdict, got.reason, -1 if got.idle_us is None else got.idle_us,
                got.keys) == expected

    def _idle_tenants(self) -> list[str]:
        """Tenants with keys and nothing alive: what kvgate-prune may forget."""
        held, queued = self.model.held(), self.model.tenant_queued()
        return [t for t in sorted(TENANTS) if t in self.model.buckets and not held.get(t)
                and not queued.get(t) and not self.model.ledger.inflight_tokens.get(t)]

    @precondition(lambda self: bool(self._idle_tenants()))
    @rule(data=st.data(), spent=st.booleans())
    def forget_an_idle_tenant(self, data: st.DataObject, spent: bool) -> None:
        """`forget` drawn at random mostly meets names with something alive; this one picks a
        tenant with nothing alive and lets its bucket refill first (15 s: every tenant's burst
        but the one that never refills), so that deletions, and the name's return as a new one
        at its next admit, are common rather than a rare draw."""
        name = data.draw(st.sampled_from(self._idle_tenants()))
        self.advance_time(15_000)
        self.forget(name, 0, True, spent)

    @rule(ms=st.integers(0, 5_000))
    def advance_time(self, ms: int) -> None:
        self.model.now += ms * 1000
        self.run(self.client.hset(self.store.keys.clock, "frozen_us", self.model.now))

    @rule(before_ms=st.integers(0, 3_000), month_end=st.booleans())
    def advance_to_a_new_period(self, before_ms: int, month_end: bool) -> None:
        """Close to the next UTC midnight (or the last one of the month), so that allowances
        roll over while tasks admitted in the old period are still alive."""
        day = self.model.now // DAY_US + 1
        if month_end:
            day = next_month_day(day - 1)
        target = day * DAY_US - before_ms * 1000
        if target > self.model.now:
            self.advance_time((target - self.model.now) // 1000)

    @rule(ms=st.integers(1, 4_000), across=st.booleans())
    def clock_steps_back(self, ms: int, across: bool) -> None:
        """Redis's clock steps back (a failover to a replica whose clock is behind, an NTP
        step) by `ms`; `across`: to `ms` before the last midnight, when that was at most 10 s
        ago (after `advance_to_a_new_period`, often a month's end too), so that tasks are
        admitted and end while the allowances count in the later period."""
        midnight = self.model.now // DAY_US * DAY_US
        if across and self.model.now - midnight <= 10_000_000:
            ms += (self.model.now - midnight) // 1000
        self.model.now -= ms * 1000
        self.run(self.client.hset(self.store.keys.clock, "frozen_us", self.model.now))

    @rule(zone=st.sampled_from(list(Zone)),
          caps=st.dictionaries(st.sampled_from(NODES),
                               st.integers(0, 1500) | st.tuples(*[st.integers(0, 1500)] * 3),
                               max_size=3),
          drain=st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
          new_leader=st.booleans(),
          dedicated_nodes=st.frozensets(st.sampled_from(NODES), max_size=2),
          dedicated_tiers=st.integers(1, 7),
          guests=st.one_of(st.just((0, 0)), st.tuples(st.integers(0, 300), st.integers(1, 3))))
    def scheduler_publishes(self, zone: Zone, caps: dict[str, int | tuple[int, int, int]],
                            drain: tuple[int, int, int], new_leader: bool,
                            dedicated_nodes: frozenset[str], dedicated_tiers: int,
                            guests: tuple[int, int]) -> None:
        dedicated = (dedicated_nodes, dedicated_tiers if dedicated_nodes else 0)
        self._publish(self.model.epoch + int(new_leader), zone, caps, drain, dedicated,
                      guests if dedicated_nodes else (0, 0))

    @rule(prompt_limit=st.integers(0, 300), cap=st.integers(1, 2),
          rate=st.sampled_from([0, 0, 150, 5_000]), output_limit=st.sampled_from([0, 0, 10, 150]),
          closed=st.sampled_from([False, False, True]))
    def scheduler_keeps_a_node_for_vip_with_guests(self, prompt_limit: int, cap: int,
                                                   rate: int, output_limit: int,
                                                   closed: bool) -> None:
        """The random publish above rarely fills a guest cap; this one makes it common, paces
        the guests by their prompts (`rate` tokens/s) or not, and bounds their outputs or not
        (`admit_short` asks for 10 or 200 tokens, `admit` for 0-300), and sometimes closes the
        dedicated node to guests (its engine runs too many sequences)."""
        self._publish(self.model.epoch, Zone.GREEN, dict.fromkeys(NODES, 1_500), self.model.drain,
                      (frozenset({"node-1"}), 1), (prompt_limit, cap), rate,
                      guest_output=output_limit,
                      guests_closed=frozenset({"node-1"}) if closed else frozenset())

    @rule()
    def deposed_leader_publish_is_refused(self) -> None:
        if self.model.epoch > 0:
            self._publish(self.model.epoch - 1, Zone.GREEN, {"node-1": 10**6}, (0, 0, 0))

    # --- comparison and invariants ---------------------------------------------------------
    @invariant()
    def redis_matches_model(self) -> None:
        k = self.store.keys
        ids = sorted(self.model.tasks)

        async def snapshot() -> list[Any]:
            async with self.client.pipeline(transaction=True) as pipe:
                for queue in k.queues:
                    pipe.zrange(queue, 0, -1)
                pipe.hgetall(k.node_reserved)
                pipe.hgetall(k.tenant_queued)
                pipe.zrange(k.leases, 0, -1, withscores=True)
                for name in BUCKETS:
                    key = k.bucket_key(name) if name in TENANTS else k.quota_key(
                        name.removeprefix("team:"))
                    pipe.hmget(key, "micro_tokens", "day", "day_used", "month", "month_used")
                for tid in ids:
                    pipe.hmget(k.task_key(tid), "state", "node", "cost", "quota_day",
                               "quota_month")
                pipe.hgetall(k.node_guests)
                pipe.zrange(k.running, 0, -1)
                pipe.hgetall(k.node_guest_pace)
                result: list[Any] = await pipe.execute()
                return result

        snap = self.run(snapshot())
        m = self.model
        for tier in range(3):
            assert [_s(x) for x in snap[tier]] == m.queues[tier], f"queue {tier} order"
        reserved = {_s(a): int(b) for a, b in snap[3].items()}
        assert reserved == m.reserved
        assert {_s(a): int(b) for a, b in snap[4].items()} == m.tenant_queued()
        assert {_s(a): int(b) for a, b in snap[5]} == m.leases
        for i, name in enumerate(BUCKETS):
            raw, *periods = snap[6 + i]
            bucket = m.buckets.get(name)
            assert (None if raw is None else int(raw)) == (None if bucket is None
                                                           else bucket.level), name
            if bucket is not None:
                assert [None if v is None else int(v) for v in periods] == [
                    bucket.day, bucket.day_used if bucket.day is not None else None,
                    bucket.month, bucket.month_used if bucket.month is not None else None], name
                assert 0 <= int(raw) <= bucket.burst * MICRO
        # Budget conservation on Redis' own records: what each node has reserved is exactly
        # the sum of the costs of the tasks released to it and not finished.
        from_tasks: dict[str, int] = {}
        released: dict[str, tuple[str, int]] = {}
        task_rows = snap[6 + len(BUCKETS):-3]
        # Guest slots: one per task alive as a guest, freed exactly once when it ends.
        assert {_s(a): int(b) for a, b in snap[-3].items()} == m.guests()
        # Paced guests: when each dedicated node takes its next one, to the µs.
        assert {_s(a): int(b) for a, b in snap[-1].items()} == m.guest_paced_until
        for tid, (state, node, cost, day, month) in zip(ids, task_rows, strict=True):
            assert _s(state) == m.tasks[tid].state.value, tid
            # The periods each level counted the task in, which its refund goes back to.
            periods = m.tasks[tid].quota_periods
            assert tuple(None if v is None else _s(v) for v in (day, month)) == (
                (None, None) if not periods else tuple(
                    " ".join("-" if p[j] is None else str(p[j]) for p in periods)
                    for j in (0, 1))), tid
            if _s(state) == "released":
                from_tasks[_s(node)] = from_tasks.get(_s(node), 0) + int(cost)
                released[tid] = (_s(node), int(cost))
        assert from_tasks == reserved
        # The scheduler's running index holds exactly the released tasks, with their sizes.
        indexed: dict[str, tuple[str, int]] = {}
        for member in snap[-2]:
            node, prompt, out, tid = _s(member).split(" ")
            assert tid not in indexed, tid
            indexed[tid] = (node, int(prompt) + int(out))
        assert indexed == released
        assert all(v > 0 for v in reserved.values())
        for t in m.tasks.values():
            assert t.releases <= 1 and t.finishes <= 1

    @invariant()
    def fair_state_matches_model(self) -> None:
        """Counters, virtual times, weights, queued and in-flight tokens, backlogged flows."""
        got = self.run(read_fair(self.client, self.store.keys, sorted(TENANTS)))
        assert got == expected_fair(self.model.ledger, self.model.queues, self.model.tasks)


def test_core_state_machine(redis_url: str) -> None:
    CoreMachine.redis_url = redis_url
    run_state_machine_as_test(
        CoreMachine,
        settings=settings(PROPERTIES, max_examples=examples(300), stateful_step_count=30),
    )
