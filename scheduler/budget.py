"""The predictive KV budget: how many reservation tokens each node may hold, every poll.

Gateways and the release script admit a task of cost W (prompt + max output tokens) of tier t
to a node only while ``node_capacity[t] - node_reserved >= W``. The scheduler steers the fleet
through the numbers it writes, ``node_capacity`` for VIP and ``node_capacity:normal`` and
``node_capacity:batch`` (the *budgets* B_t here), recomputed per node at every poll from the
node's metrics and the pool's reservations in Redis.

Model, per node (all in tokens of KV):

    C   capacity (cache_config_info num_gpu_blocks x block_size, or configuration)
    T_t = ceiling_t x C          the line projected usage must stay under for tier t's work:
                                 ``zones.vip_ceiling``, ``zones.kv_target`` (Normal) and
                                 ``zones.batch_ceiling``, each at most the one above
    U   = measured usage x C                  from the last scrape
    R   = node_reserved                       reservations of released, unsettled tasks, now
    f   = learned usage / reservation ratio   (see `UsageLearner`), with margin, per node

    ours_now  = min(U, R)             the measured usage our reservations can explain
    foreign   = U - ours_now          usage nothing of ours explains (other clients, leaks)
    pad       = n x block_size    paged-KV rounding: one partial block for each sequence
                                  the engine reports (running + waiting); with the running
                                  index, for as many as can be ours (the others' are in U)
    P   = what our tasks will hold at most   R, or their peak over time (below)
    projected = foreign + pad + max(f x P, ours_now)
    B_t       = R + (T_t - projected) / f                (never below 0)

Tier ceilings: all tiers share one projection and one reservation count, so Batch work placed
up to its line leaves the room between its line and Normal's to Normal and VIP, and the room
between Normal's line and VIP's to VIP alone, in every zone: a VIP chat finds a node while any
node's projection is below the VIP ceiling, whatever the other tiers hold.

Read as "measured usage + what was released but is not visible yet + the growth of running
sequences as they decode": ``f x R = ours_now + (f x R - ours_now)``, the bracket being the
last two together. They are not split because the split cannot be known from outside the
engine: a task released 2 ms before the scrape may already be prefilled, one released 2 s
ago may still sit in vLLM's own waiting queue. Counting each reservation at its expected final
size is exact about the total and never counts a task twice (a split by release time did, and
turned a burst that the engine had already picked up into a false RED). Measured usage enters
as a floor: when our tasks already hold more than f x R (the workload outgrew what was learned)
``ours_now`` takes over and further releases stop at once, not after the next settles.
Foreign usage is what exceeds everything reserved on the node; other clients' usage that fits
inside our reservations looks like ours running ahead, which the floor bounds without its
future growth (a known limit: the gateway is meant to be the only way in).

Peak over time (``zones.projection = "peak"``, the default; "final" uses R). R counts every task at
its final size, as if none ended before all others had grown to full length. In a node that
runs long generations next to short ones the sum of final sizes is far above any usage the
node will ever show (a steady stream of 4,000-token generations is, on average, half done),
and a pool steered by it holds Batch back at half its KV. The scheduler therefore reads each
released task's prompt, max_tokens and release time (the pool's running index) and projects
decoding in lockstep, as a continuous-batching engine runs it: each task gains one token per
step until it reaches max_tokens, then leaves. Progress so far is calibrated on the
measurement: one decode rate for the node such that prompts + tokens generated match
``ours_now``, each task's share by its age (less an allowance for its prefill: a document that
waits for the compute to prefill 8k tokens has generated nothing yet). P is the highest usage
this projection reaches at any step, now included (never below ``ours_now``); it is never above
R (the tasks' final sizes), and a new task of cost W raises it by at most W, which keeps the
budget's guarantee. Tasks that may not be in the measurement yet (on their way to the engine,
queued in it, partly prefilled) stay out of the calibration and count from their full prompt
(`peak_usage`). Measurement lag makes
the calibrated rate low, so tasks look younger and end later than they will: the projection
errs towards overlap, the safe side.

Releases add to R, never to U, so a burst released between two polls, by the scheduler or by
the gateways' fast path, can use at most ``B_t - R`` and lands exactly on T_t: the metrics' lag
cannot make the pool overshoot.

Overcommit: requests rarely reach max_tokens, so ``f < 1`` lets the pool reserve more than
its KV. f comes from the pool's settle counters (settled_usage / settled_cost, of tasks that
ran to their end: cancelled ones are not counted), decayed with
a half-life so that the workload's current mix dominates, starts at 1 (no overcommit until
settles are seen) or, for a new leader, at the ratio the last one published (the counters'
whole history is not learned at once), gets a safety margin, and is floored at
``1 / max_overcommit``. A node that reports a preemption gets f = 1 for a cool-down: the
engine told us the guess was wrong.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from admission.reads import NODE_STUCK
from scheduler.scrape import NodeView

PRIOR_TOKENS = 50_000.0
"""Weight of the initial f = 1 belief, in settled cost tokens: some tens of requests' worth."""


class UsageLearner:
    """Decayed ratio of the tokens settled tasks really used to what they had reserved."""

    def __init__(self, halflife_s: float, margin: float, max_overcommit: float) -> None:
        self.halflife_s = halflife_s
        self.margin = margin
        self.floor = 1.0 / max_overcommit
        self.cost = PRIOR_TOKENS
        self.usage = PRIOR_TOKENS
        self._last: tuple[int, int] | None = None
        self._at: float | None = None

    def observe(self, settled_cost: int, settled_usage: int, now: float) -> None:
        """Feed the pool's monotonic counters: what they gained since the last call is learned.

        The first call (of a term: `resume`) only takes them as the baseline. They hold the
        pool's whole history, which at full weight against a window of a few half-lives would
        decide the ratio for many of them: a leader taking over after the mix changed would
        overcommit by the old mix for minutes. So does a call that finds them lower (Redis
        flushed, or a failover to a replica that missed the last increments): what they lost
        is unknown, and a flushed pool's new counts are at most one poll's settles."""
        if self._at is not None:
            decay = math.pow(0.5, max(0.0, now - self._at) / self.halflife_s)
            self.cost *= decay
            self.usage *= decay
        self._at = now
        last, self._last = self._last, (settled_cost, settled_usage)
        if last is None:
            return
        d_cost, d_usage = settled_cost - last[0], settled_usage - last[1]
        if d_cost < 0 or d_usage < 0:
            return
        self.cost += d_cost
        self.usage += d_usage

    def resume(self, published_ratio: float | None) -> None:
        """A term starts: the next `observe` takes the counters as a new baseline (the settles
        of a time this replica did not lead were the last leader's to learn from), and the
        belief starts from the ratio the last leader published (`usage_ratio` in the state
        hash), weighted as the prior, so that fresh settles move it within a half-life or two.
        None (nothing published, or not a ratio): this replica's own ratio, at the same weight
        (the prior, f = 1, for a new one)."""
        self._last = None
        # Nor does the time it stood by age the belief it starts from: decayed over an hour's
        # half-lives, its weight would be nothing, and the next poll's few settles alone
        # would set the ratio.
        self._at = None
        ratio = (published_ratio if published_ratio is not None and 0.0 <= published_ratio <= 1.0
                 else self.ratio)
        # Weighted as the prior either way: its own belief, kept whole through a standby it
        # never decayed over, would outweigh the fresh settles for as long as it took to learn.
        self.cost = PRIOR_TOKENS
        self.usage = PRIOR_TOKENS * ratio

    @property
    def ratio(self) -> float:
        """Raw learned ratio, 0..1."""
        return min(1.0, max(0.0, self.usage / self.cost)) if self.cost > 0 else 1.0

    @property
    def factor(self) -> float:
        """f used for budgets: the ratio plus margin, within [1 / max_overcommit, 1]."""
        return min(1.0, max(self.floor, self.ratio * (1.0 + self.margin)))


def published_ratio(state: Mapping[str, str]) -> float | None:
    """The usage ratio a leader published in the pool's state hash (`usage_ratio`), or None:
    none published, or not a number."""
    try:
        ratio = float(state.get("usage_ratio", "nan"))
    except ValueError:
        return None
    return ratio if math.isfinite(ratio) else None


class RunningTask(NamedTuple):
    """A released task as the running index records it (a tuple: the leader builds one per
    task in flight on every tick)."""

    prompt_tokens: int
    max_tokens: int
    age_us: int
    """Time it may have spent decoding: since its release (Redis TIME), less allowances for its
    way to the engine and its prefill (`[pools.engine]`: admission.configschema.EngineSettings)."""
    arrived_us: int
    """Time since it may have reached the engine: since its release, less the allowance for its
    way there; negative while it may still be on its way."""


class EngineReading(NamedTuple):
    """What the last scrape said about the engine's requests, and how old it is."""

    waiting: int = 0
    running: int | None = None
    """None when unknown: then only the waiting count and the reading's age say what is
    missing from the measurement."""
    age_us: int = 0


FRESH_READING = EngineReading()
"""Taken just now, nothing queued, running count unknown."""


def unmeasured_count(youngest_first: Sequence[RunningTask], reading: EngineReading) -> int:
    """How many of the youngest tasks (given in order of arrival, latest first) the reading
    cannot hold in full.

    Those that arrived after it was taken; of the others, those it did not count as running
    (the engine queues them, or they are still on their way: our tasks number more than its
    running ones), and one more if a prompt was being prefilled in chunks (the engine queued
    something, or the youngest of the rest was within its prefill allowance when read)."""
    after = sum(1 for t in youngest_first if t.arrived_us <= reading.age_us)
    before = len(youngest_first) - after
    not_running = reading.waiting
    if reading.running is not None:
        not_running = max(not_running, before - reading.running)
    not_running = min(before, not_running)
    if not_running < before:
        youngest_running = youngest_first[after + not_running]
        if reading.waiting > 0 or youngest_running.age_us <= reading.age_us:
            not_running += 1
    return after + not_running


def _decode_rate(tasks: Sequence[RunningTask], generated: float) -> float:
    """The tokens per µs r at which sum(min(max_tokens, age x r)) equals `generated`.

    The sum is piecewise linear in r; walking the tasks in the order they saturate (reach
    max_tokens) finds the piece that holds the solution. Callers keep `generated` within
    [0, sum of max_tokens]."""
    growing = sorted((t for t in tasks if t.age_us > 0 and t.max_tokens > 0),
                     key=lambda t: t.max_tokens / t.age_us)
    saturated_tokens = 0.0
    unsaturated_age = float(sum(t.age_us for t in growing))
    for t in growing:
        rate = (generated - saturated_tokens) / unsaturated_age
        if rate <= t.max_tokens / t.age_us:
            return rate
        saturated_tokens += t.max_tokens
        unsaturated_age -= t.age_us
    return math.inf


def peak_usage(tasks: Sequence[RunningTask], ours_now: float,
               reading: EngineReading = FRESH_READING) -> float:
    """Highest KV (tokens) these tasks hold now or at any future decode step (module docstring).

    Tasks that may not be in the measurement yet (`unmeasured_count`) count at full prompt from
    now on and stay out of the calibration. In the calibration their prompts would swallow the
    tokens the decoding tasks generated: those would look fresh, and a node running long
    generations would be projected short by everything they generated. Which tasks those are
    comes from the reading, not from the prefill allowance: a document the engine prefilled
    faster than its allowance is in the measurement, and the allowance alone counted it twice
    for up to ~0.85 s (an 8k-token prompt); the allowance only shapes the decode calibration."""
    if not tasks:
        return 0.0
    youngest_first = sorted(tasks, key=lambda t: t.arrived_us)
    unseen = unmeasured_count(youngest_first, reading)
    queued, started = youngest_first[:unseen], youngest_first[unseen:]
    prompts = sum(t.prompt_tokens for t in started)
    # Tasks within their prefill allowance have generated nothing yet.
    could_have = float(sum(t.max_tokens for t in started if t.age_us > 0))
    generated = min(max(0.0, ours_now - prompts), could_have)
    rate = _decode_rate(started, generated) if generated > 0 else 0.0
    # (tokens still to generate, size now) per task; plain loops: thousands per tick.
    states: list[tuple[float, float]] = []
    for prompt, max_tokens, age_us, _ in started:
        made = age_us * rate
        if made > max_tokens:
            made = max_tokens
        states.append((max_tokens - made, prompt + made))
    states.extend((float(t.max_tokens), float(t.prompt_tokens)) for t in queued)
    states.sort()
    # Just before the j-th task (by remaining tokens) ends, every task not yet ended holds its
    # current size plus that many steps: the peak is at one of these moments or now.
    size_from = list(accumulate((size for _, size in reversed(states)), initial=0.0))[::-1]
    peak = size_from[0]
    alive = len(states)
    for j, (remaining, _) in enumerate(states):
        at_end = size_from[j] + remaining * (alive - j)
        if at_end > peak:
            peak = at_end
    # What the cache holds now plus the prompts still to come is a floor, whatever the
    # calibration made of the rest: also with nothing to come, when the tasks hold more than
    # their ages explain (a prefill faster than its allowance). A floor applied only when
    # something is queued let a fresh task of cost 0 lift the peak from below `ours_now` to it.
    peak = max(peak, ours_now + sum(t.prompt_tokens for t in queued))
    # No task holds more than its final size, whatever was counted twice.
    return min(peak, float(sum(t.prompt_tokens + t.max_tokens for t in tasks)))


@dataclass(frozen=True, slots=True)
class NodePlan:
    name: str
    capacity: int
    measured: float
    """Measured usage, fraction of capacity (NaN when unknown)."""
    projected: float
    """Projected usage, fraction of capacity."""
    reserved: int
    budget: int | None
    """node_capacity to publish; None = leave the node out (ejected or capacity unknown)."""
    factor: float
    stale: bool
    ejected: bool
    reason: str
    """Why the node gets no new work ('' when it may): ejected, stuck, no_capacity, stale."""
    tier_budgets: tuple[int, int, int] | None = None
    """What VIP, Normal and Batch may each reserve, every tier up to its own ceiling (the first
    is `budget`); None: `budget` for every tier."""

    @property
    def usable(self) -> bool:
        """Counted in the pool's zone: it answered recently and has a known capacity."""
        return self.budget is not None


def plan_node(
    view: NodeView,
    *,
    reserved: int,
    factor: float,
    kv_target: float,
    stale_policy: str,
    running: Sequence[RunningTask] | None = None,
    max_waiting: int = 0,
    vip_ceiling: float | None = None,
    batch_ceiling: float | None = None,
    dispatch_us: int,
) -> NodePlan:
    """The budgets and projected usage of one node (see the module docstring); `running` None
    counts every reservation at its final size; `max_waiting` > 0: no new releases while the
    engine queues more requests than that. `kv_target` is Normal's ceiling; VIP's and Batch's
    default to it. `dispatch_us` is the pool's allowance for a released task's way to its
    engine (`[pools.engine] dispatch_ms`). The plan's `budget` is VIP's."""
    capacity = view.capacity or 0
    if view.ejected or view.metrics is None or capacity <= 0:
        reason = (NODE_STUCK if view.stuck else "ejected") if view.ejected else (
            "no_capacity" if capacity <= 0 else "stale")
        # A node never heard from, or of unknown size, gets no work and no say in the zone.
        return NodePlan(view.name, capacity, math.nan, math.nan, reserved, None, factor,
                        view.stale, view.ejected, reason)
    m = view.metrics
    target = kv_target * capacity
    measured = m.kv_usage * capacity
    ours_now = min(measured, float(reserved))
    foreign = measured - ours_now
    held = float(reserved)
    # Our tasks are projected in tokens: each may hold one more, partial, block than it counts.
    pad_sequences = m.running + m.waiting
    if running is not None:
        # Reservations missing from the index (released by an older version) count in full.
        unindexed = max(0.0, reserved - sum(t.prompt_tokens + t.max_tokens for t in running))
        reading = EngineReading(m.waiting, m.running, int(view.age_s * 1_000_000))
        held = min(held, peak_usage(running, ours_now - unindexed, reading) + unindexed)
        # Only as many of the engine's sequences as can be ours are padded: the tasks released
        # before the reading was taken (each unindexed one reserves a token or more). The
        # others' blocks, partial ones included, are in `foreign` already, and padding them as
        # well would read a node at 0.84 running 363 chats of 1,000 tokens as 0.853 (RED: VIP
        # queued, Normal turned away). A node running only our tasks is padded for every
        # sequence of ours it reports (finished ones' blocks are measured, in `foreign`); a
        # task released after the reading is padded once a reading counts it, so a release
        # raises this projection by its cost and no more.
        ours = sum(1 for t in running if t.arrived_us + dispatch_us > reading.age_us)
        pad_sequences = min(pad_sequences, ours + math.ceil(unindexed))
    pad = float(pad_sequences * m.block_size)
    projected = foreign + pad + max(factor * held, ours_now)
    ceilings = (kv_target if vip_ceiling is None else vip_ceiling, kv_target,
                kv_target if batch_ceiling is None else batch_ceiling)
    # One projection, three ceilings: a tier's room is what is left under its own line, so
    # whatever Batch and Normal take, VIP keeps the room between the lines above theirs.
    tiers = [max(0, math.floor(reserved + (c * capacity - projected) / factor))
             for c in ceilings]
    reason = ""
    if max_waiting and m.waiting > max_waiting:
        # Out of compute: a Normal or Batch release would only join the engine's queue, and the
        # prompts queued there get their KV when the engine reaches them, unseen by any
        # projection. VIP is not held: its room lies above the other tiers' lines, and a VIP
        # chat held here waits for the whole queue to drain, where released it waits at most
        # as long (and skips the queue on an engine that schedules by priority).
        tiers = [tiers[0], *(min(b, reserved) for b in tiers[1:])]
        reason = "engine_queue"
    if view.stale and stale_policy == "full":
        # Declared policy 'full': no new work to a node we cannot see, and it counts as sitting
        # at the ceiling (YELLOW at most, never RED by staleness alone: a metrics blip on a
        # one-node pool must not turn into 429s for everyone).
        tiers = [0, 0, 0]
        projected = max(projected, target)
        reason = "stale"
    return NodePlan(view.name, capacity, m.kv_usage, projected / capacity, reserved, tiers[0],
                    factor, view.stale, False, reason, (tiers[0], tiers[1], tiers[2]))


def pool_usage(plans: Sequence[NodePlan], aggregate: str,
               dedicated: Collection[str] = (), projection_cap: float = 1.0) -> float | None:
    """The figure the pool's zone follows; None when no node is usable.

    Per node: its measured usage, raised by its projection up to `projection_cap` (the pool's
    `kv_target`, Normal's line). The projection counts what was released but is not measured
    yet, so a burst of Normal or Batch work makes the pool YELLOW before the cache shows it and
    Batch is held from the YELLOW line at once. Above Normal's line only VIP work is placed,
    and there the projection counts nothing: RED, which turns Normal and Batch away, follows
    measured KV alone. Were the projection counted in full, a VIP backlog placed up to VIP's
    ceiling (the RED line by default) would project the pool into RED by itself, and Normal
    and Batch would get 429s from a cache that reads a quarter full.

    The zone decides what Normal and Batch may do, and their work runs on the shared nodes:
    nodes dedicated to some tiers (`dedicated`) count only when no shared node is usable. A
    dedicated node filled by VIP chats or by its capped guests must not hold Batch back from
    idle shared nodes (each node's own budget already keeps it under the target)."""
    usable = [p for p in plans if p.usable]
    shared = [p for p in usable if p.name not in dedicated]
    usable = shared or usable
    if not usable:
        return None
    figures = [max(p.measured, min(p.projected, projection_cap)) for p in usable]
    if aggregate == "total":
        return (sum(f * p.capacity for f, p in zip(figures, usable, strict=True))
                / sum(p.capacity for p in usable))
    return max(figures)


def budgets(plans: Sequence[NodePlan]) -> Mapping[str, tuple[int, int, int]]:
    """What each usable node lets each tier (VIP, Normal, Batch) reserve."""
    return {p.name: p.tier_budgets or (p.budget,) * 3 for p in plans if p.budget is not None}
