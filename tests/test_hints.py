"""The retry hint of a capacity 429 (admission.hints), the one rule both 429 paths use
(tests/test_gateway_zones.py checks that they do), as properties of the pure functions."""

from __future__ import annotations

import math

from hypothesis import given
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

FLOOR = 1_000
depths = st.integers(0, 1_000_000)
rates = st.floats(0.0, 1e6, allow_nan=False)
floors = st.integers(-10, 2 * MAX_RETRY_MS)


@given(depths, depths, rates, floors)
def test_drain_hint_is_bounded_and_monotone_in_depth(a: int, b: int, drain: float,
                                                     floor: int) -> None:
    low, high = sorted((a, b))
    hint_low, hint_high = drain_hint_ms(low, drain, floor), drain_hint_ms(high, drain, floor)
    assert hint_low <= hint_high
    for hint in (hint_low, hint_high):
        assert min(max(1, floor), MAX_RETRY_MS) <= hint <= MAX_RETRY_MS


@given(depths, rates, rates)
def test_drain_hint_falls_as_the_rate_rises(ahead: int, a: float, b: float) -> None:
    slow, fast = sorted((a, b))
    assert drain_hint_ms(ahead, slow, FLOOR) >= drain_hint_ms(ahead, fast, FLOOR)


@given(depths, rates, st.floats(0.0, 1e-3))
def test_drain_hint_is_continuous_in_the_rate(ahead: int, drain: float, step: float) -> None:
    """A small change of rate moves the hint by about as much, relatively (plus the 1 ms of
    rounding up): no jump anywhere, in particular not as the rate reaches 0."""
    hint, nearby = drain_hint_ms(ahead, drain, FLOOR), drain_hint_ms(ahead, drain * (1 + step),
                                                                     FLOOR)
    assert 0 <= hint - nearby <= math.ceil(hint * step) + 1


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
