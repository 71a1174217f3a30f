"""A pool's load zone, with hysteresis.

Entering a higher zone is immediate: usage >= yellow is YELLOW, >= red is RED. Leaving one
takes usage below its threshold minus the hysteresis, so a pool hovering at a threshold does not
flip every poll (each flip changes what gateways reject and what the scheduler releases).
A pool with no usable node is RED: nothing can run, so only VIP may even queue.

While the pool is RED, `RedClearance` estimates when it will leave: the gateways' RED hints.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from admission.config import ZoneSettings
from admission.tiers import Zone

_RANK = {Zone.GREEN: 0, Zone.YELLOW: 1, Zone.RED: 2}


class ZoneTracker:
    def __init__(self, settings: ZoneSettings, initial: Zone = Zone.GREEN) -> None:
        self.settings = settings
        self.zone = initial

    def raw(self, usage: float) -> Zone:
        """The zone `usage` falls in without hysteresis."""
        if usage >= self.settings.red:
            return Zone.RED
        if usage >= self.settings.yellow:
            return Zone.YELLOW
        return Zone.GREEN

    def update(self, usage: float | None) -> Zone:
        if usage is None:
            self.zone = Zone.RED
            return self.zone
        s = self.settings
        target = self.raw(usage)
        if _RANK[target] >= _RANK[self.zone]:
            self.zone = target
            return self.zone
        # Going down: step to the zone whose lowered threshold usage is still above.
        if self.zone is Zone.RED and usage >= s.red - s.hysteresis:
            return self.zone
        if usage >= s.yellow - s.hysteresis:
            self.zone = Zone.YELLOW
        else:
            self.zone = Zone.GREEN
        return self.zone


RED_WINDOW_S = 60.0
"""How far back the leader looks for the decline of the pool's usage while RED: as long as the
longest retry hint (admission.hints.MAX_RETRY_MS), so that a pool where nothing drained for a
whole window is told the longest hint."""


def clearance_s(excess: float, decline: float, observed_s: float) -> float:
    """Seconds until usage `excess` above the RED exit line is gone, given that usage fell by
    `decline` over the last `observed_s` seconds (both fractions of capacity, >= 0).

    ``observed_s x excess / (decline + excess)``: the time the measured decline takes to clear
    the excess (``excess / rate``) for a decline much larger than the excess, and the time
    already observed when nothing declined: after t seconds in which nothing drained, room is
    not expected sooner than in about t more. Never more than `observed_s`; continuous in all
    three; rising with the excess and the time observed, falling with the decline."""
    if observed_s <= 0:
        return 0.0
    excess, decline = max(0.0, excess), max(0.0, decline)
    if decline <= 0:
        return observed_s
    return min(observed_s, observed_s * excess / (decline + excess))


class RedClearance:
    """The leader's estimate of the seconds until the pool leaves RED (its usage falls below
    ``red - hysteresis``), published as `red_clear_s` for the gateways' RED hints.

    Usage here is the figure the zone follows (`scheduler.budget.pool_usage`), measured KV in
    RED: it falls when running sequences finish and give their KV back, and rises as VIP work
    released into the room fills the cache. Its decline is measured between the oldest reading
    of the window (at most `RED_WINDOW_S`, never before the pool turned RED) and now, and turned
    into an estimate by `clearance_s`. While nothing drains the estimate grows with the time
    spent in RED (up to the window); it falls only when usage does. A pool RED for want of any
    usable node (usage unknown) counts as draining nothing. A new leader starts afresh."""

    def __init__(self, exit_line: float, window_s: float = RED_WINDOW_S) -> None:
        self.exit_line = exit_line
        self.window_s = window_s
        self._readings: deque[tuple[float, float | None]] = deque()

    def reset(self) -> None:
        self._readings.clear()

    def update(self, zone: Zone, usage: float | None, now: float) -> float | None:
        """The estimate after this reading, in seconds; None when the pool is not RED."""
        if zone is not Zone.RED:
            self._readings.clear()
            return None
        readings = self._readings
        readings.append((now, usage))
        # Keep one reading at or before the window's start, the reference of the decline.
        while len(readings) >= 2 and readings[1][0] <= now - self.window_s:
            readings.popleft()
        start, reference = readings[0]
        observed = min(self.window_s, now - start)
        if usage is None:
            return observed
        decline = 0.0 if reference is None else reference - usage
        return clearance_s(usage - self.exit_line, decline, observed)


def published_zone(state: Mapping[str, str], default: Zone) -> Zone:
    """The zone a leader published in the pool's state hash, or `default` where it names none:
    a new leader's hysteresis starts from it, not from GREEN (a pool RED at a usage in the band
    below the line would be published YELLOW) nor from a former term's zone."""
    try:
        return Zone(state.get("zone", ""))
    except ValueError:
        return default

