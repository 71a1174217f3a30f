"""A failure that repeats, logged once per streak: when it starts, then one line per
`FAILURE_LOG_EVERY_S` with the count, and once when it ends.

Both services meet failures that repeat for as long as an outage lasts: the scheduler's
leadership calls (every ttl/10), a pool's ticks (20 a second) and a node's scrapes; a gateway's
admits (every request), lease renewals (every round, per pool) and its wake-up subscription's
reconnects. Logged each time, they would bury everything else; each is counted in the
service's metrics one by one, and the log says that it started, that it goes on, and that it
ended. What a line quotes is the caller's: the gateway passes `admission.errors.describe` of
the error (its class and reply code, never a message that could carry a key or a prompt).
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

    def failed(self, exc: BaseException | str) -> None:
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

    def ended(self, why: str) -> None:
        """The streak ends without a success (`why`: the replica stopped leading, and its loop
        no longer runs): said once, so that the line of a later success counts its own
        streak, not one spanning the time nothing was tried."""
        if self.failures:
            self.log.info("%s: %d failed in %.1f s, until %s", self.what, self.failures,
                          self.clock() - self._since, why)
            self.failures = 0
