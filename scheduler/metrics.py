"""The scheduler's own Prometheus metrics, in a registry per service instance (tests run several
in one process). Names start with ``kvgate_scheduler_``; zones are exported as a number
(0 GREEN, 1 YELLOW, 2 RED) so a graph shows the level and an alert can compare it.

Every counter series whose labels are known from the configuration (pools, their backends, the
stale policy) and the code's fixed vocabularies (tiers, reap kinds, scrape failure reasons) is
exported at 0 from the start, on standbys too: Prometheus sees a series that appears at 1 as no
increase, so `rate()` and `increase()`, and the alerts on them, would miss its first event.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from admission.config import Config
from admission.reads import HELD_REASONS, NODE_STUCK, Held
from admission.servicemetrics import gc_pause_histogram, lag_histogram, no_created_series
from admission.tiers import Tier, Zone
from scheduler.budget import NodePlan
from scheduler.fairmetrics import FairMetrics
from scheduler.nodestate import NodeRoom
from scheduler.probe import PROBE_OUTCOMES
from scheduler.scrape import SCRAPE_FAILURES

no_created_series()

ZONE_LEVEL = {Zone.GREEN: 0, Zone.YELLOW: 1, Zone.RED: 2}
_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

REAP_KINDS = ("reaped", "expired")
"""The `kind` values of kvgate_scheduler_reaped_total (SchedulerService.reap)."""


class SchedulerMetrics:
    """`pools`: pool name -> its backends' names, whose counters are exported at 0 from the
    start (with `stale_policy`, the policy label of the stale scrapes counted); none: every
    series appears with its first use. A service builds it with `of(config)`."""

    def __init__(self, pools: Mapping[str, Sequence[str]] | None = None, *,
                 stale_policy: str | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._room_nodes: dict[str, set[str]] = {}
        """Per pool, the nodes whose release-control series the last tick set (`set_rooms`)."""
        p = "kvgate_scheduler_"
        self.leader = Gauge(p + "leader", "1 while this replica leads, else 0.", registry=r)
        self.loop_lag = lag_histogram(p, r)
        self.gc_pause = gc_pause_histogram(p, r)
        self.epoch = Gauge(p + "epoch", "Fencing epoch of this replica's leadership (0: none).",
                           registry=r)
        self.leadership_changes = Counter(
            p + "leadership_changes", "Leadership gained or lost by this replica (a lease "
            "lapsed by its clock in a Redis stall and then resumed counts once).", registry=r)
        self.leadership_errors = Counter(p + "leadership_errors",
                                         "Leadership calls (acquire or renew) that failed on a "
                                         "Redis error.", registry=r)
        self.fenced = Counter(p + "fenced", "Writes refused for an old epoch (stepped down).",
                              ["pool"], registry=r)
        self.zone = Gauge(p + "zone", "Load zone: 0 GREEN, 1 YELLOW, 2 RED.", ["pool"],
                          registry=r)
        self.pool_usage = Gauge(p + "pool_usage",
                                "KV usage the zone follows: measured, raised by the projection "
                                "up to kv_target (fraction).", ["pool"],
                                registry=r)
        self.usage_ratio = Gauge(p + "usage_ratio",
                                 "Learned tokens used / tokens reserved by settled tasks.",
                                 ["pool"], registry=r)
        self.kv_usage = Gauge(p + "kv_usage", "Measured KV usage per node (fraction).",
                              ["pool", "node"], registry=r)
        self.projected = Gauge(p + "projected_usage", "Projected KV usage per node (fraction).",
                               ["pool", "node"], registry=r)
        self.budget = Gauge(p + "node_budget_tokens",
                            "Reservation budget published per node (node_capacity).",
                            ["pool", "node"], registry=r)
        self.reserved = Gauge(p + "node_reserved_tokens",
                              "Tokens reserved by released, unsettled tasks per node.",
                              ["pool", "node"], registry=r)
        self.prefill_window = Gauge(p + "prefill_window_tokens",
                                    "Release control: prompt tokens of Normal and Batch work "
                                    "allowed to wait for prefill on the node.",
                                    ["pool", "node"], registry=r)
        self.prefill_backlog = Gauge(p + "prefill_backlog_tokens",
                                     "Release control: estimated prompt tokens released to the "
                                     "node and not prefilled yet.", ["pool", "node"], registry=r)
        self.prefill_room = Gauge(p + "prefill_room_tokens",
                                  "Release control: prompt tokens of Normal and Batch work the "
                                  "node may take now (window - backlog; negative: the backlog "
                                  "beyond the window).", ["pool", "node"],
                                  registry=r)
        self.prefill_rate = Gauge(p + "prefill_rate_tokens_per_second",
                                  "Release control: measured prefill throughput of the node.",
                                  ["pool", "node"], registry=r)
        self.control_gain = Gauge(p + "control_gain",
                                  "Release control: the window's correction from measured VIP "
                                  "TTFT (1: the model alone).", ["pool", "node"], registry=r)
        self.running_limit = Gauge(p + "running_limit",
                                   "Release control: sequences the node's engine may run before "
                                   "Normal and Batch work waits, from its decode step time "
                                   "(NaN: no limit).", ["pool", "node"], registry=r)
        self.lane_cap = Gauge(p + "lane_cap",
                              "Release control: Normal and Batch tasks a lane may hold alive "
                              "(-1: no cap; NaN: not a lane).", ["pool", "node"], registry=r)
        self.decode_step = Gauge(p + "decode_step_seconds",
                                 "Release control: the node's mean decode step time at its last "
                                 "reading (vLLM's inter-token latency; NaN: not measured).",
                                 ["pool", "node"], registry=r)
        self.calm_step = Gauge(p + "calm_decode_step_seconds",
                               "Release control: the node's decode step time learned at calm "
                               "(NaN: not learned).", ["pool", "node"], registry=r)
        self.vip_objective = Gauge(p + "vip_ttft_objective_seconds",
                                   "Release control: the VIP time-to-first-token objective now "
                                   "(vip_slowdown x the learned calm P99, or the configured "
                                   "one).", ["pool"], registry=r)
        self.ejected = Gauge(p + "node_ejected", "1 while the node is ejected.",
                             ["pool", "node"], registry=r)
        self.stuck = Gauge(p + "node_stuck", "1 while the node is ejected because its engine "
                           "holds requests, or was sent some, and its page does not change "
                           "(stuck_after_ms).",
                           ["pool", "node"], registry=r)
        self.preemptions = Gauge(p + "node_preemptions",
                                 "vllm:num_preemptions_total as last scraped.",
                                 ["pool", "node"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Queued tasks per tier.", ["pool", "tier"],
                                 registry=r)
        self.queue_held = Gauge(p + "queue_held",
                                "Why a tier's queue waits, as of the last release: per reason, "
                                "the nodes that refused its head (kv, prefill, quiet, lane, "
                                "dedicated), or 1 for a reason about the pool (zone, tenant, "
                                "behind, no_node); 0 otherwise.",
                                ["pool", "tier", "reason"], registry=r)
        self.released = Counter(p + "released", "Tasks released by the scheduler per tier.",
                                ["pool", "tier"], registry=r)
        self.expired = Counter(p + "expired", "Queued tasks expired by the scheduler.",
                               ["pool"], registry=r)
        self.reaped = Counter(p + "reaped", "Tasks reaped (dead gateway) or expired by the reaper.",
                              ["pool", "kind"], registry=r)
        self.drain = Gauge(p + "drain_rate", "Tasks/s leaving each tier's queue (EWMA).",
                           ["pool", "tier"], registry=r)
        self.scrape_errors = Counter(p + "scrape_errors", "Failed scrapes per node and reason.",
                                     ["pool", "node", "reason"], registry=r)
        self.probes = Counter(p + "probes", "Probes of nodes whose page stood still "
                              "(scheduler.probe), per node and outcome.",
                              ["pool", "node", "outcome"], registry=r)
        self.scrape_duration = Histogram(p + "scrape_duration_seconds",
                                         "Time to scrape one node's /metrics.",
                                         ["pool", "node"], buckets=_FAST, registry=r)
        self.stale = Counter(p + "stale_scrapes",
                             "Ticks that used a node without a fresh scrape, by stale policy.",
                             ["pool", "node", "policy"], registry=r)
        self.tick_duration = Histogram(p + "tick_duration_seconds",
                                       "One pool's poll-publish-release tick.", ["pool"],
                                       buckets=_FAST, registry=r)
        self.redis_errors = Counter(p + "redis_errors", "Redis calls that failed in a tick.",
                                    ["pool"], registry=r)
        self.fair = FairMetrics(r)
        """Per tenant and team (scheduler.fairmetrics)."""
        for pool, nodes in (pools or {}).items():
            self._zero(pool, nodes, stale_policy)

    @classmethod
    def of(cls, config: Config) -> SchedulerMetrics:
        """The metrics of a scheduler running `config`, its counters at 0."""
        return cls({name: [b.name for b in pool.backends] for name, pool in config.pools.items()},
                   stale_policy=config.scheduler.stale_policy)

    def _zero(self, pool: str, nodes: Sequence[str], stale_policy: str | None) -> None:
        """Create one pool's counter series (a child starts at 0)."""
        for counter in (self.fenced, self.expired, self.redis_errors):
            counter.labels(pool)
        for tier in Tier:
            self.released.labels(pool, tier.label)
        for kind in REAP_KINDS:
            self.reaped.labels(pool, kind)
        for node in nodes:
            for reason in SCRAPE_FAILURES:
                self.scrape_errors.labels(pool, node, reason)
            for outcome in PROBE_OUTCOMES:
                self.probes.labels(pool, node, outcome)
            if stale_policy is not None:
                self.stale.labels(pool, node, stale_policy)

    def set_held(self, pool: str, held: Mapping[str, Held]) -> None:
        """Every tier's reasons, those that do not hold it at 0 (a fixed set of series, so a
        panel shows a reason's end as a fall to 0, not as a gap)."""
        for tier in Tier:
            kinds = held[tier.label].kinds() if tier.label in held else {}
            for reason in HELD_REASONS:
                self.queue_held.labels(pool, tier.label, reason).set(kinds.get(reason, 0))

    def set_plans(self, pool: str, plans: Iterable[NodePlan]) -> None:
        for p in plans:
            self.kv_usage.labels(pool, p.name).set(p.measured)
            self.projected.labels(pool, p.name).set(p.projected)
            self.budget.labels(pool, p.name).set(p.budget if p.budget is not None else 0)
            self.reserved.labels(pool, p.name).set(p.reserved)
            self.ejected.labels(pool, p.name).set(1 if p.ejected else 0)
            self.stuck.labels(pool, p.name).set(1 if p.reason == NODE_STUCK else 0)

    def set_rooms(self, pool: str, rooms: Mapping[str, NodeRoom]) -> None:
        """The release control's figures per node. A node the tick gave no room (ejected, or
        gone from the config) loses its series: its last figures would show room on a dead
        node."""
        for node in self._room_nodes.get(pool, set()) - rooms.keys():
            for gauge in self._room_gauges:
                with contextlib.suppress(KeyError):
                    gauge.remove(pool, node)
        self._room_nodes[pool] = set(rooms)
        for name, room in rooms.items():
            self.prefill_window.labels(pool, name).set(room.window)
            self.prefill_backlog.labels(pool, name).set(room.backlog)
            self.prefill_room.labels(pool, name).set(room.room)
            self.prefill_rate.labels(pool, name).set(room.rate)
            self.control_gain.labels(pool, name).set(room.gain)
            self.running_limit.labels(pool, name).set(_or_nan(room.running_limit))
            self.lane_cap.labels(pool, name).set(_or_nan(room.lane_cap))
            self.decode_step.labels(pool, name).set(_or_nan(room.step_s))
            self.calm_step.labels(pool, name).set(_or_nan(room.calm_step_s))

    @property
    def _room_gauges(self) -> tuple[Gauge, ...]:
        return (self.prefill_window, self.prefill_backlog, self.prefill_room, self.prefill_rate,
                self.control_gain, self.running_limit, self.lane_cap, self.decode_step,
                self.calm_step)

    def forget_pools(self) -> None:
        """Drop every per-pool gauge: a replica that stopped leading must not go on exporting
        the last figures it saw, or sums over replicas count them twice. Counters stay: a
        standby's do not move, so they add nothing to a sum of rates, and dropping them would
        read as a reset."""
        self.fair.forget()
        for gauge in (self.zone, self.pool_usage, self.usage_ratio, self.kv_usage,
                      self.projected, self.budget, self.reserved, self.ejected, self.stuck,
                      self.preemptions, self.queue_depth, self.queue_held, self.drain,
                      *self._room_gauges, self.vip_objective):
            gauge.clear()
        self._room_nodes.clear()


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
