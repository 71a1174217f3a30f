"""What the release control (scheduler.control) keeps per node between polls, and what it
publishes for each node at a poll (`NodeRoom`), and what a new leader reads back of the state
its predecessor published (`learned_control`). The law itself, and what each field means in
it, is in scheduler.control's docstring."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from admission.reads import finite_number


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """One node's figures at a poll (tokens, tokens/s, seconds); the pool publishes them."""

    window: int
    backlog: int
    room: int
    gain: float
    rate: float
    reason: str
    """Why the room is 0 beside the backlog ('' when it is not): max_engine_running or
    running_limit."""
    running_limit: int | None = None
    """The running limit in sequences (None: none holds)."""
    miss_share: float = 0.0
    """The share of the node's recent VIP first tokens (~signal_stale_ms) later than the
    objective."""
    step_s: float | None = None
    """The node's mean decode step time at its last reading (None: not measured)."""
    calm_step_s: float | None = None
    """...and at calm (None: not learned)."""
    lane_cap: int | None = None
    """Normal and Batch tasks the node may hold alive as a lane (None: not a lane; -1: a lane
    without a cap, its engine reports no step time)."""
    floor_step_s: float | None = None
    """The shortest step time read on the node (tau_min; None: none read)."""


@dataclass(slots=True)
class NodeState:
    """One node's state, carried from poll to poll (mu, g, B and the step times of the law)."""

    rate: float
    gain: float = 1.0
    counter: tuple[float, float] | None = None
    """(prompt tokens total, reading time) of the last reading used."""
    seq: int = -1
    observed: float = 0.0
    """Average rate of the prompt counter, whatever the load."""
    waiting: int = 0
    """The engine's waiting count at the last reading used."""
    backlog: float = 0.0
    reports: tuple[int, int] | None = None
    n_recent: float = 0.0
    over_recent: float = 0.0
    reported_at: float | None = None
    hold_until: float = -math.inf
    at: float | None = None
    window: int = 0
    at_poll: float | None = None
    seen: set[Hashable] = field(default_factory=set)
    """The running index's members at the last poll: the others were released since."""
    overdrawn: int | None = None
    """The node's count of light tenants' overdraws at the last poll (None: not read yet)."""
    owed: int = 0
    """Overdraws not yet taken out of a room."""
    queued: float = 0.0
    """Backlog / window, averaged over polls (time constant `queue_tau_s`)."""
    itl: tuple[float, float] | None = None
    """(sum, count) of the engine's inter-token latency histogram at the last reading."""
    itl_seq: int = -1
    step_s: float | None = None
    """Mean step time over the last reading that counted decoded tokens (tau)."""
    calm_step_s: float | None = None
    """The step time at calm, averaged (tau0; None: not seen calm yet)."""
    calm_polls: int = 0
    calm_at: float | None = None
    min_step_s: float | None = None
    """The shortest step time read (tau_min of a lane)."""
    lane_cap: int = 1
    """The cap last computed for the node as a lane (an idle lane keeps it, at least 1)."""


def engine_restarted(s: NodeState, rate: float) -> None:
    """The node's engine started again (its prompt counter went back): what was learned of the
    engine before it (the rate and gain, the step times at calm and at best, a lane's cap) was
    the old process's, perhaps a stuck one now replaced by a healthy one, and is learned afresh
    from `rate`, the configured one. Kept: the readings just taken, and what the scripts count
    (VIP reports, overdraws, the tasks seen)."""
    s.rate, s.gain, s.observed = rate, 1.0, 0.0
    s.step_s = s.calm_step_s = s.min_step_s = None
    s.calm_polls, s.calm_at = 0, None
    s.lane_cap = 1


def take_overdraw(s: NodeState, overdrawn: int | None, room: int) -> int:
    """How much of `room` pays back light tenants' overdraws (lua/_room.lua prefill_fits): the
    room bounds the queue ahead of a VIP chat, and on a node that prefills faster than the
    leader polls, an overdraw prefilled before the next poll would otherwise come on top of
    the next room, a rate the window never allowed. What one room cannot pay is owed to the
    next. A new leader owes nothing for overdraws it did not see."""
    if overdrawn is not None:
        if s.overdrawn is not None and overdrawn > s.overdrawn:
            s.owed += overdrawn - s.overdrawn
        s.overdrawn = overdrawn
    take = min(s.owed, max(0, room))
    s.owed -= take
    return take


def learned_control(state: Mapping[str, str]
                    ) -> dict[str, tuple[float, float, float, float]]:
    """node -> (prefill rate, gain, calm step, shortest step; steps in seconds) as a leader
    published them in the state hash (`prefill_rate:<node>`, `prefill_gain:<node>`,
    `calm_step_ms:<node>`, `floor_step_ms:<node>` of a lane; a missing or unreadable gain
    reads 1, a missing step 0: not learned)."""
    out: dict[str, tuple[float, float, float, float]] = {}
    for field_name, raw in state.items():
        kind, _, node = field_name.partition(":")
        if kind != "prefill_rate" or not node:
            continue
        out[node] = (finite_number(raw), finite_number(state.get(f"prefill_gain:{node}"), 1.0),
                     finite_number(state.get(f"calm_step_ms:{node}")) / 1000,
                     finite_number(state.get(f"floor_step_ms:{node}")) / 1000)
    return out
