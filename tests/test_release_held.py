"""Why a queue waits, against real Redis: the leader's main release records, per tier, the nodes
that refused the head and their reasons (the tier's KV ceiling, the release control's prefill
room, the quiet-node rule), a head kept by the zone or by its tenant's in-flight cap, tiers
behind a waiting head; clears it when the queue empties; and the scheduler exports it as
`kvgate_scheduler_queue_held` and kvgate-inspect shows it."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from admission import inspect
from admission.outcomes import AdmitOutcome
from admission.reads import HELD_REASONS, Held, held_map
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from scheduler.metrics import SchedulerMetrics
from tests.scheduler_stub import (
    FakeVllm,
    always,
    make_config,
    pool_scheduler,
    queue_tasks,
    serve_fake,
)

BIG = 10**9
TENANT = TenantQuota("t", rate=0, burst=BIG, max_queued=1_000)


async def _store(client: aioredis.Redis) -> PoolStore:
    return PoolStore(client, register_scripts(client), "held", PoolPolicy())


async def _admit(store: PoolStore, task_id: str, tier: Tier, prompt: int, output: int = 10,
                 tenant: TenantQuota = TENANT) -> AdmitOutcome:
    got = await store.admit(task_id=task_id, tenant=tenant, tier=tier, prompt_tokens=prompt,
                            max_tokens=output, gateway="gw", queue_timeout_ms=60_000)
    return got.outcome


async def _held(store: PoolStore) -> dict[str, Held]:
    return held_map(await store.client.hgetall(store.keys.held_by))


async def test_a_head_no_node_takes_is_recorded_with_each_nodes_reason(
        redis_client: aioredis.Redis) -> None:
    """node-a's Normal ceiling leaves 100 tokens (kv), node-b's KV has room but its prefill
    room is spent (prefill): the Normal head waits for both reasons, and Batch waits behind
    it. VIP, which neither holds, is released and records nothing."""
    store = await _store(redis_client)
    caps = {"node-a": (BIG, 100, 100), "node-b": (BIG, BIG, BIG)}
    rooms = {"node-a": (5_000, 5_000), "node-b": (0, 5_000)}
    await store.publish_state(1, Zone.GREEN, caps, prefill=rooms)
    await queue_tasks(store, [("n1", Tier.NORMAL, 1_000), ("b1", Tier.BATCH, 1_000),
                              ("v1", Tier.VIP, 1_000)])
    await store.publish_state(1, Zone.GREEN, caps, prefill=rooms)
    released = await store.release(1, (10, 10, 10), record_held=True)
    assert [t.task_id for t in released] == ["v1"]
    held = await _held(store)
    assert set(held) == {"normal", "batch"}
    normal = held["normal"]
    assert normal.reason == "kv=1,prefill=1"
    assert normal.kinds() == {"kv": 1, "prefill": 1}
    assert (normal.task, normal.cost, normal.prompt) == ("n1", 1_000, 500)
    assert held["batch"].reason == "behind normal" and held["batch"].task is None
    assert held["batch"].kinds() == {"behind": 1}
    assert normal.at_us is not None and normal.at_us == held["batch"].at_us

    text = inspect.render(await inspect.snapshot(redis_client, ["held"]))
    assert "kv on 1 node, prefill on 1 node (head: 1000 tokens, prompt 500)" in text
    assert "the normal queue's head" in text


async def test_a_long_prompt_kept_off_the_quiet_node_says_quiet(
        redis_client: aioredis.Redis) -> None:
    """Two nodes, one kept quiet for VIP: two documents run on one node, the third waits:
    that node's room is spent (prefill), the other's would take it but must stay quiet."""
    store = await _store(redis_client)
    caps = {"node-a": BIG, "node-b": BIG}
    rooms = {"node-a": (600, 1_000), "node-b": (600, 1_000)}
    await store.publish_state(1, Zone.GREEN, caps, {"prefill_quiet": 1}, prefill=rooms)
    assert await _admit(store, "doc-1", Tier.BATCH, 8_000) is AdmitOutcome.RELEASED
    assert await _admit(store, "doc-2", Tier.BATCH, 8_000) is AdmitOutcome.RELEASED
    assert await _admit(store, "doc-3", Tier.BATCH, 8_000) is AdmitOutcome.QUEUED
    assert await store.release(1, (10, 10, 10), record_held=True) == []
    assert (await _held(store))["batch"].reason == "prefill=1,quiet=1"


async def test_the_zone_and_a_tenants_cap_are_named_and_a_drained_queue_clears(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    capped = TenantQuota("capped", rate=0, burst=BIG, max_queued=10, max_inflight_tokens=1_500)
    await queue_tasks(store, [("v1", Tier.VIP, 100), ("n1", Tier.NORMAL, 100)])
    assert await _admit(store, "c1", Tier.BATCH, 500, 500, capped) is AdmitOutcome.QUEUED
    assert await _admit(store, "c2", Tier.BATCH, 500, 500, capped) is AdmitOutcome.QUEUED
    await store.publish_state(1, Zone.RED, {"node-a": BIG})
    # RED: this call may release VIP only; what waits below is the zone's doing.
    assert [t.task_id for t in await store.release(1, (10, 0, 0), record_held=True)] == ["v1"]
    held = await _held(store)
    assert {k: h.reason for k, h in held.items()} == {"normal": "zone", "batch": "zone"}
    # A call that does not record (the Batch share, the trickle) leaves the record alone.
    await store.release(1, (0, 0, 0))
    assert {k: h.reason for k, h in (await _held(store)).items()} == {"normal": "zone",
                                                                       "batch": "zone"}
    # GREEN: Normal drains, its record goes; the capped tenant's second task holds Batch.
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG})
    released = await store.release(1, (10, 10, 10), record_held=True)
    assert [t.task_id for t in released] == ["n1", "c1"]
    held = await _held(store)
    assert list(held) == ["batch"] and held["batch"].reason == "tenant"
    text = inspect.render(await inspect.snapshot(redis_client, ["held"]))
    assert "its tenants' in-flight caps or fair hold-back" in text
    await store.client.hset(store.keys.tenant_key("capped"), "inflight_cap", BIG)
    assert [t.task_id for t in await store.release(1, (10, 10, 10), record_held=True)] == ["c2"]
    assert await store.client.exists(store.keys.held_by) == 0


async def test_the_leader_exports_the_reasons_and_forgets_them_when_nothing_waits(
        redis_client: Any, redis_url: str) -> None:
    full = FakeVllm(usage=0.90, running=0)
    async with serve_fake(full) as url:
        config = make_config(redis_url, [{"name": "n0", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("n0", Tier.NORMAL, 100)])
            first = await ps.tick(1, always)
            assert first.zone is Zone.RED and first.released == []
            # The gauge follows the record of the previous tick's release.
            second = await ps.tick(1, always)
            assert {k: h.reason for k, h in second.held.items()} == {"normal": "zone"}
            gauge = ps.metrics.queue_held
            assert gauge.labels("p", "normal", "zone")._value.get() == 1
            assert gauge.labels("p", "normal", "kv")._value.get() == 0
            # The task leaves the queue without a release (its client went away): the next
            # tick finds nothing waiting, forgets the record and zeroes the gauge.
            await ps.store.cancel("n0")
            third = await ps.tick(1, always)
            assert third.held == {}
            assert await redis_client.exists(ps.store.keys.held_by) == 0
            assert gauge.labels("p", "normal", "zone")._value.get() == 0


def test_every_reason_has_a_series_per_tier_at_zero_unless_it_holds() -> None:
    m = SchedulerMetrics({"p": ["n0"]})
    m.set_held("p", {"batch": Held("kv=2,quiet=1"), "normal": Held("behind vip")})
    values = {(s.labels["tier"], s.labels["reason"]): s.value
              for metric in m.registry.collect() if metric.name == "kvgate_scheduler_queue_held"
              for s in metric.samples}
    assert len(values) == len(Tier) * len(HELD_REASONS)
    assert {k: v for k, v in values.items() if v} == {
        ("batch", "kv"): 2, ("batch", "quiet"): 1, ("normal", "behind"): 1}
