"""A lane's cap (scheduler.control, "Lanes") in the deterministic decode loop of
tests/test_scheduler_running_limit.py, no Redis, no clock; and the pool's choice of lanes.

The loop's node is a lane: VIP chats go there (in the pool, the quiet node running the fewest
sequences), Normal joins it only while fewer than the published cap are alive there, and what
the lane does not take goes to the pool's other nodes, which this loop does not model. The
control's settings are the shipped ones otherwise: no running limit, the absolute objective,
`lane_slowdown` 1.2 (lanes are off by default; the loop makes its node one).
"""

from __future__ import annotations

import math

from admission.controlconfig import ControlSettings
from scheduler.calm import CalmBaseline
from scheduler.control import STEP_SPAN, ReleaseControl
from tests.test_scheduler_running_limit import (
    CALM_RATE,
    CALM_S,
    FIXED_S,
    FLOOD_RATE,
    FLOOD_S,
    PER_SEQ_S,
    Engine,
    p99,
    ttft_between,
)


def lane(settings: ControlSettings | None = None) -> Engine:
    settings = settings or ControlSettings()
    e = Engine(ReleaseControl(settings),
               CalmBaseline(settings.vip_slowdown, settings.vip_ttft_objective_ms,
                            settings.signal_stale_ms / 1000))
    e.lane = True
    return e


def test_lanes_are_off_by_default_and_sized_by_a_slowdown_of_1_2() -> None:
    settings = ControlSettings()
    assert settings.lane_nodes == 0 and settings.lane_slowdown == 1.2
    assert settings.running_min == 0 and settings.vip_slowdown == 0


def test_a_flood_leaves_the_lane_within_its_step_budget_from_the_first_seconds() -> None:
    """A sixfold step in Normal load. The lane takes of it only what keeps its decode step
    within its shortest step plus a third of 0.2x the calm VIP P99, so VIP's P99 there stays
    within 1.25x of calm through the flood and in every 2 s window, while the lane keeps
    serving Normal at a part of its calm rate (the rest of the flood goes to the other
    nodes)."""
    e = lane()
    e.run(CALM_S, CALM_RATE)
    calm_p99 = p99(ttft_between(e, 5.0, CALM_S))
    assert e.calm.calm_ms() is not None
    e.run(CALM_S + FLOOD_S, FLOOD_RATE)
    for start in range(int(CALM_S), int(CALM_S + FLOOD_S), 2):
        assert p99(ttft_between(e, start, start + 2)) <= 1.5 * calm_p99, start
    assert p99(ttft_between(e, CALM_S, CALM_S + FLOOD_S)) <= 1.25 * calm_p99
    flood = [x for x in e.log if x["t"] >= CALM_S]
    # The step budget in sequences: what (shortest step + budget) / per-sequence cost allows.
    shortest = e.control.node("n").min_step_s
    assert shortest is not None
    budget_s = 0.2 * e.calm.calm_ms() / 1000 / STEP_SPAN  # type: ignore[operator]
    bound = (shortest + budget_s - FIXED_S) / PER_SEQ_S
    settled = [x for x in flood if x["t"] >= CALM_S + 1.0]
    assert max(x["running"] for x in settled) <= bound + 2
    assert all(x["normal"] <= max(x["cap"], 0) + 1 for x in settled)
    assert e.elsewhere > 0  # the lane did not take the flood...
    served = sum(1 for t in e.served if CALM_S <= t < CALM_S + FLOOD_S)
    # ...but kept serving Normal: 4.25 a second in this loop, against 10 at calm (the lane is
    # held below its calm batch; the price of its short steps).
    assert served / FLOOD_S > CALM_RATE / 4


def test_without_a_lane_the_same_flood_slows_vip_several_times() -> None:
    """The counterfactual: the same node, not a lane, takes the flood up to the KV line."""
    e = lane()
    e.lane = False
    e.run(CALM_S, CALM_RATE)
    calm_p99 = p99(ttft_between(e, 5.0, CALM_S))
    e.run(CALM_S + FLOOD_S, FLOOD_RATE)
    assert p99(ttft_between(e, CALM_S, CALM_S + FLOOD_S)) > 3 * calm_p99


def test_the_cap_follows_the_step_time_and_an_idle_lane_starts_from_one() -> None:
    """Cap arithmetic at one node: a step at the shortest step plus the budget keeps the batch; a
    step twice as long takes the cap below the Normal tasks alive; an idle lane may start one;
    an engine whose page has no inter-token histogram gets no cap (-1); a node that is not a
    lane gets none (None)."""
    c = ReleaseControl(ControlSettings())
    calm_p99_ms, shortest = 90.0, 0.020
    budget = 0.2 * calm_p99_ms / 1000 / STEP_SPAN
    c.node("n").min_step_s = shortest
    histogram = [0.0, 0.0]

    def poll(seq: int, running: int, guests: int, step: float,
             lane_: bool = True) -> int | None:
        """A reading after 10 more tokens decoded at `step` each."""
        histogram[0] += 10 * step
        histogram[1] += 10
        return c.update("n", tasks=(), now=float(seq), seq=seq, running=running,
                        itl=(histogram[0], histogram[1]), calm_p99_ms=calm_p99_ms,
                        lane=lane_, guests=guests).lane_cap

    at_budget = shortest + budget
    poll(1, running=30, guests=20, step=at_budget)  # the first reading starts the deltas
    assert poll(2, running=30, guests=20, step=at_budget) == 20
    assert poll(3, running=30, guests=20, step=2 * at_budget) == 5
    assert poll(4, running=30, guests=5, step=3 * at_budget) == 0
    assert poll(5, running=0, guests=0, step=at_budget) == 1
    assert poll(6, running=30, guests=20, step=at_budget, lane_=False) is None
    fresh = ReleaseControl(ControlSettings())
    assert fresh.update("m", tasks=(), now=1.0, running=30, lane=True, guests=3).lane_cap == -1


def test_before_the_calm_p99_is_learned_the_objective_stands_in() -> None:
    """No calm P99 yet: the cap keeps the step within the shortest step read plus a third of
    0.2x the configured objective (250 ms)."""
    c = ReleaseControl(ControlSettings())
    shortest, later = 0.010, 0.040
    budget = 0.2 * 250 / 1000 / STEP_SPAN
    c.update("n", tasks=(), now=0.0, seq=1, running=4, itl=(0.0, 0.0), lane=True)
    c.update("n", tasks=(), now=1.0, seq=2, running=4, itl=(shortest * 100, 100.0), lane=True)
    room = c.update("n", tasks=(), now=2.0, seq=3, running=40,
                    itl=(shortest * 100 + later * 100, 200.0), lane=True, guests=36)
    expected = math.floor(40 * (shortest + budget) / later + 1e-9) - (40 - 36)
    assert room.lane_cap == max(0, expected)


def test_a_calm_step_learned_in_a_flood_does_not_open_the_lane() -> None:
    """A flood below the YELLOW line looks calm to the pool, and the node's calm step, learned
    then, grows with it (here 40 ms against a shortest step of 10 ms). The cap follows the
    shortest step: the lane holds what it held before the flood's steps were averaged in."""
    grown = ReleaseControl(ControlSettings())
    plain = ReleaseControl(ControlSettings())
    grown.node("lane").calm_step_s = 0.040
    caps = []
    for c in (grown, plain):
        c.update("lane", tasks=(), now=0.0, seq=1, running=2, itl=(0.0, 0.0), lane=True)
        c.update("lane", tasks=(), now=1.0, seq=2, running=2, itl=(0.1, 10.0), lane=True)
        room = c.update("lane", tasks=(), now=2.0, seq=3, running=10, itl=(0.4, 20.0),
                        lane=True, calm_p99_ms=100.0, guests=8)
        caps.append(room.lane_cap)
    budget = 0.2 * 100.0 / 1000 / STEP_SPAN
    assert caps[0] == caps[1] == math.floor(10 * (0.010 + budget) / 0.030 + 1e-9) - 2


def test_a_new_leader_starts_from_the_published_shortest_step() -> None:
    """A leader taking over in a flood reads only long steps: it starts from the shortest step
    the last leader published for the lane, else from the calm step, until it reads a shorter
    one."""
    c = ReleaseControl(ControlSettings())
    c.resume({"lane": (20_000.0, 1.0, 0.030, 0.0), "other": (20_000.0, 1.0, 0.030, 0.008)})
    assert c.node("lane").min_step_s == 0.030 and c.node("other").min_step_s == 0.008
    c.resume({"lane": (20_000.0, 1.0, 0.030, 0.015)})
    assert c.node("lane").min_step_s == 0.015
    c.update("lane", tasks=(), now=0.0, seq=1, running=30, itl=(0.0, 0.0), lane=True)
    room = c.update("lane", tasks=(), now=1.0, seq=2, running=30, itl=(0.5, 10.0),
                    lane=True, calm_p99_ms=90.0, guests=28)
    budget = 0.2 * 90.0 / 1000 / STEP_SPAN
    assert room.lane_cap == max(0, math.floor(30 * (0.015 + budget) / 0.050 + 1e-9) - 2)


def test_on_miss_the_cap_holds_from_a_pool_miss_until_the_pool_has_been_calm() -> None:
    """`lane_on_miss`: no cap (-1) while the pool's VIP first tokens keep the objective; a
    report whose misses take the pool's recent share past `vip_miss_target`, on any node, closes
    the lane at its next poll; a flood (not settled) keeps it closed without further misses;
    calm with no such report for `signal_stale_ms` opens it again. Off, the cap holds
    throughout."""
    settings = ControlSettings(lane_on_miss=True)
    stale = settings.signal_stale_ms / 1000
    itl = [0.0, 0.0]
    reports = {"lane": (0, 0), "other": (0, 0)}
    budget = 0.2 * 90.0 / 1000 / STEP_SPAN
    capped = max(0, math.floor(30 * (0.010 + budget) / 0.050 + 1e-9) - (30 - 28))

    def poll(c: ReleaseControl, t: float, settled: bool, report: tuple[int, int] | None = None,
             step: float = 0.050) -> int | None:
        if report is not None:
            n, over = reports["other"]
            reports["other"] = (n + report[0], over + report[1])
        c.update("other", tasks=(), now=t, seq=int(t * 10), running=10,
                 reports=reports["other"], settled=settled)
        itl[0] += 10 * step
        itl[1] += 10
        return c.update("lane", tasks=(), now=t, seq=int(t * 10), running=30,
                        itl=(itl[0], itl[1]), lane=True, guests=28, calm_p99_ms=90.0,
                        reports=reports["lane"], settled=settled).lane_cap

    c = ReleaseControl(settings)
    poll(c, 0.0, settled=True, step=0.010)
    assert poll(c, 1.0, settled=True, report=(200, 1), step=0.010) == -1  # 0.5%: within
    assert poll(c, 2.0, settled=False, report=(100, 0)) == -1  # a flood alone does not close it
    assert 0 < capped < 28
    assert poll(c, 3.0, settled=False, report=(50, 5)) == capped  # 6 of 350 recent: closed
    for t in (4.0, 3.0 + stale, 3.0 + 3 * stale):
        assert poll(c, t, settled=False, report=(100, 0)) == capped, t  # the flood keeps it
    # Calm (settled: for `signal_stale_ms` already) with no miss for as long: open again.
    assert poll(c, 3.0 + 3 * stale, settled=True) == -1
    # A miss at calm closes it for `signal_stale_ms`, calm or not.
    t = 4.0 + 3 * stale
    assert poll(c, t, settled=True, report=(10, 5)) == capped
    assert poll(c, t + 0.5 * stale, settled=True, report=(100, 0)) == capped
    assert poll(c, t + stale, settled=True) == -1
    always = ReleaseControl(ControlSettings())
    itl[:] = [0.0, 0.0]
    poll(always, 0.0, settled=True, step=0.010)
    short = math.floor(30 * (0.010 + budget) / 0.010 + 1e-9) - (30 - 28)
    assert poll(always, 1.0, settled=True, step=0.010) == short  # a cap, if a loose one
    assert poll(always, 2.0, settled=True) == capped
