"""Stateful property test of fair release: the Lua scripts against the reference model
(tests/model.py with tests/fairmodel.py), on a real redis-server, with two clients enqueuing at
the same time.

Each step is an admit, a pair of admit sequences sent concurrently by two clients (two
connections, two `PoolStore`s: two gateways), a release, a settle or cancel, a publish of new
room, or time passing. Redis runs the two sequences in some interleaving; the test finds the
interleavings of the model that give the replies Redis gave, and keeps the one whose state is
Redis' state (queues, counters, flows). After every step: the tenants' counters, virtual times,
weights, queued and in-flight tokens and backlogged flows equal the model's, and every release
call returns the tasks in the model's order.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from admission.outcomes import AdmitOutcome, AdmitResult
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from tests.fairmodel import expected_fair, read_fair
from tests.model import Model
from tests.properties import PROPERTIES, examples

START_US = 1_800_000_000_000_000
POLICY = PoolPolicy(tier_queue_caps=(1_000, 1_000, 1_000), lease_ttl_ms=60_000,
                    stale_after_ms=0, default_retry_ms=500, retention_s=3600, fair=True,
                    fair_headroom=0.3, fair_light_window_ms=3_000)
TENANTS = {
    "ant": TenantQuota("ant", rate=10**6, burst=10**7, max_queued=1_000, weight=1.0),
    "bee": TenantQuota("bee", rate=10**6, burst=10**7, max_queued=1_000, weight=3.0,
                       max_inflight_tokens=1_200),
    "cat": TenantQuota("cat", rate=10**6, burst=10**7, max_queued=1_000, weight=0.5,
                       max_queued_tokens=2_000),
    "dog": TenantQuota("dog", rate=10**6, burst=10**7, max_queued=1_000, weight=1.0,
                       max_inflight_tokens=900, max_queued_tokens=1_500),
}
TIMEOUT_MS = 20_000
NODES = ("n1", "n2")

Admit = tuple[str, Tier, int, int]
"""(tenant, tier, prompt tokens, max tokens)."""
admits = st.tuples(st.sampled_from(sorted(TENANTS)),
                   st.sampled_from([Tier.NORMAL, Tier.NORMAL, Tier.BATCH, Tier.VIP]),
                   st.integers(1, 400), st.integers(0, 400))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reply(got: AdmitResult) -> tuple[str, str]:
    return got.outcome.value, got.node or (got.reason.value if got.reason else "")


def interleavings(a: Sequence[Any], b: Sequence[Any]) -> Iterator[list[Any]]:
    """Every merge of `a` and `b` that keeps each one's own order."""
    n = len(a) + len(b)
    for positions in itertools.combinations(range(n), len(a)):
        out, ia, ib = [], iter(a), iter(b)
        for i in range(n):
            out.append(next(ia) if i in positions else next(ib))
        yield out


class FairMachine(RuleBasedStateMachine):
    redis_url = ""
    task_ids = Bundle("task_ids")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clients = [aioredis.Redis.from_url(self.redis_url) for _ in range(2)]
        self.stores = [PoolStore(c, register_scripts(c), "fair", POLICY) for c in self.clients]
        self.client, self.store = self.clients[0], self.stores[0]
        self.model = Model(now=START_US, tier_caps=POLICY.tier_queue_caps,
                           lease_ttl_ms=POLICY.lease_ttl_ms, stale_after_ms=0,
                           default_retry_ms=POLICY.default_retry_ms, fair=True,
                           fair_headroom=POLICY.fair_headroom,
                           fair_light_window_ms=POLICY.fair_light_window_ms)
        self.counter = 0
        self.run(self.client.flushdb())
        self.run(self.client.hset(self.store.keys.clock, "frozen_us", START_US))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        for c in self.clients:
            self.run(c.aclose())
        self.loop.close()

    def _new_id(self) -> str:
        self.counter += 1
        return f"t{self.counter}"

    def _model_admit(self, model: Model, tid: str, a: Admit, gateway: str) -> tuple[str, str]:
        tenant, tier, prompt, out = a
        q = TENANTS[tenant]
        outcome, detail, _, _ = model.admit(tid, tenant, int(tier), prompt + out, q.rate,
                                            q.burst, q.max_queued, TIMEOUT_MS, gateway,
                                            prompt, q.weight, q.max_queued_tokens,
                                            q.max_inflight_tokens)
        return outcome, detail if outcome != "queued" else ""

    async def _admit(self, store: PoolStore, tid: str, a: Admit, gateway: str) -> AdmitResult:
        tenant, tier, prompt, out = a
        return await store.admit(task_id=tid, tenant=TENANTS[tenant], tier=tier,
                                 prompt_tokens=prompt, max_tokens=out, gateway=gateway,
                                 queue_timeout_ms=TIMEOUT_MS, tier_timeout_ms=TIMEOUT_MS)

    @initialize()
    def publish_first(self) -> None:
        self._publish(Zone.YELLOW, {"n1": 600, "n2": 300})

    def _publish(self, zone: Zone, caps: dict[str, int]) -> None:
        assert self.model.publish_state(1, zone.value, caps, (0, 0, 0))
        self.run(self.store.publish_state(1, zone, caps, {}))

    @rule(target=task_ids, a=admits)
    def admit(self, a: Admit) -> str:
        tid = self._new_id()
        expected = self._model_admit(self.model, tid, a, "gw-a")
        got = self.run(self._admit(self.store, tid, a, "gw-a"))
        assert _reply(got) == expected
        return tid

    @rule(first=st.lists(admits, min_size=1, max_size=3),
          second=st.lists(admits, min_size=1, max_size=3))
    def two_gateways_enqueue_at_once(self, first: list[Admit], second: list[Admit]) -> None:
        """Two clients on their own connections send their admits at the same time; some
        interleaving of the two sequences must explain Redis' replies and state."""
        a = [(self._new_id(), x, "gw-a", 0) for x in first]
        b = [(self._new_id(), x, "gw-b", 1) for x in second]

        async def send(batch: list[tuple[str, Admit, str, int]]) -> list[AdmitResult]:
            return [await self._admit(self.stores[i], tid, x, gw) for tid, x, gw, i in batch]

        async def both() -> tuple[list[AdmitResult], list[AdmitResult]]:
            ra, rb = await asyncio.gather(send(a), send(b))
            return ra, rb

        got_a, got_b = self.run(both())
        got = {tid: _reply(r) for (tid, *_), r in zip(a + b, got_a + got_b, strict=True)}
        assert all(r.outcome is not AdmitOutcome.DUPLICATE for r in got_a + got_b)
        actual = self.run(self._snapshot())
        for order in interleavings(a, b):
            model = copy.deepcopy(self.model)
            replies = {tid: self._model_admit(model, tid, x, gw) for tid, x, gw, _ in order}
            if replies == got and self._model_snapshot(model) == actual:
                self.model = model
                return
        raise AssertionError(f"no interleaving of {a} and {b} explains {got}")

    async def _snapshot(self) -> tuple[Any, ...]:
        k = self.store.keys
        queues = [[_s(x) for x in await self.client.zrange(q, 0, -1)] for q in k.queues]
        fair = await read_fair(self.client, k, sorted(TENANTS))
        reserved = {_s(n): int(v) for n, v in (await self.client.hgetall(
            k.node_reserved)).items()}
        return queues, fair, reserved

    def _model_snapshot(self, model: Model) -> tuple[Any, ...]:
        return ([list(q) for q in model.queues],
                expected_fair(model.ledger, model.queues, model.tasks), model.reserved)

    @rule(limits=st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(0, 6)))
    def release(self, limits: tuple[int, int, int]) -> None:
        expected = self.model.release(1, limits)
        got = self.run(self.store.release(1, limits))
        assert [(r.task_id, r.node, int(r.tier)) for r in got] == [
            (tid, node, tier) for tid, _, node, tier in expected or []]

    @rule(heavy=st.sampled_from(sorted(TENANTS)), light=st.sampled_from(sorted(TENANTS)),
          big=st.integers(150, 450), small=st.integers(2, 120), n=st.integers(2, 5),
          usage=st.integers(0, 450))
    def noisy_neighbour(self, heavy: str, light: str, big: int, small: int, n: int,
                        usage: int) -> None:
        """One tenant floods a GREEN tier with large requests, another sends a small one, one
        of the first tenant's tasks ends, the leader releases: the shape in which a release
        holds room back for a light tenant (fair_keep() in lua/_tenant.lua). Every step is checked
        against the model as the single rules check it."""
        self._publish(Zone.GREEN, {"n1": 700, "n2": 350})
        flood = [self.admit((heavy, Tier.NORMAL, big // 2, big - big // 2)) for _ in range(n)]
        self.admit((light, Tier.NORMAL, small // 2, small - small // 2))
        running = [t for t in flood
                   if t in self.model.tasks and self.model.tasks[t].state.value == "released"]
        if running:
            self.finish(running[0], min(usage, self.model.tasks[running[0]].cost), False)
        self.release((0, 6, 0))

    @rule(away=st.sampled_from(sorted(TENANTS)), other=st.sampled_from(sorted(TENANTS)),
          n=st.integers(1, 3), cost=st.integers(60, 300), served=st.integers(1, 4),
          usage=st.integers(0, 300))
    def away_while_its_tasks_run(self, away: str, other: str, n: int, cost: int, served: int,
                                 usage: int) -> None:
        """A tenant's tasks are released and its queue empties while another is served on;
        it queues again (lifted against a counter that holds those tasks' full charges), and
        they end having used less: the shape in which a refund is capped by the lift's room
        (flow_settle() in lua/_tenant.lua). Every step is checked as the single rules are."""
        assume(away != other)
        self._publish(Zone.YELLOW, {"n1": 1500, "n2": 1500})
        half = cost // 2
        mine = [self.admit((away, Tier.NORMAL, half, cost - half)) for _ in range(n)]
        for _ in range(n + served):
            self.admit((other, Tier.NORMAL, half, cost - half))
        self.release((0, 2 * n + served, 0))
        self.admit((away, Tier.NORMAL, half, cost - half))
        for tid in mine:
            if tid in self.model.tasks and self.model.tasks[tid].state.value == "released":
                self.finish(tid, min(usage, cost), False)
        self.release((0, 2, 0))

    @rule(tid=task_ids, usage=st.one_of(st.none(), st.integers(0, 900)),
          cancelled=st.booleans())
    def finish(self, tid: str, usage: int | None, cancelled: bool) -> None:
        if usage is None and not cancelled:
            usage = 0
        expected = self.model.finish(tid, usage, cancelled)
        got = self.run(self.store.finish(tid, usage, cancelled=cancelled))
        assert (got.outcome, got.previous, got.refunded) == expected

    @rule(zone=st.sampled_from([Zone.GREEN, Zone.YELLOW, Zone.YELLOW]),
          n1=st.integers(0, 1500), n2=st.integers(0, 1500))
    def scheduler_publishes(self, zone: Zone, n1: int, n2: int) -> None:
        self._publish(zone, {"n1": n1, "n2": n2})

    @rule(ms=st.integers(0, 15_000))
    def advance_time(self, ms: int) -> None:
        self.model.now += ms * 1000
        self.run(self.client.hset(self.store.keys.clock, "frozen_us", self.model.now))

    @invariant()
    def redis_matches_model(self) -> None:
        assert self.run(self._snapshot()) == self._model_snapshot(self.model)


def test_fair_release_matches_the_model(redis_url: str) -> None:
    FairMachine.redis_url = redis_url
    run_state_machine_as_test(
        FairMachine,
        settings=settings(PROPERTIES, max_examples=examples(60), stateful_step_count=40),
    )


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_interleavings_keep_each_sequence_in_order(n: int) -> None:
    a, b = ["a1", "a2"], [f"b{i}" for i in range(n)]
    merges = list(interleavings(a, b))
    assert len(merges) == len(set(map(tuple, merges)))
    assert len(merges) == [1, 3, 6, 10][n]
    for m in merges:
        assert [x for x in m if x in a] == a and [x for x in m if x in b] == b
