"""The leader's tick against real HTTP metrics servers and real Redis: zones with hysteresis,
strict tier order, YELLOW holds Batch and meters Normal, RED releases VIP only, and a burst
released between two polls never takes projected usage past the ceiling."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from admission.errors import FencedError
from admission.outcomes import AdmitOutcome, TaskState
from admission.tiers import Tier, Zone
from scheduler.budget import NodePlan, peak_usage
from scheduler.pool import PoolScheduler
from tests.scheduler_stub import (
    FakeClock,
    FakeVllm,
    admit,
    always,
    make_config,
    next_message,
    pool_scheduler,
    queue_tasks,
    reserved,
    serve_fake,
    state,
)

CAPACITY = 100_000  # the stub's 6,250 blocks of 16 tokens
TARGET = 78_000  # default kv_target 0.78: Normal's ceiling
VIP_TARGET = 85_000  # default vip_ceiling 0.85
BATCH_TARGET = 70_000  # default yellow 0.70: Batch's ceiling


def normal_budget(plan: NodePlan) -> int | None:
    return None if plan.tier_budgets is None else plan.tier_budgets[Tier.NORMAL]


async def test_zone_transitions_follow_usage_with_hysteresis(
    redis_client: Any, redis_url: str
) -> None:
    fake = FakeVllm()
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"yellow": 0.70, "red": 0.85, "hysteresis": 0.03})
        async with pool_scheduler(redis_client, config) as ps:
            seen = []
            for usage in (0.50, 0.72, 0.68, 0.66, 0.90, 0.83, 0.81, 0.86, 0.60):
                fake.usage = usage
                result = await ps.tick(1, always)
                published = (await state(ps.store))["zone"]
                assert published == result.zone.value
                seen.append(result.zone)
    G, Y, R = Zone.GREEN, Zone.YELLOW, Zone.RED
    # 0.68 stays YELLOW (needs < 0.67), 0.83 stays RED (needs < 0.82), 0.81 steps to YELLOW,
    # 0.60 drops from RED straight to GREEN.
    assert seen == [G, Y, Y, G, R, R, Y, R, G]


async def test_release_is_in_strict_tier_order(redis_client: Any, redis_url: str) -> None:
    async with serve_fake(FakeVllm()) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            # Batch arrives first, VIP last; room for 7 tasks of 10,000 (78,000 budget).
            await queue_tasks(ps.store, [
                *((f"b{i}", Tier.BATCH, 10_000) for i in range(4)),
                *((f"n{i}", Tier.NORMAL, 10_000) for i in range(4)),
                *((f"v{i}", Tier.VIP, 10_000) for i in range(4)),
            ])
            result = await ps.tick(1, always)
            order = [t.task_id for t in result.released]
            assert order == ["v0", "v1", "v2", "v3", "n0", "n1", "n2"]
            # A VIP that arrives now overtakes every queued Normal and Batch task.
            await queue_tasks(ps.store, [("v4", Tier.VIP, 10_000)])
            for task in result.released[:2]:
                await ps.store.settle(task.task_id, 10_000)
            result = await ps.tick(1, always)
            assert [t.task_id for t in result.released] == ["v4", "n3"]
            assert (await ps.store.task("b0") or {})["state"] == "queued"


async def test_yellow_holds_batch_and_meters_normal(redis_client: Any, redis_url: str) -> None:
    fake = FakeVllm(usage=0.72)  # YELLOW; 6,000 tokens of room below the 0.78 target
    clock = FakeClock()
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"yellow_normal_rate": 20.0})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            await queue_tasks(ps.store, [
                *((f"b{i}", Tier.BATCH, 100) for i in range(5)),
                *((f"n{i}", Tier.NORMAL, 100) for i in range(10)),
                *((f"v{i}", Tier.VIP, 100) for i in range(2)),
            ])
            first = await ps.tick(1, always)
            assert first.zone is Zone.YELLOW
            assert [t.task_id for t in first.released] == ["v0", "v1"]  # the bucket starts empty
            clock.advance(0.1)  # 20/s x 0.1 s = 2 Normal
            second = await ps.tick(1, always)
            assert [t.task_id for t in second.released] == ["n0", "n1"]
            clock.advance(10.0)  # a long wait fills the bucket only to its burst (0.2 s of rate)
            third = await ps.tick(1, always)
            assert [t.task_id for t in third.released] == ["n2", "n3", "n4", "n5"]
            for i in range(5):
                assert (await ps.store.task(f"b{i}") or {})["state"] == "queued"
            fake.usage = 0.60  # back to GREEN: Batch drains by itself
            clock.advance(0.05)
            green = await ps.tick(1, always)
            assert green.zone is Zone.GREEN
            assert {t.task_id for t in green.released} >= {f"b{i}" for i in range(5)}


async def test_red_releases_only_vip(redis_client: Any, redis_url: str) -> None:
    full, roomy = FakeVllm(usage=0.90, running=0), FakeVllm(usage=0.60, running=0)
    async with serve_fake(full) as u0, serve_fake(roomy) as u1:
        # The pool is RED by its fullest node; the other still has room, and only VIP may
        # use it.
        config = make_config(redis_url, [{"name": "n0", "url": u0}, {"name": "n1", "url": u1}])
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("b0", Tier.BATCH, 100), ("n0", Tier.NORMAL, 100),
                                         ("v0", Tier.VIP, 100), ("v1", Tier.VIP, 100)])
            result = await ps.tick(1, always)
            assert result.zone is Zone.RED
            assert result.limits[1:] == (0, 0)
            assert [t.task_id for t in result.released] == ["v0", "v1"]
            assert await reserved(ps.store) == {"n1": 200}
            # New Normal and Batch requests are turned away by the admit script itself.
            rejected = await admit(ps.store, "n9", Tier.NORMAL, 100)
            assert rejected.outcome is AdmitOutcome.REJECTED


@pytest.mark.parametrize("projection", ["final", "peak"])
async def test_burst_between_polls_never_passes_the_ceiling(
    redis_client: Any, redis_url: str, projection: str
) -> None:
    # Metrics that lag: the node keeps reporting an idle cache while tasks pour onto it, as
    # vLLM does between two polls. Releases and fast-path admits alike must stop at the target.
    fakes = [FakeVllm(usage=0.0, running=0), FakeVllm(usage=0.05, running=10)]
    async with serve_fake(fakes[0]) as u1, serve_fake(fakes[1]) as u2:
        config = make_config(redis_url, [{"name": "n1", "url": u1}, {"name": "n2", "url": u2}],
                             zones={"projection": projection})
        async with pool_scheduler(redis_client, config) as ps:
            costs = [700 + (i * 7919) % 4_300 for i in range(120)]
            await queue_tasks(ps.store, [(f"q{i}", Tier(i % 3), c) for i, c in enumerate(costs)])
            max_cost = max(costs)

            async def holds() -> dict[str, float]:
                """What each node's tasks will hold at most: f = 1 (nothing settled yet), so
                every reserved token may become KV; at final size or at the peak over time."""
                snap = await ps.read_snapshot()
                out: dict[str, float] = {}
                for node, fake in zip(("n1", "n2"), fakes, strict=True):
                    r = snap.reserved.get(node, 0)
                    out[node] = (float(r) if projection == "final" else
                                 peak_usage(snap.running.get(node, []),
                                            min(fake.usage * CAPACITY, r)))
                return out

            for round_ in range(4):
                result = await ps.tick(1, always)
                # Gateways' fast path between polls, against the same published budget.
                for j in range(30):
                    await admit(ps.store, f"f{round_}-{j}", Tier.VIP, 2_000)
                held = await reserved(ps.store)
                projected = await holds()
                for plan, fake in zip(result.plans, fakes, strict=True):
                    r = held.get(plan.name, 0)
                    unexplained = max(0.0, fake.usage * CAPACITY - r)
                    pad = fake.running * 16
                    # VIP's fast path may fill up to VIP's ceiling, the highest.
                    assert projected[plan.name] + unexplained + pad <= VIP_TARGET + 1e-6
                    assert plan.projected <= 0.85 + 1e-9
            # ... and the ceiling is reached, not merely respected: no idle GPU.
            projected = await holds()
            for fake, node in zip(fakes, ("n1", "n2"), strict=True):
                room = (VIP_TARGET - max(fake.usage * CAPACITY, projected[node])
                        - fake.running * 16)
                assert 0 <= room < max_cost
            if projection == "peak":  # short and long outputs mixed: more fits than at full size
                assert sum(held.values()) > 2 * VIP_TARGET - 2 * 16 * 10


async def test_normal_and_batch_between_polls_stay_under_their_own_ceilings(
    redis_client: Any, redis_url: str
) -> None:
    """As above, for the lower tiers: Batch queued and released by the leader, Normal on the
    fast path between polls, on nodes whose metrics lag. What Batch reserves on a node stays
    under Batch's ceiling (the YELLOW line) and what Normal and Batch reserve under Normal's
    (`kv_target`), and both are reached."""
    fakes = [FakeVllm(usage=0.0, running=0), FakeVllm(usage=0.05, running=10)]
    async with serve_fake(fakes[0]) as u1, serve_fake(fakes[1]) as u2:
        # Batch fills the nodes to the YELLOW line, where Normal's fast path is paced
        # (`yellow_normal_rate`): unpaced here, so that how much Normal reaches its ceiling
        # does not depend on how fast the machine runs the admits.
        config = make_config(redis_url, [{"name": "n1", "url": u1}, {"name": "n2", "url": u2}],
                             zones={"projection": "final", "yellow_normal_rate": 1e6})
        async with pool_scheduler(redis_client, config) as ps:
            costs = [700 + (i * 7919) % 4_300 for i in range(80)]
            ids = [f"b{i}" for i in range(len(costs))]
            await queue_tasks(ps.store, [(b, Tier.BATCH, c) for b, c in zip(ids, costs,
                                                                              strict=True)])
            for round_ in range(4):
                await ps.tick(1, always)
                for j in range(30):
                    ids.append(f"n{round_}-{j}")
                    await admit(ps.store, ids[-1], Tier.NORMAL, 2_000)
                tiers: dict[tuple[str, Tier], int] = {}
                placed: dict[str, int] = {}
                for task_id in ids:
                    record = await ps.store.task(task_id)
                    if record and record["state"] == "released":
                        key = (record["node"], Tier(int(record["tier"])))
                        tiers[key] = tiers.get(key, 0) + int(record["cost"])
                        placed[record["node"]] = placed.get(record["node"], 0) + 1
                for node, fake in zip(("n1", "n2"), fakes, strict=True):
                    normal = tiers.get((node, Tier.NORMAL), 0)
                    batch = tiers.get((node, Tier.BATCH), 0)
                    # The part of the reported usage that no reservation explains, and a
                    # paged-KV block of padding per running sequence, as the budget counts.
                    base = max(0.0, fake.usage * CAPACITY - normal - batch) + fake.running * 16
                    assert normal + batch + base <= TARGET + 1e-6
                    assert batch + base <= BATCH_TARGET + 1e-6
            for node, fake in zip(("n1", "n2"), fakes, strict=True):
                normal = tiers.get((node, Tier.NORMAL), 0)
                batch = tiers.get((node, Tier.BATCH), 0)
                base = max(0.0, fake.usage * CAPACITY - normal - batch) + fake.running * 16
                # Reached: within two Normal tasks (how many land on n2 varies by one from
                # run to run with the ticks' timing) and the block of padding the budget counts
                # for each task in flight.
                assert 0 <= TARGET - normal - batch - base < 2 * 2_000 + 16 * placed[node]
                # Batch was released when nothing was reserved yet: all the reported usage
                # was another's then.
                assert 0 <= BATCH_TARGET - batch - fake.usage * CAPACITY - fake.running * 16 < max(
                    costs)


async def test_learned_usage_overcommits_within_bounds(redis_client: Any, redis_url: str) -> None:
    fake = FakeVllm(usage=0.0)
    clock = FakeClock()
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"max_overcommit": 2.0, "usage_margin": 0.1})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            await queue_tasks(ps.store, [(f"t{i}", Tier.NORMAL, 10_000) for i in range(100)])
            first = await ps.tick(1, always)
            assert len(first.released) == 7  # no settles seen: no overcommit
            # Requests use a third of what they reserve.
            for task in first.released:
                await ps.store.settle(task.task_id, 3_333)
            for _ in range(20):
                clock.advance(0.05)
                result = await ps.tick(1, always)
                for task in result.released:
                    await ps.store.settle(task.task_id, 3_333)
            assert 0.33 < ps.learner.ratio < 0.6  # the f = 1 prior fades as settles come in
            budget = normal_budget(result.plans[0])
            assert budget is not None and TARGET < budget <= 2 * TARGET
            # Many settles between two ticks outweigh what was learned before them.
            await redis_client.hincrby(ps.store.keys.stats, "settled_cost", 30_000_000)
            await redis_client.hincrby(ps.store.keys.stats, "settled_usage", 10_000_000)
            result = await ps.tick(1, always)
            assert ps.learner.ratio == pytest.approx(0.3333, abs=0.01)
            # f = max(0.333 x 1.1, 1 / max_overcommit) = 0.5: the budget is twice the target.
            assert normal_budget(result.plans[0]) == 2 * TARGET
            # Measured usage that our reservations cannot explain takes its share off.
            held = (await reserved(ps.store)).get("n1", 0)
            fake.usage = (held + 20_000) / CAPACITY
            result = await ps.tick(1, always)
            plan = result.plans[0]
            assert plan.projected == pytest.approx((20_000 + held) / CAPACITY)
            assert normal_budget(plan) == held + int((TARGET - 20_000 - held) / 0.5)


async def test_a_new_leader_starts_from_the_published_ratio_not_the_counters_history(
    redis_client: Any, redis_url: str
) -> None:
    fake = FakeVllm(usage=0.0)
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"max_overcommit": 3.0, "usage_margin": 0.0})
        async with pool_scheduler(redis_client, config, clock=FakeClock()) as ps:
            # A long history at 10%, and the last leader's recent ratio at 50%.
            await redis_client.hincrby(ps.store.keys.stats, "settled_cost", 3_000_000_000)
            await redis_client.hincrby(ps.store.keys.stats, "settled_usage", 300_000_000)
            await redis_client.hset(ps.store.keys.state, "usage_ratio", "0.5000")
            result = await ps.tick(1, always)
            assert ps.learner.ratio == pytest.approx(0.5)
            assert normal_budget(result.plans[0]) == 2 * TARGET  # f = 0.5, not 1/3


@contextlib.asynccontextmanager
async def overcommitting(redis_client: Any, redis_url: str, preemptions: int,
                         ) -> AsyncIterator[tuple[FakeVllm, FakeClock, PoolScheduler]]:
    """One node reporting `preemptions`, its pool's scheduler having learned that requests use
    a tenth of what they reserve (twice the target, at most, may be reserved), and one tick."""
    fake = FakeVllm(usage=0.0, preemptions=preemptions)
    clock = FakeClock()
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"max_overcommit": 2.0},
                             scheduler={"preemption_cooldown_ms": 5_000})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            ps.learner.observe(0, 0, clock())
            ps.learner.observe(10_000_000, 1_000_000, clock())  # learned: requests use 10%
            assert normal_budget((await ps.tick(1, always)).plans[0]) == 2 * TARGET
            yield fake, clock, ps


async def test_preemption_stops_overcommit_on_that_node(redis_client: Any, redis_url: str) -> None:
    async with overcommitting(redis_client, redis_url, 4) as (fake, clock, ps):
        fake.preemptions = 5
        assert normal_budget((await ps.tick(1, always)).plans[0]) == TARGET
        clock.advance(5.1)
        assert normal_budget((await ps.tick(1, always)).plans[0]) == 2 * TARGET


async def test_a_cool_down_running_when_the_lease_is_taken_back_holds(
    redis_client: Any, redis_url: str
) -> None:
    """The lease lost and taken back within seconds: the preemption the node just reported still
    keeps overcommit off on it for the rest of its cool-down."""
    async with overcommitting(redis_client, redis_url, 4) as (fake, clock, ps):
        fake.preemptions = 5
        assert normal_budget((await ps.tick(1, always)).plans[0]) == TARGET
        clock.advance(1.0)
        ps.new_term()
        assert normal_budget((await ps.tick(2, always)).plans[0]) == TARGET
        clock.advance(4.5)
        assert normal_budget((await ps.tick(2, always)).plans[0]) == 2 * TARGET


async def test_preemptions_of_a_time_this_replica_did_not_lead_start_no_cool_down(
    redis_client: Any, redis_url: str
) -> None:
    """A replica leads again after an hour's standby: the node's preemption counter grew
    meanwhile (a leader in between dealt with them). Compared with its last term's reading,
    that growth stopped overcommit on the node for a cool-down, with no recent preemption."""
    async with overcommitting(redis_client, redis_url, 5) as (fake, clock, ps):
        clock.advance(3600)
        fake.preemptions = 40
        # The leader in between released a Normal task a second: not this moment's rate.
        await redis_client.hincrby(ps.store.keys.stats, "released_1", 3600)
        ps.new_term()
        assert normal_budget((await ps.tick(2, always)).plans[0]) == 2 * TARGET
        assert "drain_1" not in await state(ps.store)  # measured afresh, not over the hour
        fake.preemptions = 41  # one now: the cool-down holds
        assert normal_budget((await ps.tick(2, always)).plans[0]) == TARGET


async def test_drain_rates_and_operator_figures_are_published(
    redis_client: Any, redis_url: str
) -> None:
    clock = FakeClock()
    async with serve_fake(FakeVllm(usage=0.1)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            await ps.tick(1, always)
            await queue_tasks(ps.store, [(f"v{i}", Tier.VIP, 100) for i in range(50)])
            clock.advance(1.0)
            assert len((await ps.tick(1, always)).released) == 50
            clock.advance(1.0)
            await ps.tick(1, always)  # counters are read before releasing: one tick later
            st = await state(ps.store)
            assert float(st["drain_0"]) > 5.0  # 50 tasks in 1 s, through a 5 s average
            assert float(st["drain_0"]) < 50.0
            assert float(st["drain_2"]) == 0.0
            assert st["usage:n1"] == "0.1000"
            # 5,000 tokens reserved, 10,000 measured: the rest belongs to someone else.
            assert st["projected:n1"] == "0.1000"
            assert st["epoch"] == "1" and st["leader"] == "test"


async def test_batch_trickle_passes_blocked_higher_tiers_in_green(
    redis_client: Any, redis_url: str
) -> None:
    clock = FakeClock()
    async with serve_fake(FakeVllm(usage=0.0)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"batch_trickle_rate": 10.0})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            # A VIP task too big for the room left blocks everything behind it...
            await queue_tasks(ps.store, [("v0", Tier.VIP, 60_000), ("v1", Tier.VIP, 60_000),
                                         ("b0", Tier.BATCH, 100), ("b1", Tier.BATCH, 100)])
            first = await ps.tick(1, always)
            assert [t.task_id for t in first.released] == ["v0"]
            clock.advance(0.1)  # ... except the trickle: 10/s x 0.1 s = 1 Batch task
            second = await ps.tick(1, always)
            assert second.zone is Zone.GREEN
            assert [t.task_id for t in second.released] == ["b0"]
            third = await ps.tick(1, always)  # the bucket is spent
            assert third.released == []


async def test_what_a_tick_released_is_announced_when_a_later_call_of_it_fails(
    redis_client: Any, redis_url: str
) -> None:
    """The main release call released v0, then the trickle's call failed (Redis went away
    between the two): v0's gateway hears of it now, not at its fallback read."""
    clock = FakeClock()
    async with serve_fake(FakeVllm(usage=0.0)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"batch_trickle_rate": 10.0})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            await ps.tick(1, always)  # nothing queued yet: the trickle's bucket starts
            await queue_tasks(ps.store, [("v0", Tier.VIP, 60_000), ("v1", Tier.VIP, 60_000),
                                         ("b0", Tier.BATCH, 100)])
            clock.advance(0.1)  # the trickle may pass one Batch task past v1
            real_release = ps.store.release
            calls = 0

            async def failing_second(*args: Any, **kwargs: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls > 1:
                    raise ConnectionError("Redis went away")
                return await real_release(*args, **kwargs)

            ps.store.release = failing_second  # type: ignore[method-assign]
            pubsub = redis_client.pubsub()
            await pubsub.subscribe(ps.store.keys.wake_channel("gw"))
            with pytest.raises(ConnectionError):
                await ps.tick(1, always)
            assert calls == 2
            message = await next_message(pubsub)
            assert message is not None and message["data"] == b"v0 n1"
            await pubsub.aclose()


async def test_expired_queued_task_is_returned_to_its_gateway(
    redis_client: Any, redis_url: str
) -> None:
    async with serve_fake(FakeVllm(usage=0.0)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("old", Tier.NORMAL, 100)])
            await redis_client.hset(ps.store.keys.task_key("old"), "deadline_us", 1)
            pubsub = redis_client.pubsub()
            await pubsub.subscribe(ps.store.keys.wake_channel("gw"))
            result = await ps.tick(1, always)
            assert [(t.task_id, t.node) for t in result.released] == [("old", None)]
            message = await next_message(pubsub)
            assert message is not None and message["data"] == b"old "
            assert (await ps.store.task("old") or {})["state"] == TaskState.EXPIRED
            await pubsub.aclose()


async def test_older_epoch_is_fenced(redis_client: Any, redis_url: str) -> None:
    async with serve_fake(FakeVllm()) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("v0", Tier.VIP, 100)])
            await ps.tick(2, always)
            with pytest.raises(FencedError):
                await ps.tick(1, always)
            assert (await ps.store.task("v0") or {})["state"] == "released"


async def test_no_writes_once_the_lease_is_gone(redis_client: Any, redis_url: str) -> None:
    async with serve_fake(FakeVllm()) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("v0", Tier.VIP, 100)])
            result = await ps.tick(1, lambda: False)
            assert not result.published and result.released == []
            assert await redis_client.exists(ps.store.keys.state) == 0
            assert (await ps.store.task("v0") or {})["state"] == "queued"
