"""What the scripts keep for VIP chats and where they send them, against real Redis: long
prefills leave a quiet node for VIP (a VIP chat holds them off its node for the objective, which
chooses where a document goes, never whether), VIP steered to the quiet node with the shorter
decode batch, a VIP burst between polls counted where it was placed, and lanes: the shared node
that takes Normal and Batch only up to its cap and its bound on declared outputs, and never a
long prompt, while VIP passes it."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import redis.asyncio as aioredis

from admission.store import PoolStore
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
