"""What the gateway's and the scheduler's metrics share: how late the event loop runs its
timers, how long the garbage collector holds the process, and the exposition's defaults.

How late the loop runs is the one figure that tells a starved process (too little CPU, or one
callback that holds the loop) from a slow dependency.

Every request a gateway serves waits, at each of its steps (the body read, the admit round trip
to Redis, the forward, each relayed chunk), for the loop to come back to it. When the process
cannot get a core (a node shared with busier processes, a CPU limit below what the traffic
needs) or one callback runs long, every one of those waits grows at once, and a fast path's
first token is late although Redis and the nodes answered in time. Neither the request
histograms nor Redis's SLOWLOG show that cause; the loop's own lateness does.

`probe` sleeps `LAG_PROBE_INTERVAL_S` at a time and records how much later than asked each
sleep returned. Probes land at moments unrelated to the work, so the share of probes later
than some x estimates the share of time the loop is that far behind; a stall of d seconds
shows in about d / `LAG_PROBE_INTERVAL_S` probes, with its remaining length at each.

One cause of such a stall is the process's own garbage collector: a full collection walks
every object the process tracks, and a gateway holding a deep queue's requests holds many.
`watch_gc` times each collection (`gc.callbacks`), so a lag histogram's tail can be told apart
as the collector's or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics

LAG_PROBE_INTERVAL_S = 0.1
"""Ten wake-ups a second: negligible work, and enough probes for a P99 within minutes."""
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""A healthy loop is late by well under a millisecond; past 10 ms every request in the process
waits that long at each step."""


def lag_histogram(prefix: str, registry: CollectorRegistry) -> Histogram:
    """`<prefix>event_loop_lag_seconds` in `registry`."""
    return Histogram(
        prefix + "event_loop_lag_seconds",
        "How much later than asked the event loop woke a sleeping task, sampled every "
        f"{LAG_PROBE_INTERVAL_S:g} s: a process short of CPU, or a long callback, delays "
        "every request it serves by this much at each step.",
        buckets=LAG_BUCKETS, registry=registry)


async def probe(observe: Callable[[float], None],
                interval_s: float = LAG_PROBE_INTERVAL_S) -> None:
    """Pass the loop's lateness, in seconds, to `observe` (a histogram's) until cancelled."""
    clock = time.perf_counter
    while True:
        asked = clock()
        await asyncio.sleep(interval_s)
        observe(max(0.0, clock() - asked - interval_s))


GC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""A young collection takes well under a millisecond; a full one walks every object the
process tracks, tens of milliseconds with a deep queue's requests in memory."""


def gc_pause_histogram(prefix: str, registry: CollectorRegistry) -> Histogram:
    """`<prefix>gc_pause_seconds{generation}` in `registry`."""
    return Histogram(
        prefix + "gc_pause_seconds",
        "How long each of the Python garbage collector's collections held the process, by the "
        "oldest generation collected (2: a full collection, which walks every tracked object): "
        "every request in flight through the process waits that long.",
        ["generation"], buckets=GC_BUCKETS, registry=registry)


def watch_gc(histogram: Histogram) -> Callable[[], None]:
    """Observe every collection of this process into `histogram` (gc_pause_histogram) until
    the returned function is called. The collector runs with the GIL held, so one collection
    ends before the next starts: one start time is enough."""
    children = [histogram.labels(str(generation)) for generation in range(3)]
    clock = time.perf_counter
    started = [0.0]

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            children[min(int(info["generation"]), 2)].observe(clock() - started[0])

    gc.callbacks.append(on_collection)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(on_collection)

    return stop


def no_created_series() -> None:
    """Turn off prometheus_client's `_created` series for the process: they double every
    counter's series on the page (a gateway of 10 pools of 256 nodes served 3.7 MB), and
    dashboards and alerts use `rate()`, not creation times. Each service's metrics module
    calls it when imported."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
