"""Release control: how much Normal and Batch prefill each node may take now, every poll.

KV budgets (scheduler.budget) keep the cache under its line; they say nothing about compute. A
VIP chat's first token waits for the prefill released to its node before it: the engine runs
chunked prefill, its running list first, so every prompt token already there is computed
before the chat's. The control keeps that queue short enough for the VIP objective.

Per node, every poll (all in prompt tokens and seconds):

    mu  prefill throughput: the rate of the node's ``vllm:prompt_tokens_total`` over intervals
        in which it had prefill queued (a rate measured while idle is the offered load, not
        the capacity), averaged over ~2 s; ``prefill_tokens_per_s`` until one is measured
    B   backlog: prompt tokens of the tasks released to the node (every tier, from the running
        index: prompt and release time) not prefilled yet by a FCFS server of rate mu, the
        Lindley recursion over the tasks in release order
    g   gain, from the VIP first tokens the gateways report per node (finish script): AIMD,
        halved (at most once per `HOLD_S`) at a poll reporting a miss when more than
        `vip_miss_target` of the recent ones (~10 s) were later than the objective, +
        `GAIN_STEP` at each poll with reports and no miss, within [GAIN_MIN, GAIN_MAX];
        1 when no report came for `signal_stale_ms`
    X   window = clamp(g x mu x objective x MODEL_SHARE, window_min, window_max)
    room = X - B, or 0 while the engine runs more than `max_engine_running` sequences

Enforcement is in the scripts that admit and release (lua/_lib.lua prefill_of): a Normal or
Batch task goes to a node only if its prompt fits the room, which its release then takes; a
prompt larger than the whole window passes only on a node whose room is whole (B = 0), so long
documents run one at a time per node instead of never. The room is published as an absolute
limit on the node's count of such prompt tokens released so far, read before the running
index: a release between that read and the publish counts against the new room (never twice
freed), so the rule holds across gateways without the leader's help between polls.

Response to a step in offered load: the room is refilled every poll from the measured backlog,
so releases track the node's throughput within one poll; B is at most X plus the prompt of
one task larger than X (passed on a whole room) and the releases of the poll, so a VIP chat
waits at most about (X + one long prompt) / mu. The gain moves only on VIP reports: a miss
halves the window within one report interval, recovery takes (1 - g) / GAIN_STEP reported
polls. Stale or missing signals: no VIP report means gain 1 (the model alone); a stale scrape
keeps the last mu (B comes from Redis and is always current); an unknown counter keeps the
configured rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from admission.controlconfig import ControlSettings

MODEL_SHARE = 0.5
"""Share of the objective the queue ahead of a VIP chat may take; the rest is for the chat's
own prefill and the decode steps around it."""
GAIN_MIN, GAIN_MAX = 0.1, 2.0
GAIN_STEP = 0.02
"""Additive increase per poll with VIP reports and no excess misses."""
GAIN_DECREASE = 0.5
HOLD_S = 1.0
"""After a decrease, no other one for this long: the reports of chats that were already
waiting when the window shrank describe the old window."""
RATE_TAU_S = 2.0
"""Time constant of the throughput average (the prompt counter moves in whole prompts)."""
SIGNAL_TAU_S = 10.0
"""Time constant of the recent VIP miss share."""


def backlog(tasks: Iterable[tuple[int, float]], rate: float) -> float:
    """Prompt tokens not yet prefilled now of tasks given as (prompt tokens, seconds since
    release), by a FCFS server of `rate` tokens/s (Lindley: w = max(0, w - rate x gap) + p)."""
    work = 0.0
    prev: float | None = None
    for prompt, age_s in sorted(tasks, key=lambda t: -t[1]):
        at = -max(0.0, age_s)
        if prev is not None:
            work = max(0.0, work - rate * (at - prev))
        work += prompt
        prev = at
    if prev is not None:
        work = max(0.0, work + rate * prev)
    return work


@dataclass(frozen=True, slots=True)
class NodeRoom:
    window: int
    backlog: int
    room: int
    gain: float
    rate: float
    reason: str
    """Why the room is 0 beside the backlog ('' when it is not): max_engine_running."""


@dataclass(slots=True)
class _Node:
    rate: float
    gain: float = 1.0
    counter: tuple[float, float] | None = None
    """(prompt tokens total, reading time) of the last reading used."""
    seq: int = -1
    backlog: float = 0.0
    reports: tuple[int, int] | None = None
    n_recent: float = 0.0
    over_recent: float = 0.0
    reported_at: float | None = None
    hold_until: float = -math.inf
    at: float | None = None


class ReleaseControl:
    """The control law's state for one pool's nodes (see the module docstring)."""

    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self._nodes: dict[str, _Node] = {}

    def node(self, name: str) -> _Node:
        state = self._nodes.get(name)
        if state is None:
            state = self._nodes[name] = _Node(float(self.settings.prefill_tokens_per_s))
        return state

    def _observe_rate(self, s: _Node, prompt_total: float | None, read_at: float, seq: int,
                      waiting: int) -> None:
        if prompt_total is None or seq == s.seq:
            return
        s.seq = seq
        last, s.counter = s.counter, (prompt_total, read_at)
        if last is None or read_at <= last[1]:
            return
        done, dt = prompt_total - last[0], read_at - last[1]
        if done < 0:
            return  # the engine restarted: its counter starts again
        sample = done / dt
        # Busy over the interval (queued prefill at its start, or the engine queues requests):
        # the rate is the capacity. Otherwise it is the offered load, a lower bound only.
        if s.backlog > done or waiting > 0:
            alpha = 1.0 - math.exp(-dt / RATE_TAU_S)
            s.rate += alpha * (sample - s.rate)
        elif sample > s.rate:
            s.rate = sample

    def _observe_reports(self, s: _Node, reports: tuple[int, int] | None, now: float) -> None:
        if s.at is not None:
            decay = math.exp(-max(0.0, now - s.at) / SIGNAL_TAU_S)
            s.n_recent *= decay
            s.over_recent *= decay
        s.at = now
        if reports is None:
            reports = (0, 0)
        last, s.reports = s.reports, reports
        if last is None:
            return  # the first reading is history: it starts the deltas
        n, over = reports[0] - last[0], reports[1] - last[1]
        if n < 0 or over < 0:
            return  # the counters were reset (Redis flushed): start again
        if n > 0:
            s.reported_at = now
            s.n_recent += n
            s.over_recent += over
            miss = s.over_recent / s.n_recent
            if over > 0 and miss > self.settings.vip_miss_target:
                if now >= s.hold_until:
                    s.gain = max(GAIN_MIN, s.gain * GAIN_DECREASE)
                    s.hold_until = now + HOLD_S
            elif over == 0:
                s.gain = min(GAIN_MAX, s.gain + GAIN_STEP)
        elif s.reported_at is None or now - s.reported_at > self.settings.signal_stale_ms / 1000:
            s.gain = 1.0

    def update(
        self,
        name: str,
        *,
        tasks: Iterable[tuple[int, float]],
        now: float,
        prompt_total: float | None = None,
        read_at: float | None = None,
        seq: int = 0,
        running: int | None = None,
        waiting: int = 0,
        reports: tuple[int, int] | None = None,
    ) -> NodeRoom:
        """One poll for node `name`: `tasks` (prompt, seconds since release) released to it and
        running, its prompt counter as read at `read_at` (reading number `seq`), its engine's
        running and waiting counts, and the VIP reports (first tokens, over the objective)."""
        c = self.settings
        s = self.node(name)
        self._observe_rate(s, prompt_total, now if read_at is None else read_at, seq, waiting)
        self._observe_reports(s, reports, now)
        s.backlog = backlog(tasks, s.rate)
        model = s.gain * s.rate * c.vip_ttft_objective_ms / 1000 * MODEL_SHARE
        window = int(min(c.window_max_tokens, max(c.window_min_tokens, model)))
        room = max(0, window - math.ceil(s.backlog))
        reason = ""
        if c.max_engine_running and running is not None and running > c.max_engine_running:
            room, reason = 0, "max_engine_running"
        return NodeRoom(window, math.ceil(s.backlog), room, s.gain, s.rate, reason)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the state of nodes no longer in the pool."""
        names = set(keep)
        for name in [n for n in self._nodes if n not in names]:
            del self._nodes[name]
