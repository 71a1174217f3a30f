"""The pure delay function and the retry decision, under a fake clock and seeded randomness."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from kvgate_client import (
    BASE_DELAY_S,
    MAX_ATTEMPTS,
    MAX_DELAY_S,
    MAX_RETRY_AFTER_S,
    Retrier,
    RetryBudget,
    RetryPolicy,
    backoff_delay,
    backoff_window,
)
from kvgate_client.retrying import CANCELED, DEADLINE, HINT_TOO_LONG
from kvgate_client.retrying import MAX_ATTEMPTS as R_MAX_ATTEMPTS

SAMPLES = 2000
# Kolmogorov-Smirnov critical value at alpha = 0.001: sqrt(-ln(alpha / 2) / 2) / sqrt(n).
KS_CRITICAL = math.sqrt(-math.log(0.001 / 2) / 2) / math.sqrt(SAMPLES)


def ks_statistic(samples: list[float], cdf: Callable[[float], float]) -> float:
    """sup |F_n(x) - F(x)|, evaluated on both sides of each step of the empirical CDF."""
    xs = sorted(samples)
    n = len(xs)
    return max(max((i + 1) / n - cdf(x), cdf(x) - i / n) for i, x in enumerate(xs))


def uniform_cdf(lo: float, hi: float) -> Callable[[float], float]:
    return lambda x: min(1.0, max(0.0, (x - lo) / (hi - lo)))


def test_ks_statistic_has_power() -> None:
    # Guard against a KS helper that accepts anything: the OpenAI SDK's formula,
    # min(0.5 * 2^n, 8) * (1 - 0.25 U), is far from uniform on [0, window].
    rng = random.Random(7)
    window = backoff_window(2, base=0.5, cap=8.0)
    openai_like = [window * (1 - 0.25 * rng.random()) for _ in range(SAMPLES)]
    assert ks_statistic(openai_like, uniform_cdf(0, window)) > 10 * KS_CRITICAL
    uniform = [rng.random() * window for _ in range(SAMPLES)]
    assert ks_statistic(uniform, uniform_cdf(0, window)) < KS_CRITICAL


@pytest.mark.parametrize("attempt", [0, 1, 2, 3, 4, 6])
def test_delays_are_full_jitter_uniform(attempt: int) -> None:
    rng = random.Random(1000 + attempt)
    window = min(MAX_DELAY_S, BASE_DELAY_S * 2**attempt)
    delays = [
        backoff_delay(attempt, base=BASE_DELAY_S, cap=MAX_DELAY_S, hint_s=None, rand=rng.random)
        for _ in range(SAMPLES)
    ]
    assert all(0 <= d <= window for d in delays)
    assert ks_statistic(delays, uniform_cdf(0, window)) < KS_CRITICAL
    # Full jitter uses the whole window, not just its top (as "equal jitter" would).
    assert min(delays) < 0.01 * window and max(delays) > 0.99 * window


@pytest.mark.parametrize(("attempt", "hint"), [(0, 0.25), (0, 3.5), (2, 1.0), (1, 30.0)])
def test_delay_never_below_hint_and_spread_above_it(attempt: int, hint: float) -> None:
    rng = random.Random(int(hint * 100) + attempt)
    window = min(MAX_DELAY_S, max(BASE_DELAY_S * 2**attempt, hint))
    delays = [
        backoff_delay(attempt, base=BASE_DELAY_S, cap=MAX_DELAY_S, hint_s=hint, rand=rng.random)
        for _ in range(SAMPLES)
    ]
    assert min(delays) >= hint
    assert ks_statistic(delays, uniform_cdf(hint, hint + window)) < KS_CRITICAL


def test_zero_hint_is_no_hint() -> None:
    assert backoff_delay(1, base=1.0, cap=8.0, hint_s=0.0, rand=lambda: 0.5) == 1.0


def test_window_caps_and_does_not_overflow() -> None:
    assert backoff_window(0, base=1.0, cap=8.0) == 1.0
    assert backoff_window(3, base=1.0, cap=8.0) == 8.0
    assert backoff_window(10_000, base=1.0, cap=8.0) == 8.0
    with pytest.raises(ValueError):
        backoff_window(-1, base=1.0, cap=8.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"deadline_s": 0.0}, {"base_delay_s": -1.0}, {"hint_spread": -0.5}],
)
def test_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_openai_sdk_limit_constant() -> None:
    # The same threshold as the official SDK; a larger hint means "give up now".
    assert MAX_RETRY_AFTER_S == 120.0
    assert MAX_ATTEMPTS == 3


def test_hint_above_maximum_gives_up_at_once() -> None:
    retrier = Retrier(RetryPolicy(deadline_s=None), clock=Clock(), rand=lambda: 0.5)
    state = retrier.begin()
    decision = state.after_response(429, {"retry-after": str(int(MAX_RETRY_AFTER_S) + 1)})
    assert not decision.retry and decision.reason == HINT_TOO_LONG
    state = retrier.begin()
    assert state.after_response(429, {"retry-after": str(int(MAX_RETRY_AFTER_S))}).retry
    # With the default 60 s deadline, a 100 s hint cannot be honoured in time either.
    state = Retrier(clock=Clock()).begin()
    assert state.after_response(429, {"retry-after": "100"}).reason == DEADLINE


def test_attempts_are_bounded() -> None:
    retrier = Retrier(RetryPolicy(max_attempts=4), clock=Clock(), rand=lambda: 0.0)
    state = retrier.begin()
    decisions = [state.after_response(503, {}) for _ in range(5)]
    assert [d.retry for d in decisions] == [True, True, True, False, False]
    assert decisions[3].reason == R_MAX_ATTEMPTS
    assert retrier.stats().attempts == 4


def test_deadline_counts_elapsed_time_and_the_next_sleep() -> None:
    clock = Clock()
    retrier = Retrier(RetryPolicy(max_attempts=10, deadline_s=10.0), clock=clock, rand=lambda: 0.0)
    state = retrier.begin()
    clock.now = 6.0  # the first attempt itself took 6 s
    assert state.after_response(429, {"retry-after-ms": "3000"}).retry  # 6 + 3 <= 10
    clock.now = 9.0
    decision = state.after_response(429, {"retry-after-ms": "1500"})  # 9 + 1.5 > 10
    assert not decision.retry and decision.reason == DEADLINE


def test_a_retry_is_counted_when_it_is_sent_and_refunded_when_it_never_is() -> None:
    budget = RetryBudget(max_tokens=2.0)
    retrier = Retrier(budget=budget, clock=Clock(), rand=lambda: 0.0)
    state = retrier.begin()
    assert state.after_response(429, {}).retry
    # Decided, not sent: the caller is sleeping before it, and may never send it.
    assert (retrier.stats().attempts, retrier.stats().retries, state.attempts) == (1, 0, 1)
    assert (budget.tokens, budget.retries) == (1.0, 1)  # its token is held meanwhile
    state.stop(CANCELED)
    stats = retrier.stats()
    assert (stats.requests, stats.attempts, stats.retries, stats.outcomes) == (
        1, 1, 0, {CANCELED: 1})
    assert (budget.tokens, budget.retries) == (2.0, 0)

    state = retrier.begin()
    assert state.after_response(503, {}).retry
    assert state.start_retry() == 1  # the retry's number, for x-kvgate-retry-count
    assert not state.after_response(200, {}).retry
    stats = retrier.stats()
    assert (stats.requests, stats.attempts, stats.retries, state.attempts) == (2, 3, 1, 2)
    assert (budget.tokens, budget.retries) == (1.0, 1)


def test_reporting_an_outcome_means_the_retry_was_sent() -> None:
    """A caller that drives the engine without start_retry: the next outcome it reports is
    the retry's, so the retry was sent."""
    retrier = Retrier(RetryPolicy(max_attempts=2), clock=Clock(), rand=lambda: 0.0)
    state = retrier.begin()
    assert state.after_response(429, {}).retry
    assert state.after_error(OSError("reset"), retryable=True).reason == R_MAX_ATTEMPTS
    stats = retrier.stats()
    assert (stats.attempts, stats.retries, state.attempts) == (2, 1, 2)


def test_budget_is_spent_only_on_real_retries() -> None:
    budget = RetryBudget(max_tokens=1.0)
    retrier = Retrier(budget=budget, clock=Clock(), rand=lambda: 0.0)
    state = retrier.begin()
    assert not state.after_response(404, {}).retry
    assert budget.tokens == pytest.approx(1.0)
    assert state.after_response(429, {}).retry
    assert budget.tokens == pytest.approx(0.0)
