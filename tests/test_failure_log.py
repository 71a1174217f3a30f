"""`admission.failurelog.FailureLog`: one line when a streak starts, one per interval while it
goes on, one when it ends, by a success or by the loop that met it stopping."""

from __future__ import annotations

import logging

import pytest

from admission.failurelog import FAILURE_LOG_EVERY_S, FailureLog


def test_a_streak_that_ends_by_stepping_down_is_said_once_and_not_carried_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """A leader's pool tick that failed and then stopped running (the replica stepped down)
    closes its streak; the success after it leads again, 19 minutes later, counts only the
    failures of its own streak, not the minutes nothing was tried."""
    now = [0.0]
    failures = FailureLog("pool p tick", lambda: now[0], logging.getLogger("test.failurelog"))
    with caplog.at_level(logging.INFO, logger="test.failurelog"):
        failures.failed("ConnectionError")
        now[0] = FAILURE_LOG_EVERY_S / 2
        failures.failed("ConnectionError")
        failures.ended("this replica stopped leading")
        failures.ended("this replica stopped leading")  # nothing more to say
        now[0] = 1_140.0
        failures.failed("ConnectionError")
        now[0] = 1_141.0
        failures.succeeded()
    assert [r.getMessage() for r in caplog.records] == [
        "pool p tick failed: ConnectionError",
        f"pool p tick: 2 failed in {FAILURE_LOG_EVERY_S / 2:.1f} s, until this replica "
        "stopped leading",
        "pool p tick failed: ConnectionError",
        "pool p tick succeeds again after 1 failed in 1.0 s",
    ]
