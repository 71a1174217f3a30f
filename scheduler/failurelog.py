"""A failure that repeats, logged once per streak: when it starts, then one line per
`FAILURE_LOG_EVERY_S` with the count, and once when it ends.

A retry loop that meets a Redis outage (a leadership call every ttl/10, a pool's tick 20 times
a second) would otherwise log several lines a second for as long as the outage lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

FAILURE_LOG_EVERY_S = 30.0
"""While failures go on, one line per this many seconds after the first."""


class FailureLog:
    """One kind of failure of one thing (`what`: "leadership call", "pool p tick"), logged to
    `logger` by `failed` and `succeeded`; `recovered` words the line of the first success
    after failures (default: "<what> succeeds again")."""

    def __init__(self, what: str, clock: Callable[[], float], logger: logging.Logger, *,
                 recovered: str | None = None) -> None:
        self.what = what
        self.clock = clock
        self.log = logger
        self.recovered = recovered or f"{what} succeeds again"
        self.failures = 0
        """Failures in a row since the last success."""
        self._since = self._logged_at = 0.0

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._since = self._logged_at = now
            self.log.warning("%s failed: %s", self.what, exc)
        elif now - self._logged_at >= FAILURE_LOG_EVERY_S:
            self._logged_at = now
            self.log.warning("%s failed %d times in a row in %.0f s, the latest: %s",
                             self.what, self.failures, now - self._since, exc)

    def succeeded(self) -> None:
        if self.failures:
            self.log.info("%s after %d failed in %.1f s", self.recovered, self.failures,
                          self.clock() - self._since)
            self.failures = 0
