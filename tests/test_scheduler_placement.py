"""The leader's tick with dedicated nodes and with the peak-over-time projection: real Redis,
fake vLLM metrics pages over HTTP."""

from __future__ import annotations

from typing import Any

from admission.outcomes import AdmitOutcome
from admission.tiers import Tier, Zone
from tests.scheduler_stub import (
    FakeVllm,
    admit,
    always,
    make_config,
    pool_scheduler,
    queue_tasks,
    serve_fake,
    state,
)


def _dedicated_to_vip(redis_url: str, vip_url: str, shared_url: str, **guests: int) -> Any:
    """A pool of two nodes, "vip-node" dedicated to VIP with the given guest keys, and "shared"."""
    return make_config(redis_url, [{"name": "vip-node", "url": vip_url},
                                   {"name": "shared", "url": shared_url}],
                       dedicated={"nodes": ["vip-node"], "tiers": ["vip"], **guests})


async def test_dedicated_nodes_are_published_and_the_release_places_by_them(
        redis_client: Any, redis_url: str) -> None:
    async with serve_fake(FakeVllm()) as vip_url, serve_fake(FakeVllm()) as shared_url:
        config = _dedicated_to_vip(redis_url, vip_url, shared_url)
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("b1", Tier.BATCH, 1_000), ("v1", Tier.VIP, 1_000),
                                         ("n1", Tier.NORMAL, 1_000)])
            result = await ps.tick(1, always)
            published = await state(ps.store)
            assert (published["dedicated_nodes"], published["dedicated_tiers"]) == ("vip-node",
                                                                                    "1")
            placed = {t.task_id: t.node for t in result.released}
            assert placed == {"v1": "vip-node", "n1": "shared", "b1": "shared"}
            assert "dedicated_guest_prompt" not in published


async def test_a_guest_pace_is_published_and_a_paced_node_takes_one_guest_per_tick(
        redis_client: Any, redis_url: str) -> None:
    async with serve_fake(FakeVllm()) as vip_url, serve_fake(FakeVllm()) as shared_url:
        config = _dedicated_to_vip(redis_url, vip_url, shared_url, guest_max_prompt_tokens=500,
                                   max_guests_per_node=10, guest_prompt_tokens_per_s=100,
                                   guest_max_output_tokens=400)
        async with pool_scheduler(redis_client, config) as ps:
            # Prompts of 400 tokens: the first guest paces the dedicated node for 4 s.
            await queue_tasks(ps.store, [("n1", Tier.NORMAL, 800), ("n2", Tier.NORMAL, 800)])
            result = await ps.tick(1, always)
            published = await state(ps.store)
            assert (published["dedicated_guest_rate"], published["dedicated_guest_output"]) == (
                "100", "400")
            placed = {t.task_id: t.node for t in result.released}
            assert placed == {"n1": "vip-node", "n2": "shared"}
            assert await redis_client.hgetall(ps.store.keys.node_guests) == {b"vip-node": b"1"}


async def test_guest_limits_are_published_and_short_work_of_other_tiers_joins_the_dedicated_node(
        redis_client: Any, redis_url: str) -> None:
    async with serve_fake(FakeVllm()) as vip_url, serve_fake(FakeVllm()) as shared_url:
        config = _dedicated_to_vip(redis_url, vip_url, shared_url, guest_max_prompt_tokens=500,
                                   max_guests_per_node=1)
        async with pool_scheduler(redis_client, config) as ps:
            # queue_tasks splits each cost in halves: prompts of 400, 400 and 1,000 tokens.
            await queue_tasks(ps.store, [("n1", Tier.NORMAL, 800), ("b1", Tier.BATCH, 800),
                                         ("b2", Tier.BATCH, 2_000)])
            result = await ps.tick(1, always)
            published = await state(ps.store)
            assert (published["dedicated_guest_prompt"],
                    published["dedicated_guest_cap"]) == ("500", "1")
            placed = {t.task_id: t.node for t in result.released}
            # n1 takes the only guest slot; b1 fits the limit but finds the slot taken.
            assert placed == {"n1": "vip-node", "b1": "shared", "b2": "shared"}
            assert await redis_client.hgetall(ps.store.keys.node_guests) == {b"vip-node": b"1"}


async def test_a_dedicated_node_full_of_guests_does_not_hold_batch_off_idle_shared_nodes(
        redis_client: Any, redis_url: str) -> None:
    """The zone follows the shared nodes: a dedicated node at 75% (its VIP chats and guests) would
    make the pool YELLOW under aggregate "max", and YELLOW holds every Batch task."""
    dedicated, shared = FakeVllm(usage=0.75), FakeVllm(usage=0.10)
    async with serve_fake(dedicated) as dedicated_url, serve_fake(shared) as shared_url:
        config = make_config(redis_url, [{"name": "vip-node", "url": dedicated_url},
                                         {"name": "shared", "url": shared_url}],
                             dedicated={"nodes": ["vip-node"], "tiers": ["vip"],
                                        "guest_max_prompt_tokens": 500})
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("b1", Tier.BATCH, 20_000)])
            result = await ps.tick(1, always)
            assert result.zone is Zone.GREEN
            assert {t.task_id: t.node for t in result.released} == {"b1": "shared"}
            shared.usage = 0.75  # now the shared node is where the pressure is
            result = await ps.tick(1, always)
            assert result.zone is Zone.YELLOW


async def test_yellow_holds_batch_off_the_shared_nodes_but_the_dedicated_node_takes_guests(
        redis_client: Any, redis_url: str) -> None:
    """YELLOW follows the shared nodes; a dedicated node's guest room is its own. Without Batch
    guests there, YELLOW leaves that room to Normal chats, whose long answers fill its batch."""
    dedicated, shared = FakeVllm(usage=0.10), FakeVllm(usage=0.72)
    async with serve_fake(dedicated) as dedicated_url, serve_fake(shared) as shared_url:
        config = _dedicated_to_vip(redis_url, dedicated_url, shared_url,
                                   guest_max_prompt_tokens=500, max_guests_per_node=2)
        async with pool_scheduler(redis_client, config) as ps:
            # queue_tasks splits each cost in halves: prompts of 400, 1,000 and 400 tokens.
            await queue_tasks(ps.store, [("b1", Tier.BATCH, 800), ("b2", Tier.BATCH, 2_000),
                                         ("b3", Tier.BATCH, 800)])
            result = await ps.tick(1, always)
            assert result.zone is Zone.YELLOW
            # b1 joins the dedicated node; b2 may not (prompt too long) and the shared node is held,
            # so it waits, and b3 behind it: FIFO within the tier.
            assert {t.task_id: t.node for t in result.released} == {"b1": "vip-node"}
            for task_id in ("b2", "b3"):
                assert (await ps.store.task(task_id) or {})["state"] == "queued"
            shared.usage = 0.10
            result = await ps.tick(1, always)
            assert result.zone is Zone.GREEN
            assert {t.task_id: t.node for t in result.released} == {"b2": "shared",
                                                                    "b3": "vip-node"}


async def test_a_dedicated_node_running_too_many_sequences_takes_no_new_guests(
        redis_client: Any, redis_url: str) -> None:
    dedicated, shared = FakeVllm(running=65), FakeVllm()
    async with serve_fake(dedicated) as dedicated_url, serve_fake(shared) as shared_url:
        config = _dedicated_to_vip(redis_url, dedicated_url, shared_url,
                                   guest_max_prompt_tokens=500, guest_max_running=64)
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("v1", Tier.VIP, 800), ("b1", Tier.BATCH, 800)])
            result = await ps.tick(1, always)
            assert (await state(ps.store))["dedicated_guests_closed"] == "vip-node"
            # VIP chats are never turned away from their node; the guest goes elsewhere.
            assert {t.task_id: t.node for t in result.released} == {"v1": "vip-node",
                                                                    "b1": "shared"}
            dedicated.running = 64  # at the bound, not above it: open again
            await queue_tasks(ps.store, [("b2", Tier.BATCH, 800)])
            result = await ps.tick(1, always)
            assert "dedicated_guests_closed" not in await state(ps.store)
            assert {t.task_id: t.node for t in result.released} == {"b2": "vip-node"}


async def test_half_done_generations_leave_room_that_final_sizes_would_not(
        redis_client: Any, redis_url: str) -> None:
    """Released generations, each 200 + 4,000 tokens, one every 2 s of pool time and decoding
    at 50 tokens/s: the node holds their prompts and what they generated. Counted at final
    size they fill the 78% target; projected over time they leave room, so the budget grows."""
    budgets = {}
    for projection in ("final", "peak"):
        await redis_client.flushdb()
        fake = FakeVllm()  # 100,000 tokens of KV
        async with serve_fake(fake) as url:
            # Batch up to Normal's line: the 18 generations fill it to its last 2,400 tokens.
            config = make_config(redis_url, [{"name": "n1", "url": url}],
                                 zones={"projection": projection, "batch_ceiling": 0.78})
            async with pool_scheduler(redis_client, config) as ps:
                await ps.tick(1, always)  # publishes the node's capacity
                now_us = 1_000_000_000_000
                for i in range(18):
                    await redis_client.hset(ps.store.keys.clock, "frozen_us", now_us)
                    admitted = await admit(ps.store, f"g{i}", Tier.BATCH, 4_200)
                    assert admitted.outcome is AdmitOutcome.RELEASED
                    # admit() splits the cost in halves: 2,100 prompt, 2,100 output tokens.
                    now_us += 2_000_000
                ages_s = [2 * (18 - i) for i in range(18)]
                generated = sum(min(2_100, 50 * a) for a in ages_s)
                await redis_client.hset(ps.store.keys.clock, "frozen_us", now_us)
                fake.usage = (18 * 2_100 + generated) / 100_000
                fake.running = 18
                plan = (await ps.tick(1, always)).plans[0]
                assert plan.reserved == 18 * 4_200
                budgets[projection] = plan.tier_budgets and plan.tier_budgets[Tier.BATCH]
    assert budgets["final"] is not None and budgets["peak"] is not None
    # Every reservation at its full size, plus padding:
    assert budgets["final"] <= 78_000 - 18 * 16, budgets
    assert budgets["peak"] > budgets["final"] + 10_000, budgets



async def test_each_tier_is_placed_up_to_its_own_ceiling_and_vip_keeps_the_room_above(
        redis_client: Any, redis_url: str) -> None:
    """The default ceilings on an idle 100,000-token node: Batch up to 70,000 (the YELLOW
    line), Normal up to 78,000 (`kv_target`), VIP up to 85,000; on the fast path and in the
    release, whatever the lower tiers asked for first."""
    fake = FakeVllm()  # 100,000 tokens of KV, idle
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            await ps.tick(1, always)
            published = await state(ps.store)
            assert (published["ceiling_vip"], published["ceiling_normal"],
                    published["ceiling_batch"]) == ("0.8500", "0.7800", "0.7000")
            keys = ps.store.keys
            caps = [await redis_client.hget(keys.tier_capacity(t), "n1") for t in Tier]
            assert caps == [b"85000", b"78000", b"70000"]
            first = await admit(ps.store, "b1", Tier.BATCH, 70_000)
            assert (first.outcome, first.node) == (AdmitOutcome.RELEASED, "n1")
            assert (await admit(ps.store, "b2", Tier.BATCH, 1)).outcome is AdmitOutcome.QUEUED
            normal = await admit(ps.store, "n1", Tier.NORMAL, 8_000)
            assert (normal.outcome, normal.node) == (AdmitOutcome.RELEASED, "n1")
            assert (await admit(ps.store, "n2", Tier.NORMAL, 1)).outcome is AdmitOutcome.QUEUED
            vip = await admit(ps.store, "v1", Tier.VIP, 7_000)
            assert (vip.outcome, vip.node) == (AdmitOutcome.RELEASED, "n1")
            assert (await admit(ps.store, "v2", Tier.VIP, 1)).outcome is AdmitOutcome.QUEUED
            # VIP's room is VIP's: a release with everything settled but VIP's 7,000 gives
            # the queued VIP its token first, then Normal and Batch under their own lines.
            await ps.store.settle("b1", 70_000)
            await ps.store.settle("n1", 8_000)
            released = await ps.store.release(1, (10, 10, 10))
            assert [(t.task_id, t.node) for t in released] == [
                ("v2", "n1"), ("n2", "n1"), ("b2", "n1")]
