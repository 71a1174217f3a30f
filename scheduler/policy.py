"""What each zone lets out of the queues, and how fast the queues drain.

GREEN releases every tier (strict order, the release script's job). YELLOW releases VIP,
Normal at `yellow_normal_rate` per second and holds Batch off the shared nodes: the zone
follows their usage, so where a pool keeps dedicated nodes that take guests, Batch still goes
to those as guests, by their own rules (pace, cap, prompt and output bounds). Otherwise the
dedicated node's guest room goes to whatever the zone does not hold, Normal chats with long answers,
and its batch grows through a flood. RED releases VIP only. With
`batch_trickle_rate` > 0, GREEN also lets that many Batch tasks per second past VIP and Normal
tasks that are waiting for room: strict priority otherwise starves Batch under a steady
interactive load. The rates are token buckets kept here, on the leader, so they hold whatever
the poll interval is; a new leader starts them empty.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from admission.config import ZoneSettings
from admission.tiers import Tier, Zone

BURST_S = 0.2
"""A rate bucket holds this many seconds of its rate (at least one task): entering YELLOW
after a quiet spell lets a handful of Normal tasks out, not a second's worth at once."""


class TokenBucket:
    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.burst = max(1.0, rate * BURST_S)
        self.level = 0.0
        self.at = now

    def refill(self, now: float) -> int:
        """Whole tasks available now."""
        self.level = min(self.burst, self.level + self.rate * max(0.0, now - self.at))
        self.at = now
        return math.floor(self.level)

    def take(self, n: int) -> None:
        self.level = max(0.0, self.level - n)

    def reset(self, now: float) -> None:
        self.level, self.at = 0.0, now


class ReleasePolicy:
    """Per-tier release limits for one release call."""

    def __init__(self, zones: ZoneSettings, batch_size: int, now: float,
                 dedicated_guests: bool = False) -> None:
        self.batch_size = batch_size
        self.dedicated_guests = dedicated_guests
        """The pool keeps dedicated nodes that take guests."""
        self.normal = TokenBucket(zones.yellow_normal_rate, now)
        self.trickle = TokenBucket(zones.batch_trickle_rate, now)
        self._zone: Zone | None = None

    def limits(self, zone: Zone, now: float) -> tuple[int, int, int]:
        if zone is not self._zone:
            # Rates apply within a zone: a bucket that filled in another zone would let a burst
            # out the moment the pool turns YELLOW.
            self.normal.reset(now)
            self.trickle.reset(now)
            self._zone = zone
        n = self.batch_size
        if zone is Zone.GREEN:
            return (n, n, n)
        if zone is Zone.YELLOW:
            return (n, min(n, self.normal.refill(now)), n if self.dedicated_guests else 0)
        return (n, 0, 0)

    def guests_only(self, zone: Zone) -> tuple[Tier, ...]:
        """Tiers that this zone releases only as guests of dedicated nodes."""
        return (Tier.BATCH,) if zone is Zone.YELLOW and self.dedicated_guests else ()

    def trickle_limit(self, zone: Zone, now: float) -> int:
        """Batch tasks that may pass waiting higher tiers now (GREEN only)."""
        if zone is not Zone.GREEN or self.trickle.rate <= 0:
            return 0
        return min(self.batch_size, self.trickle.refill(now))

    def released(self, zone: Zone, per_tier: Sequence[int], *, trickle: bool = False) -> None:
        if trickle:
            self.trickle.take(per_tier[Tier.BATCH])
        elif zone is Zone.YELLOW:
            self.normal.take(per_tier[Tier.NORMAL])


class DrainRates:
    """Tasks per second leaving each tier's queue (released by the scheduler or the fast path),
    an exponentially weighted average of the pool's `released_<tier>` counters. Gateways turn
    them into Retry-After hints, so they should follow a change within seconds, not jitter.

    The average starts from nothing, not from 0 tasks/s: it is divided by the weight its
    observations carry (``1 - exp(-observed / tau)``), so a new leader's first seconds are not
    read as a queue that barely moves. Until `MIN_OBSERVED_S` has been observed the rates are
    not published at all: gateways read a missing rate as unknown, and 0 as "nothing leaves"
    (admission.hints)."""

    MIN_OBSERVED_S = 1.0

    def __init__(self, tau_s: float = 5.0) -> None:
        self.tau_s = tau_s
        self._average = [0.0, 0.0, 0.0]
        self._weight = 0.0
        self._observed_s = 0.0
        self._last: list[int] | None = None
        self._at = 0.0

    @property
    def rates(self) -> list[float]:
        """Tasks/s per tier (0 before any interval was observed)."""
        if self._weight <= 0:
            return [0.0, 0.0, 0.0]
        return [average / self._weight for average in self._average]

    def observe(self, stats: Mapping[str, int], now: float) -> None:
        counts = [stats.get(f"released_{t}", 0) for t in range(3)]
        if self._last is not None and now > self._at:
            dt = now - self._at
            alpha = 1.0 - math.exp(-dt / self.tau_s)
            for t in range(3):
                delta = max(0, counts[t] - self._last[t])
                self._average[t] += alpha * (delta / dt - self._average[t])
            self._weight += alpha * (1.0 - self._weight)
            self._observed_s += dt
        self._last, self._at = counts, now

    def fields(self) -> dict[str, str]:
        if self._observed_s < self.MIN_OBSERVED_S:
            return {}
        return {f"drain_{t}": f"{rate:.3f}" for t, rate in enumerate(self.rates)}
