"""The Python SDK against the shared retry-policy vectors (clients/vectors/retry_policy.json).

The Go SDK's tests read the same file (clients/go/vectors_test.go), so the two SDKs cannot
drift apart: a change of policy changes the file, and both suites with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate_client import (
    BASE_DELAY_S,
    DEADLINE_S,
    HINT_SPREAD,
    MAX_ATTEMPTS,
    MAX_DELAY_S,
    MAX_RETRY_AFTER_S,
    RETRYABLE_STATUSES,
    Retrier,
    RetryBudget,
    RetryPolicy,
)
from kvgate_client.budget import EARN_PER_REQUEST, MAX_TOKENS, RETRY_COST
from kvgate_client.transport import read_timeout

VECTORS_PATH = Path(__file__).resolve().parents[1] / "clients" / "vectors" / "retry_policy.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text())
# Delays are compared to a microsecond: the Go SDK computes in integer nanoseconds.
TOLERANCE_S = 1e-6


def policy_of(case: dict[str, Any]) -> RetryPolicy:
    fields = {**VECTORS["default_policy"], **case.get("policy", {})}
    return RetryPolicy(
        base_delay_s=fields["base_delay_s"],
        max_delay_s=fields["max_delay_s"],
        max_attempts=fields["max_attempts"],
        deadline_s=fields["deadline_s"],
        max_retry_after_s=fields["max_retry_after_s"],
        hint_spread=fields["hint_spread"],
        retryable_statuses=frozenset(fields["retryable_statuses"]),
    )


def test_the_file_states_the_sdks_defaults() -> None:
    assert VECTORS["default_policy"] == {
        "base_delay_s": BASE_DELAY_S,
        "max_delay_s": MAX_DELAY_S,
        "max_attempts": MAX_ATTEMPTS,
        "deadline_s": DEADLINE_S,
        "max_retry_after_s": MAX_RETRY_AFTER_S,
        "hint_spread": HINT_SPREAD,
        "retryable_statuses": sorted(RETRYABLE_STATUSES),
    }
    assert VECTORS["default_budget"] == {
        "earn_per_request": EARN_PER_REQUEST, "retry_cost": RETRY_COST, "max_tokens": MAX_TOKENS}
    assert len(VECTORS["delay_cases"]) >= 10 and len(VECTORS["decision_cases"]) >= 30


@pytest.mark.parametrize("case", VECTORS["delay_cases"], ids=lambda c: c["name"])
def test_delay(case: dict[str, Any]) -> None:
    delay = policy_of(case).delay(case["attempt"], case["hint_s"], lambda: case["u"])
    assert delay == pytest.approx(case["expected_delay_s"], abs=TOLERANCE_S), case["why"]


@pytest.mark.parametrize("case", VECTORS["decision_cases"], ids=lambda c: c["name"])
def test_decision(case: dict[str, Any]) -> None:
    defaults = VECTORS["defaults"]
    tokens = float(case.get("budget_tokens", defaults["budget_tokens"]))
    budget = RetryBudget(max_tokens=max(MAX_TOKENS, tokens), initial_tokens=tokens)
    now = [0.0]
    retrier = Retrier(
        policy_of(case),
        budget,
        clock=lambda: now[0],
        wall_clock=lambda: float(defaults["now_unix"]) + now[0],
        rand=lambda: float(case["u"]),
    )
    state = retrier.begin()
    state.attempts = case["attempt"] + 1  # attempt n follows the (n + 1)-th attempt sent
    now[0] = float(case.get("elapsed_s", defaults["elapsed_s"]))
    if "error" in case:
        decision = state.after_error(OSError("vector"), retryable=case["error"] == "connection")
    else:
        decision = state.after_response(case["status"], case["headers"])
    expected = case["expected"]
    assert decision.retry is expected["retry"], case["why"]
    if expected["retry"]:
        assert decision.delay_s == pytest.approx(expected["delay_s"], abs=TOLERANCE_S), case["why"]
        assert budget.retries == 1
    else:
        assert decision.reason == expected["reason"], case["why"]
        assert retrier.stats().outcomes == {expected["reason"]: 1}


@pytest.mark.parametrize("case", VECTORS["request_timeout_cases"], ids=lambda c: c["name"])
def test_request_timeout(case: dict[str, Any]) -> None:
    assert read_timeout(case["wait_s"]) == case["expected"], case["why"]
