"""The retry decision, shared by the sync and async transports and the standalone client.

It never sleeps and never does I/O: callers report what an attempt produced and get back
whether to try again and after how long. Clock, wall clock and randomness are injected so the
whole loop runs under a fake clock in tests.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .budget import BudgetStats, RetryBudget
from .hints import parse_hints
from .policy import RetryPolicy

log = logging.getLogger("kvgate_client")

# Reasons a logical request ends, as counted in RetryStats.outcomes.
OK = "ok"  # a response the caller gets as is (success, or an error not worth retrying)
NOT_RETRYABLE = "not_retryable"  # an error status outside the retryable set
SERVER_SAID_NO = "server_said_no"  # x-should-retry: false
HINT_TOO_LONG = "hint_too_long"  # Retry-After above the policy's maximum
MAX_ATTEMPTS = "max_attempts"
DEADLINE = "deadline"  # the next attempt would start after the deadline
BUDGET = "budget"  # the retry budget was empty
ERROR = "error"  # an exception that is not a connection error (a timeout, a cancellation)
CANCELED = "canceled"  # cancelled (or interrupted) during a backoff sleep


@dataclass(frozen=True, slots=True)
class Decision:
    retry: bool
    delay_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class RetryStats:
    """Counters of one Retrier (transport): logical requests, attempts, and how they ended.

    `attempts` counts the attempts sent, first ones included, and `retries` those after a first
    one. A retry counts once it is sent (RetryState.start_retry), not when it is decided: one
    whose backoff sleep is cut short was never sent, so it is in neither count.
    """

    requests: int
    attempts: int
    retries: int
    outcomes: Mapping[str, int] = field(default_factory=dict)
    budget: BudgetStats | None = None


class Retrier:
    """Policy + budget + clock + randomness: the state shared by all requests of one client."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy if policy is not None else RetryPolicy()
        self.budget = budget if budget is not None else RetryBudget()
        self.clock = clock
        self.wall_clock = wall_clock
        self.rand = rand
        self._lock = threading.Lock()
        self._requests = 0
        self._attempts = 0
        self._retries = 0
        self._outcomes: Counter[str] = Counter()

    def begin(self) -> RetryState:
        """Start a logical request (its first attempt is about to be sent)."""
        self.budget.record_request()
        with self._lock:
            self._requests += 1
            self._attempts += 1
        return RetryState(self)

    def _count_retry(self) -> None:
        with self._lock:
            self._attempts += 1
            self._retries += 1

    def _count_outcome(self, reason: str) -> None:
        with self._lock:
            self._outcomes[reason] += 1

    def stats(self) -> RetryStats:
        with self._lock:
            return RetryStats(
                requests=self._requests,
                attempts=self._attempts,
                retries=self._retries,
                outcomes=dict(self._outcomes),
                budget=self.budget.stats(),
            )


class RetryState:
    """One logical request's progress through the policy.

    A decision to retry takes its token from the budget at once (so that no one sleeps for a
    retry the budget would refuse), but counts the retry only when the caller sends it: call
    `start_retry()` after the backoff sleep, or `stop()` if it was cut short, which gives the
    token back. Reporting the next outcome (`after_response`, `after_error`) without calling
    `start_retry()` first counts the retry as sent.
    """

    def __init__(self, retrier: Retrier) -> None:
        self._r = retrier
        self.started_at = retrier.clock()
        # Attempts sent so far, the first one included.
        self.attempts = 1
        # A retry was decided (its token taken) and has been neither sent nor given up.
        self._retry_pending = False

    def start_retry(self) -> int:
        """The retry decided last is being sent: count it. Returns its number (the attempts
        sent before it), the value of the x-kvgate-retry-count header."""
        if not self._retry_pending:
            raise RuntimeError("start_retry() without a decision to retry")
        self._retry_pending = False
        self.attempts += 1
        self._r._count_retry()
        return self.attempts - 1

    def after_response(self, status: int, headers: Mapping[str, str]) -> Decision:
        self._outcome_reported()
        policy = self._r.policy
        if status < 400:
            return self._stop(OK)
        hints = parse_hints(headers, wall_clock=self._r.wall_clock)
        # The server's explicit word beats our status table, both ways (as in the OpenAI SDK).
        if hints.should_retry is False:
            return self._stop(SERVER_SAID_NO)
        if hints.should_retry is None and status not in policy.retryable_statuses:
            return self._stop(NOT_RETRYABLE)
        return self._retry_or_stop(hints.retry_after_s, f"status {status}")

    def after_error(self, exc: BaseException, *, retryable: bool) -> Decision:
        self._outcome_reported()
        if not retryable:
            return self._stop(ERROR)
        return self._retry_or_stop(None, type(exc).__name__)

    def stop(self, reason: str) -> Decision:
        """End the request for `reason` (an outcome above) without asking the policy: for a
        caller whose backoff sleep was cancelled. A retry decided but not started is given up:
        it is not counted, and its token goes back to the budget."""
        return self._stop(reason)

    def _outcome_reported(self) -> None:
        # An outcome can only be the pending retry's: it was sent.
        if self._retry_pending:
            self.start_retry()

    def _retry_or_stop(self, hint_s: float | None, why: str) -> Decision:
        policy = self._r.policy
        if hint_s is not None and hint_s > policy.max_retry_after_s:
            return self._stop(HINT_TOO_LONG)
        if self.attempts >= policy.max_attempts:
            return self._stop(MAX_ATTEMPTS)
        delay = policy.delay(self.attempts - 1, hint_s, self._r.rand)
        if policy.deadline_s is not None:
            elapsed = self._r.clock() - self.started_at
            if elapsed + delay > policy.deadline_s:
                return self._stop(DEADLINE)
        # Last, so a token is taken only for a retry every other rule allows; stop() gives it
        # back if the retry is then never sent.
        if not self._r.budget.try_spend():
            return self._stop(BUDGET)
        self._retry_pending = True
        log.debug("kvgate_client: %s, retry %d in %.3f s", why, self.attempts, delay)
        return Decision(retry=True, delay_s=delay, reason=why)

    def _stop(self, reason: str) -> Decision:
        if self._retry_pending:
            self._retry_pending = False
            self._r.budget.refund()
        decision = Decision(retry=False, delay_s=0.0, reason=reason)
        self._r._count_outcome(reason)
        if reason != OK:
            log.debug("kvgate_client: not retrying (%s) after %d attempt(s)", reason, self.attempts)
        return decision
