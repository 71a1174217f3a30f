"""A failure that repeats on every request or every round, logged once per streak: when it
starts, then one line per `STREAK_LOG_EVERY_S` with the count, and once when it ends.

During a Redis outage every admit fails (a warning per request was thousands of lines a
second at production rates, burying everything else) and every lease renewal does (one line
per pool every few seconds for as long as the outage lasts). The counters
(`kvgate_gateway_redis_errors_total`) count every failure; the log says that it started, that
it goes on, and that it ended. The scheduler's equivalent is scheduler.failurelog, which may
quote the error itself; these lines carry only what the caller passes (`describe`: a Redis
error's class and code, never its message).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

STREAK_LOG_EVERY_S = 30.0
"""While failures go on, one line per this many seconds after the first."""


class FailureStreak:
    """One kind of failure; `what` starts each line ("admission store unavailable")."""

    __slots__ = ("_logged_at", "_since", "clock", "every_s", "failures", "log", "what")

    def __init__(self, what: str, logger: logging.Logger, *,
                 clock: Callable[[], float] = time.monotonic,
                 every_s: float = STREAK_LOG_EVERY_S) -> None:
        self.what = what
        self.log = logger
        self.clock = clock
        self.every_s = every_s
        self.failures = 0
        """Failures in a row since the last success."""
        self._since = self._logged_at = 0.0

    def failed(self, detail: str) -> None:
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._since = self._logged_at = now
            self.log.warning("%s (%s)", self.what, detail)
        elif now - self._logged_at >= self.every_s:
            self._logged_at = now
            self.log.warning("%s (%s): %d failures in a row in %.0f s", self.what, detail,
                             self.failures, now - self._since)

    def succeeded(self) -> None:
        if self.failures:
            self.log.info("%s: over after %d failures in %.1f s", self.what, self.failures,
                          self.clock() - self._since)
            self.failures = 0
