"""A release in fair order passes over the tenants at their cap on in-flight tokens at a cost
in proportion to their number: each is read once per call. A call runs inside Redis, which is
single-threaded, and a leader calls it every tick; when every backlogged tenant of a
many-tenant pool is at its cap (each the only one it hurts), re-reading the passed-over
prefix after each one made a tick cost time in the square of the tenants (1.5 s of Redis at
2,000). Counted with the server's own statistics (INFO commandstats counts a script's calls)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone

BIG = 10**9
NODES = {"node-a": BIG, "node-b": BIG}


def quota(name: str, cap: int = 0) -> TenantQuota:
    return TenantQuota(name, rate=BIG, burst=BIG, max_queued=1_000, max_inflight_tokens=cap)


async def admit(store: PoolStore, tid: str, who: TenantQuota) -> str:
    got = await store.admit(task_id=tid, tenant=who, tier=Tier.NORMAL, prompt_tokens=100,
                            max_tokens=100, gateway="gw", queue_timeout_ms=600_000)
    return str(got.outcome.value)


async def scores(client: aioredis.Redis, key: str) -> dict[str, float]:
    rows: list[Any] = list(await client.zrange(key, 0, -1, withscores=True))
    return {bytes(k).decode(): float(v) for k, v in rows}


async def test_capped_tenants_are_passed_over_once_each_and_keep_their_place(
        redis_client: aioredis.Redis) -> None:
    store = PoolStore(redis_client, register_scripts(redis_client), "pass",
                      PoolPolicy(fair=True, tier_queue_caps=(10_000,) * 3))
    capped = [quota(f"c{i:02d}", cap=300) for i in range(60)]
    free = [quota(f"f{i}") for i in range(3)]
    await store.publish_state(1, Zone.GREEN, NODES)
    for who in capped:  # each holds 200 of its 300 tokens: its next task of 200 must wait
        assert await admit(store, f"run-{who.name}", who) == "released"
    await store.publish_state(1, Zone.YELLOW, NODES)  # YELLOW: Normal queues
    for who in capped + free:
        assert await admit(store, f"wait-{who.name}", who) == "queued"
    flows = store.keys.flows(Tier.NORMAL)
    before = await scores(redis_client, flows)
    assert len(before) == len(capped) + len(free)

    await store.publish_state(1, Zone.GREEN, NODES)
    await redis_client.config_resetstat()
    got = await store.release(1, (0, 100, 0))
    stats = await redis_client.info("commandstats")

    assert sorted(t.task_id for t in got) == [f"wait-{who.name}" for who in free]
    after = await scores(redis_client, flows)
    assert after == {k: v for k, v in before.items() if not k.startswith("f")}
    # Each tenant's flow head and the flows' first rows, about twice a tenant; re-reading the
    # passed-over rows, or the tied flows' heads, after each tenant is several times that.
    zrange = int(stats["cmdstat_zrange"]["calls"])
    assert zrange <= 3 * (len(capped) + len(free)), zrange
