"""What the lab machine's cores went to in each phase of an arm, and how late the gateways'
event loops ran meanwhile.

Every process of an arm (the simulated nodes, the load generator, and in arm (c) the gateways,
the schedulers and Redis) shares the machine's cores. A gateway that waits for a core delays
each request it serves at every step, which at a reduced scale counts `time_scale` times in
the simulated TTFT. A deployment runs its gateways on cores of their own, so this part of a
VIP's time outside the engine belongs to the lab, not to kvgate; these figures show how much of
it there was. The gateways' own histogram (`kvgate_gateway_event_loop_lag_seconds`, a probe
every 100 ms, `admission.servicemetrics`) is read at each phase's start and end; the share of probes
late by more than `LATE_S` estimates the share of the phase the gateways' loops were that far
behind. So are their full garbage collections (`kvgate_gateway_gc_pause_seconds`, generation
2): how many, and how long they held the gateways in all.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

LAG_BUCKET = "kvgate_gateway_event_loop_lag_seconds_bucket"
FULL_GC = "kvgate_gateway_gc_pause_seconds"
"""Read for generation 2 only: the full collections, the ones long enough to matter."""
LATE_S = 0.005
"""A probe this late (one of the histogram's bucket bounds) means the loop was behind by more
than a fast-path admission takes on a quiet machine, several times over."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    t: float
    """Wall seconds from the arm's start."""
    cpu: Mapping[str, float]
    """CPU seconds used so far, by kind of process."""
    lag: Mapping[float, float] | None
    """The gateways' lag probes so far, cumulative by bucket bound (s; inf last), summed over
    the gateways; None when there are none or one did not answer."""
    full_gc: tuple[float, float] | None = None
    """The gateways' full garbage collections so far: (how many, seconds they took), summed
    over the gateways; None when not read."""


def lag_buckets(text: str) -> dict[float, float]:
    """The cumulative bucket counts of the loop-lag histogram in a Prometheus text page."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(LAG_BUCKET + "{"):
            continue
        le = line.split('le="', 1)[1].split('"', 1)[0]
        out[float(le)] = out.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def full_gcs(text: str) -> tuple[float, float] | None:
    """(full collections, seconds they took) in a gateway's Prometheus text page; None when
    the page has no such histogram."""
    count = total = None
    for line in text.splitlines():
        if line.startswith(FULL_GC + '_count{generation="2"} '):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith(FULL_GC + '_sum{generation="2"} '):
            total = float(line.rsplit(" ", 1)[1])
    return None if count is None or total is None else (count, total)


async def read_pages(session: aiohttp.ClientSession, gateways: Sequence[str]
                     ) -> list[str] | None:
    """Each gateway's metrics page; None when there are none or one did not answer."""
    if not gateways:
        return None
    pages = []
    for url in gateways:
        try:
            async with session.get(url + "/metrics",
                                   timeout=aiohttp.ClientTimeout(total=5)) as resp:
                pages.append(await resp.text())
        except (aiohttp.ClientError, TimeoutError):
            return None
    return pages


def summed_lag(pages: Sequence[str] | None) -> dict[float, float] | None:
    """The lag histograms of `pages`, summed; None when a page has none."""
    total: dict[float, float] = {}
    for page in pages or ():
        buckets = lag_buckets(page)
        if not buckets:
            return None
        for le, count in buckets.items():
            total[le] = total.get(le, 0.0) + count
    return total or None


def summed_full_gcs(pages: Sequence[str] | None) -> tuple[float, float] | None:
    """The full collections of `pages`, summed; None when a page has none."""
    found = [full_gcs(page) for page in pages or ()]
    if not found or any(f is None for f in found):
        return None
    return (sum(f[0] for f in found if f), sum(f[1] for f in found if f))


async def take(session: aiohttp.ClientSession, gateways: Sequence[str],
               cpu: Callable[[], Mapping[str, float]], t: float) -> Snapshot:
    pages = await read_pages(session, gateways)
    return Snapshot(t, dict(cpu()), summed_lag(pages), summed_full_gcs(pages))


def phase_load(start: Snapshot, end: Snapshot) -> dict[str, float]:
    """Cores used on average by each kind of process (`cores:<kind>`) between two snapshots
    and, when both read the gateways, the probes taken (`gateway_probes`), the share late by
    more than `LATE_S` (`gateway_late_share`) and the bucket bound their P99 falls in
    (`gateway_lag_p99_ms`; inf: past the last bound)."""
    span = max(1e-9, end.t - start.t)
    out = {f"cores:{kind}": max(0.0, used - start.cpu.get(kind, 0.0)) / span
           for kind, used in sorted(end.cpu.items())}
    if start.full_gc is not None and end.full_gc is not None:
        out.update(gateway_full_gcs=end.full_gc[0] - start.full_gc[0],
                   gateway_full_gc_ms=(end.full_gc[1] - start.full_gc[1]) * 1000)
    if start.lag is None or end.lag is None:
        return out
    bounds = sorted(end.lag)
    counts = [end.lag[b] - start.lag.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return out
    on_time = next(c for b, c in zip(bounds, counts, strict=True) if b >= LATE_S)
    p99 = next(b for b, c in zip(bounds, counts, strict=True) if c >= 0.99 * total)
    out.update(gateway_probes=total, gateway_late_share=(total - on_time) / total,
               gateway_lag_p99_ms=p99 * 1000 if math.isfinite(p99) else math.inf)
    return out


class PhaseClock:
    """Snapshots at the arm's start and at each phase boundary, taken on time in the
    background while the load runs."""

    def __init__(self, session: aiohttp.ClientSession, gateways: Sequence[str],
                 cpu: Callable[[], Mapping[str, float]],
                 boundaries: Mapping[str, tuple[float, float]]) -> None:
        self.session, self.gateways, self.cpu = session, list(gateways), cpu
        self.boundaries = dict(boundaries)
        self.snapshots: dict[float, Snapshot] = {}

    async def run(self, t0: float, now: Callable[[], float]) -> None:
        """Take every boundary's snapshot at its time (`t0` + t on the `now` clock)."""
        for t in sorted({t for window in self.boundaries.values() for t in window}):
            await asyncio.sleep(max(0.0, t0 + t - now()))
            self.snapshots[t] = await take(self.session, self.gateways, self.cpu, t)

    def loads(self) -> dict[str, dict[str, float]]:
        """`phase_load` of each phase whose two snapshots were taken."""
        return {name: phase_load(self.snapshots[a], self.snapshots[b])
                for name, (a, b) in self.boundaries.items()
                if a in self.snapshots and b in self.snapshots}


def describe(loads: Mapping[str, Mapping[str, float]]) -> list[str]:
    """One line per phase, for the progress output."""
    lines = []
    for phase, load in loads.items():
        cores = ", ".join(f"{k.split(':', 1)[1]} {v:.2f}" for k, v in load.items()
                          if k.startswith("cores:"))
        line = f"{phase}: cores {cores}"
        if "gateway_late_share" in load:
            line += (f"; gateways' loops late by more than {LATE_S * 1000:.0f} ms in "
                     f"{load['gateway_late_share']:.1%} of their probes, P99 up to "
                     f"{load['gateway_lag_p99_ms']:.0f} ms")
        if load.get("gateway_full_gcs"):
            line += (f"; {load['gateway_full_gcs']:.0f} full garbage collections in the "
                     f"gateways, {load['gateway_full_gc_ms']:.0f} ms in all")
        lines.append(line)
    return lines
