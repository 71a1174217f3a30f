"""The Retry-After hint of a capacity 429, from the pool's published state: one rule for every
path that answers one (a rejected admit, a queued request past its deadline).

Two estimates, both in milliseconds, both within [floor, `MAX_RETRY_MS`]:

- **Drain** (`drain_hint_ms`): the tasks queued at the request's tier or above, and the request
  itself, leave their queues at the leader's measured drain rate (`drain_<tier>` in the state
  hash, tasks/s): ``ceil((ahead + 1) / drain)`` seconds. A rate of 0 is a measurement (nothing
  leaves those queues: no room soon) and gets the cap, the limit of the rule as the rate
  falls, so the hint never drops back to the floor as a decaying rate reaches 0. A rate that is
  unknown (no leader has measured it) gets the floor.
- **RED** (`red_hint_ms`): Normal and Batch wait for the pool to leave RED, however the queues
  move (VIP releases do not make room for them). The leader publishes `red_clear_s`, its
  estimate of the seconds until the pool's KV falls below the RED exit line
  (`scheduler.zones.RedClearance`), and the hint is that estimate aged by the state's age:
  an estimate grows by the time that passes while nothing drains, so a state that is not
  refreshed (no leader) keeps growing towards the cap instead of standing still or falling.

`retry_hint_ms` chooses: the RED rule for a tier RED shuts out when the estimate is known, the
drain rule otherwise. The gateway spreads the result upward by `gateway.retry_jitter` and never
beyond the cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from admission.tiers import Tier, Zone

MAX_RETRY_MS = 60_000
"""No hint is longer: the OpenAI SDK gives up on hints above 120 s, and past a minute a fresh
look at the pool is worth more than any estimate."""


@dataclass(frozen=True, slots=True)
class QueueView:
    """What a hint is computed from, as one script call read it."""

    zone: Zone
    ahead: int
    """Tasks queued at the request's tier or above, not counting the request."""
    drain: float | None
    """Tasks/s leaving those queues (the sum of their tiers' rates); None: unknown."""
    red_clear_s: float | None
    """The leader's estimate of the seconds until the pool leaves RED; None: unknown (the zone
    is not RED, or no leader of this version published one)."""
    state_age_ms: int
    """How old the state hash was when read (Redis TIME); 0 when unknown."""


def _floor(floor_ms: int) -> int:
    return min(max(1, floor_ms), MAX_RETRY_MS)


def drain_hint_ms(ahead: int, drain: float | None, floor_ms: int) -> int:
    """``ceil((ahead + 1) / drain)`` seconds in ms, within [floor_ms, MAX_RETRY_MS]; drain 0
    (nothing leaves) is the cap, drain None (unknown) the floor."""
    floor = _floor(floor_ms)
    if drain is None:
        return floor
    needed_ms = (max(0, ahead) + 1) * 1000.0
    if drain * MAX_RETRY_MS <= needed_ms:  # also drain 0: the limit as the rate falls
        return MAX_RETRY_MS
    return min(MAX_RETRY_MS, max(floor, math.ceil(needed_ms / drain)))


def red_hint_ms(red_clear_s: float, state_age_ms: int, floor_ms: int) -> int:
    """The leader's estimate plus the state's age, in ms, within [floor_ms, MAX_RETRY_MS]."""
    ms = max(0.0, red_clear_s) * 1000.0 + max(0, state_age_ms)
    return min(MAX_RETRY_MS, max(_floor(floor_ms), math.ceil(ms)))


def retry_hint_ms(view: QueueView, tier: Tier, floor_ms: int) -> int:
    """The hint of a capacity 429 for a request of `tier` (module docstring)."""
    if view.zone is Zone.RED and tier is not Tier.VIP and view.red_clear_s is not None:
        return red_hint_ms(view.red_clear_s, view.state_age_ms, floor_ms)
    return drain_hint_ms(view.ahead, view.drain, floor_ms)


def tenant_drain_hint_ms(wait_ms: int, floor_ms: int) -> int:
    """The hint of a request over one of its tenant's caps on its queue (queued tokens, queued
    requests): the script's wait until the excess drains from the tenant's own queue at its
    own drain rate (`drain_wait_ms` in lua/_tenant.lua), within [floor_ms, MAX_RETRY_MS]; -1
    (the tenant never drained, or holds nothing queued: unknown) is the floor."""
    floor = _floor(floor_ms)
    if wait_ms < 0:
        return floor
    return min(MAX_RETRY_MS, max(floor, wait_ms))


def parse_rate(raw: object) -> float | None:
    """A rate or estimate field as published ('' or absent: unknown; never negative)."""
    if raw is None or raw is False:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
