"""The gateway's Prometheus metrics, in a registry of its own (one per app).

Labels are bounded: pool (configured), tier (3), outcome and reason (fixed vocabularies). Tenant
names appear only when `gateway.tenant_metrics` is set; raw keys and prompts never do.

Every counter series whose labels are known from the configuration (pools, their backends,
teams, fail-open tiers) and the fixed vocabularies below is exported at 0 from the start:
Prometheus sees a series that appears at 1 as no increase, so `rate()` and `increase()`, and
the alerts on them, would miss its first event. With tenant labels (`gateway.tenant_metrics`),
each configured tenant's series exist at 0 in its own tier; those of a tier it lowers a request
to (`X-Priority`) appear with their first event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from admission.config import Config
from admission.outcomes import RejectReason
from admission.servicemetrics import gc_pause_histogram, lag_histogram, no_created_series
from admission.tiers import Tier
from gateway.errors import KEY_SCOPE

no_created_series()

# Request outcomes (label values of kvgate_gateway_requests_total).
OK = "ok"
REJECTED = "rejected"  # 429 / never-fits 4xx from admission
INVALID = "invalid"  # 4xx before admission (auth, body, model, context)
QUEUE_TIMEOUT = "queue_timeout"
CLIENT_GONE = "client_gone"
UPSTREAM_ERROR = "upstream_error"
UNAVAILABLE = "unavailable"  # Redis unreachable, failed closed
MISCONFIGURED = "misconfigured"  # Redis refuses admission for good (credentials, ACL): 500
FAIL_OPEN = "fail_open"
INTERNAL_ERROR = "internal_error"
SHUTTING_DOWN = "shutting_down"  # queued on, or cut off by, a gateway that stopped: 503
TASK_LOST = "task_lost"  # queued task ended by the cluster (reaped): 503
UNKNOWN_NODE = "unknown_node"  # released to a node this gateway's config lacks: 502
REQUEST_OUTCOMES = (OK, REJECTED, INVALID, QUEUE_TIMEOUT, CLIENT_GONE, UPSTREAM_ERROR,
                    UNAVAILABLE, MISCONFIGURED, FAIL_OPEN, INTERNAL_ERROR, SHUTTING_DOWN,
                    TASK_LOST, UNKNOWN_NODE)
"""The `outcome` values of kvgate_gateway_requests_total."""
UNPARSED_POOL = "none"
"""The `pool` of a request refused before its pool was known (a body that does not parse):
its requests_total series exist for outcome `invalid` only."""
CLIENT_DEADLINE = "client_deadline"
"""The rejection reason of a queued request whose client's deadline (`X-Request-Timeout`, an
SDK's declared read timeout) came before its tier's queue timeout: QUEUE_TIMEOUT alone means
the tier's whole timeout was waited, which is what the VIP queue-timeout alert reads."""
REJECTION_REASONS = (*(reason.value for reason in RejectReason), QUEUE_TIMEOUT, CLIENT_DEADLINE)
"""The `reason` values of kvgate_gateway_rejections_total: admission's, and the two deadlines
of a queued request."""
UPSTREAM_ERROR_KINDS = ("unreachable", "error", "rejected", "timeout", "stuck", "broken_stream",
                        "oversized_event", "oversized_answer", "malformed_answer")
"""The `kind` values of kvgate_gateway_upstream_errors_total (gateway.proxy)."""

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# TTFT counts from arrival, so it includes the queue wait: the buckets reach as far as the
# waits' (the default queue timeouts are 30 s, 60 s and 600 s), or histogram_quantile would
# report every slower first token as the highest bound.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                 60, 120, 300, 600)

AUTH_FAILURES = ("missing_api_key", "invalid_api_key", "missing_admin_token",
                 "invalid_admin_token")
"""The `reason` values of kvgate_gateway_auth_failures_total (the 401s' error codes)."""
REDIS_OPS = ("admit", "settle", "abandon", "renew", "poll", "subscribe", "drain_hint", "admin",
             "nodes_out")
"""The `op` values of kvgate_gateway_redis_errors_total."""
SETTLE_OPS = ("settle", "cancel")
GIVE_UP_REASONS = ("permanent", "deadline")
"""The `op` and `reason` values of kvgate_gateway_settles_abandoned_total."""


M = TypeVar("M", Counter, Gauge, Histogram)


class GatewayMetrics:
    """`pools`: pool name -> its backends' names; `quota_scopes`: the scopes a quota rejection
    can name (`key`, `team:<name>` per configured team); `fail_open_tiers`: the tiers that can
    fail open; `tenants` (with `tenant_labels`): each configured tenant's name and tier, whose
    series exist in that tier (a request `X-Priority` lowers creates its own on first use:
    every tier of every tenant would be three times the series, at tens per tenant). Their
    counter series are exported at 0 from the start; without them every labelled series
    appears with its first use, and `increase()` misses that first event (an alert on the
    first VIP queue timeout of a tenant would not fire). An app builds it with `of(config)`."""

    def __init__(self, *, tenant_labels: bool = False,
                 pools: Mapping[str, Sequence[str]] | None = None,
                 quota_scopes: Iterable[str] = (),
                 fail_open_tiers: Iterable[Tier] = (),
                 tenants: Iterable[tuple[str, Tier]] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_labels = tenant_labels
        r = self.registry
        by_tier = ["pool", "tier"] + (["tenant"] if tenant_labels else [])
        self.requests = Counter(
            "kvgate_gateway_requests", "Completion requests by tier and outcome (misconfigured: "
            "Redis refuses admission for good: credentials, ACL, key types, scripts; a 500).",
            [*by_tier, "outcome"], registry=r)
        self.rejections = Counter(
            "kvgate_gateway_rejections", "Requests refused by admission, by reason "
            "(quota, zone_red, no_node, queue_full, tenant_queue_full, "
            "tenant_queued_tokens, "
            "exceeds_burst; queue_timeout: queued for the tier's whole queue timeout; "
            "client_deadline: queued until the client's shorter deadline).",
            [*by_tier, "reason"], registry=r)
        self.auth_failures = Counter(
            "kvgate_gateway_auth_failures", "Requests refused for their API key or admin token, "
            "by reason (missing_api_key, invalid_api_key, missing_admin_token, "
            "invalid_admin_token): a client misconfigured, or keys being guessed.",
            ["reason"], registry=r)
        self.quota_rejections = Counter(
            "kvgate_gateway_quota_rejections", "Requests refused by a quota level, by the "
            "binding level (scope: key, or team:<name> of a configured team).",
            ["pool", "scope"], registry=r)
        self.queue_wait = Histogram(
            "kvgate_gateway_queue_wait_seconds", "Time queued before release.",
            ["pool", "tier"], buckets=_WAIT_BUCKETS, registry=r)
        self.loop_lag = lag_histogram("kvgate_gateway_", r)
        self.gc_pause = gc_pause_histogram("kvgate_gateway_", r)
        self.ttft = Histogram(
            "kvgate_gateway_ttft_seconds",
            "Arrival to first byte of the streamed answer sent to the client.",
            ["pool", "tier"], buckets=_TTFT_BUCKETS, registry=r)
        self.tokens_reserved = Counter(
            "kvgate_gateway_tokens_reserved", "Tokens reserved at admission (prompt + max out).",
            by_tier, registry=r)
        self.tokens_settled = Counter(
            "kvgate_gateway_tokens_settled", "Tokens charged when tasks ended (real usage).",
            by_tier, registry=r)
        self.in_flight = Gauge(
            "kvgate_gateway_in_flight", "Completion requests being handled (queued or proxied).",
            ["pool"], registry=r)
        self.queued = Gauge(
            "kvgate_gateway_queued", "Requests of this gateway waiting in the queue.",
            ["pool"], registry=r)
        self.fail_open = Counter(
            "kvgate_gateway_fail_open", "Requests let through unadmitted while Redis was "
            "unreachable (gateway.fail_open_tiers; never while it refuses them for good).",
            ["pool", "tier"], registry=r)
        self.redis_errors = Counter(
            "kvgate_gateway_redis_errors", "Failed Redis operations by operation.",
            ["op"], registry=r)
        self.wake_fallbacks = Counter(
            "kvgate_gateway_wake_fallbacks", "Released or expired tasks found by polling their "
            "record rather than by a pub/sub wake-up.", ["pool"], registry=r)
        self.pubsub_reconnects = Counter(
            "kvgate_gateway_pubsub_reconnects", "Reconnections of the wake-up subscription.",
            registry=r)
        self.orphans = Counter(
            "kvgate_gateway_orphans", "Tasks found in this gateway's set in Redis but unknown "
            "to the process (an admit whose reply was lost), cancelled.", ["pool"], registry=r)
        self.settle_retries = Counter(
            "kvgate_gateway_settle_retries", "Settle or cancel calls retried after a transient "
            "Redis error.", registry=r)
        self.settles_abandoned = Counter(
            "kvgate_gateway_settles_abandoned", "Settle or cancel calls given up (reason "
            "permanent: a Redis error no retry can pass; deadline: transient errors past the "
            "retry deadline); the task's lease is left to expire and the scheduler's reaper "
            "returns its reservation.", ["op", "reason"], registry=r)
        self.upstream_errors = Counter(
            "kvgate_gateway_upstream_errors", "Failed requests to backends by kind.",
            ["pool", "node", "kind"], registry=r)

        self._children: dict[tuple[Any, ...], Any] = {}
        for reason in AUTH_FAILURES:
            self.child(self.auth_failures, reason)
        for op in REDIS_OPS:
            self.child(self.redis_errors, op)
        for op in SETTLE_OPS:
            for reason in GIVE_UP_REASONS:
                self.child(self.settles_abandoned, op, reason)
        scopes, fail_open = tuple(quota_scopes), tuple(fail_open_tiers)
        # Without tenant labels one set of series per tier; with them, one per tenant and tier.
        tiers = ([(tier, ()) for tier in Tier] if not tenant_labels else
                 [(own, (name,)) for name, own in tenants])
        for pool, nodes in (pools or {}).items():
            self._zero(pool, nodes, scopes, fail_open, tiers)
        if pools:
            for tier, tenant in tiers:
                self.child(self.requests, UNPARSED_POOL, tier.label, *tenant, INVALID)

    @classmethod
    def of(cls, config: Config) -> GatewayMetrics:
        """The metrics of a gateway serving `config`, its counters at 0."""
        return cls(
            tenant_labels=config.gateway.tenant_metrics,
            tenants=[(tenant.name, tenant.tier) for tenant in config.tenants],
            pools={name: [b.name for b in pool.backends] for name, pool in config.pools.items()},
            quota_scopes=(KEY_SCOPE, *(team.level.scope for team in config.teams.values())),
            fail_open_tiers=config.gateway.fail_open_tiers,
        )

    def _zero(self, pool: str, nodes: Sequence[str], scopes: Sequence[str],
              fail_open: Sequence[Tier], tiers: Sequence[tuple[Tier, tuple[str, ...]]]) -> None:
        """Create one pool's counter series (a child starts at 0)."""
        for counter in (self.wake_fallbacks, self.orphans):
            self.child(counter, pool)
        for scope in scopes:
            self.child(self.quota_rejections, pool, scope)
        for tier in fail_open:
            self.child(self.fail_open, pool, tier.label)
        for node in nodes:
            for kind in UPSTREAM_ERROR_KINDS:
                self.child(self.upstream_errors, pool, node, kind)
        for tier, tenant in tiers:
            for outcome in REQUEST_OUTCOMES:
                self.child(self.requests, pool, tier.label, *tenant, outcome)
            for reason in REJECTION_REASONS:
                self.child(self.rejections, pool, tier.label, *tenant, reason)
            self.child(self.tokens_reserved, pool, tier.label, *tenant)
            self.child(self.tokens_settled, pool, tier.label, *tenant)

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, cached: the hot path skips prometheus-client's lookup."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        child: M = found
        return child

    def tier_labels(self, pool: str, tier: Tier, tenant: str) -> tuple[str, ...]:
        if self.tenant_labels:
            return (pool, tier.label, tenant)
        return (pool, tier.label)

    def render(self) -> bytes:
        return generate_latest(self.registry)
