"""What bounds a release call's time inside Redis, which runs one script at a time: while it
runs, no gateway's admit does. A leader calls it every tick.

- A release in fair order passes over the tenants at their cap on in-flight tokens at a cost
  in proportion to their number: each is read once per call. When every backlogged tenant of
  a many-tenant pool is at its cap (each the only one it hurts), re-reading the passed-over
  prefix after each one made a tick cost time in the square of the tenants (1.5 s of Redis
  at 2,000). Counted with the server's own statistics (INFO commandstats counts a script's
  calls).
- A release given a bound on its Redis time (`call_ms`) goes on in further calls, each
  stopping after the release that reaches the bound, and decides as one unbounded call would.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

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


async def test_passing_over_capped_tenants_does_not_stop_a_bounded_call(
        redis_client: aioredis.Redis) -> None:
    """Each call of 1 ms passes over 60 capped tenants before it reaches a free one: were the
    pass-overs to stop it, a tenant queued behind many capped ones would never be served."""
    store = PoolStore(redis_client, register_scripts(redis_client), "passb",
                      PoolPolicy(fair=True, tier_queue_caps=(10_000,) * 3))
    capped = [quota(f"c{i:02d}", cap=300) for i in range(60)]
    free = [quota(f"f{i}") for i in range(3)]
    await store.publish_state(1, Zone.GREEN, NODES)
    for who in capped:
        assert await admit(store, f"run-{who.name}", who) == "released"
    await store.publish_state(1, Zone.YELLOW, NODES)
    for who in capped + free:
        assert await admit(store, f"wait-{who.name}", who) == "queued"
    await store.publish_state(1, Zone.GREEN, NODES)
    got = await store.release(1, (0, 100, 0), call_ms=1)
    assert sorted(t.task_id for t in got) == [f"wait-{who.name}" for who in free]
    assert not got.more


async def twin_pools(client: aioredis.Redis, names: tuple[str, ...],
                     nodes: int) -> list[PoolStore]:
    """Pools alike in all but their names: the same nodes, prefill rooms and queued tasks."""
    scripts = register_scripts(client)
    stores = []
    for name in names:
        store = PoolStore(client, scripts, name,
                          PoolPolicy(fair=True, tier_queue_caps=(10_000,) * 3))
        await client.hset(store.keys.clock, "frozen_us", 10**15)
        caps = {f"node-{i:02d}": 40_000 for i in range(nodes)}
        await store.publish_state(1, Zone.YELLOW, dict.fromkeys(caps, 0))  # all queue
        for i in range(120):
            who = quota(f"t{i % 7}")
            tier = (Tier.VIP, Tier.NORMAL, Tier.BATCH)[i % 3]
            got = await store.admit(task_id=f"q{i}", tenant=who, tier=tier,
                                    prompt_tokens=200 + 37 * (i % 11), max_tokens=300,
                                    gateway="gw", queue_timeout_ms=600_000)
            assert got.outcome.value == "queued", got
        await store.publish_state(1, Zone.GREEN, caps, {"prefill_quiet": 1},
                                  prefill={n: (3_000, 4_000) for n in caps})
        stores.append(store)
    return stores


async def test_a_bounded_release_goes_on_in_calls_and_decides_as_one_call(
        redis_client: aioredis.Redis) -> None:
    one, split = await twin_pools(redis_client, ("one", "split"), 64)
    whole = await one.release(1, (100, 100, 100))
    parts = await split.release(1, (100, 100, 100), call_ms=1)
    assert whole.calls == 1
    # 64 nodes weighed for each task: far more than a millisecond for the first ones.
    assert parts.calls > 1, parts.calls
    assert [(t.task_id, t.node, t.tier) for t in parts] == \
        [(t.task_id, t.node, t.tier) for t in whole]
    assert len(whole) > 20 and whole.more == parts.more


async def test_a_bounded_release_stops_at_the_tiers_limits(
        redis_client: aioredis.Redis) -> None:
    [store] = await twin_pools(redis_client, ("limits",), 64)
    got = await store.release(1, (5, 7, 3), call_ms=1)
    assert got.calls > 1
    assert [sum(1 for t in got if t.tier is tier) for tier in Tier] == [5, 7, 3]


async def test_one_call_fills_each_node_exactly_to_its_capacity(
        redis_client: aioredis.Redis) -> None:
    """A call keeps the node hashes it read for its later placements: each placement must see
    the reservations and prefill the earlier ones of the same call made."""
    store = PoolStore(redis_client, register_scripts(redis_client), "fill",
                      PoolPolicy(fair=True, tier_queue_caps=(10_000,) * 3))
    caps = {"node-a": 1_000, "node-b": 1_400}  # 5 and 7 tasks of 200
    await store.publish_state(1, Zone.YELLOW, dict.fromkeys(caps, 0))
    for i in range(20):
        assert await admit(store, f"q{i}", quota(f"t{i % 3}")) == "queued"
    await store.publish_state(1, Zone.GREEN, caps)
    got = await store.release(1, (0, 100, 0))
    assert len(got) == 12
    assert {n: sum(1 for t in got if t.node == n) for n in caps} == {"node-a": 5, "node-b": 7}
    reserved: dict[Any, Any] = await redis_client.hgetall(store.keys.node_reserved)
    assert {bytes(k).decode(): int(v) for k, v in reserved.items()} == caps
    # Prompt tokens released on each node, counted for its prefill room by each placement.
    # The room is a limit on the node's count of released prompt tokens: 250 beyond it.
    before = int(await redis_client.hget(store.keys.node_prefill_released, "node-a") or 0)
    assert before == 5 * 100
    await store.publish_state(1, Zone.GREEN, {"node-a": 10**6},
                              prefill={"node-a": (before + 250, 1_000)})
    got = await store.release(1, (0, 100, 0))
    assert len(got) == 2, got  # prompts of 100: two fit the 250, a third not the 50 left


class DropsLaterCalls:
    """Carries script calls to a real Redis, but a release call after the first finds the link
    gone (what a failover or a network blip does between two calls of one tick)."""

    def __init__(self, client: aioredis.Redis, release_sha: str, error: Exception) -> None:
        self.client, self.release_sha, self.error = client, release_sha, error
        self.releases = 0
        self.failed = 0

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        if sha == self.release_sha and self.releases >= 1:
            self.failed += 1
            raise self.error
        reply = await self.client.evalsha(sha, numkeys, *keys_and_args)
        if sha == self.release_sha:
            self.releases += 1
        return reply

    def script_load(self, script: str) -> Any:
        return self.client.script_load(script)


async def test_a_later_call_lost_ends_the_release_with_what_the_first_released(
        redis_client: aioredis.Redis) -> None:
    [store] = await twin_pools(redis_client, ("lost",), 64)
    link = DropsLaterCalls(redis_client, store.scripts.release.sha,
                           redis.exceptions.ConnectionError("Connection reset by peer"))
    lossy = PoolStore(redis_client, store.scripts.via(link), "lost", store.policy)
    got = await lossy.release(1, (100, 100, 100), call_ms=1)
    assert (link.releases, link.failed, got.calls) == (1, 1, 1) and len(got) > 0
    # Exactly those tasks left the queues; the rest wait for the next tick.
    records = [await redis_client.hget(store.keys.task_key(t.task_id), "state")
               for t in got]
    assert records == [b"released"] * len(got)
    queued = sum([await redis_client.zcard(q) for q in store.keys.queues])
    assert queued == 120 - len(got)
    # A permanent error is not swallowed.
    link = DropsLaterCalls(redis_client, store.scripts.release.sha,
                           redis.exceptions.ResponseError("ERR a script failed at run time"))
    lossy = PoolStore(redis_client, store.scripts.via(link), "lost", store.policy)
    with pytest.raises(redis.exceptions.ResponseError):
        await lossy.release(1, (100, 100, 100), call_ms=1)
