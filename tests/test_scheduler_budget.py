"""The predictive budget model and the pieces of zone policy, as pure functions."""

from __future__ import annotations

import dataclasses
import math

import pytest

from admission.config import EngineSettings, ZoneSettings
from admission.tiers import Tier, Zone
from scheduler.budget import (
    NodePlan,
    RunningTask,
    UsageLearner,
    plan_node,
    pool_usage,
    published_ratio,
)
from scheduler.policy import DrainRates, ReleasePolicy
from scheduler.running import running_task as pool_running_task
from scheduler.scrape import NodeMetrics, NodeView
from scheduler.zones import ZoneTracker

ENGINE = EngineSettings()
"""The shipped `[pools.engine]` timings."""
DISPATCH_US = ENGINE.dispatch_us


def running_task(prompt_tokens: int, max_tokens: int, arrived_us: int) -> RunningTask:
    return pool_running_task(prompt_tokens, max_tokens, arrived_us, ENGINE.prefill_us_per_token)


def view(usage: float, *, running: int = 0, capacity: int = 100_000, stale: bool = False,
         ejected: bool = False) -> NodeView:
    metrics = NodeMetrics(usage, "vllm:kv_cache_usage_perc", running, 0, 0.0, capacity, 16)
    return NodeView("n", metrics, capacity, stale, ejected, 0.0, 1, "")


def plan(v: NodeView, reserved: int, factor: float = 1.0, policy: str = "full") -> NodePlan:
    return plan_node(v, reserved=reserved, factor=factor, kv_target=0.8, stale_policy=policy,
                     dispatch_us=DISPATCH_US)


def test_budget_counts_every_reservation_at_its_expected_final_size() -> None:
    # 50k reserved, whether prefilled yet or not; requests end at 60% of their reservation; the
    # cache shows 25k so far (some tasks still waiting or early in their decoding).
    p = plan(view(0.25), reserved=50_000, factor=0.6)
    assert p.projected == pytest.approx(0.30)  # 0.6 x 50k: the 25k now + growth + unseen
    assert p.budget == 50_000 + math.floor((80_000 - 30_000) / 0.6)


def test_a_burst_the_engine_already_picked_up_is_not_counted_twice() -> None:
    # Everything was reserved since the last poll and the engine prefilled it all already.
    p = plan(view(0.144), reserved=23_913)
    assert p.projected == pytest.approx(23_913 / 100_000)


def test_measured_usage_ahead_of_plan_takes_over() -> None:
    # Requests grow beyond what was learned (f = 0.5): 40k reserved already fill 30k of cache.
    p = plan(view(0.30), reserved=40_000, factor=0.5)
    assert p.projected == pytest.approx(0.30)
    assert p.budget == 40_000 + math.floor((80_000 - 30_000) / 0.5)


def test_unexplained_usage_is_foreign_and_padding_counts_blocks() -> None:
    p = plan(view(0.30, running=100), reserved=10_000)
    # 20k of the 30k measured cannot be ours; each running sequence may hold a partial block.
    assert p.projected == pytest.approx((20_000 + 1_600 + 10_000) / 100_000)
    assert p.budget == 80_000 - 20_000 - 1_600


def test_over_target_gives_no_room_and_never_a_negative_budget() -> None:
    assert plan(view(0.95), reserved=0).budget == 0
    over = plan(view(0.5), reserved=90_000)
    assert over.budget is not None and over.budget < over.reserved


def test_stale_nodes_follow_the_declared_policy() -> None:
    full = plan(view(0.1, stale=True), reserved=0, policy="full")
    assert (full.budget, full.reason, full.projected) == (0, "stale", 0.8)
    last = plan(view(0.1, stale=True), reserved=0, policy="last")
    assert (last.budget, last.reason) == (70_000, "")
    gone = plan(view(0.1, stale=True, ejected=True), reserved=5)
    assert (gone.budget, gone.reason, gone.usable) == (None, "ejected", False)


def test_pool_usage_aggregates() -> None:
    a = plan(view(0.1), reserved=0)
    b = plan(view(0.5, capacity=300_000), reserved=0)
    assert pool_usage([a, b], "max") == pytest.approx(0.5)
    assert pool_usage([a, b], "total") == pytest.approx((10_000 + 150_000) / 400_000)
    assert pool_usage([plan(view(0.1, ejected=True), reserved=0)], "max") is None


def test_pool_usage_leaves_nodes_dedicated_to_some_tiers_out_while_a_shared_one_is_usable() -> None:
    dedicated = dataclasses.replace(plan(view(0.75), reserved=0), name="dedicated")
    shared = dataclasses.replace(plan(view(0.2), reserved=0), name="shared")
    gone = dataclasses.replace(plan(view(0.2, ejected=True), reserved=0), name="shared")
    # The dedicated node, full of VIP chats or capped guests, does not hold Batch off the shared
    # one.
    assert pool_usage([dedicated, shared], "max", ("dedicated",)) == pytest.approx(0.2)
    assert pool_usage([dedicated, shared], "total", ("dedicated",)) == pytest.approx(0.2)
    assert pool_usage([dedicated, shared], "max") == pytest.approx(0.75)
    # With no usable shared node, the dedicated nodes are all there is to go by.
    assert pool_usage([dedicated, gone], "max", ("dedicated",)) == pytest.approx(0.75)


def test_zone_follows_the_projection_up_to_normals_line_and_measured_usage_above() -> None:
    # VIP work reserved up to its ceiling (the RED line) projects the node to 0.85 while the
    # cache reads 0.27: the pool is YELLOW by the projection, not RED.
    vip_backlog = dataclasses.replace(plan(view(0.27), reserved=0), projected=0.85)
    assert pool_usage([vip_backlog], "max", projection_cap=0.78) == pytest.approx(0.78)
    assert pool_usage([vip_backlog], "total", projection_cap=0.78) == pytest.approx(0.78)
    # Below the cap the projection counts in full: a released burst not measured yet.
    burst = dataclasses.replace(plan(view(0.20), reserved=0), projected=0.72)
    assert pool_usage([burst], "max", projection_cap=0.78) == pytest.approx(0.72)
    # A cache that really holds 0.88 is RED whatever the projection says.
    full = dataclasses.replace(plan(view(0.88), reserved=0), projected=0.90)
    assert pool_usage([full, burst], "max", projection_cap=0.78) == pytest.approx(0.88)
    # Without a cap the projection counts in full (and is never below the measurement).
    assert pool_usage([vip_backlog], "max") == pytest.approx(0.85)


def test_learner_starts_without_overcommit_and_is_bounded() -> None:
    learner = UsageLearner(halflife_s=60.0, margin=0.1, max_overcommit=2.5)
    assert learner.factor == 1.0
    learner.observe(0, 0, 0.0)
    learner.observe(1_000_000, 100_000, 1.0)
    assert learner.ratio == pytest.approx(150_000 / 1_050_000, rel=0.01)
    assert learner.factor == pytest.approx(0.4)  # 1 / max_overcommit
    learner.observe(1_000_000 + 400_000, 100_000 + 400_000, 2.0)  # a burst of full-length runs
    assert learner.factor > 0.4


def test_learner_forgets_with_its_half_life_and_survives_a_counter_reset() -> None:
    learner = UsageLearner(halflife_s=10.0, margin=0.0, max_overcommit=10.0)
    learner.observe(0, 0, 0.0)
    learner.observe(10_000_000, 9_000_000, 0.0)
    assert learner.ratio > 0.85
    learner.observe(10_000_000, 9_000_000, 100.0)  # ten half-lives, nothing new
    learner.observe(10_100_000, 9_010_000, 100.0)  # fresh settles at 10% dominate
    assert learner.ratio < 0.2
    before = learner.ratio
    learner.observe(50_000, 40_000, 100.0)  # counters went back: a new baseline, nothing learned
    assert learner.ratio == before
    learner.observe(150_000, 140_000, 100.0)  # counted from there
    assert 0.5 < learner.ratio < 1.0


def test_a_new_term_learns_from_the_last_leaders_ratio_not_the_counters_history() -> None:
    """The counters hold the pool's whole history: a day of requests using a quarter of their
    reservations, then an hour at 90%. The last leader's decayed ratio says 90%; taken whole
    by the first look of a new leader, the history said 25%, and it overcommitted about 3x by
    a mix that no longer ran, for about ten minutes."""
    learner = UsageLearner(halflife_s=60.0, margin=0.1, max_overcommit=3.0)
    learner.resume(published_ratio({"usage_ratio": "0.9000"}))
    learner.observe(4_000_000_000, 1_000_000_000, 0.0)
    assert learner.ratio == pytest.approx(0.9)
    assert learner.factor == pytest.approx(0.99)
    # Fresh settles are learned as before, and move the belief within a half-life.
    learner.observe(4_000_500_000, 1_000_100_000, 30.0)
    assert learner.ratio < 0.5
    # A term with nothing published (the pool's first leader): the prior, no overcommit.
    fresh = UsageLearner(halflife_s=60.0, margin=0.1, max_overcommit=3.0)
    fresh.resume(published_ratio({}))
    fresh.observe(4_000_000_000, 1_000_000_000, 0.0)
    assert fresh.factor == 1.0
    for odd in ("", "nan", "inf", "abc"):
        assert published_ratio({"usage_ratio": odd}) is None


def test_a_replica_leading_again_after_a_standby_starts_from_the_published_ratio_whole() -> None:
    """Its last observation was an hour ago: decaying the belief it resumes from over that
    hour left it weightless, and one small settle set f to the floor (full overcommit)."""
    learner = UsageLearner(halflife_s=60.0, margin=0.0, max_overcommit=3.0)
    learner.observe(0, 0, 0.0)
    learner.observe(1_000_000, 900_000, 1.0)
    learner.resume(0.9)  # an hour later, leading again
    learner.observe(5_000_000, 4_500_000, 3601.0)  # the baseline
    learner.observe(5_002_000, 4_500_100, 3602.0)  # one settle: 2,000 reserved, 100 used
    assert learner.ratio > 0.8
    # Nothing published (Redis lost the state): its own ratio, at the prior's weight, not a
    # heavy belief that fresh settles could not move for minutes.
    heavy = UsageLearner(halflife_s=60.0, margin=0.0, max_overcommit=10.0)
    heavy.observe(0, 0, 0.0)
    heavy.observe(80_000_000, 8_000_000, 1.0)  # learned 10%, at a weight of millions
    heavy.resume(None)
    heavy.observe(80_000_000, 8_000_000, 3601.0)
    heavy.observe(80_200_000, 8_200_000, 3603.0)  # fresh settles at 100%
    assert heavy.ratio > 0.7


@pytest.mark.parametrize(
    ("usages", "zones"),
    [
        ([0.1, 0.7, 0.68, 0.669], "GYYG"),
        ([0.9, 0.83, 0.8, 0.6], "RRYG"),
        ([0.86, 0.5], "RG"),
        ([0.72, 0.85, 0.66], "YRG"),
    ],
)
def test_hysteresis(usages: list[float], zones: str) -> None:
    tracker = ZoneTracker(ZoneSettings(yellow=0.7, red=0.85, hysteresis=0.03))
    assert "".join(tracker.update(u).value[0] for u in usages) == zones


def test_no_usable_node_is_red() -> None:
    assert ZoneTracker(ZoneSettings()).update(None) is Zone.RED


def test_release_limits_per_zone() -> None:
    policy = ReleasePolicy(ZoneSettings(yellow_normal_rate=10.0), batch_size=500, now=0.0)
    assert policy.limits(Zone.GREEN, 0.0) == (500, 500, 500)
    assert policy.limits(Zone.YELLOW, 0.0) == (500, 0, 0)
    assert policy.limits(Zone.YELLOW, 0.15) == (500, 1, 0)
    policy.released(Zone.YELLOW, [3, 1, 0])
    assert policy.limits(Zone.YELLOW, 0.16) == (500, 0, 0)  # 0.5 left + 0.1 refilled
    assert policy.limits(Zone.RED, 5.0) == (500, 0, 0)
    # Back in YELLOW after RED: the bucket starts empty, not with what it would have gathered.
    assert policy.limits(Zone.YELLOW, 9.0) == (500, 0, 0)
    assert policy.guests_only(Zone.YELLOW) == ()


def test_yellow_releases_batch_only_as_guests_where_dedicated_nodes_take_them() -> None:
    policy = ReleasePolicy(ZoneSettings(), batch_size=500, now=0.0, dedicated_guests=True)
    assert policy.limits(Zone.YELLOW, 0.0) == (500, 0, 500)
    assert policy.guests_only(Zone.YELLOW) == (Tier.BATCH,)
    assert policy.guests_only(Zone.GREEN) == ()
    assert policy.limits(Zone.RED, 1.0) == (500, 0, 0)


def test_drain_rate_follows_released_counters() -> None:
    drains = DrainRates(tau_s=1.0)
    drains.observe({}, 0.0)
    for second in range(1, 11):
        drains.observe({"released_1": 100 * second}, float(second))
    assert drains.rates[1] == pytest.approx(100.0, rel=0.01)
    assert drains.fields() == {"drain_0": "0.000", "drain_1": f"{drains.rates[1]:.3f}",
                               "drain_2": "0.000"}


def test_an_engine_out_of_compute_gets_no_new_releases_while_its_queue_is_long() -> None:
    def queued(waiting: int) -> NodeView:
        metrics = NodeMetrics(0.30, "vllm:kv_cache_usage_perc", 40, waiting, 0.0, 100_000, 16)
        return NodeView("n", metrics, 100_000, False, False, 0.0, 1, "")

    def plan_with(waiting: int, max_waiting: int) -> NodePlan:
        return plan_node(queued(waiting), reserved=30_000, factor=1.0, kv_target=0.8,
                         stale_policy="full", max_waiting=max_waiting,
                         dispatch_us=DISPATCH_US)

    free = plan_with(9, 0)  # the check is off by default
    assert free.budget is not None and free.budget > 30_000 and free.reason == ""
    assert plan_with(8, 8).budget == plan_with(8, 0).budget  # at the limit: still fed
    held = plan_with(9, 8)
    assert held.reason == "engine_queue"
    assert held.tier_budgets is not None and free.tier_budgets is not None
    # Normal and Batch keep what they have, no more; VIP keeps its room above their lines.
    assert held.tier_budgets[1:] == (30_000, 30_000)
    assert held.budget == free.budget == free.tier_budgets[0] > 30_000
    assert held.projected == free.projected  # the zone still sees the same usage
    assert plan_with(9, 8).usable


def test_sequences_that_are_not_ours_are_measured_not_padded() -> None:
    # A 432,000-token node at 0.84, filled by 363 chats of 1,000 tokens none of which came
    # through the gateways: their blocks, partial ones included, are the measured 0.84.
    capacity = 432_000
    zones = ZoneSettings()
    vip, normal, batch = zones.ceilings()

    def planned(running: list[RunningTask] | None, reserved: int = 0,
                engine: int = 363) -> NodePlan:
        metrics = NodeMetrics(0.84, "vllm:kv_cache_usage_perc", engine, 0, 0.0, capacity, 16)
        node = NodeView("n", metrics, capacity, False, False, 0.0, 1, "")
        return plan_node(node, reserved=reserved, factor=1.0, kv_target=normal,
                         stale_policy="full", running=running, vip_ceiling=vip,
                         batch_ceiling=batch, dispatch_us=DISPATCH_US)

    def pad(running: list[RunningTask], reserved: int) -> float:
        """Tokens the engine's 363 sequences add to the projection."""
        return (planned(running, reserved).projected
                - planned(running, reserved, engine=0).projected) * capacity

    alone = planned([])
    assert alone.projected == pytest.approx(0.84)
    assert alone.tier_budgets == (math.floor((vip - 0.84) * capacity), 0, 0)
    assert ZoneTracker(zones).update(alone.projected) is Zone.YELLOW
    # Without the running index every sequence is padded: VIP has no room, the pool is RED.
    final = planned(None)
    assert final.projected == pytest.approx(0.84 + 363 * 16 / capacity)
    assert final.tier_budgets == (0, 0, 0)
    assert ZoneTracker(zones).update(final.projected) is Zone.RED
    # Ten of ours released before the reading (the engine counts them among its 363) are
    # padded; one released since is not, until a reading counts it.
    ours = [running_task(10, 20, 300_000) for _ in range(10)]
    assert pad(ours, 300) == pytest.approx(10 * 16)
    assert pad([*ours, running_task(10, 20, -DISPATCH_US)], 330) == pytest.approx(10 * 16)
    # Reservations the index lacks may each be a sequence of ours: 3 tokens, up to 3 more.
    assert pad(ours, 303) == pytest.approx(13 * 16)


def test_a_node_running_only_our_tasks_pads_every_sequence() -> None:
    # 40 tasks released a second before the reading, the engine runs all of them and queues
    # nothing else: each may hold one partial block beyond the tokens projected.
    capacity = 100_000
    metrics = NodeMetrics(0.20, "vllm:kv_cache_usage_perc", 40, 0, 0.0, capacity, 16)
    node = NodeView("n", metrics, capacity, False, False, 0.0, 1, "")
    tasks = [running_task(400, 200, 1_000_000) for _ in range(40)]
    with_pad = plan_node(node, reserved=40 * 600, factor=1.0, kv_target=0.78,
                         stale_policy="full", running=tasks, dispatch_us=DISPATCH_US)
    idle = NodeView("n", dataclasses.replace(metrics, running=0), capacity, False, False, 0.0,
                    1, "")
    without = plan_node(idle, reserved=40 * 600, factor=1.0, kv_target=0.78,
                        stale_policy="full", running=tasks, dispatch_us=DISPATCH_US)
    assert (with_pad.projected - without.projected) * capacity == pytest.approx(40 * 16)
