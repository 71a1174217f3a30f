"""The prefill room in the scripts, against real Redis: the rule Normal and Batch placements obey
(lua/_room.lua prefill_fits, and the count each release raises) checked against a plain-Python
reference, exactness under concurrent admits, VIP never held by it, the leader's release obeying
it, and the VIP first-token counts the finish script keeps for the release control."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from admission.config import Config
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from scheduler.control import REFILL_POLLS
from tests.scheduler_stub import FakeVllm, always, make_config, pool_scheduler, serve_fake, state

NODES = ("node-a", "node-b", "node-c")
TENANT = TenantQuota("t", rate=0, burst=10**9, max_queued=10_000)
BIG = 10**9
"""KV budgets that never bind: these tests are about the prefill room alone."""
FROZEN_US = 10**15
"""Where tests stop the scripts' clock (µs)."""


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


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _count(client: aioredis.Redis, key: str, field: str) -> int:
    value = await client.hget(key, field)
    assert value is not None, (key, field)
    return int(value)


async def _store(client: aioredis.Redis, pool: str = "pf") -> PoolStore:
    return PoolStore(client, register_scripts(client), pool, PoolPolicy())


async def _at_ms(client: aioredis.Redis, store: PoolStore, ms: int) -> None:
    """Stand the scripts' clock still at FROZEN_US + `ms`."""
    await client.hset(store.keys.clock, "frozen_us", FROZEN_US + ms * 1000)


async def _admit(store: PoolStore, task_id: str, tier: Tier, prompt: int) -> tuple[str, str | None]:
    got = await store.admit(task_id=task_id, tenant=TENANT, tier=tier, prompt_tokens=prompt,
                            max_tokens=10, gateway="gw", queue_timeout_ms=60_000)
    return got.outcome.value, got.node


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


async def test_long_prompts_leave_a_quiet_node_for_vip(redis_client: aioredis.Redis) -> None:
    """Two nodes with half-empty rooms, one kept quiet (the shipped default): the first
    document runs on one of them, the second queues behind it there although the other's room
    would take it by the half-window rule, a third waits, and a VIP chat goes to the node left
    quiet, as does a chat that fits its room. With no quiet node kept, the second document
    runs at once on the other node."""
    store = await _store(redis_client)
    rooms = {"node-a": (600, 1_000), "node-b": (600, 1_000)}
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG, "node-b": BIG},
                              {"prefill_quiet": 1}, prefill=rooms)
    outcome, first = await _admit(store, "doc-1", Tier.BATCH, 8_000)
    assert outcome == "released" and first is not None
    other = "node-b" if first == "node-a" else "node-a"
    assert await _admit(store, "doc-2", Tier.BATCH, 8_000) == ("released", first)
    assert await _admit(store, "doc-3", Tier.BATCH, 8_000) == ("queued", None)
    assert await _admit(store, "vip", Tier.VIP, 300) == ("released", other)
    assert await _admit(store, "chat", Tier.NORMAL, 100) == ("released", other)
    await redis_client.flushdb()
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG, "node-b": BIG},
                              {"prefill_quiet": 0}, prefill=rooms)
    placed = {(await _admit(store, f"doc-{i}", Tier.BATCH, 8_000))[1] for i in (1, 2)}
    assert placed == {"node-a", "node-b"}


async def test_a_vip_chat_holds_long_prefills_off_its_node_for_the_objective(
        redis_client: aioredis.Redis) -> None:
    """Three quiet nodes, one kept quiet, a 250 ms objective, the clock standing still;
    node-a has the most KV headroom, so the VIP chat and, left alone, each document go there.
    While the chat may still wait for its first step the document goes elsewhere; once the
    objective has passed node-a takes the next one. Without quiet nodes kept nothing is held
    and nothing is recorded."""
    rooms = {n: (1_000, 1_000) for n in NODES}
    caps = {"node-a": 2 * BIG, "node-b": BIG, "node-c": BIG}
    for quiet in (1, 0):
        store = await _store(redis_client, f"hold{quiet}")
        extra = {"prefill_quiet": quiet, "vip_ttft_objective_ms": 250}
        await _at_ms(redis_client, store, 0)
        await store.publish_state(1, Zone.GREEN, caps, extra, prefill=rooms)
        assert await _admit(store, "vip", Tier.VIP, 300) == ("released", "node-a")
        outcome, doc = await _admit(store, "doc-1", Tier.BATCH, 8_000)
        recorded = await redis_client.hget(store.keys.node_prefill_released, "node-a:vip")
        if not quiet:
            assert (outcome, doc, recorded) == ("released", "node-a", None)
            continue
        assert outcome == "released" and doc in ("node-b", "node-c")
        assert recorded is not None and int(recorded) == FROZEN_US
        for ms, held in ((249, True), (250, False)):
            # Every room whole again (the documents prefilled), the clock at `ms`.
            await _at_ms(redis_client, store, ms)
            released = await redis_client.hgetall(store.keys.node_prefill_released)
            fresh = {n: (int(released.get(n.encode(), 0)) + 1_000, 1_000) for n in NODES}
            await store.publish_state(1, Zone.GREEN, caps, extra, prefill=fresh)
            outcome, doc = await _admit(store, f"doc-{ms}", Tier.BATCH, 8_000)
            assert outcome == "released" and (doc != "node-a") is held


async def test_a_steady_vip_stream_does_not_hold_documents_back(
        redis_client: aioredis.Redis) -> None:
    """Two nodes, one kept quiet, a 250 ms objective, and a VIP chat on each node within it:
    the hold chooses where a document goes, never whether. Released by the leader, the
    document at the head of Normal goes to the node whose chat is older, and the chat queued
    behind it goes too (a head that fits no node would hold them both, and Batch, for as long
    as VIP keeps arriving); the next document queues behind it there, where the other node
    stays quiet."""
    store = await _store(redis_client)
    caps = {"node-a": BIG, "node-b": BIG}
    extra = {"prefill_quiet": 1, "vip_ttft_objective_ms": 250}
    await _at_ms(redis_client, store, 0)
    await store.publish_state(1, Zone.GREEN, caps, extra,
                              prefill={n: (0, 1_000) for n in caps})
    assert (await _admit(store, "doc-1", Tier.NORMAL, 8_000))[0] == "queued"
    assert (await _admit(store, "chat", Tier.NORMAL, 100))[0] == "queued"
    placed = []
    for i, ms in enumerate((100, 200)):
        await _at_ms(redis_client, store, ms)
        outcome, node = await _admit(store, f"vip-{i}", Tier.VIP, 300)
        assert outcome == "released" and node is not None
        placed.append(node)
    older, newer = placed
    assert older != newer, "the setup needs a VIP chat on each node"
    await _at_ms(redis_client, store, 250)
    released = await redis_client.hgetall(store.keys.node_prefill_released)
    await store.publish_state(1, Zone.GREEN, caps, extra, prefill={
        n: (int(released.get(n.encode(), 0)) + 1_000, 1_000) for n in caps})
    got = {t.task_id: t.node for t in await store.release(1, (100, 100, 100))}
    assert set(got) == {"doc-1", "chat"} and got["doc-1"] == older
    await _at_ms(redis_client, store, 260)
    assert await _admit(store, "doc-2", Tier.NORMAL, 8_000) == ("released", older)


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


async def test_vip_goes_to_the_quiet_node_with_the_shorter_decode_batch(
        redis_client: aioredis.Redis) -> None:
    """Both nodes quiet, node-a with twice node-b's KV headroom: a VIP chat goes to node-b
    while node-a's engine runs 40 sequences to node-b's 10, and to node-a (the KV rule) once
    their counts are within the slack (10 and 12). A node not quiet is passed over whatever
    its batch."""
    store = await _store(redis_client)
    caps = {"node-a": 2 * BIG, "node-b": BIG}
    for running, expect in (((40, 10), "node-b"), ((12, 10), "node-a")):
        await store.publish_state(1, Zone.GREEN, caps, prefill={
            "node-a": (1_000, 1_000, 0, running[0]), "node-b": (1_000, 1_000, 0, running[1])})
        assert await _admit(store, f"vip-{expect}", Tier.VIP, 300) == ("released", expect)
    await store.publish_state(1, Zone.GREEN, caps, prefill={
        "node-a": (100, 1_000, 0, 0), "node-b": (1_000, 1_000, 0, 40)})
    assert await _admit(store, "vip-busy", Tier.VIP, 300) == ("released", "node-b")


async def test_a_vip_burst_between_polls_counts_the_chats_it_placed(
        redis_client: aioredis.Redis) -> None:
    """Both nodes quiet, equal KV, node-a's engine running 10 sequences and node-b's 20 at
    the last scrape, and 21 VIP chats before the next poll: each chat counts as running where
    it was placed, so node-a takes the first ones and node-b its share once the counts are
    within the slack (the scraped counts alone would send all 20 to node-a). Chats placed
    after the leader read the counts, before it published, count as well. The next publish
    starts the count again from its own read: a VIP chat then goes to node-a at 20 to 30,
    although node-a took more of the burst. Without a count published (a leader of a
    version that publishes none) nothing is added."""
    store = await _store(redis_client)
    caps = {"node-a": BIG, "node-b": BIG}
    await store.publish_state(1, Zone.GREEN, caps, prefill={
        "node-a": (1_000, 1_000, 0, 20, -2, 0), "node-b": (1_000, 1_000, 0, 10, -2, 0)})
    read = await store.vip_placements()  # the leader's read, before its scrape
    assert read == {}
    # Placed after the read, before the publish: node-a's 20 is past the slack of node-b's 10.
    assert await _admit(store, "early", Tier.VIP, 300) == ("released", "node-b")
    await store.publish_state(1, Zone.GREEN, caps, prefill={
        "node-a": (1_000, 1_000, 0, 15, -2, 0), "node-b": (1_000, 1_000, 0, 10, -2, 0)})
    assert await store.vip_placements() == {"node-b": 1}
    # node-b runs 11 with it: node-a's 15 is within the slack (4), and has less reserved.
    assert await _admit(store, "vip-first", Tier.VIP, 300) == ("released", "node-a")
    placed = Counter([(await _admit(store, f"vip-{i}", Tier.VIP, 300))[1] for i in range(20)])
    placed["node-a"] += 1
    assert set(placed) == {"node-a", "node-b"}
    # Each chat went to a node within the slack of the least busy (max(4, a quarter of it)),
    # the one placed before the publish counted on node-b.
    low, high = sorted((15 + placed["node-a"], 10 + 1 + placed["node-b"]))
    assert high - low <= max(4, math.ceil(low / 4)) + 1, placed
    counts = await store.vip_placements()
    await store.publish_state(1, Zone.GREEN, caps, prefill={
        "node-a": (1_000, 1_000, 0, 30, -2, counts["node-a"]),
        "node-b": (1_000, 1_000, 0, 20, -2, counts["node-b"])})
    assert await _admit(store, "vip-next", Tier.VIP, 300) == ("released", "node-b")
    await store.publish_state(1, Zone.GREEN, caps, prefill={
        "node-a": (1_000, 1_000, 0, 10), "node-b": (1_000, 1_000, 0, 20)})
    assert await _admit(store, "vip-old-leader", Tier.VIP, 300) == ("released", "node-a")


async def test_a_lane_takes_exactly_its_cap_of_normal_and_batch_and_vip_past_it(
        redis_client: aioredis.Redis) -> None:
    """node-a is a lane with a cap of 5 (node-b has no KV room): of 100 concurrent Normal
    chats exactly 5 are released, all to the lane, and counted as its guests; VIP chats pass
    the cap. A chat's end frees its place for the next one, and Batch is counted alike."""
    store = await _store(redis_client)
    k = store.keys
    rooms = {"node-a": (100_000, 100_000, 0, 3, 5)}
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG, "node-b": 0}, prefill=rooms)
    results = await asyncio.gather(*(_admit(store, f"n{i}", Tier.NORMAL, 100) for i in range(100)))
    released = [f"n{i}" for i, r in enumerate(results) if r == ("released", "node-a")]
    assert len(released) == 5
    assert all(r == ("queued", None) for r in results if r[0] != "released")
    assert await _count(redis_client, k.node_guests, "node-a") == 5
    vips = await asyncio.gather(*(_admit(store, f"v{i}", Tier.VIP, 400) for i in range(10)))
    assert vips == [("released", "node-a")] * 10
    assert await _count(redis_client, k.node_guests, "node-a") == 5
    await redis_client.delete(*k.queues)  # the queued chats would block the fast path
    await store.finish(released[0], 20, cancelled=False)
    assert await _count(redis_client, k.node_guests, "node-a") == 4
    assert await _admit(store, "b1", Tier.BATCH, 100) == ("released", "node-a")
    assert await _admit(store, "b2", Tier.BATCH, 100) == ("queued", None)
    assert await _count(redis_client, k.node_guests, "node-a") == 5
    # The leader reads the count in its tick, only when the pool keeps lanes.
    with_guests = await store.read_tick(control=True, running=True, guests=True)
    assert with_guests.guests == {"node-a": 5} and with_guests.running is not None
    without = await store.read_tick(control=True, running=True)
    assert without.guests == {} and without.running == with_guests.running


async def test_a_lane_takes_no_long_prompt_and_a_cap_of_minus_one_counts_nothing(
        redis_client: aioredis.Redis) -> None:
    """With no quiet node kept, a document larger than twice the window goes to the node that
    is not a lane, and the next one queues rather than take the lane; a chat goes to the lane,
    whose cap of -1 (not learned) bounds nothing. Without the lane the second document runs on
    node-a (test_long_prompts_leave_a_quiet_node_for_vip)."""
    store = await _store(redis_client)
    rooms = {"node-a": (600, 1_000, 0, -1, -1), "node-b": (600, 1_000)}
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG, "node-b": BIG},
                              {"prefill_quiet": 0}, prefill=rooms)
    assert await _admit(store, "doc-1", Tier.BATCH, 8_000) == ("released", "node-b")
    assert await _admit(store, "doc-2", Tier.BATCH, 8_000) == ("queued", None)
    await redis_client.delete(*store.keys.queues)
    chats = [await _admit(store, f"c{i}", Tier.NORMAL, 100) for i in range(3)]
    assert chats == [("released", "node-a")] * 3
    assert await _count(redis_client, store.keys.node_guests, "node-a") == 3
    state_hash = {_s(f): _s(v) for f, v in
                  (await redis_client.hgetall(store.keys.node_prefill)).items()}
    assert state_hash["node-a:lane"] == "-1" and "node-b:lane" not in state_hash


async def test_vip_goes_to_a_lane_with_a_cap_even_when_its_prefill_room_is_short(
        redis_client: aioredis.Redis) -> None:
    """node-a is a lane whose cap holds (2) and whose room is spent (not quiet), running 5
    sequences; node-b is quiet and runs 50: a VIP chat goes to the lane, for its short batch.
    A lane without a cap (-1: open) and a node that is no lane are steered by quietness as
    before: the chat goes to node-b."""
    caps = {"node-a": BIG, "node-b": BIG}
    for lane, expect in ((2, "node-a"), (0, "node-a"), (-1, "node-b"), (None, "node-b")):
        store = await _store(redis_client, f"lane{lane}")
        a: tuple[int, ...] = (0, 1_000, 0, 5) if lane is None else (0, 1_000, 0, 5, lane)
        await store.publish_state(1, Zone.GREEN, caps,
                                  prefill={"node-a": a, "node-b": (1_000, 1_000, 0, 50)})
        assert await _admit(store, "vip", Tier.VIP, 300) == ("released", expect), lane


async def test_a_lane_takes_no_normal_or_batch_task_declaring_a_longer_output_than_its_bound(
        redis_client: aioredis.Redis) -> None:
    """`lane_output` 500 published: Normal and Batch chats declaring at most 500 output tokens
    go to the lane (node-a; node-b has no KV room), longer ones queue, and VIP passes whatever it
    declares. Not published (0), the lane takes any output."""
    async def admit(store: PoolStore, task_id: str, tier: Tier, max_tokens: int) -> str | None:
        got = await store.admit(task_id=task_id, tenant=TENANT, tier=tier, prompt_tokens=100,
                                max_tokens=max_tokens, gateway="gw", queue_timeout_ms=60_000)
        return got.node if got.outcome.value == "released" else got.outcome.value

    rooms = {"node-a": (100_000, 100_000, 0, 3, -1)}
    caps = {"node-a": BIG, "node-b": 0}
    bounded = await _store(redis_client, "bounded")
    await bounded.publish_state(1, Zone.GREEN, caps, {"lane_output": 500}, prefill=rooms)
    assert await admit(bounded, "n-short", Tier.NORMAL, 500) == "node-a"
    assert await admit(bounded, "b-short", Tier.BATCH, 20) == "node-a"
    assert await admit(bounded, "v-long", Tier.VIP, 4_000) == "node-a"
    assert await admit(bounded, "n-long", Tier.NORMAL, 501) == "queued"
    await redis_client.delete(*bounded.keys.queues)
    assert await admit(bounded, "b-long", Tier.BATCH, 4_000) == "queued"
    assert await _count(redis_client, bounded.keys.node_guests, "node-a") == 2
    unbounded = await _store(redis_client, "unbounded")
    await unbounded.publish_state(1, Zone.GREEN, caps, prefill=rooms)
    assert await admit(unbounded, "n-long", Tier.NORMAL, 4_000) == "node-a"


async def test_a_one_node_pool_runs_long_prompts_with_a_quiet_node_asked_for(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, {"prefill_quiet": 2},
                              prefill={"node-a": (600, 1_000)})
    assert await _admit(store, "doc", Tier.BATCH, 8_000) == ("released", "node-a")


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


async def test_the_finish_script_counts_vip_first_tokens_against_the_objective(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    k = store.keys
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG})
    assert (await _admit(store, "v0", Tier.VIP, 10))[0] == "released"
    await store.finish("v0", 20, cancelled=False, ttft_ms=500)
    # No objective published: nothing counted.
    assert await redis_client.hgetall(k.node_vip_ttft) == {}
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, {"vip_ttft_objective_ms": 250})
    for task_id, tier, ttft in (("v1", Tier.VIP, 100), ("v2", Tier.VIP, 251),
                                ("v3", Tier.VIP, None), ("n1", Tier.NORMAL, 900)):
        assert (await _admit(store, task_id, tier, 10))[0] == "released"
        await store.finish(task_id, 20, cancelled=False, ttft_ms=ttft)
    counts = {_s(f): int(v) for f, v in (await redis_client.hgetall(k.node_vip_ttft)).items()}
    # ...and each in its 10% bucket: 100 ms in [1.1^48, 1.1^49), 251 in [1.1^57, 1.1^58).
    # The histogram is the pool's, one field a bucket however many nodes.
    assert counts == {"node-a:n": 2, "node-a:over": 1, "h48": 1, "h57": 1}
    # The leader reads them per node, the field format parsed in admission.reads; per-node
    # buckets that an earlier version of the script wrote still count.
    await redis_client.hset(k.node_vip_ttft, "node-old:h48", 2)
    reading = await store.read_tick(control=True, running=False)
    assert reading.vip_reports == {"node-a": (2, 1)}
    assert reading.vip_histogram == {48: 3, 57: 1}
    await redis_client.hdel(k.node_vip_ttft, "node-old:h48")
    # A repeated settle is a no-op: counted once.
    await store.finish("v2", 20, cancelled=False, ttft_ms=251)
    counts = {_s(f): int(v) for f, v in (await redis_client.hgetall(k.node_vip_ttft)).items()}
    assert counts == {"node-a:n": 2, "node-a:over": 1, "h48": 1, "h57": 1}


@pytest.mark.parametrize("ttft_ms", [0, 1, 2, 10, 11, 12, 99, 1_000, 45_000, 10**7])
async def test_the_finish_scripts_buckets_are_ten_percent_wide(
        redis_client: aioredis.Redis, ttft_ms: int) -> None:
    """The bucket of a first token is the k with 1.1^k <= ms < 1.1^(k+1), from 0 (below
    1.1 ms) to 120 (the last holds everything above ~92 s); scheduler.calm reads them so."""
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, {"vip_ttft_objective_ms": 250})
    assert (await _admit(store, "v", Tier.VIP, 10))[0] == "released"
    await store.finish("v", 20, cancelled=False, ttft_ms=ttft_ms)
    [bucket] = (await store.read_tick(control=True, running=False)).vip_histogram
    assert 0 <= bucket <= 120
    assert bucket == 0 or 1.1 ** bucket <= ttft_ms * 1.000001
    assert bucket == 120 or ttft_ms < 1.1 ** (bucket + 1) * 1.000001


def _control_config(redis_url: str, node_url: str) -> Config:
    """One node, the release control on: a window of 10,000 tokens/s x 0.2 s x 1/2 = 1,000."""
    return make_config(redis_url, [{"name": "n1", "url": node_url}],
                       control={"vip_ttft_objective_ms": 200, "prefill_tokens_per_s": 10_000})


@asynccontextmanager
async def _one_node_control(redis_client: aioredis.Redis, redis_url: str
                            ) -> AsyncIterator[tuple[FakeVllm, Any]]:
    """A pool scheduler with the release control on (window 10,000 tokens/s x 0.2 s x 1/2 =
    1,000 tokens) over one node whose metrics page a test drives; the scripts' clock stopped
    at FROZEN_US (the rooms refill only as a test moves it)."""
    fake = FakeVllm(running=1, prompt_tokens=0.0)
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as ps:
            await _at_ms(redis_client, ps.store, 0)
            yield fake, ps


async def test_the_leader_publishes_rooms_from_the_measured_backlog(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """A tick against a real metrics page: window, backlog and room in the state hash and the
    scripts' hash, the room shrinking by what a gateway released, and growing back when the
    engine's prompt counter shows it prefilled."""
    async with _one_node_control(redis_client, redis_url) as (fake, ps):
        k = ps.store.keys
        await ps.tick(1, always)  # window 10,000 tokens/s x 0.2 s x 1/2
        published = await state(ps.store)
        assert (published["prefill_window:n1"], published["prefill_backlog:n1"],
                published["prefill_room:n1"]) == ("1000", "0", "1000")
        assert published["vip_ttft_objective_ms"] == "200"
        rooms = {_s(f): int(v) for f, v in (await redis_client.hgetall(k.node_prefill)).items()}
        refill_us = REFILL_POLLS * ps.settings.poll_interval_ms * 1000
        assert rooms == {"n1": 1_000, "n1:window": 1_000, "n1:rate": 10_000, "n1:running": 1,
                         "n1:vips": 0, ":at": FROZEN_US, ":until": FROZEN_US + refill_us}
        assert ps.metrics.prefill_window.labels("p", "n1")._value.get() == 1_000
        assert (await _admit(ps.store, "a", Tier.NORMAL, 800))[0] == "released"
        await ps.tick(1, always)  # the counter has not moved: 800 queued for prefill
        published = await state(ps.store)
        assert (published["prefill_backlog:n1"], published["prefill_room:n1"]) == ("800", "200")
        assert (await _admit(ps.store, "b", Tier.NORMAL, 300))[0] == "queued"
        fake.prompt_tokens = 800.0
        result = await ps.tick(1, always)  # prefilled: the whole window again
        assert [t.task_id for t in result.released] == ["b"]
        published = await state(ps.store)
        assert (published["prefill_backlog:n1"], published["prefill_room:n1"]) == ("0", "1000")
        assert await _count(redis_client, k.node_prefill_released, "n1") == 1_100


async def test_the_leader_takes_light_overdraws_out_of_the_next_room(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """A light tenant's overdraw prefilled before the next poll does not come on top of the
    next room: 300 overdrawn (the scripts' n1:light count) leave the next room 700, then the
    whole window again; a count already there when the leader first reads it is not owed."""
    async with _one_node_control(redis_client, redis_url) as (_fake, ps):
        k = ps.store.keys
        await redis_client.hset(k.node_prefill_released, "n1:light", 5_000)
        rooms = []
        for overdraw in (0, 300, 0):
            await redis_client.hincrby(k.node_prefill_released, "n1:light", overdraw)
            await ps.tick(1, always)
            rooms.append((await state(ps.store))["prefill_room:n1"])
            limit = await _count(redis_client, k.node_prefill, "n1")
            assert limit == int(rooms[-1])  # nothing released: the limit is the room
        assert rooms == ["1000", "700", "1000"]


async def test_a_new_leader_ages_released_tasks_by_the_redis_clock(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """A takeover: the last publish is the previous leader's, from before the pause, and the
    fast path released a task after it, long enough ago to be prefilled at the configured rate.
    The new leader's first room is the whole window: it ages the task by Redis TIME. Against
    the last publish the task would look released in the future, so still queued, and the room
    would stay shut for as long as the task runs (the engine's counter, which would correct
    the estimate, does not move once everything is prefilled)."""
    fake = FakeVllm(running=1, prompt_tokens=0.0)
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as old:
            k = old.store.keys
            await old.tick(1, always)
            assert (await _admit(old.store, "a", Tier.NORMAL, 800))[0] == "released"
        # The history, moved back: the publish 10 s ago, the release 5 s ago.
        now_us = await old.store.redis_time_us()
        await redis_client.hset(k.state, "updated_us", now_us - 10_000_000)
        members = [_s(m) for m in await redis_client.zrange(k.running, 0, -1)]
        assert len(members) == 1
        await redis_client.zadd(k.running, {members[0]: now_us - 5_000_000})
        async with pool_scheduler(redis_client, config) as new:
            await new.tick(2, always)
            published = await state(new.store)
            assert (published["prefill_backlog:n1"], published["prefill_room:n1"]) == ("0", "1000")
            # The control: a task released just now is queued for its prefill.
            assert (await _admit(new.store, "b", Tier.NORMAL, 300))[0] == "released"
            await new.tick(2, always)
            assert (await state(new.store))["prefill_backlog:n1"] == "300"


async def test_a_new_leader_resumes_the_published_prefill_rate_and_gain(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """The rate and gain the last leader measured (the state hash's prefill_rate and
    prefill_gain) carry over a takeover: the new leader's first window is built on them, not
    on the configured rate (10,000 tokens/s: a window of 1,000), and it publishes them on."""
    fake = FakeVllm(running=1, prompt_tokens=0.0)
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as ps:
            await redis_client.hset(ps.store.keys.state, mapping={
                "prefill_rate:n1": "8000", "prefill_gain:n1": "0.900",
                "prefill_rate:gone": "nan"})
            await ps.tick(1, always)
            published = await state(ps.store)
            # 0.9 x 8,000 tokens/s x 0.2 s x 1/2
            assert (published["prefill_window:n1"], published["prefill_rate:n1"],
                    published["prefill_gain:n1"]) == ("720", "8000", "0.900")


async def test_the_leader_publishes_the_decode_step_time_and_resumes_the_calm_one(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """The running limit's signal against a real metrics page: the mean step time between two
    readings of the inter-token histogram (0.5 s over 20 tokens: 25 ms) in the state hash and
    the metrics, and the calm step time the last leader published carried over a takeover."""
    fake = FakeVllm(running=1, prompt_tokens=0.0, itl=(1.0, 100.0))
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as ps:
            await redis_client.hset(ps.store.keys.state, mapping={
                "prefill_rate:n1": "8000", "calm_step_ms:n1": "12.50"})
            await ps.tick(1, always)
            published = await state(ps.store)
            assert (published["decode_step_ms:n1"], published["calm_step_ms:n1"]) == ("", "12.50")
            fake.itl = (1.5, 120.0)
            await ps.tick(1, always)
            published = await state(ps.store)
            assert published["decode_step_ms:n1"] == "25.00"
            assert published["calm_step_ms:n1"] == "12.50"  # one calm poll moves it by ~nothing
            assert ps.metrics.decode_step.labels("p", "n1")._value.get() == pytest.approx(0.025)


async def test_the_leader_keeps_the_first_shared_node_as_a_lane_and_publishes_its_cap(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """Three nodes, n1 dedicated to VIP: the lane is n2, the first shared node by name (n3 is
    not one: at most all but one shared node). Before any step time is read it may start one
    task; once its engine reports a step within budget, the cap is the batch that step allows
    less the sequences that are not the lane's Normal and Batch tasks. Published in the
    scripts' hash, the state hash and the metrics, with the lane's bound on declared outputs;
    with lane_nodes 0 there is none."""
    fakes = [FakeVllm(running=4, prompt_tokens=0.0, itl=(0.0, 0.0)) for _ in range(3)]
    async with (serve_fake(fakes[0]) as u1, serve_fake(fakes[1]) as u2,
                serve_fake(fakes[2]) as u3):
        backends = [{"name": f"n{i + 1}", "url": u} for i, u in enumerate((u1, u2, u3))]
        for lane_nodes, lanes in ((1, ["n2"]), (0, [])):
            config = make_config(redis_url, backends, dedicated={"nodes": ["n1"],
                                                                 "tiers": ["vip"]},
                                 control={"vip_ttft_objective_ms": 300,
                                          "lane_nodes": lane_nodes,
                                          "lane_output": 600 * lane_nodes})
            async with pool_scheduler(redis_client, config) as ps:
                for fake in fakes:
                    fake.itl = (0.0, 0.0)
                await ps.tick(1, always)
                published = await state(ps.store)
                scripts = {_s(f): _s(v) for f, v in
                           (await redis_client.hgetall(ps.store.keys.node_prefill)).items()}
                if not lanes:
                    assert not any(f.startswith("lane_cap:") for f in published)
                    assert not any(f.endswith(":lane") for f in scripts)
                    continue
                assert published["lane_cap:n2"] == "1" and scripts["n2:lane"] == "1"
                assert published["lane_output"] == "600"  # what the scripts bound outputs by
                assert "lane_cap:n3" not in published and "n3:lane" not in scripts
                # 10 tokens at 20 ms, the shortest step read; the objective (300 ms) stands
                # in for the calm P99: the step may reach 20 + 20 ms.
                fakes[1].itl = (0.2, 10.0)
                await ps.tick(1, always)
                # 4 running, 0 of them the lane's tasks: 4 x 40 / 20 - 4 = 4.
                published = await state(ps.store)
                assert (published["lane_cap:n2"], published["floor_step_ms:n2"]) == ("4", "20.00")
                assert "floor_step_ms:n3" not in published
                assert ps.metrics.lane_cap.labels("p", "n2")._value.get() == 4
            await redis_client.flushdb()
