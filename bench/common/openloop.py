"""Open-loop load generation helpers: requests go out on schedule, not when the last returns."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator


async def sleep_until(when: float) -> None:
    """Event-loop timers fire on a 1 ms grid; yield-spin the last stretch so the schedule,
    not the timer, decides when a request is sent (the loop keeps serving I/O meanwhile)."""
    delay = when - time.perf_counter()
    if delay > 0.0015:
        await asyncio.sleep(delay - 0.0015)
    while time.perf_counter() < when:  # noqa: ASYNC110 - a deadline, not an event
        await asyncio.sleep(0)


FULL_COLLECTIONS_DEFERRED = 1_000_000_000
"""A gen-2 threshold no run reaches: the collector never starts a full collection itself."""


@contextlib.contextmanager
def quiet_collector() -> Iterator[None]:
    """Keep the garbage collector's full collections out of a measurement.

    A load generator holds every planned request and outcome: a few hundred thousand tracked
    objects at full scale. A full collection walks all of them while the event loop stands
    still (90 to 300 ms measured), and every VIP request in flight then carries the stall in
    its measured TTFT. Inside the block, what exists on entry is frozen (never walked again)
    and full collections wait for the block's end; young objects are still collected, so
    only cyclic garbage that reaches the oldest generation waits (bounded by the run).
    """
    gc.collect()
    gc.freeze()
    saved = gc.get_threshold()
    gc.set_threshold(saved[0], saved[1], FULL_COLLECTIONS_DEFERRED)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        gc.unfreeze()
        gc.collect()


class LoopLag:
    """The worst lag of this process's event loop, per second from a start time.

    A probe that sleeps ``interval_s`` and measures how late it wakes: whatever held the loop
    (a collection, a long callback, a starved CPU) delayed every timestamp the client took
    meanwhile by as much.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.per_second: list[float] = []
        """Worst lag (s) in each whole second since ``run``'s start; 0 where none was late."""

    def record(self, t: float, lag: float) -> None:
        if t < 0:
            return
        second = int(t)
        if second >= len(self.per_second):
            self.per_second.extend([0.0] * (second + 1 - len(self.per_second)))
        self.per_second[second] = max(self.per_second[second], lag)

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.perf_counter()
            lag = max(0.0, now - due)
            # The stall covered [due, now]: both ends' seconds saw it.
            self.record(due - t0, lag)
            self.record(now - t0, lag)
