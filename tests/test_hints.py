"""The retry hint of a capacity 429 (admission.hints), the one rule both 429 paths use
(tests/test_gateway_zones.py checks that they do), and the leader's RED estimate it reads
(scheduler.zones.RedClearance; over a real stack: tests/test_red_hint.py), as properties of the
pure functions."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from admission.hints import (
    MAX_RETRY_MS,
    QueueView,
    drain_hint_ms,
    parse_rate,
    red_hint_ms,
    retry_hint_ms,
)
from admission.tiers import Tier, Zone
from scheduler.zones import RED_WINDOW_S, RedClearance, clearance_s
from tests.properties import PROPERTIES, examples

FLOOR = 1_000
depths = st.integers(0, 1_000_000)
rates = st.floats(0.0, 1e6, allow_nan=False)
floors = st.integers(-10, 2 * MAX_RETRY_MS)


@settings(PROPERTIES, max_examples=examples(100))
@given(depths, depths, rates, floors)
def test_drain_hint_is_bounded_and_monotone_in_depth(a: int, b: int, drain: float,
                                                     floor: int) -> None:
    low, high = sorted((a, b))
    hint_low, hint_high = drain_hint_ms(low, drain, floor), drain_hint_ms(high, drain, floor)
    assert hint_low <= hint_high
    for hint in (hint_low, hint_high):
        assert min(max(1, floor), MAX_RETRY_MS) <= hint <= MAX_RETRY_MS


@settings(PROPERTIES, max_examples=examples(100))
@given(depths, rates, rates)
def test_drain_hint_falls_as_the_rate_rises(ahead: int, a: float, b: float) -> None:
    slow, fast = sorted((a, b))
    assert drain_hint_ms(ahead, slow, FLOOR) >= drain_hint_ms(ahead, fast, FLOOR)


@settings(PROPERTIES, max_examples=examples(100))
@given(depths, rates, st.floats(0.0, 1e-3))
def test_drain_hint_is_continuous_in_the_rate(ahead: int, drain: float, step: float) -> None:
    """A small change of rate moves the hint by about as much, relatively (plus the 1 ms of
    rounding up): no jump anywhere, in particular not as the rate reaches 0."""
    hint, nearby = drain_hint_ms(ahead, drain, FLOOR), drain_hint_ms(ahead, drain * (1 + step),
                                                                     FLOOR)
    assert 0 <= hint - nearby <= math.ceil(hint * step) + 1


@settings(PROPERTIES, max_examples=examples(100))
@given(depths)
def test_drain_hint_at_rate_zero_is_the_cap_and_unknown_is_the_floor(ahead: int) -> None:
    assert drain_hint_ms(ahead, 0.0, FLOOR) == MAX_RETRY_MS
    assert drain_hint_ms(ahead, 1e-9, FLOOR) == MAX_RETRY_MS  # the limit as the rate falls
    assert drain_hint_ms(ahead, None, FLOOR) == FLOOR


def test_drain_hint_values() -> None:
    assert drain_hint_ms(29, 10.0, FLOOR) == 3_000  # 30 tasks at 10/s
    assert drain_hint_ms(1, 0.7, FLOOR) == 2_858  # 2 / 0.7 s, rounded up
    assert drain_hint_ms(0, 50.0, FLOOR) == FLOOR
    assert drain_hint_ms(999, 1.0, FLOOR) == MAX_RETRY_MS


@settings(PROPERTIES, max_examples=examples(100))
@given(st.floats(0.0, 1e5), st.floats(0.0, 1e5), st.integers(0, 10**7), st.integers(0, 10**7))
def test_red_hint_is_bounded_and_grows_with_the_estimate_and_its_age(
    a: float, b: float, age_a: int, age_b: int
) -> None:
    low, high = sorted((a, b))
    young, old = sorted((age_a, age_b))
    assert red_hint_ms(low, young, FLOOR) <= red_hint_ms(high, young, FLOOR)
    assert red_hint_ms(low, young, FLOOR) <= red_hint_ms(low, old, FLOOR)
    assert FLOOR <= red_hint_ms(low, young, FLOOR) <= MAX_RETRY_MS


def test_red_hint_values() -> None:
    assert red_hint_ms(0.0, 0, FLOOR) == FLOOR
    assert red_hint_ms(12.5, 0, FLOOR) == 12_500
    assert red_hint_ms(12.5, 2_000, FLOOR) == 14_500  # a state 2 s old: 2 s more to wait
    assert red_hint_ms(59.0, 5_000, FLOOR) == MAX_RETRY_MS


@settings(PROPERTIES, max_examples=examples(100))
@given(st.sampled_from(list(Zone)), st.sampled_from(list(Tier)), depths,
       st.one_of(st.none(), rates), st.one_of(st.none(), st.floats(0.0, 1e4)),
       st.integers(0, 10**6))
def test_the_red_rule_applies_to_the_tiers_red_shuts_out(
    zone: Zone, tier: Tier, ahead: int, drain: float | None, red: float | None, age: int
) -> None:
    hint = retry_hint_ms(QueueView(zone, ahead, drain, red, age), tier, FLOOR)
    if zone is Zone.RED and tier is not Tier.VIP and red is not None:
        assert hint == red_hint_ms(red, age, FLOOR)
    else:
        assert hint == drain_hint_ms(ahead, drain, FLOOR)


def test_published_figures_parse_with_unknown_apart_from_zero() -> None:
    assert parse_rate(b"0.000") == 0.0
    assert parse_rate("12.5") == 12.5
    for unknown in (None, b"", "", b"nan", "-1", "inf", "x"):
        assert parse_rate(unknown) is None
# --- the leader's estimate -------------------------------------------------------------------

fractions = st.floats(0.0, 1.0)
spans = st.floats(0.0, 3_600.0)


@settings(PROPERTIES, max_examples=examples(100))
@given(fractions, fractions, spans)
def test_clearance_is_at_most_the_time_observed(excess: float, decline: float,
                                                observed: float) -> None:
    estimate = clearance_s(excess, decline, observed)
    assert 0.0 <= estimate <= observed


@settings(PROPERTIES, max_examples=examples(100))
@given(fractions, fractions, fractions, spans, spans)
def test_clearance_grows_with_excess_and_time_and_falls_with_decline(
    e1: float, e2: float, decline: float, t1: float, t2: float
) -> None:
    small, large = sorted((e1, e2))
    short, long = sorted((t1, t2))
    assert clearance_s(small, decline, short) <= clearance_s(large, decline, short) + 1e-9
    assert clearance_s(small, decline, short) <= clearance_s(small, decline, long) + 1e-9
    less, more = sorted((decline, e2))
    assert clearance_s(small, less, short) >= clearance_s(small, more, short) - 1e-9


@settings(PROPERTIES, max_examples=examples(100))
@given(st.floats(1e-3, 1.0), spans, st.floats(0.0, 1e-6))
def test_clearance_is_continuous_as_the_decline_reaches_zero(excess: float, observed: float,
                                                              decline: float) -> None:
    assert clearance_s(excess, 0.0, observed) - clearance_s(excess, decline, observed) <= (
        observed * decline / excess + 1e-9)


def test_clearance_values() -> None:
    assert clearance_s(0.1, 0.0, 30.0) == 30.0  # nothing drained in 30 s: about 30 s more
    # Usage fell 0.9 in 10 s with 0.1 left above the line: about a second.
    assert clearance_s(0.1, 0.9, 10.0) == 1.0


def _estimate(red: RedClearance, usage: float | None, now: float) -> float:
    estimate = red.update(Zone.RED, usage, now)
    assert estimate is not None
    return estimate


def test_the_estimate_grows_while_nothing_drains_and_falls_when_usage_does() -> None:
    red = RedClearance(exit_line=0.82)
    assert red.update(Zone.YELLOW, 0.80, 0.0) is None
    held = [_estimate(red, 0.95, float(t)) for t in range(1, 200)]
    assert held == sorted(held), "the estimate fell while nothing drained"
    assert held[0] == 0.0 and held[29] == 29.0 and held[-1] == RED_WINDOW_S
    # Usage falls 0.01 a second: the estimate follows the measured rate down.
    falling = [_estimate(red, 0.95 - 0.01 * s, 200.0 + s) for s in range(1, 13)]
    assert falling == sorted(falling, reverse=True)
    assert falling[-1] < 5.0
    # Leaving RED forgets the episode: the next one starts from its own beginning.
    assert red.update(Zone.YELLOW, 0.80, 300.0) is None
    assert red.update(Zone.RED, 0.95, 301.0) == 0.0


def test_a_pool_with_no_usable_node_counts_as_draining_nothing() -> None:
    red = RedClearance(exit_line=0.82)
    estimates = [red.update(Zone.RED, None, float(t)) for t in range(0, 90, 10)]
    assert estimates == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 60.0, 60.0]


def test_a_rise_then_a_fall_back_is_no_decline() -> None:
    red = RedClearance(exit_line=0.82)
    for t, usage in enumerate((0.90, 0.95, 0.99, 0.95, 0.90)):
        estimate = red.update(Zone.RED, usage, float(t))
    assert estimate == 4.0  # back where it started: nothing drained in 4 s
