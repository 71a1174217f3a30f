"""Open-loop load generation helpers: requests go out on schedule, not when the last returns."""

from __future__ import annotations

import asyncio
import time


async def sleep_until(when: float) -> None:
    """Event-loop timers fire on a 1 ms grid; yield-spin the last stretch so the schedule,
    not the timer, decides when a request is sent (the loop keeps serving I/O meanwhile)."""
    delay = when - time.perf_counter()
    if delay > 0.0015:
        await asyncio.sleep(delay - 0.0015)
    while time.perf_counter() < when:  # noqa: ASYNC110 - a deadline, not an event
        await asyncio.sleep(0)
