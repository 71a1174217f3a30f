"""A pool's load zone, with hysteresis.

Entering a higher zone is immediate: usage >= yellow is YELLOW, >= red is RED. Leaving one
takes usage below its threshold minus the hysteresis, so a pool hovering at a threshold does not
flip every poll (each flip changes what gateways reject and what the scheduler releases).
A pool with no usable node is RED: nothing can run, so only VIP may even queue.
"""

from __future__ import annotations

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
