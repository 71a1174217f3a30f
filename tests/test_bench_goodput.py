"""The goodput bound (bench.burst.goodput) holds against the simulator's own engine.

The property drives bench.sim.engine offline, as the nodes run it (steps back to back, requests
arriving while a step runs, preemptions allowed: no admission control in front), reads its
counters the way the monitor does (the totals of the steps completed by a scrape), and checks
that the tokens counted between two scrapes never exceed the bound computed from the work
offered, the counters at the first scrape and the time between the two.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.burst.goodput import Bound, Work, capacity_tokens, check, edge_tokens, upper_bound
from bench.sim.config import SimConfig
from bench.sim.engine import Engine, SimRequest

CONFIG = SimConfig(capacity_scale=0.05, max_model_len=4096, scheduling_policy="priority")


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt: int
    output: int
    priority: int


def _replay(arrivals: list[Arrival], horizon: float) -> list[tuple[float, int, int]]:
    """(step end, prompt counter, generation counter) after every step until ``horizon``."""
    engine = Engine(CONFIG)
    pending = sorted(arrivals, key=lambda a: a.at)
    now, i = 0.0, 0
    out: list[tuple[float, int, int]] = [(0.0, 0, 0)]
    while now < horizon:
        while i < len(pending) and pending[i].at <= now:
            a = pending[i]
            engine.add(SimRequest(str(i), a.prompt, a.output, priority=a.priority,
                                  arrival=a.at), a.at)
            i += 1
        if not engine.has_work():
            if i >= len(pending):
                break
            now = pending[i].at
            continue
        plan = engine.schedule(now)
        now += engine.step_seconds(plan)
        engine.complete(plan, now)
        out.append((now, engine.stats.prompt_tokens, engine.stats.generation_tokens))
    return out


def _counters_at(trace: list[tuple[float, int, int]], t: float) -> tuple[int, int]:
    done = [(p, g) for end, p, g in trace if end <= t]
    return done[-1]


arrivals = st.lists(
    st.builds(Arrival, at=st.floats(0, 30), prompt=st.integers(1, 3500),
              output=st.integers(1, 500), priority=st.integers(0, 2)),
    min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(arrivals, st.floats(0, 25), st.floats(0.05, 20))
def test_tokens_counted_between_two_scrapes_never_exceed_the_bound(
        reqs: list[Arrival], t0: float, span: float) -> None:
    t1 = t0 + span
    trace = _replay(reqs, t1 + 1)
    p0, g0 = _counters_at(trace, t0)
    p1, g1 = _counters_at(trace, t1)
    offered = Work(sum(a.prompt for a in reqs if a.at < t1),
                   sum(a.output for a in reqs if a.at < t1))
    bound = upper_bound([CONFIG], [span], offered, Work(p0, g0))
    counted = (p1 - p0) + (g1 - g0)
    assert counted <= bound.tokens
    assert 0 <= check(counted, bound) <= 1


def test_a_busy_engine_comes_within_reach_of_the_capacity_ceiling() -> None:
    # Long prompts, short answers, far more than the engine can do: the capacity term binds
    # and the engine, prefilling nearly all the time, reaches a large share of it (the bound
    # is a ceiling, not a fantasy).
    rng = random.Random(5)
    reqs = [Arrival(rng.uniform(0, 1), 3000, 2, 0) for _ in range(400)]
    trace = _replay(reqs, 61)
    p0, g0 = _counters_at(trace, 10)
    p1, g1 = _counters_at(trace, 60)
    offered = Work(sum(a.prompt for a in reqs), sum(a.output for a in reqs))
    bound = upper_bound([CONFIG], [50.0], offered, Work(p0, g0))
    assert bound.binding == "capacity"
    assert 0.8 < check((p1 - p0) + (g1 - g0), bound) <= 1


def test_the_knapsack_spends_time_on_prompt_tokens_first() -> None:
    prompt_cost = CONFIG.step_costs.per_prefill_token_s / CONFIG.capacity_scale
    gen_cost = CONFIG.step_costs.per_seq_s / CONFIG.capacity_scale
    edges = edge_tokens(CONFIG)
    # Time for 1,000 prompt tokens and 10 generated ones: all prompt first, the rest decode.
    seconds = 1000 * prompt_cost + 10 * gen_cost
    got = capacity_tokens([CONFIG], [seconds], Work(1000, 10_000))
    assert got - edges == pytest.approx(1010)
    # Less prompt work than time: the leftover time goes to generated tokens.
    got = capacity_tokens([CONFIG], [seconds], Work(500, 10_000))
    assert got - edges == pytest.approx(500 + (seconds - 500 * prompt_cost) / gen_cost)


def test_the_offered_term_subtracts_what_was_counted_before_the_window() -> None:
    bound = upper_bound([CONFIG], [1000.0], Work(10_000, 2_000), Work(4_000, 500))
    assert bound.offered == 7_500
    assert bound.tokens == 7_500 and bound.binding == "offered"


def test_check_refuses_a_ratio_above_one() -> None:
    bound = Bound(tokens=100.0, offered=100.0, capacity=math.inf, node_seconds=1.0)
    assert check(100, bound) == 1.0
    with pytest.raises(AssertionError, match="exceeds its upper bound"):
        check(101, bound)
