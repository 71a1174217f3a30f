"""The goodput bound (bench.burst.goodput) holds against the simulator's own engine.

The property drives bench.sim.engine offline, as the nodes run it (steps back to back, requests
arriving while a step runs, preemptions allowed: no admission control in front), reads its
counters the way the monitor does (the totals of the steps completed by a scrape), and checks
that the tokens counted between two scrapes never exceed the bound computed from the work
offered, the counters at the first scrape and the time between the two.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.burst.goodput import (
    TOKENS,
    Bound,
    BoundExceeded,
    Offer,
    Value,
    Work,
    capacity_ceiling,
    check,
    edge_work,
    upper_bound,
    work_value,
)
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


@settings(max_examples=150, deadline=None)
@given(arrivals, st.floats(0, 25), st.floats(0.05, 20))
def test_tokens_counted_between_two_scrapes_never_exceed_the_bound(
        reqs: list[Arrival], t0: float, span: float) -> None:
    t1 = t0 + span
    trace = _replay(reqs, t1 + 1)
    p0, g0 = _counters_at(trace, t0)
    p1, g1 = _counters_at(trace, t1)
    offers = [Offer(a.prompt, a.output) for a in reqs if a.at < t1]
    done = Work(p1 - p0, g1 - g0)
    for value in (TOKENS, work_value([CONFIG])):
        bound = upper_bound([CONFIG], [span], offers, Work(p0, g0), value)
        assert value.of(done) <= bound.ceiling * (1 + 1e-9)
        assert 0 <= check(value.of(done), bound) <= 1


@settings(max_examples=60, deadline=None)
@given(arrivals, st.randoms(use_true_random=False))
def test_windows_opening_as_a_step_ends_never_exceed_the_bound(
        reqs: list[Arrival], rng: random.Random) -> None:
    # Random windows rarely open just before a step ends, where the window counts a whole
    # step (and a prompt whose earlier chunks ran before it) in almost no node time: the
    # bound's edges are for exactly these windows, so they are the ones to try.
    trace = _replay(reqs, 40)
    for _ in range(40):
        i = rng.randrange(1, len(trace)) if len(trace) > 1 else 0
        j = min(len(trace) - 1, i + rng.choice((0, 1, 2, 5, 20, 100)))
        t0, t1 = trace[i][0] - 1e-9, trace[j][0]
        (_, p0, g0), (_, p1, g1) = trace[max(0, i - 1)], trace[j]
        offers = [Offer(a.prompt, a.output) for a in reqs if a.at < t1]
        done = Work(p1 - p0, g1 - g0)
        for value in (TOKENS, work_value([CONFIG])):
            bound = upper_bound([CONFIG], [max(0.0, t1 - t0)], offers, Work(p0, g0), value)
            assert value.of(done) <= bound.capacity * (1 + 1e-9), (i, j, bound)
            assert value.of(done) <= bound.offered * (1 + 1e-9), (i, j, bound)


def test_a_busy_engine_comes_within_reach_of_the_capacity_ceiling() -> None:
    # Long prompts, short answers, far more than the engine can do: the capacity term binds
    # and the engine, prefilling nearly all the time, reaches a large share of it (the bound
    # is a ceiling, not a fantasy).
    rng = random.Random(5)
    reqs = [Arrival(rng.uniform(0, 1), 3000, 2, 0) for _ in range(400)]
    trace = _replay(reqs, 61)
    p0, g0 = _counters_at(trace, 10)
    p1, g1 = _counters_at(trace, 60)
    bound = upper_bound([CONFIG], [50.0], [Offer(a.prompt, a.output) for a in reqs],
                        Work(p0, g0))
    assert bound.binding == "capacity"
    assert 0.8 < check((p1 - p0) + (g1 - g0), bound) <= 1


@pytest.mark.parametrize(("count", "prompt"), [(12, 200), (5, 2500)])
def test_a_decode_batch_comes_within_reach_of_the_capacity_ceiling(count: int,
                                                                   prompt: int) -> None:
    # Requests that fill the KV cache together and decode for the whole window: the window is
    # all decode steps of a small batch, whose fixed and attention costs the ceiling counts.
    # The engine comes within a few percent of it (per-token costs alone leave 10% and more
    # between them).
    reqs = [Arrival(0.01 * i, prompt, 3000, 0) for i in range(count)]
    trace = _replay(reqs, 31)
    p0, g0 = _counters_at(trace, 10)
    p1, g1 = _counters_at(trace, 30)
    assert p1 == p0 == count * prompt  # every prompt was done before the window
    bound = upper_bound([CONFIG], [20.0], [Offer(a.prompt, a.output) for a in reqs],
                        Work(p0, g0))
    assert bound.binding == "capacity"
    done = Work(p1 - p0, g1 - g0)
    assert check(done.total, bound) <= 1
    # The edges (work done before the window) are most of this short window's bound; the
    # steps inside it come within 5% of what the time allows, in tokens and in work.
    assert done.total / (bound.ceiling - TOKENS.of(edge_work(CONFIG, prompt))) > 0.95
    work = work_value([CONFIG])
    bound = upper_bound([CONFIG], [20.0], [Offer(a.prompt, a.output) for a in reqs],
                        Work(p0, g0), work)
    assert check(work.of(done), bound) <= 1
    assert work.of(done) / (bound.ceiling - work.of(edge_work(CONFIG, prompt))) > 0.95


# A config with no fixed cost and no attention cost: every token has one price by kind.
FLAT = SimConfig(capacity_scale=0.05, max_model_len=4096,
                 step_costs=dataclasses.replace(CONFIG.step_costs, fixed_s=0.0,
                                                per_context_token_s=0.0))


def test_the_knapsack_spends_time_on_prompt_tokens_first() -> None:
    prompt_cost = FLAT.step_costs.per_prefill_token_s / FLAT.capacity_scale
    gen_cost = FLAT.step_costs.per_seq_s / FLAT.capacity_scale
    edges = TOKENS.of(edge_work(FLAT, 100))
    # Ten requests of 100 prompt tokens and 1,001 generated.
    offers = [Offer(100, 1001)] * 10
    # Time for the 1,000 prompt tokens and 10 generated tokens: all prompt first.
    seconds = 1000 * prompt_cost + 10 * gen_cost
    got = capacity_ceiling([FLAT], [seconds], offers, Work())
    assert got - edges == pytest.approx(1000 + 10)
    # Half the prompts counted before the window: the leftover time goes to generated tokens.
    got = capacity_ceiling([FLAT], [seconds], offers, Work(500, 0))
    assert got - edges == pytest.approx(500 + (seconds - 500 * prompt_cost) / gen_cost)
    # Valued as work, a token is worth its cost: the time itself is the ceiling.
    work = work_value([FLAT])
    got = capacity_ceiling([FLAT], [seconds], offers, Work(), work)
    assert got - work.of(edge_work(FLAT, 100)) == pytest.approx(seconds)


def test_decode_tokens_cost_their_context_and_a_share_of_the_fixed_cost() -> None:
    costs = CONFIG.step_costs
    k = CONFIG.capacity_scale
    # One request of 1,600 prompt tokens (a multiple of the context bins) and three generated:
    # no prompt left to count, and the decode tokens read 1,600 and 1,601 cached tokens.
    offers = [Offer(1600, 3)]
    per_token = (costs.per_seq_s + costs.per_context_token_s * 1600) / k
    # With only l1 = 1 the fixed share is fixed / max_num_seqs; with l2 = 1 it is
    # fixed * context / kv; the bound takes the tighter.
    kv = CONFIG.usable_blocks * CONFIG.block_size
    share = max(1 / CONFIG.effective_max_num_seqs, 1600 / kv,
                1 / CONFIG.effective_max_num_batched_tokens)
    seconds = 1.5 * (per_token + costs.fixed_s * share)
    got = (capacity_ceiling([CONFIG], [seconds], offers, Work(1600, 0))
           - TOKENS.of(edge_work(CONFIG, 1600)))
    # The first token costs less than a decode token (no context, a smaller fixed share), so
    # 1.5 decode tokens' time buys it and at most a little more than half a decode token.
    assert 1.0 < got < 2.0
    # Without the fixed and attention costs the same time buys more of them.
    flat = (capacity_ceiling([FLAT], [seconds], offers, Work(1600, 0))
            - TOKENS.of(edge_work(FLAT, 1600)))
    assert flat > got


def test_tokens_counted_before_come_off_the_expensive_end() -> None:
    # Two runs, one with short contexts, one with long: with 100 generated tokens counted
    # before the window, the bound assumes they were the long run's decode tokens, and what
    # is left is the short run plus the long run's first token. The time (about 40 decode
    # tokens) binds.
    offers = [Offer(10, 101), Offer(3000, 101)]
    seconds = 0.5
    after_long = (capacity_ceiling([CONFIG], [seconds], offers, Work(3010, 100))
                  - TOKENS.of(edge_work(CONFIG, 3000)))
    only_short = (capacity_ceiling([CONFIG], [seconds], [Offer(10, 101)], Work(10, 0))
                  - TOKENS.of(edge_work(CONFIG, 10)))
    only_long = (capacity_ceiling([CONFIG], [seconds], [Offer(3000, 101)], Work(3000, 0))
                 - TOKENS.of(edge_work(CONFIG, 3000)))
    assert after_long == pytest.approx(only_short, abs=1.0)
    assert after_long < 100
    assert only_long < after_long - 5


def test_the_offered_term_subtracts_what_was_counted_before_the_window() -> None:
    bound = upper_bound([CONFIG], [1000.0], [Offer(1000, 200)] * 10, Work(4_000, 500))
    assert bound.offered == 7_500
    assert bound.ceiling == 7_500 and bound.binding == "offered"


def test_work_values_a_token_at_the_least_time_its_kind_costs() -> None:
    work = work_value([CONFIG])
    k = CONFIG.capacity_scale
    assert work.prompt == pytest.approx(CONFIG.step_costs.per_prefill_token_s / k)
    assert work.generated == pytest.approx(CONFIG.step_costs.per_seq_s / k)
    # A generated token is worth many prompt tokens; as tokens they count the same.
    assert work.of(Work(0, 1)) > 10 * work.of(Work(1, 0))
    assert TOKENS.of(Work(3, 4)) == 7
    assert Value(2.0, 5.0, "x").of(Work(3, 4)) == 26


def test_check_refuses_a_ratio_above_one() -> None:
    bound = Bound(ceiling=100.0, offered=100.0, capacity=math.inf, node_seconds=1.0)
    assert check(100, bound) == 1.0
    with pytest.raises(BoundExceeded, match="exceeds its upper bound"):
        check(101, bound)
