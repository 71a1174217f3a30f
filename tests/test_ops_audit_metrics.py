"""The gateway's metrics as Prometheus stores and queries them: what a dashboard or an alert
computes from a scrape, not just which names exist (tests/test_grafana_dashboard.py).

Prometheus' own rules apply here: `histogram_quantile` cannot place a quantile that falls in the
`+Inf` bucket and answers the highest finite bound instead, and `rate()` / `increase()` count
nothing for a counter series whose first scrape already shows it at 1.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

from prometheus_client import CollectorRegistry

from admission.configschema import DEFAULT_TIERS
from admission.tiers import Tier
from gateway import settle
from gateway.metrics import GIVE_UP_REASONS, REDIS_OPS, SETTLE_OPS, GatewayMetrics

ROOT = Path(__file__).resolve().parent.parent


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over (upper bound, cumulative count) pairs, +Inf last."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return buckets[-2][0]  # Prometheus: the highest finite bound
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError("unreachable")


def ttft_buckets(registry: CollectorRegistry, tier: str) -> list[tuple[float, float]]:
    out = []
    for family in registry.collect():
        for s in family.samples:
            if s.name == "kvgate_gateway_ttft_seconds_bucket" and s.labels["tier"] == tier:
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


def test_the_ttft_quantiles_reach_the_longest_default_queue_wait() -> None:
    # A queued request's TTFT is its queue wait plus the backend's first token: a Normal request
    # released after 45 s, or a Batch one after 500 s, must read as such on the TTFT panel.
    for tier in Tier:
        waited = DEFAULT_TIERS[tier].queue_timeout_ms / 1000
        metrics = GatewayMetrics()
        child = metrics.ttft.labels("demo", tier.label)
        for _ in range(100):
            child.observe(waited * 0.9 + 0.2)
        p99 = histogram_quantile(0.99, ttft_buckets(metrics.registry, tier.label))
        assert p99 >= waited * 0.9 + 0.2, (tier, p99)
        assert p99 <= waited, (tier, p99)


def _redis_error_ops_in_gateway_code() -> set[str]:
    """Every `op` label the gateway passes with `redis_errors`."""
    ops: set[str] = set()
    for path in (ROOT / "gateway").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and len(node.args) == 2
                    and isinstance(node.args[0], ast.Attribute)
                    and node.args[0].attr == "redis_errors"
                    and isinstance(node.args[1], ast.Constant)):
                ops.add(str(node.args[1].value))
    return ops


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() for s in family.samples}


def test_error_counters_are_exported_at_zero_before_the_first_error() -> None:
    found = _redis_error_ops_in_gateway_code()
    assert {"admit", "settle", "renew", "poll", "subscribe"} <= found  # the scan works
    assert found <= set(REDIS_OPS), f"not exported at 0: {sorted(found - set(REDIS_OPS))}"
    assert {settle.PERMANENT, settle.DEADLINE} == set(GIVE_UP_REASONS)

    scraped = samples(GatewayMetrics())
    for op in REDIS_OPS:
        assert scraped[("kvgate_gateway_redis_errors_total", (("op", op),))] == 0.0, op
    for op in SETTLE_OPS:
        for reason in GIVE_UP_REASONS:
            key = ("kvgate_gateway_settles_abandoned_total", (("op", op), ("reason", reason)))
            assert scraped[key] == 0.0, key
    # ... so that the first error is an increase of 1 between two scrapes.
    metrics = GatewayMetrics()
    metrics.child(metrics.settles_abandoned, "settle", settle.PERMANENT).inc()
    key = ("kvgate_gateway_settles_abandoned_total", (("op", "settle"), ("reason", "permanent")))
    assert samples(metrics)[key] - scraped[key] == 1.0
