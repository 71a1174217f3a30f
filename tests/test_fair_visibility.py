"""What operators see of fair release and quota levels, on a real redis-server: kvgate-inspect's
fairness and quota tables (and its JSON), and the leader's per-tenant and per-team metrics with
their bounded label sets."""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from admission import inspect
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, QuotaLevel, TenantQuota
from admission.tiers import Tier, Zone
from scheduler.fairmetrics import OTHER, TOP_TENANTS, FairMetrics

POOL = "vis"
T0 = 1_750_000_000_000_000
CREW = QuotaLevel("crew", rate=100, burst=50_000, daily_tokens=40_000)


def quota(name: str, weight: float = 1.0, **kw: object) -> TenantQuota:
    return TenantQuota(name, rate=10**6, burst=10**6, max_queued=1_000, weight=weight,
                       **kw)  # type: ignore[arg-type]


async def world(client: aioredis.Redis) -> PoolStore:
    store = PoolStore(client, register_scripts(client), POOL, PoolPolicy())
    await client.hset(store.keys.clock, "frozen_us", T0)
    await store.publish_state(1, Zone.YELLOW, {"gpu": 100_000})  # Normal queues
    for name, weight, n in (("heavy", 3.0, 3), ("light", 1.0, 1), ("solo", 1.0, 2)):
        q = quota(name, weight, levels=(CREW,) if name != "solo" else (),
                  max_inflight_tokens=10**6 if name == "heavy" else 0)
        for i in range(n):
            got = await store.admit(task_id=f"{name}{i}", tenant=q, tier=Tier.NORMAL,
                                    prompt_tokens=500, max_tokens=500, gateway="gw",
                                    queue_timeout_ms=60_000)
            assert got.outcome.value == "queued"
    [released] = await store.release(1, (0, 1, 0))
    assert released.task_id == "heavy0"  # all at 0: the oldest head
    return store


async def test_inspect_shows_shares_lags_tokens_and_levels(redis_client: aioredis.Redis) -> None:
    await world(redis_client)
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    assert p.fairness is not None
    by = {t.tenant: t for t in p.fairness.tenants}
    heavy, light, solo = by["heavy"], by["light"], by["solo"]
    # Normal's backlogged weights: 3 + 1 + 1.
    assert (heavy.share[1], light.share[1], solo.share[1]) == (0.6, 0.2, 0.2)
    assert heavy.share[0] is None and heavy.counters[1] == 1_000 * 1_000 // 3
    assert (heavy.lag_tokens[1], light.lag_tokens[1]) == (333.333, 0.0)
    assert (heavy.queued_tokens, heavy.inflight_tokens, heavy.inflight_cap) == (
        2_000, 1_000, 10**6)
    assert (solo.queued_tokens, solo.inflight_tokens, solo.inflight_cap) == (2_000, 0, None)
    assert heavy.release_rate == 1_000 / 5  # released at the frozen instant: 1,000 / 5 s
    (crew,) = p.fairness.levels
    assert (crew.level, crew.tokens, crew.burst, crew.day_used) == ("crew", 46_000.0, 50_000,
                                                                     4_000)
    assert p.fairness.vtime[1] == 0
    text = inspect.render(await inspect.snapshot(redis_client, [POOL]))
    assert any(line.split()[:4] == ["heavy", "3", "-/60%/-", "-/333/-"]
               for line in text.splitlines()), text
    assert any(line.split()[:2] == ["crew", "46000.0"] for line in text.splitlines())
    data = json.loads((await inspect.snapshot(redis_client, [POOL])).to_json())
    assert data["pools"][0]["fairness"]["levels"][0]["day_used"] == 4_000


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, ...], float]:
    out = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name:
                out[tuple(s.labels.values())] = s.value
    return out


async def test_metrics_per_tenant_and_team(redis_client: aioredis.Redis) -> None:
    store = await world(redis_client)
    registry = CollectorRegistry()
    metrics = FairMetrics(registry)
    metrics.observe(POOL, await store.read_fairness(["crew", "unused"]),
                    {"crew": CREW.burst, "unused": 7_000})
    share = _samples(registry, "kvgate_scheduler_fair_share")
    assert share == {(POOL, "normal", "heavy"): 0.6, (POOL, "normal", "light"): 0.2,
                     (POOL, "normal", "solo"): 0.2}
    assert _samples(registry, "kvgate_scheduler_fair_backlogged_tenants")[
        (POOL, "normal")] == 3
    assert _samples(registry, "kvgate_scheduler_fair_inflight_tokens")[(POOL, "heavy")] == 1_000
    assert _samples(registry, "kvgate_scheduler_fair_release_rate_tokens")[
        (POOL, "heavy")] == 200.0
    # A configured team no request has used yet shows its bucket as its first request finds
    # it: full, at its configured burst.
    assert _samples(registry, "kvgate_scheduler_quota_level_tokens") == {
        (POOL, "crew"): 46_000, (POOL, "unused"): 7_000}
    assert _samples(registry, "kvgate_scheduler_quota_level_burst_tokens") == {
        (POOL, "crew"): 50_000, (POOL, "unused"): 7_000}
    metrics.forget()
    assert _samples(registry, "kvgate_scheduler_fair_share") == {}


async def test_tenant_labels_are_bounded(redis_client: aioredis.Redis) -> None:
    store = PoolStore(redis_client, register_scripts(redis_client), POOL, PoolPolicy())
    await store.publish_state(1, Zone.YELLOW, {"gpu": 0})
    n = TOP_TENANTS + 5
    for i in range(n):  # tenant i queues i + 1 requests: the last TOP_TENANTS are the top
        for j in range(i + 1):
            await store.admit(task_id=f"t{i}-{j}", tenant=quota(f"t{i:02d}"), tier=Tier.BATCH,
                              prompt_tokens=10, max_tokens=0, gateway="gw",
                              queue_timeout_ms=60_000)
    registry = CollectorRegistry()
    metrics = FairMetrics(registry)
    metrics.observe(POOL, await store.read_fairness())
    queued = _samples(registry, "kvgate_scheduler_fair_queued_tokens")
    assert len(queued) == TOP_TENANTS + 1
    assert queued[(POOL, OTHER)] == 10 * sum(range(1, 6))  # the five smallest, summed
    assert (POOL, f"t{n - 1:02d}") in queued and (POOL, "t00") not in queued
    assert len(_samples(registry, "kvgate_scheduler_fair_share")) == TOP_TENANTS


async def test_tenants_in_flight_with_nothing_queued_are_counted(
        redis_client: aioredis.Redis) -> None:
    """A tenant whose requests all run, none queued, is in no backlogged flow: its in-flight
    tokens are still exported, under its own name in the top or summed in `_other`, read from
    the pool's index of tenants in flight (no SCAN of the tenant hashes)."""
    store = PoolStore(redis_client, register_scripts(redis_client), POOL, PoolPolicy())
    await store.publish_state(1, Zone.YELLOW, {"gpu": 100_000})  # VIP runs, Batch queues
    for name, tokens in (("busy", 2_400), ("small", 30)):
        got = await store.admit(task_id=name, tenant=quota(name), tier=Tier.VIP,
                                prompt_tokens=tokens // 2, max_tokens=tokens // 2, gateway="gw",
                                queue_timeout_ms=60_000)
        assert got.outcome.value == "released"
    assert await redis_client.zrange(store.keys.tenant_inflight, 0, -1, withscores=True) == [
        (b"small", 30.0), (b"busy", 2_400.0)]
    for i in range(TOP_TENANTS):  # each queues more than `small` holds in flight
        await store.admit(task_id=f"q{i}", tenant=quota(f"q{i:02d}"), tier=Tier.BATCH,
                          prompt_tokens=50, max_tokens=0, gateway="gw", queue_timeout_ms=60_000)
    registry = CollectorRegistry()
    metrics = FairMetrics(registry)
    metrics.observe(POOL, await store.read_fairness())
    inflight = _samples(registry, "kvgate_scheduler_fair_inflight_tokens")
    queued = _samples(registry, "kvgate_scheduler_fair_queued_tokens")
    assert (inflight[(POOL, "busy")], queued[(POOL, "busy")]) == (2_400, 0)
    assert (POOL, "small") not in inflight and inflight[(POOL, OTHER)] == 30
    assert queued[(POOL, OTHER)] == 50  # q19, left out of the top (ties go by name)
    assert len(inflight) == TOP_TENANTS + 1

    # The index follows each change and keeps no tenant at 0: ended, a tenant leaves it, and
    # nothing of it is left once no tenant is in flight.
    await store.settle("busy", 100)
    assert await redis_client.zscore(store.keys.tenant_inflight, "busy") is None
    metrics.observe(POOL, await store.read_fairness())
    assert (POOL, "busy") not in _samples(registry, "kvgate_scheduler_fair_inflight_tokens")
    await store.cancel("small")
    assert await redis_client.exists(store.keys.tenant_inflight) == 0

    # A tenant in flight before the index existed (an upgrade) joins it at its next change, at
    # the total its hash holds.
    await store.admit(task_id="old", tenant=quota("old"), tier=Tier.VIP, prompt_tokens=500,
                      max_tokens=500, gateway="gw", queue_timeout_ms=60_000)
    await redis_client.delete(store.keys.tenant_inflight)
    await store.admit(task_id="new", tenant=quota("old"), tier=Tier.VIP, prompt_tokens=100,
                      max_tokens=100, gateway="gw", queue_timeout_ms=60_000)
    assert await redis_client.zscore(store.keys.tenant_inflight, "old") == 1_200
