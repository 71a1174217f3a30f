"""What one pool tick reads from Redis (`Snapshot`) and what it decides (`TickResult`):
scheduler.pool reads the one and returns the other; the service, its metrics and the tests
read the result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from admission.outcomes import ReleasedTask
from admission.reads import Held
from admission.tiers import Tier, Zone
from scheduler.budget import NodePlan, RunningTask
from scheduler.nodestate import NodeRoom


@dataclass(frozen=True, slots=True)
class Snapshot:
    reserved: Mapping[str, int]
    stats: Mapping[str, int]
    depths: tuple[int, int, int]
    running: Mapping[str, list[RunningTask]] = field(default_factory=dict)
    """Released tasks per node, from the pool's running index."""
    prefill_released: Mapping[str, int] = field(default_factory=dict)
    """Prompt tokens of Normal and Batch work released per node so far, read before the
    running index (scheduler.control: the published room is a limit on this count)."""
    prefill_overdrawn: Mapping[str, int] = field(default_factory=dict)
    """Prompt tokens light tenants released per node beyond the room so far (the rooms that
    follow pay them back: scheduler.nodestate.take_overdraw)."""
    vip_reports: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """VIP first tokens per node and those later than the objective (monotonic counts)."""
    vip_histogram: Mapping[int, int] = field(default_factory=dict)
    """The pool's VIP first tokens per 10% bucket of ms (monotonic counts; scheduler.calm)."""
    prefill_tasks: Mapping[str, list[tuple[Any, int, float]]] = field(default_factory=dict)
    """Released tasks per node as the release control reads them: (running index member,
    prompt tokens, seconds since release)."""
    guests: Mapping[str, int] = field(default_factory=dict)
    """Tasks alive per node as guests of a dedicated node or a lane (node_guests)."""
    why_held: Mapping[str, Held] = field(default_factory=dict)
    """Why each tier's queue waited at the last tick's release (tier label -> Held)."""

    @property
    def held(self) -> bool:
        """Normal or Batch work waits in the pool."""
        return bool(self.depths[Tier.NORMAL] or self.depths[Tier.BATCH])


@dataclass(slots=True)
class TickResult:
    zone: Zone
    usage: float | None
    plans: list[NodePlan]
    limits: tuple[int, int, int]
    depths: tuple[int, int, int]
    released: list[ReleasedTask] = field(default_factory=list)
    published: bool = False
    guests_closed: tuple[str, ...] = ()
    """Dedicated nodes running more sequences than `guest_max_running`: no new guests."""
    red_clear_s: float | None = None
    """While RED: the estimated seconds until the pool leaves it (scheduler.zones)."""
    rooms: dict[str, NodeRoom] = field(default_factory=dict)
    """The release control's figures per usable node (empty when it is off)."""
    prefill: dict[str, tuple[int, int, float, int, int, int]] | None = None
    """What is published for the scripts: node -> (limit, window, refill rate, running
    sequences, lane cap: -2 for a node that is not a lane, VIP placements counted before the
    scrape); None when control is off."""
    shared: int = 0
    """How many of `released`, at its start, Batch's minimum share let past waiting higher
    tiers (scheduler.policy.BatchShare)."""
    held: Mapping[str, Held] = field(default_factory=dict)
    """Why each tier's queue waited at the last release (empty when nothing waits)."""
    objective_ms: int = 0
    """The VIP objective the release control used (scheduler.calm; 0 when it is off)."""
    calm_p99_ms: float | None = None
    """The learned calm VIP P99 it used (None: not learned, or the control is off)."""

    def count(self, tier: Tier) -> int:
        return sum(1 for t in self.released if t.node is not None and t.tier is tier)
