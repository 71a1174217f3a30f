"""The event-loop lag probe: a loop held by a long callback is observed late by about as long
as it was held; every garbage collection is timed by its generation; both services export
both histograms."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

from prometheus_client import CollectorRegistry

from admission.servicemetrics import gc_pause_histogram, probe, watch_gc
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
    assert {"kvgate_gateway_event_loop_lag_seconds", "kvgate_gateway_gc_pause_seconds"} <= names
    names = {m.name for m in SchedulerMetrics().registry.collect()}
    assert {"kvgate_scheduler_event_loop_lag_seconds",
            "kvgate_scheduler_gc_pause_seconds"} <= names


def _counts(registry: CollectorRegistry) -> dict[str, tuple[float, float]]:
    """generation -> (collections, seconds) observed."""
    out: dict[str, list[float]] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.endswith(("_count", "_sum")):
                pair = out.setdefault(sample.labels["generation"], [0.0, 0.0])
                pair[0 if sample.name.endswith("_count") else 1] = sample.value
    return {g: (c, s) for g, (c, s) in out.items()}


def test_every_collection_is_timed_by_its_generation_until_stopped() -> None:
    registry = CollectorRegistry()
    stop = watch_gc(gc_pause_histogram("t_", registry))
    try:
        # Cyclic garbage of many objects: the full collection that frees it walks them all.
        for _ in range(20_000):
            a: list[object] = []
            a.append(a)
        gc.collect(0)
        gc.collect(2)
    finally:
        stop()
    counts = _counts(registry)
    assert counts["0"][0] >= 1 and counts["2"][0] >= 1
    assert counts["2"][1] > 0
    before = counts["2"][0]
    gc.collect(2)
    stop()  # a second stop is harmless
    assert _counts(registry)["2"][0] == before
