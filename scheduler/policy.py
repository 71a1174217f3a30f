"""What each zone lets out of the queues, and how fast the queues drain.

GREEN releases every tier (strict order, the release script's job). YELLOW releases VIP,
Normal at `yellow_normal_rate` per second and holds Batch off the shared nodes: the zone
follows their usage, so where a pool keeps dedicated nodes that take guests, Batch still goes
to those as guests, by their own rules (pace, cap, prompt and output bounds). Otherwise the
dedicated node's guest room goes to whatever the zone does not hold, Normal chats with long answers,
and its batch grows through a flood. RED releases VIP only. With
`batch_trickle_rate` > 0, GREEN also lets that many Batch tasks per second past VIP and Normal
tasks that are waiting for room: strict priority otherwise starves Batch under a steady
interactive load. With `batch_min_share` > 0, GREEN also lets Batch past them for at least
that share of the tokens released (`BatchShare`). The rates are token buckets kept here, on the
leader, so they hold whatever the poll interval is; a new leader starts them empty, and the
share's account too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from admission.config import ZoneSettings
from admission.tiers import Tier, Zone

LIGHT_CREDIT_S = 1.0
"""Light tenants may take this many seconds of YELLOW's Normal rate ahead of its refill (at
least the bucket's burst): a tenant within its share sends in Poisson bursts, and a credit of
a fraction of a second would run dry in them."""
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
        """Whole tasks available now (0 while in debt, `owe`)."""
        self.level = min(self.burst, self.level + self.rate * max(0.0, now - self.at))
        self.at = now
        return max(0, math.floor(self.level))

    def take(self, n: int) -> None:
        self.level = max(0.0, self.level - n)

    def owe(self, n: int) -> None:
        """Tasks taken ahead of the refill: the level goes below 0, and the refill pays the
        debt before anything more is available."""
        self.level -= n

    def reset(self, now: float) -> None:
        """Empty, but for a debt (`owe`): what was taken ahead of the rate in one spell is
        paid in the next one, not forgiven by a spell in another zone."""
        self.level, self.at = min(0.0, self.level), now


class BatchShare:
    """Batch's minimum share of the tokens the leader releases from the queues, as a credit.

    The credit is in tokens: `share` of every token released minus every Batch token released,
    so it is positive while Batch is behind its share. Each VIP or Normal token earns Batch
    `share` of a token and each Batch token spends `1 - share`; while the credit is positive,
    `owed` Batch tasks go past the waiting higher tiers. The leader releases them at the start
    of the next tick, before the higher tiers take the room freed meanwhile (released after
    them, Batch would find their backlog in that room, and a Batch ceiling below theirs): over
    a run, Batch gets at least `share` of the tokens released, but for what the last tick
    earned it.

    Only what the leader releases from the queues counts, not the gateways' fast path: a
    task takes it only when nothing waits ahead of it in its tier's order, so no Batch task
    does while Batch waits, and the VIP (or, in fair order, Normal) work that does never waited
    in the queues Batch is kept from starving behind. Counting it would also take a token
    counter on every admission's hot path (admit.lua), where the leader's count costs nothing:
    the release reply carries each task's cost.

    The account is kept only while Batch waits (`observe` with `contested`): Batch is owed no
    share of what was released while it had nothing waiting, so an idle spell banks nothing.
    While it waits, the credit is bounded both ways by `cap`, the larger of the tokens released
    on the tick and `CREDIT_TASKS` average released tasks. That carries what one tick earns
    into the next (a share is at most one half, so a tick earns at most half of its own
    releases), or across ticks that release nothing while tasks run; but Batch waiting for
    room it could not use (its ceiling is below Normal's) saves up no more than that, so it
    never bursts past waiting work on a backlog of credit. The debt is bounded the same way:
    Batch released freely while nothing above it waited does not hold it back for long later.
    """

    CREDIT_TASKS = 4
    """The credit's bound, in average released tasks (when more than the tick released)."""
    MEAN_WEIGHT = 0.1
    """Weight of each released task in the running average costs."""

    def __init__(self, share: float, batch_size: int) -> None:
        self.share = share
        self.batch_size = batch_size
        self.credit = 0.0
        """Tokens Batch is behind its share (negative: ahead of it)."""
        self.mean_cost = 0.0
        """Running average cost of the tasks released, any tier (0: none yet)."""
        self.mean_batch = 0.0
        """Running average cost of the Batch tasks released (0: none yet)."""

    def owed(self) -> int:
        """Batch tasks to release past waiting higher tiers now: enough, at the average Batch
        cost, to pay the credit (at least one while it is positive, at most one release
        batch). A task's cost is known only once it is released; the one that overpays puts
        the credit in debt, which the next ticks earn back."""
        if self.share <= 0 or self.credit <= 0:
            return 0
        size = self.mean_batch or self.mean_cost
        if size <= 0:
            return 1
        # (A float credit a hair over a whole number of tasks does not buy one more.)
        tasks = math.ceil(self.credit / ((1 - self.share) * size) - 1e-9)
        return min(self.batch_size, max(1, tasks))

    def cap(self, tick_tokens: int) -> float:
        """The credit's bound either way after a tick that released `tick_tokens`."""
        return max(float(tick_tokens), self.CREDIT_TASKS * self.mean_cost)

    def observe(self, released: Iterable[tuple[Tier, int]], contested: bool) -> None:
        """A tick's releases, as (tier, cost) of each task released (not expired) by every
        release call of the tick. `contested`: Batch work waited when the tick began; if not,
        the account is closed (credit 0)."""
        total = batch = 0
        for tier, cost in released:
            total += cost
            self.mean_cost = _average(self.mean_cost, cost, self.MEAN_WEIGHT)
            if tier is Tier.BATCH:
                batch += cost
                self.mean_batch = _average(self.mean_batch, cost, self.MEAN_WEIGHT)
        if not contested or self.share <= 0:
            self.credit = 0.0
            return
        cap = self.cap(total)
        self.credit = min(cap, max(-cap, self.credit + self.share * total - batch))

    def reset(self) -> None:
        self.credit = 0.0


def _average(mean: float, value: float, weight: float) -> float:
    """An exponentially weighted average that starts at its first value (mean 0: none yet)."""
    return float(value) if mean <= 0 else mean + weight * (value - mean)


class ReleasePolicy:
    """Per-tier release limits for one release call."""

    def __init__(self, zones: ZoneSettings, batch_size: int, now: float,
                 dedicated_guests: bool = False, light: bool = False) -> None:
        self.batch_size = batch_size
        self.dedicated_guests = dedicated_guests
        """The pool keeps dedicated nodes that take guests."""
        self.credit_for_light = light
        """Releases hold room back for light tenants (fair order with a headroom): they may
        take YELLOW's Normal rate ahead of its refill on the fast path (`light_credit`)."""
        self.credit_out = 0
        """The credit the last release call left for them (lua/release.lua ARGV[11])."""
        self.normal = TokenBucket(zones.yellow_normal_rate, now)
        self.trickle = TokenBucket(zones.batch_trickle_rate, now)
        self.share = BatchShare(zones.batch_min_share, batch_size)
        self._zone: Zone | None = None

    def limits(self, zone: Zone, now: float) -> tuple[int, int, int]:
        if zone is not self._zone:
            # Rates apply within a zone: a bucket that filled in another zone would let a burst
            # out the moment the pool turns YELLOW.
            self.normal.reset(now)
            self.trickle.reset(now)
            self.share.reset()
            self._zone = zone
        n = self.batch_size
        if zone is Zone.GREEN:
            return (n, n, n)
        if zone is Zone.YELLOW:
            return (n, min(n, self.normal.refill(now)), n if self.dedicated_guests else 0)
        return (n, 0, 0)

    def light_credit(self, zone: Zone, normal_limit: int) -> int:
        """Normal tasks light tenants' fast path may release in YELLOW until the next release
        call (lua/release.lua ARGV[11]; the leader passes it with a call whose Normal limit is
        `normal_limit`), taken ahead of the rate's refill: what they take is owed by the rate's
        bucket (`released`), so the flood waits while the refill pays it. Up to
        `LIGHT_CREDIT_S` of the rate, less what is still owed (and the script takes off what
        they took of the last credit), so that the YELLOW spells of a run release at most that
        much beyond the rate times their length (the debt outlives a spell: `reset`). Kept in
        GREEN too (its fast path takes none), so that it is there when the pool turns YELLOW;
        0 in RED (no Normal) and in a pool that holds no room back for light tenants."""
        if zone is Zone.RED or not self.credit_for_light:
            return 0
        whole = math.floor(max(self.normal.burst, self.normal.rate * LIGHT_CREDIT_S))
        owed = math.floor(self.normal.level) - (normal_limit if zone is Zone.YELLOW else 0)
        return max(0, whole + min(0, owed))

    def guests_only(self, zone: Zone) -> tuple[Tier, ...]:
        """Tiers that this zone releases only as guests of dedicated nodes."""
        return (Tier.BATCH,) if zone is Zone.YELLOW and self.dedicated_guests else ()

    def trickle_limit(self, zone: Zone, now: float) -> int:
        """Batch tasks that may pass waiting higher tiers now (GREEN only)."""
        if zone is not Zone.GREEN or self.trickle.rate <= 0:
            return 0
        return min(self.batch_size, self.trickle.refill(now))

    def share_limit(self, zone: Zone, depths: Sequence[int]) -> int:
        """Batch tasks to release past waiting higher tiers before the tick's release in tier
        order (GREEN only, while VIP or Normal work and Batch work wait: `depths`)."""
        if zone is not Zone.GREEN or not depths[Tier.BATCH]:
            return 0
        if not depths[Tier.VIP] + depths[Tier.NORMAL]:
            return 0
        return self.share.owed()

    def share_observe(self, zone: Zone, released: Iterable[tuple[Tier, int]],
                      batch_waited: bool) -> None:
        """Every task a tick released, as (tier, cost), and whether Batch work waited when it
        began. Outside GREEN, Batch is owed nothing."""
        self.share.observe(released, batch_waited and zone is Zone.GREEN)

    def released(self, zone: Zone, per_tier: Sequence[int], *, trickle: bool = False,
                 credit: tuple[int, int] = (0, 0)) -> None:
        """Tasks a release call took per tier; `credit`: the Normal credit it found left and
        the credit it set (`light_credit`): what light tenants took of the last one is owed by
        the YELLOW rate."""
        if trickle:
            self.trickle.take(per_tier[Tier.BATCH])
            return
        before, after = credit
        taken, self.credit_out = max(0, self.credit_out - before), after
        # Taken in YELLOW (the only zone the fast path takes it in), whatever zone this call
        # is in: a debt counted only by a YELLOW call would be lost when the pool left YELLOW
        # between the take and the call.
        self.normal.owe(taken + (per_tier[Tier.NORMAL] if zone is Zone.YELLOW else 0))


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
