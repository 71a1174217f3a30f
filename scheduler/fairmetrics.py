"""The leader's fairness and quota metrics: per tenant and team, with bounded label sets.

About once a second the leader reads each pool's backlogged flows, the tenants with tokens in
flight (the pool's `tenant_inflight` index), those tenants' hashes and the configured teams'
buckets (`PoolStore.read_fairness`) and exports:

- `kvgate_scheduler_fair_backlogged_tenants{pool, tier}`: tenants with work queued;
- `kvgate_scheduler_fair_share{pool, tier, tenant}`: the tenant's weight over the weights of
  the tenants backlogged in the tier, the share of releases fair order gives it now;
- `kvgate_scheduler_fair_lag_tokens{pool, tier, tenant}`: its virtual counter above the least
  of the tier's backlogged counters, in tokens at weight 1 (0: it is served next);
- `kvgate_scheduler_fair_queued_tokens`, `..._inflight_tokens`, `..._release_rate_tokens`
  `{pool, tenant}`: its queued and in-flight reservations, and the tokens/s released from its
  queue (decayed over 5 s: the rate the 429's hint uses);
- `kvgate_scheduler_quota_level_tokens` and `..._burst_tokens` `{pool, team}`: each configured
  team's bucket, refilled to now; full, at the configured burst, until its first request
  writes it (the scripts' bucket starts full).

Bounded labels: the tenants of a pool are its `TOP_TENANTS` tenants, among those with work
queued or tokens in flight, with the most queued and in-flight tokens, the others summed under
tenant="_other" (their share and lag are not summed: a sum of those means nothing); teams are
the configured ones. Series of tenants that left the top are removed, and a replica that stops
leading drops them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Gauge

from admission.reads import FairReading, release_rate
from admission.reads import finite_number as _num
from admission.tiers import Tier

TOP_TENANTS = 20
OTHER = "_other"
def bucket_tokens(h: Mapping[str, str], now_us: int) -> float | None:
    """A bucket's level in tokens at `now_us` (the scripts' lazy refill); None: never used."""
    if "micro_tokens" not in h:
        return None
    level, at = _num(h.get("micro_tokens")), _num(h.get("updated_us"), now_us)
    rate, burst = _num(h.get("rate")), _num(h.get("burst"))
    if now_us > at:
        level += rate * (now_us - at)
    return min(level, burst * 1e6) / 1e6


class FairMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p, r = "kvgate_scheduler_", registry
        self.backlogged = Gauge(p + "fair_backlogged_tenants",
                                "Tenants with work queued per tier.", ["pool", "tier"],
                                registry=r)
        self.share = Gauge(p + "fair_share", "A backlogged tenant's weight over the weights of "
                           "the tier's backlogged tenants (top tenants).",
                           ["pool", "tier", "tenant"], registry=r)
        self.lag = Gauge(p + "fair_lag_tokens", "A backlogged tenant's virtual counter above "
                         "the tier's least, tokens at weight 1 (top tenants).",
                         ["pool", "tier", "tenant"], registry=r)
        self.queued = Gauge(p + "fair_queued_tokens", "Tokens of a tenant's queued requests "
                            "(top tenants; the rest as _other).", ["pool", "tenant"], registry=r)
        self.inflight = Gauge(p + "fair_inflight_tokens", "Tokens reserved by a tenant's "
                              "released, unfinished requests (top tenants; the rest as _other).",
                              ["pool", "tenant"], registry=r)
        self.rate = Gauge(p + "fair_release_rate_tokens", "Tokens/s released from a tenant's "
                          "queue, decayed over 5 s (top tenants; the rest as _other).",
                          ["pool", "tenant"], registry=r)
        self.level = Gauge(p + "quota_level_tokens", "A team's bucket in the pool, tokens now.",
                           ["pool", "team"], registry=r)
        self.burst = Gauge(p + "quota_level_burst_tokens", "A team's bucket size in the pool.",
                           ["pool", "team"], registry=r)
        self._series: dict[str, set[tuple[Gauge, tuple[str, ...]]]] = {}

    def _set(self, seen: set[tuple[Gauge, tuple[str, ...]]], gauge: Gauge,
             labels: tuple[str, ...], value: float) -> None:
        gauge.labels(*labels).set(value)
        seen.add((gauge, labels))

    def observe(self, pool: str, reading: FairReading,
                bursts: Mapping[str, float] | None = None) -> None:
        """`bursts`: each configured team's burst, for the teams of `reading.levels` whose
        bucket was never written in the pool: a team no request has used yet is exported at
        it, as full as its first request finds it, rather than missing from its dashboard."""
        seen: set[tuple[Gauge, tuple[str, ...]]] = set()
        tenants = reading.tenants
        load = {name: _num(h.get("queued_tokens")) + _num(h.get("inflight_tokens"))
                for name, h in tenants.items()}
        top = set(sorted(load, key=lambda n: (-load[n], n))[:TOP_TENANTS])
        for tier in Tier:
            flows = reading.backlogged[tier]
            self._set(seen, self.backlogged, (pool, tier.label), len(flows))
            if not flows:
                continue
            weights = {n: _num(tenants.get(n, {}).get("weight"), 1.0) for n in flows}
            total = sum(weights.values()) or 1.0
            least = min(flows.values())
            for name in sorted(top & set(flows)):
                self._set(seen, self.share, (pool, tier.label, name), weights[name] / total)
                self._set(seen, self.lag, (pool, tier.label, name), flows[name] - least)
        other = [0.0, 0.0, 0.0]
        for name, h in tenants.items():
            figures = (_num(h.get("queued_tokens")), _num(h.get("inflight_tokens")),
                       release_rate(h, reading.now_us))
            if name in top:
                for gauge, value in zip((self.queued, self.inflight, self.rate), figures,
                                        strict=True):
                    self._set(seen, gauge, (pool, name), value)
            else:
                other = [a + b for a, b in zip(other, figures, strict=True)]
        if len(tenants) > len(top):
            for gauge, value in zip((self.queued, self.inflight, self.rate), other, strict=True):
                self._set(seen, gauge, (pool, OTHER), value)
        for team, h in reading.levels.items():
            tokens = bucket_tokens(h, reading.now_us)
            if tokens is not None:
                self._set(seen, self.level, (pool, team), tokens)
                self._set(seen, self.burst, (pool, team), _num(h.get("burst")))
            elif bursts is not None and team in bursts:
                self._set(seen, self.level, (pool, team), float(bursts[team]))
                self._set(seen, self.burst, (pool, team), float(bursts[team]))
        self._drop(self._series.get(pool, set()) - seen)
        self._series[pool] = seen

    def _drop(self, series: Iterable[tuple[Gauge, tuple[str, ...]]]) -> None:
        for gauge, labels in series:
            with contextlib.suppress(KeyError):  # already gone
                gauge.remove(*labels)

    def forget(self) -> None:
        """Drop every series (this replica stopped leading)."""
        for series in self._series.values():
            self._drop(series)
        self._series.clear()

