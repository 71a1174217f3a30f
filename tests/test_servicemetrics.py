"""The event-loop lag probe: a loop held by a long callback is observed late by about as long
as it was held; both services export the histogram."""

from __future__ import annotations

import asyncio
import contextlib
import time

from admission.servicemetrics import probe
from gateway.metrics import GatewayMetrics
from scheduler.metrics import SchedulerMetrics


class Lags:
    """What the probe observed, and an event per observation count reached."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.changed = asyncio.Event()

    def observe(self, lag: float) -> None:
        self.values.append(lag)
        self.changed.set()

    async def reach(self, count: int) -> None:
        while len(self.values) < count:
            self.changed.clear()
            await self.changed.wait()


async def test_a_held_loop_is_observed_late_by_about_as_long_as_it_was_held() -> None:
    lags = Lags()
    task = asyncio.create_task(probe(lags.observe, interval_s=0.01))
    try:
        await asyncio.wait_for(lags.reach(3), timeout=5)
        before = len(lags.values)
        # The stall under test: a callback that holds the loop (what a starved or blocked
        # process looks like to its timers).
        time.sleep(0.3)  # noqa: ASYNC251
        await asyncio.wait_for(lags.reach(before + 2), timeout=5)
        stalled = [lag for lag in lags.values[before:] if lag > 0.25]
        assert len(stalled) == 1, lags.values  # the one probe asleep across it
        assert stalled[0] <= 0.3 + 1.0  # late by the stall, give or take the machine
        assert all(lag >= 0 for lag in lags.values)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_both_services_export_it() -> None:
    names = {m.name for m in GatewayMetrics().registry.collect()}
    assert "kvgate_gateway_event_loop_lag_seconds" in names
    names = {m.name for m in SchedulerMetrics().registry.collect()}
    assert "kvgate_scheduler_event_loop_lag_seconds" in names
