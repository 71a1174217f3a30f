"""Fair release within a tier, on a real redis-server: what the model-based property test
(tests/test_fair_stateful.py) checks step by step, here as the behaviours it is for.

- a tenant that floods a tier does not hold back another tenant that queues after it;
- weights 3:1 give service 3:1 while both are backlogged, in tokens, not requests;
- the settle corrects the charge to real usage;
- a tenant idle for a while banks no credit (it is lifted to the others' counters);
- FIFO when the pool says so; and the order continues across stores (another leader).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone

BIG = 10**9


def quota(name: str, weight: float = 1.0) -> TenantQuota:
    return TenantQuota(name, rate=BIG, burst=BIG, max_queued=10_000, weight=weight)


def store_of(client: aioredis.Redis, fair: bool = True) -> PoolStore:
    policy = PoolPolicy(tier_queue_caps=(10_000, 10_000, 10_000), fair=fair)
    return PoolStore(client, register_scripts(client), "fair", policy)


async def enqueue(store: PoolStore, tenant: TenantQuota, n: int, cost: int = 100,
                  tier: Tier = Tier.NORMAL, start: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        tid = f"{tenant.name}-{start + i}"
        got = await store.admit(task_id=tid, tenant=tenant, tier=tier, prompt_tokens=cost // 2,
                                max_tokens=cost - cost // 2, gateway="gw",
                                queue_timeout_ms=600_000)
        assert got.outcome.value == "queued", got
        ids.append(tid)
    return ids


async def release_one_by_one(store: PoolStore, n: int, room: int = 100) -> list[str]:
    """Release `n` tasks, each alone on an emptied node (room for one task of `room`)."""
    out = []
    for _ in range(n):
        await store.publish_state(1, Zone.YELLOW, {"node": room})
        [task] = await store.release(1, (0, 1, 1))
        assert task.node == "node"
        out.append(task.task_id)
        await store.settle(task.task_id, room)
    return out


@pytest.fixture
async def store(redis_client: aioredis.Redis) -> PoolStore:
    s = store_of(redis_client)
    await s.publish_state(1, Zone.YELLOW, {"node": 0})  # YELLOW: Normal always queues
    return s


async def test_a_flood_does_not_hold_back_a_tenant_queued_after_it(store: PoolStore) -> None:
    await enqueue(store, quota("flood"), 30)
    light = await enqueue(store, quota("light"), 3)
    order = await release_one_by_one(store, 8)
    # The light tenant's three tasks leave among the first six, in their own order.
    assert [t for t in order if t.startswith("light")] == light
    assert max(order.index(t) for t in light) < 6, order
    fifo = store_of(store.client, fair=False)
    await enqueue(fifo, quota("light"), 1, start=3)
    # FIFO (the same pool, released in queue order): the flood's queued tasks go first.
    await store.publish_state(1, Zone.YELLOW, {"node": 100})
    [task] = await fifo.release(1, (0, 1, 1))
    assert task.task_id.startswith("flood")


async def test_weights_three_to_one_give_three_to_one_service(store: PoolStore) -> None:
    await enqueue(store, quota("heavy", 3.0), 40)
    await enqueue(store, quota("light", 1.0), 40)
    order = await release_one_by_one(store, 40)
    heavy = sum(t.startswith("heavy") for t in order)
    assert heavy in (29, 30, 31), order  # 3:1 of 40, within one task


async def test_service_is_counted_in_tokens_not_requests(store: PoolStore) -> None:
    """One tenant sends requests four times larger: it gets a quarter of the requests."""
    await enqueue(store, quota("docs"), 20, cost=400)
    await enqueue(store, quota("chats"), 60, cost=100)
    released: dict[str, int] = {"docs": 0, "chats": 0}
    for _ in range(25):
        await store.publish_state(1, Zone.YELLOW, {"node": 400})
        [task] = await store.release(1, (0, 1, 1))
        name = task.task_id.split("-")[0]
        released[name] += 400 if name == "docs" else 100
        await store.settle(task.task_id, 400 if name == "docs" else 100)
    assert abs(released["docs"] - released["chats"]) <= 400, released


async def test_the_settle_corrects_the_charge_to_real_usage(store: PoolStore) -> None:
    """Tenant 'thrifty' uses a tenth of what it reserves: corrected, it gets about as many real
    tokens as 'full', i.e. many more releases."""
    await enqueue(store, quota("thrifty"), 60)
    await enqueue(store, quota("full"), 60)
    used = {"thrifty": 0, "full": 0}
    for _ in range(44):
        await store.publish_state(1, Zone.YELLOW, {"node": 100})
        [task] = await store.release(1, (0, 1, 1))
        name = task.task_id.split("-")[0]
        usage = 10 if name == "thrifty" else 100
        used[name] += usage
        await store.settle(task.task_id, usage)
    assert abs(used["thrifty"] - used["full"]) <= 100, used


async def test_an_idle_tenant_banks_no_credit(store: PoolStore,
                                              redis_client: aioredis.Redis) -> None:
    """'busy' is served alone for a while; 'late' then arrives with many tasks: it is lifted
    to busy's counter and the two alternate, instead of late taking everything until its
    counter catches up."""
    await enqueue(store, quota("busy"), 40)
    await release_one_by_one(store, 15)
    await enqueue(store, quota("late"), 20)
    keys = store.keys
    assert await redis_client.zscore(keys.flows(Tier.NORMAL), "late") == await (
        redis_client.zscore(keys.flows(Tier.NORMAL), "busy"))
    order = await release_one_by_one(store, 10)
    assert 4 <= sum(t.startswith("late") for t in order) <= 6, order


@pytest.mark.parametrize("settled", ["before", "after"])
async def test_refunds_that_land_after_a_lift_bank_no_credit(
        store: PoolStore, redis_client: aioredis.Redis, settled: str) -> None:
    """late's two tasks run, charged in full, while it has nothing queued and busy is served
    on; late queues again and is lifted to busy's counter (its own, even with those charges,
    is below); then they end having used nothing, `before` or `after` late's next release.
    Their refund must not take late below the floor it was lifted to: it would get credit for
    the time it was away. A task charged after the lift still gets its whole refund."""
    keys = store.keys
    await enqueue(store, quota("late"), 2)
    await enqueue(store, quota("busy"), 20)
    await store.publish_state(1, Zone.YELLOW, {"big": 10_000})
    bulk = [t.task_id for t in await store.release(1, (0, 4, 0))]
    assert bulk == ["late-0", "busy-0", "late-1", "busy-1"]  # ties: the older head
    for tid in ("busy-0", "busy-1"):
        await store.settle(tid, 100)
    await release_one_by_one(store, 6)  # busy alone: late has nothing queued
    await enqueue(store, quota("late"), 1, start=2)
    flows = keys.flows(Tier.NORMAL)
    assert await redis_client.zscore(flows, "late") == await redis_client.zscore(flows, "busy")
    if settled == "after":
        assert await release_one_by_one(store, 2) == ["busy-8", "late-2"]
    for tid in ("late-0", "late-1"):
        await store.settle(tid, 0)  # nothing used: the whole charge would come back
    late_at = int(await redis_client.hget(keys.tenant_key("late"), "vt_1") or 0)
    busy_at = int(await redis_client.hget(keys.tenant_key("busy"), "vt_1") or 0)
    assert late_at == busy_at  # no lower: the refunds took back nothing below the floor
    await enqueue(store, quota("late"), 3, start=3)
    order = await release_one_by_one(store, 4)
    first = (["busy-8", "late-2", "busy-9", "late-3"] if settled == "before"
             else ["busy-9", "late-3", "busy-10", "late-4"])
    assert order == first  # they alternate: late's older tasks bought it no turns
    # A task charged after the lift: its refund is whole.
    await store.publish_state(1, Zone.YELLOW, {"big": 10_000})
    released = [t.task_id for t in await store.release(1, (0, 3, 0))]
    [later] = [t for t in released if t.startswith("late")]
    before = int(await redis_client.hget(keys.tenant_key("late"), "vt_1") or 0)
    await store.settle(later, 0)
    after = int(await redis_client.hget(keys.tenant_key("late"), "vt_1") or 0)
    charge = int(await redis_client.hget(keys.task_key(later), "charge") or 0)
    assert before - after == charge > 0


async def test_the_order_continues_across_stores(store: PoolStore,
                                                 redis_client: aioredis.Redis,
                                                 redis_url: str) -> None:
    """Counters live in Redis: a release through another connection (a new leader) picks up
    where the last one stopped."""
    await enqueue(store, quota("a", 2.0), 20)
    await enqueue(store, quota("b"), 20)
    first = await release_one_by_one(store, 6)
    other_client = aioredis.Redis.from_url(redis_url)
    try:
        other = store_of(other_client)
        second = await release_one_by_one(other, 6)
    finally:
        await other_client.aclose()
    order = first + second
    assert sum(t.startswith("a-") for t in order) == 8, order  # 2:1 of 12
    counters = await redis_client.hget(store.keys.tenant_key("a"), "vt_1")
    assert counters is not None and int(counters) > 0


async def test_fast_path_charges_only_a_busy_tier(store: PoolStore,
                                                  redis_client: aioredis.Redis) -> None:
    """GREEN with room: an idle tier's fast path is not charged; with a backlog, a tenant whose
    counter is the least still takes the fast path, charged."""
    keys = store.keys
    await store.publish_state(1, Zone.GREEN, {"node": 1_000})
    got = await store.admit(task_id="solo", tenant=quota("solo"), tier=Tier.NORMAL,
                            prompt_tokens=50, max_tokens=50, gateway="gw",
                            queue_timeout_ms=60_000)
    assert got.outcome.value == "released"
    assert await redis_client.hget(keys.tenant_key("solo"), "vt_1") is None
    assert await redis_client.hget(keys.task_key("solo"), "charge") is None
    # A backlog of another tenant (too large to fit) now exists in Normal.
    big = quota("big")
    queued = await store.admit(task_id="huge", tenant=big, tier=Tier.NORMAL,
                               prompt_tokens=2_000, max_tokens=0, gateway="gw",
                               queue_timeout_ms=60_000)
    assert queued.outcome.value == "queued"
    fast = await store.admit(task_id="next", tenant=quota("solo"), tier=Tier.NORMAL,
                             prompt_tokens=50, max_tokens=50, gateway="gw",
                             queue_timeout_ms=60_000)
    assert fast.outcome.value == "released"
    assert await redis_client.hget(keys.task_key("next"), "charge") == b"100000"
    assert int(await redis_client.hget(keys.tenant_key("solo"), "vt_1") or 0) == 100_000
    # Its counter is now above big's: its next request queues behind big's.
    after = await store.admit(task_id="after", tenant=quota("solo"), tier=Tier.NORMAL,
                              prompt_tokens=50, max_tokens=50, gateway="gw",
                              queue_timeout_ms=60_000)
    assert after.outcome.value == "queued"


async def a_fills_the_node(client: aioredis.Redis, policy: PoolPolicy) -> PoolStore:
    """A GREEN node of 1,000 tokens, filled by tenant a's ten tasks of 100 on the fast path
    (an idle tier)."""
    store = PoolStore(client, register_scripts(client), "fair", policy)
    await client.hset(store.keys.clock, "frozen_us", 1_800_000_000_000_000)
    await store.publish_state(1, Zone.GREEN, {"node": 1_000})
    for i in range(10):
        got = await store.admit(task_id=f"a-{i}", tenant=quota("a"), tier=Tier.NORMAL,
                                prompt_tokens=50, max_tokens=50, gateway="gw",
                                queue_timeout_ms=600_000)
        assert got.outcome.value == "released"
    return store


async def _light_scene(client: aioredis.Redis, headroom: float) -> tuple[PoolStore, list[str]]:
    """Tenant a fills a GREEN node of 1,000 tokens on the fast path (an idle tier) and queues
    five more; two of its tasks end, and b is admitted on the fast path beside a's backlog (b
    becomes light); two more of a's end. Returns the store and what one release then gives."""
    policy = PoolPolicy(tier_queue_caps=(10_000, 10_000, 10_000), fair_headroom=headroom,
                        fair_light_window_ms=5_000)
    store = await a_fills_the_node(client, policy)
    a, b = quota("a"), quota("b")
    await enqueue(store, a, 5, start=10)
    await store.settle("a-0", 100)
    got = await store.admit(task_id="b-0", tenant=b, tier=Tier.NORMAL, prompt_tokens=25,
                            max_tokens=25, gateway="gw", queue_timeout_ms=600_000)
    assert got.outcome.value == "released"
    assert await client.zscore(store.keys.light(Tier.NORMAL), "b") is not None
    for tid in ("a-1", "a-2"):
        await store.settle(tid, 100)
    return store, [t.task_id for t in await store.release(1, (0, 10, 10))]


async def test_a_flooding_tenant_leaves_room_for_a_light_one(
        redis_client: aioredis.Redis) -> None:
    """With a's 700 tokens in flight against b's 50, a holds more than its share: its releases
    stop 10% of the node short of full (900 tokens), and b's next request finds room at once."""
    store, released = await _light_scene(redis_client, 0.10)
    assert released == ["a-10"]  # 850 reserved: a second one would leave 50 < 100 free
    got = await store.admit(task_id="b-1", tenant=quota("b"), tier=Tier.NORMAL,
                            prompt_tokens=50, max_tokens=50, gateway="gw",
                            queue_timeout_ms=600_000)
    assert got.outcome.value == "released"
    # Once b has been away for longer than the window, a's backlog takes the whole node again.
    await store.settle("b-0", 50)
    await store.settle("b-1", 100)
    await redis_client.hincrby(store.keys.clock, "frozen_us", 5_000_001)
    assert [t.task_id for t in await store.release(1, (0, 10, 10))] == ["a-11", "a-12"]
    assert await redis_client.zcard(store.keys.light(Tier.NORMAL)) == 0


async def test_without_headroom_the_backlog_takes_every_freed_token(
        redis_client: aioredis.Redis) -> None:
    store, released = await _light_scene(redis_client, 0.0)
    assert released == ["a-10", "a-11"]
    got = await store.admit(task_id="b-1", tenant=quota("b"), tier=Tier.NORMAL,
                            prompt_tokens=50, max_tokens=50, gateway="gw",
                            queue_timeout_ms=600_000)
    assert got.outcome.value == "queued"
    # The marks no release reads still expire: once b has been away for longer than the
    # window, a release drops it.
    light = store.keys.light(Tier.NORMAL)
    assert await redis_client.zscore(light, "b") is not None
    await redis_client.hincrby(store.keys.clock, "frozen_us", 5_000_001)
    await store.release(1, (0, 10, 10))
    assert await redis_client.zcard(light) == 0


async def test_a_head_that_fits_nowhere_holds_its_tier_with_headroom_on(
        redis_client: aioredis.Redis) -> None:
    """a holds the node and queues more; a Batch task queues too; b, light, takes the fast
    path and leaves 50 tokens free. a is over its share, so the headroom keeps 100 back from
    its release, but its head (100) would not fit even without that: it is the node's room
    that stops it, so Normal waits for room and Batch waits behind it, as without headroom.
    Passing a over instead let the Batch task take the 50 tokens Normal waits for."""
    policy = PoolPolicy(tier_queue_caps=(10_000, 10_000, 10_000), fair_headroom=0.1,
                        fair_light_window_ms=5_000)
    store = await a_fills_the_node(redis_client, policy)
    a = quota("a")
    await enqueue(store, a, 3, start=10)
    await enqueue(store, quota("z"), 1, cost=50, tier=Tier.BATCH)
    await store.settle("a-0", 100)
    got = await store.admit(task_id="b-0", tenant=quota("b"), tier=Tier.NORMAL,
                            prompt_tokens=25, max_tokens=25, gateway="gw",
                            queue_timeout_ms=600_000)
    assert got.outcome.value == "released"  # 950 of 1,000 reserved; b is light
    assert await store.release(1, (0, 10, 10), record_held=True) == []
    held: Any = await redis_client.hgetall(store.keys.held_by)
    assert held[b"normal"].startswith(b"kv=") and held[b"batch"] == b"behind normal", held
    # Room for a's head: it is released, and then the Batch task behind it.
    await store.settle("a-1", 100)
    await store.settle("a-2", 100)
    assert [t.task_id for t in await store.release(1, (0, 1, 10))] == ["a-10", "z-0"]


@pytest.mark.parametrize("headroom", [0.1, 0.0])
async def test_a_light_tenant_under_its_share_is_released_before_the_counters_order(
        redis_client: aioredis.Redis, headroom: float) -> None:
    """a fills the node and queues five more; b's request finds no room and queues beside a's
    backlog (b is light, lifted to a's counter: a tie, which a's older head would win). A
    completion frees 100 tokens: with headroom the release serves b first (it holds nothing in
    flight, under its share), without it serves a."""
    policy = PoolPolicy(tier_queue_caps=(10_000, 10_000, 10_000), fair_headroom=headroom)
    store = await a_fills_the_node(redis_client, policy)
    a = quota("a")
    await enqueue(store, a, 5, start=10)
    await enqueue(store, quota("b"), 1)
    assert await redis_client.zscore(store.keys.light(Tier.NORMAL), "b") is not None
    await store.settle("a-0", 100)
    released = [t.task_id for t in await store.release(1, (0, 10, 10))]
    assert released == (["b-0"] if headroom else ["a-10"])
