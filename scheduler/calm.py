"""The VIP objective a pool is held to in a flood: a slowdown of what VIP gets when it is calm.

An absolute time-to-first-token objective is wrong in both directions. A node that prefills
a VIP chat in 60 ms and runs a light decode batch serves it in about 100 ms at calm, so a
250 ms objective lets a flood slow VIP down 2.5 times before the control acts; a pool whose
calm traffic already keeps its engines busy serves VIP in 700 ms at calm, and a 250 ms
objective would throttle its Normal traffic for a slowdown nobody asked to avoid. What
operators promise is relative: "VIP is at most `vip_slowdown` times slower in a flood than
when the pool is calm". It is off by default (`vip_slowdown` 0): docs/design.md has what it
costs.

So the leader learns the calm distribution. The finish script counts every VIP first token
of the pool (ms from its dispatch to the node until its first token) in log buckets 10% wide
(lua/finish.lua, field `<node>:h<k>`: ms in [1.1^k, 1.1^(k+1))). At each poll the leader
adds the counts that came in since the last one to a histogram, decaying with a time constant
of `CALM_TAU_S`, when the pool was calm over that interval:

* its zone GREEN and no Normal or Batch task queued at every poll since at least
  `signal_stale_ms` before the interval (the decode batches a flood leaves take a while to
  end, and VIP chats are slow in them);
* and, for the first tokens beyond the learned P99's bucket (the tail), only as many as the
  quantile allows: each first token learned below it earns a hundredth of a tail one
  (banking at most `TAIL_CREDIT_MAX`). At calm about 1% of first tokens lie in the tail and
  are learned at that rate, so the tail is not trimmed; a flood that the admission lets
  through queues nothing (its work fits the KV budget and the prefill windows) and slows the
  decode batch, putting many first tokens in the tail, and they cannot ratchet the P99 up,
  each a little above the last (with a few dozen samples the P99 is the largest of them).
  Its first tokens below the P99 are learned: they only make the P99 smaller.

Once the histogram holds `MIN_SAMPLES` first tokens, the objective is `vip_slowdown` x its
P99 (interpolated within the bucket); before that, and with `vip_slowdown` 0, the configured
`vip_ttft_objective_ms`. The objective is published in the pool's state hash, where the
finish script counts first tokens later than it.

A replica that was never leader starts with an empty histogram (the configured objective
until it has seen `MIN_SAMPLES` calm first tokens); the counters it reads are monotonic, so
the first reading of a term only starts the deltas.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

BUCKET_RATIO = 1.1
"""Bucket k of the finish script's histogram holds ms in [1.1^k, 1.1^(k+1))."""
CALM_TAU_S = 600.0
"""Time constant of the calm histogram: calm traffic changes over the day, not per minute."""
MIN_SAMPLES = 20.0
"""Calm first tokens needed before the learned objective replaces the configured one."""
QUANTILE = 0.99
TAIL_CREDIT_MAX = 2.0
"""Tail credit does not bank beyond this many first tokens."""


def quantile(histogram: Mapping[int, float], q: float) -> float | None:
    """The q-quantile (ms) of a histogram of `BUCKET_RATIO` buckets, interpolated
    geometrically within its bucket; None when it is empty."""
    total = sum(histogram.values())
    if total <= 0:
        return None
    target = q * total
    seen = 0.0
    for bucket in sorted(histogram):
        count = histogram[bucket]
        if count <= 0:
            continue
        if seen + count >= target:
            share = (target - seen) / count
            return float(BUCKET_RATIO ** (bucket + share))
        seen += count
    return float(BUCKET_RATIO ** (max(histogram) + 1))


class CalmBaseline:
    """The learned calm VIP distribution of one pool and the objective it gives."""

    def __init__(self, slowdown: float, fallback_ms: int, settle_s: float) -> None:
        self.slowdown = slowdown
        self.fallback_ms = fallback_ms
        self.settle_s = settle_s
        self.histogram: dict[int, float] = {}
        self._last: dict[int, int] | None = None
        """The counts read at the last poll (None: no reading to start deltas from)."""
        self._at: float | None = None
        """The last poll's time."""
        self._credit = 0.0
        """Tail first tokens that may be learned now (earned at 1% of the others)."""
        self._calm_since: float | None = None
        """Since when the pool has been calm at every poll (None: not calm at the last)."""

    def restart(self) -> None:
        """A new leadership: the counters read in an earlier term are not a start for deltas,
        nor is calm then known to have lasted (the histogram is kept, and decays by the time
        between)."""
        self._last, self._calm_since = None, None

    def settled(self, now: float) -> bool:
        """The pool has been calm at every poll for `settle_s` as of the last one observed
        (`now`): a flood's decode batches take a while to end, queueing nothing, so calm
        counts once it has lasted (the release control learns the calm step time then)."""
        return self._calm_since is not None and now - self._calm_since >= self.settle_s

    @property
    def samples(self) -> float:
        return sum(self.histogram.values())

    def observe(self, counts: Mapping[int, int], calm: bool, now: float) -> None:
        """One poll: the pool's monotonic bucket counts and whether it is calm now (see the
        module for when the interval since the last poll is learned)."""
        last_at, self._at = self._at, now
        if last_at is not None:
            decay = math.exp(-max(0.0, now - last_at) / CALM_TAU_S)
            for bucket in self.histogram:
                self.histogram[bucket] *= decay
        settled = (calm and last_at is not None and self._calm_since is not None
                   and last_at - self._calm_since >= self.settle_s)
        if not calm:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now
        last, self._last = self._last, dict(counts)
        if last is None:
            return
        deltas = {bucket: count - last.get(bucket, 0) for bucket, count in counts.items()}
        if not settled or any(delta < 0 for delta in deltas.values()):
            return  # (below 0: the counters were reset, Redis flushed; the deltas start again)
        # The tail: first tokens beyond the learned P99's bucket, ~1% of them at calm.
        known = self.calm_ms()
        edge = -1 if known is None else math.floor(math.log(known) / math.log(BUCKET_RATIO))
        body = {b: d for b, d in deltas.items() if d and (known is None or b <= edge)}
        for bucket, delta in body.items():
            self.histogram[bucket] = self.histogram.get(bucket, 0.0) + delta
        self._credit = min(TAIL_CREDIT_MAX, self._credit + (1 - QUANTILE) * sum(body.values()))
        for bucket in sorted(b for b, d in deltas.items() if d and b not in body):
            take = min(deltas[bucket], math.floor(self._credit))
            if take > 0:
                self.histogram[bucket] = self.histogram.get(bucket, 0.0) + take
                self._credit -= take

    def calm_ms(self) -> float | None:
        """The learned calm P99 (ms), None until `MIN_SAMPLES` calm first tokens."""
        if self.samples < MIN_SAMPLES:
            return None
        return quantile(self.histogram, QUANTILE)

    def objective_ms(self) -> int:
        """The objective the control and the finish script use now (see the module)."""
        calm = self.calm_ms() if self.slowdown > 0 else None
        if calm is None:
            return self.fallback_ms
        return max(1, round(self.slowdown * calm))
