"""The retry budget: bounded, counted, and capping retries near 10% under sustained 429s."""

from __future__ import annotations

import threading

import httpx
import pytest

from kvgate_client import RetryBudget, RetryTransport
from kvgate_client.budget import EARN_PER_REQUEST, MAX_TOKENS


def test_starts_full_earns_and_spends() -> None:
    budget = RetryBudget(max_tokens=2.0)
    assert budget.tokens == 2.0
    assert budget.try_spend() and budget.try_spend()
    assert not budget.try_spend()
    for _ in range(10):
        budget.record_request()
    assert budget.tokens == pytest.approx(1.0)
    assert budget.try_spend()  # ten earnings of 0.1 buy exactly one retry
    stats = budget.stats()
    assert (stats.first_attempts, stats.retries, stats.retries_denied) == (10, 3, 1)


def test_is_bounded() -> None:
    budget = RetryBudget(max_tokens=3.0, initial_tokens=0.0)
    for _ in range(1000):
        budget.record_request()
    assert budget.tokens == 3.0


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        RetryBudget(max_tokens=1.0, initial_tokens=2.0)
    with pytest.raises(ValueError):
        RetryBudget(retry_cost=0.0)


def test_thread_safe_counts() -> None:
    budget = RetryBudget(max_tokens=1e9, initial_tokens=0.0, earn_per_request=1.0)

    def work() -> None:
        for _ in range(2000):
            budget.record_request()
            budget.try_spend()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats = budget.stats()
    assert stats.first_attempts == 8000
    assert stats.retries + stats.retries_denied == 8000
    assert stats.tokens == pytest.approx(8000 - stats.retries)


@pytest.mark.parametrize("requests", [200, 1000])
def test_sustained_429_adds_about_ten_percent(requests: int) -> None:
    attempts = 0

    def always_full(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        return httpx.Response(429, headers={"retry-after-ms": "100"})

    budget = RetryBudget()
    transport = RetryTransport(
        httpx.MockTransport(always_full),
        budget=budget,
        sleep=lambda s: None,
        clock=lambda: 0.0,
        rand=lambda: 0.5,
    )
    with httpx.Client(transport=transport) as client:
        for _ in range(requests):
            assert client.get("http://gw/").status_code == 429
    retries = attempts - requests
    # Without the budget, 3 attempts per request would have tripled the load.
    assert retries <= EARN_PER_REQUEST * requests + MAX_TOKENS
    assert retries >= EARN_PER_REQUEST * requests - 1  # and the budget is actually used
    assert budget.retries == retries
    assert budget.retries_denied > 0
    assert transport.stats().attempts == attempts
