"""Leadership: a Redis lease with a fencing epoch (`lua/leader.lua`), seen from one replica.

The leader renews every ttl/3. It trusts its lease only until ``t_sent + ttl x (1 - SAFETY)``
by its own monotonic clock, where t_sent is when the renewing call left (Redis starts the TTL
later than that, so the local deadline always falls before the lease ends in Redis): a leader
that cannot reach Redis, or that was paused, stops releasing by itself before anyone else can
take over. What a paused process sends after that is refused by the epoch the new leader
writes (`FencedError`), and the replica steps down.

A standby retries when the holder's lease is due to end (the script tells it the time left),
so it takes over at most ~ttl after the leader died. A leader that resigns (SIGTERM) frees the
lease and publishes on the handover channel; standbys listen and try at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from admission.errors import REDIS_ERRORS, describe, is_transient
from admission.failurelog import FailureLog
from admission.leadership import leadership
from admission.pubsub import MESSAGE_KINDS, announce_handover, handover_subscription
from admission.scripts import Scripts

SAFETY = 0.1
"""Part of the lease given up to clock drift between this host and Redis."""

log = logging.getLogger("kvgate.scheduler.leader")


class Elector:
    def __init__(
        self,
        client: Any,
        scripts: Scripts,
        me: str,
        ttl_ms: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[], object] = lambda: None,
        on_change: Callable[[], object] = lambda: None,
    ) -> None:
        self.client = client
        self.on_failure = on_failure
        """Called once per leadership call that failed on a Redis error (the metric's counter:
        the log says it once per streak, admission.failurelog)."""
        self.on_change = on_change
        """Called when this replica starts or stops leading (the service's metrics: its loops
        are not running while it is a standby, so they cannot notice a step-down)."""
        self.scripts = scripts
        self.me = me
        self.ttl_s = ttl_ms / 1000
        self.clock = clock
        self.epoch: int | None = None
        self.holder: str | None = None
        self.deadline = 0.0
        self.changes = 0
        """Leadership gained or lost, for metrics."""
        self.failed_at: float | None = None
        """When a leadership call last failed on a Redis error (this replica's clock)."""
        self.last_error: str | None = None
        """`describe` of the Redis error of the latest leadership call, None once one
        succeeds: /healthz shows it."""
        self.error_permanent = False
        """Whether that error is one only an operator repairs (credentials, ACL, a
        certificate): /healthz says "refused" instead of "unreachable"."""
        # Redis down or a wrong password: logged once per streak, not at every ttl/10 retry.
        self._failure_log = FailureLog("leadership call", clock, log,
                                       recovered="leadership calls succeed again")
        self._leading_event = asyncio.Event()
        self._wake = asyncio.Event()
        self._lapsed: int | None = None
        """The epoch whose lease lapsed by this replica's clock during a Redis stall."""

    @property
    def failures(self) -> int:
        """Leadership calls failed in a row since the last one that succeeded."""
        return self._failure_log.failures

    @property
    def leading(self) -> bool:
        """True only while this replica holds the lease by its own clock."""
        return self.epoch is not None and self.clock() < self.deadline

    async def attempt(self) -> float:
        """One acquire-or-renew call; returns the seconds to wait before the next one."""
        sent = self.clock()
        try:
            result = await leadership(self.client, self.scripts, self.me, int(self.ttl_s * 1000))
        except REDIS_ERRORS as exc:  # a Redis Cluster none of whose nodes answers included
            self._failed(exc)
            if self.epoch is not None and not self.leading:
                # Our own clock ended the lease (no renewal got through): a step-down like
                # any other, said and counted now rather than when Redis answers again.
                self._lapsed = self.epoch
                self.step_down("lease lapsed: Redis did not answer the renewals")
            # Keep trying often: the lease may still be ours for a while.
            return self.ttl_s / 10
        self._failure_log.succeeded()
        self.last_error = None
        self.error_permanent = False
        self.holder = result.holder
        if result.leading:
            changed = self.epoch != result.epoch
            if changed and result.epoch == self._lapsed:
                # The lease outlived the stall in Redis: no one else led, so one change (the
                # lapse) for the blip, not two, which the flapping alert would count.
                log.info("%s leads again with epoch %d (its lease lapsed by its own clock "
                         "only)", self.me, result.epoch)
            elif changed:
                log.info("%s leads with epoch %d", self.me, result.epoch)
                self.changes += 1
            self._lapsed = None
            self.epoch = result.epoch
            self.deadline = sent + self.ttl_s * (1 - SAFETY)
            self._leading_event.set()
            if changed:
                self.on_change()
            return self.ttl_s / 3
        if self.epoch is not None:
            self.step_down(f"lease held by {result.holder}")
        left = result.lease_left_ms / 1000 if result.lease_left_ms > 0 else 0.0
        return max(0.005, min(self.ttl_s / 3, left + 0.005))

    def _failed(self, exc: BaseException) -> None:
        self.failed_at = self.clock()
        self.last_error = describe(exc)
        self.error_permanent = not is_transient(exc)
        self.on_failure()
        self._failure_log.failed(exc)

    def step_down(self, why: str) -> None:
        was = self.epoch
        if was is not None:
            level = logging.INFO if why == "resigning" else logging.WARNING
            log.log(level, "%s steps down from epoch %d: %s", self.me, was, why)
            self.changes += 1
        self.epoch = None
        self.deadline = 0.0
        self._leading_event.clear()
        if was is not None:
            self.on_change()

    async def wait_leading(self) -> int:
        """Wait until this replica leads; returns the epoch."""
        while True:
            epoch = self.epoch
            if epoch is not None and self.leading:
                return epoch
            self._leading_event.clear()
            await self._leading_event.wait()

    async def resign(self) -> None:
        """Free the lease now (if held) and tell the standbys."""
        was = self.epoch
        self.step_down("resigning")
        if was is None:
            return
        with contextlib.suppress(*REDIS_ERRORS):
            await leadership(self.client, self.scripts, self.me, int(self.ttl_s * 1000),
                             resign=True)
            await announce_handover(self.client, self.me)

    async def run(self) -> None:
        """Acquire or renew for ever (cancel to stop)."""
        listener = asyncio.create_task(self._listen_handover())
        try:
            while True:
                delay = await self.attempt()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen_handover(self) -> None:
        """Wake the loop when a leader resigns; best effort (the timed retry is the fallback)."""
        while True:
            subscription = handover_subscription(self.client)
            try:
                await subscription.open()
                while True:
                    message = await subscription.get(1.0)
                    if message is not None and message[0] in MESSAGE_KINDS and self.epoch is None:
                        self._wake.set()
            except REDIS_ERRORS as exc:
                log.debug("handover listener: %s", exc)
                await asyncio.sleep(self.ttl_s / 3)
            except Exception as exc:  # never end silently: only the timed retry would be left
                log.warning("handover listener failed: %r", exc)
                await asyncio.sleep(self.ttl_s / 3)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await subscription.aclose()
