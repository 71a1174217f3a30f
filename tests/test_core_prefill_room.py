"""The prefill room in the scripts, against real Redis: the rule Normal and Batch placements obey
(lua/_room.lua prefill_fits, and the count each release raises) checked against a plain-Python
reference (`fits`, `may_place`), exactness under concurrent admits with VIP never held by it, a
prompt larger than the window, rooms refilling between polls at the published rate, light
tenants overdrawing the room a flood left (and that overdraw counted for the leader), the
leader's release obeying the room in FIFO order, and no limit without a published room."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from tests.prefill_support import (
    BIG,
    FROZEN_US,
    NODES,
    TENANT,
    _admit,
    _at_ms,
    _count,
    _s,
    _store,
)


def fits(prompt: int, room: int, window: int) -> bool:
    """The reference rule: the prompt fits the room, or the room is at least half the window."""
    return prompt <= room or (2 * room >= window and room > 0)


def quiet(room: int | None, window: int) -> bool:
    """A node VIP is steered to: no room published, or at least half its window left."""
    return room is None or 2 * room >= window


def may_place(node: str, prompt: int, rooms: dict[str, int | None], windows: dict[str, int],
              keep_quiet: int, vip_held: frozenset[str] = frozenset()) -> bool:
    """The reference rule with quiet nodes kept: a prompt larger than the room and than twice
    the window (a long prefill) goes to `node` only while min(keep_quiet, nodes - 1) others
    are quiet and no VIP chat placed there holds it (`vip_held`: placed less than the
    objective ago), and then by the half-window rule or behind at most a prompt's worth of
    queue beyond the window (one long prefill queued behind another)."""
    room = rooms[node]
    if room is None or prompt <= room:
        return True
    need = min(keep_quiet, len(rooms) - 1)
    if prompt <= 2 * windows[node] or need == 0:
        return fits(prompt, room, windows[node])
    # A long prefill, with quiet nodes kept: also one more behind a long prefill.
    if node in vip_held:
        return False
    others = sum(quiet(r, windows.get(n, 0)) for n, r in rooms.items() if n != node)
    return (fits(prompt, room, windows[node]) or room + prompt >= 0) and others >= need


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rooms=st.dictionaries(st.sampled_from(NODES),
                             st.tuples(st.integers(-500, 3_000), st.integers(1, 3_000),
                                       st.integers(0, 10_000)), min_size=1),
       unlimited=st.sampled_from([(), ("node-c",)]),
       keep_quiet=st.integers(0, 3),
       objective_ms=st.sampled_from([0, 250]),
       admits=st.lists(st.tuples(st.sampled_from(list(Tier)), st.integers(1, 2_500)),
                       min_size=1, max_size=12))
@example(rooms={"node-a": (600, 1_000, 0), "node-b": (600, 1_000, 0)}, unlimited=(),
         keep_quiet=1, objective_ms=250,
         admits=[(Tier.VIP, 100), (Tier.VIP, 100), (Tier.BATCH, 2_500)])
def test_placements_follow_the_reference_room_rule(
        redis_url: str, rooms: dict[str, tuple[int, int, int]], unlimited: tuple[str, ...],
        keep_quiet: int, objective_ms: int, admits: list[tuple[Tier, int]]) -> None:
    """Each node: (room, window, released so far), published as limit = released + room, and
    `keep_quiet` quiet nodes kept, the VIP objective published or not (the clock stands still:
    a VIP placement, with quiet nodes kept and an objective, holds its node's long prefills off
    for the rest of the run). A sequence of fast-path admits: a Normal or Batch task is
    released iff some node's room takes it by the reference rule, goes to such a node, and
    raises that node's count by its prompt; a VIP task is always released, to a node the
    reference calls least queued, and raises no count. A node without a published room takes
    anything. Where only the VIP hold refuses a task everywhere, the first such node by name
    takes it (every hold is equally old on the stopped clock)."""
    nodes = {n: r for n, r in rooms.items() if n not in unlimited}
    caps = {n: BIG for n in {*rooms, *unlimited}}

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.flushdb()
            store = await _store(client)
            k = store.keys
            await _at_ms(client, store, 0)
            extra = {"prefill_quiet": keep_quiet, "vip_ttft_objective_ms": objective_ms}
            await store.publish_state(1, Zone.GREEN, caps, extra,
                                      prefill={n: (released + room, window)
                                               for n, (room, window, released) in nodes.items()})
            counts = {n: released for n, (_, _, released) in nodes.items()}
            if counts:
                await client.hset(k.node_prefill_released, mapping=counts)  # type: ignore[arg-type]
            # Every node's count moves, limited or not (a room published later starts from it).
            counts.update({n: 0 for n in unlimited})
            limits = {n: released + room for n, (room, _, released) in nodes.items()}
            windows = {n: window for n, (_, window, _) in nodes.items()}
            held: set[str] = set()
            vip_placed: Counter[str] = Counter()
            for i, (tier, prompt) in enumerate(admits):
                outcome, node = await _admit(store, f"t{i}", tier, prompt)
                room = {n: limits[n] - counts[n] for n in nodes}
                rooms_now = {n: room.get(n) for n in caps}
                allowed = [n for n in caps
                           if may_place(n, prompt, rooms_now, windows, keep_quiet,
                                        frozenset(held))]
                if tier is Tier.VIP:
                    assert outcome == "released"
                    light = [n for n in caps if n not in nodes or 2 * room[n] >= windows[n]]
                    if not light:
                        most = max(room.values())
                        light = [n for n in nodes if room[n] == most]
                    assert node in light
                    vip_placed[str(node)] += 1
                    if keep_quiet and objective_ms:
                        held.add(str(node))
                    continue
                if not allowed:
                    # The hold only chooses where: where it alone refuses everywhere, the node
                    # whose VIP chat is oldest takes it (all equally old here: name order).
                    allowed = sorted(n for n in caps
                                     if may_place(n, prompt, rooms_now, windows, keep_quiet))[:1]
                if not allowed:
                    assert outcome == "queued"
                    # Queued work blocks its own tier's fast path after it: start afresh.
                    await client.delete(*k.queues, k.tenant_queued, k.tenant_key(TENANT.name),
                                        *(k.flows(t) for t in Tier),
                                        *(k.flow(t, TENANT.name) for t in Tier))
                    continue
                assert outcome == "released" and node in allowed
                counts[node] += prompt
            stored = {_s(f): int(v) for f, v in
                      (await client.hgetall(k.node_prefill_released)).items()}
            assert {n: stored.get(n, 0) for n in counts} == counts
            # Each held node's VIP placement is recorded at the clock's time, and only those.
            vip = {f: v for f, v in stored.items() if f.endswith(":vip")}
            assert vip == {f"{n}:vip": FROZEN_US for n in held}
            # Each VIP placement is counted on its node (it runs there until the next scrape).
            vips = {f: v for f, v in stored.items() if f.endswith(":vips")}
            assert vips == {f"{n}:vips": c for n, c in vip_placed.items()}
            assert set(stored) - set(vip) - set(vips) <= set(counts)
        finally:
            await client.aclose()

    asyncio.run(run())


async def test_concurrent_normal_admits_take_exactly_the_room_and_vip_is_not_held(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    # Room 2,550 of a 10,000 window, 100-token prompts: 25 fit, the 26th finds 50 left.
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (2_550, 10_000)})
    results = await asyncio.gather(*(_admit(store, f"n{i}", Tier.NORMAL, 100) for i in range(100)))
    released = [r for r in results if r[0] == "released"]
    assert len(released) == 25
    assert all(r[0] == "queued" for r in results if r[0] != "released")
    assert await _count(redis_client, store.keys.node_prefill_released, "node-a") == 2_500
    vips = await asyncio.gather(*(_admit(store, f"v{i}", Tier.VIP, 400) for i in range(20)))
    assert vips == [("released", "node-a")] * 20
    assert await _count(redis_client, store.keys.node_prefill_released, "node-a") == 2_500


async def test_a_prompt_larger_than_the_window_runs_on_a_half_empty_room(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (600, 1_000)})
    assert await _admit(store, "doc", Tier.BATCH, 8_000) == ("released", "node-a")
    # Its prompt took the room (and more): nothing else of Normal or Batch until the leader
    # publishes the next room.
    assert (await _admit(store, "chat", Tier.NORMAL, 10))[0] == "queued"


async def test_rooms_refill_between_polls_at_the_published_rate_up_to_the_window(
        redis_client: aioredis.Redis) -> None:
    """A room published with a prefill rate of 10,000 tokens/s refills as the scripts' clock
    moves, never beyond the window, and only until the publish's horizon (100 ms here)."""
    async def published(pool: str, room: int, rate: int) -> PoolStore:
        """A pool whose one node got `room` of a 1,000-token window at 0 ms."""
        store = await _store(redis_client, pool)
        await _at_ms(redis_client, store, 0)
        await store.publish_state(1, Zone.GREEN, {"node-a": BIG},
                                  prefill={"node-a": (room, 1_000, rate)}, refill_ms=100)
        return store

    store = await published("refill", 1_000, 10_000)
    assert await _admit(store, "a", Tier.NORMAL, 1_000) == ("released", "node-a")
    await _at_ms(redis_client, store, 20)  # 200 tokens prefilled since, by the rate
    assert await _admit(store, "b", Tier.NORMAL, 150) == ("released", "node-a")
    await _at_ms(redis_client, store, 500)  # the refill stopped at 100 ms: -150 + 1,000
    assert await _admit(store, "c", Tier.NORMAL, 850) == ("released", "node-a")
    assert await _admit(store, "d", Tier.NORMAL, 1) == ("queued", None)

    store = await published("capped", 400, 10_000)
    await _at_ms(redis_client, store, 100)  # 400 + 1,000 refilled, but at most the window
    assert await _admit(store, "a", Tier.NORMAL, 1_000) == ("released", "node-a")
    assert await _admit(store, "b", Tier.NORMAL, 1) == ("queued", None)

    store = await published("still", 400, 0)
    await _at_ms(redis_client, store, 100)  # rate 0 (the node must take nothing more): no refill
    assert await _admit(store, "a", Tier.NORMAL, 400) == ("released", "node-a")
    assert await _admit(store, "b", Tier.NORMAL, 1) == ("queued", None)


def _fair_store(client: aioredis.Redis, headroom: float) -> PoolStore:
    return PoolStore(client, register_scripts(client), "pf", PoolPolicy(fair_headroom=headroom))


async def _admit_as(store: PoolStore, task_id: str, tenant: str, prompt: int) -> str:
    got = await store.admit(task_id=task_id, tier=Tier.NORMAL, prompt_tokens=prompt,
                            max_tokens=10, gateway="gw", queue_timeout_ms=60_000,
                            tenant=TenantQuota(tenant, rate=0, burst=10**9, max_queued=100))
    return got.outcome.value


@pytest.mark.parametrize("headroom", [0.02, 0.0])
async def test_light_tenants_overdraw_the_room_a_flood_left_by_up_to_two_windows(
        redis_client: aioredis.Redis, headroom: float) -> None:
    """Tenant a's chats take 900 of a 1,000-token room and its next one queues (100 left:
    less than the prompt and than half the window). b and c arrive beside a's backlog with none
    of their own: in a pool that holds room back for light tenants each overdraws the room
    (to -300, then -700: counted for the leader to take out of the next rooms), d's 1,400
    tokens would take it below minus two windows and queue. With the next room of 100, e's
    2,200 tokens would take it below minus two windows and queue, f's 2,000 pass. Without
    headroom none of them passes."""
    store = _fair_store(redis_client, headroom)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (1_000, 1_000)})
    assert [await _admit_as(store, f"a-{i}", "a", 300) for i in range(4)] == [
        "released", "released", "released", "queued"]
    got = [await _admit_as(store, f"{t}-0", t, p) for t, p in (("b", 400), ("c", 400),
                                                                 ("d", 1_400))]
    assert got == (["released", "released", "queued"] if headroom else ["queued"] * 3)
    for tenant in "bcd":
        assert await redis_client.zscore(store.keys.light(Tier.NORMAL), tenant) is not None
    released = 1_700 if headroom else 900
    assert await _count(redis_client, store.keys.node_prefill_released, "node-a") == released
    overdrawn = await redis_client.hget(store.keys.node_prefill_released, "node-a:light")
    assert overdrawn == (b"700" if headroom else None)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG},
                              prefill={"node-a": (released + 100, 1_000)})
    got = [await _admit_as(store, f"{t}-0", t, p) for t, p in (("e", 2_200), ("f", 2_000))]
    assert got == (["queued", "released"] if headroom else ["queued"] * 2)


async def test_a_light_tenants_prompt_the_room_takes_anyway_is_no_overdraw(
        redis_client: aioredis.Redis) -> None:
    """Beside a's backlog, light b's 2,000-token prompt finds 600 of a 1,000-token window: the
    half-window rule passes it for any tenant, so nothing is counted for the leader to take
    back (only what the light rule alone let through is an overdraw)."""
    store = _fair_store(redis_client, 0.02)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (1_000, 1_000)})
    assert [await _admit_as(store, f"a-{i}", "a", 300) for i in range(4)] == [
        "released", "released", "released", "queued"]
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG},
                              prefill={"node-a": (900 + 600, 1_000)})
    assert await _admit_as(store, "b-0", "b", 2_000) == "released"
    assert await _count(redis_client, store.keys.node_prefill_released, "node-a") == 2_900
    assert await redis_client.hget(store.keys.node_prefill_released, "node-a:light") is None


@pytest.mark.parametrize("headroom", [0.02, 0.0])
async def test_a_flooding_tenants_release_leaves_a_token_of_room_for_a_light_one(
        redis_client: aioredis.Redis, headroom: float) -> None:
    """a holds 930 tokens in flight against light b's 60: more than its share. With headroom
    its queued 300-token prompt does not spend a room of exactly 300 (a light request finds a
    token left); without, it does."""
    store = _fair_store(redis_client, headroom)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (1_000, 1_000)})
    assert [await _admit_as(store, f"a-{i}", "a", 300) for i in range(4)][-1] == "queued"
    assert await _admit_as(store, "b-0", "b", 50) == "released"
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (950 + 300,
                                                                                  1_000)})
    released = [t.task_id for t in await store.release(1, (10, 10, 10))]
    assert released == ([] if headroom else ["a-3"])


async def test_the_leaders_release_obeys_the_room_and_keeps_fifo(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (0, 2_000)})
    for i, prompt in enumerate((600, 600, 600, 100)):
        assert (await _admit(store, f"b{i}", Tier.BATCH, prompt))[0] == "queued"
    # The next poll's room takes two of the three 600-token prompts; the 100-token one behind
    # the third does not overtake it.
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (1_300, 2_000)})
    released = await store.release(1, (100, 100, 100))
    assert [t.task_id for t in released] == ["b0", "b1"]
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, prefill={"node-a": (2_400, 2_000)})
    released = await store.release(1, (100, 100, 100))
    assert [t.task_id for t in released] == ["b2", "b3"]
    assert await _count(redis_client, store.keys.node_prefill_released, "node-a") == 1_900


async def test_without_a_published_room_nothing_is_limited(redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG})
    results = [await _admit(store, f"n{i}", Tier.NORMAL, 8_000) for i in range(10)]
    assert results == [("released", "node-a")] * 10
