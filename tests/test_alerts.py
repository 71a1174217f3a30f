"""The alerting rules (helm/kvgate/alerts/kvgate-alerts.yaml) query what the services export and
fire when, and only when, their runbook section applies.

Each rule is read like the dashboard's expressions (tests/test_grafana_dashboard.py): its
metrics must be exported with the labels it matches and groups by. Then Prometheus itself
evaluates every rule on synthetic series, through promtool's rule unit tests: for each alert a
case where it fires, with the labels and the rendered annotations expected, and cases where
it must not (healthy series, or a condition not yet held for the rule's `for`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_grafana_dashboard import EXPORTED, SCHEDULER, TARGET_LABELS, read_promql

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "helm" / "kvgate" / "alerts" / "kvgate-alerts.yaml"
DEPLOYED = ROOT / "deploy" / "prometheus" / "kvgate-alerts.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
SEVERITIES = ("critical", "warning")
LEADER_ONLY = "and on (instance) (kvgate_scheduler_leader == 1)"


def load_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


ALERTS = {rule["alert"]: rule for rule in load_rules()}


def slug(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_deployable_file_is_the_charts() -> None:
    assert DEPLOYED.is_symlink() and DEPLOYED.resolve() == RULES.resolve()


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section() -> None:
    anchors = {slug(line.lstrip("#")) for line in RUNBOOK.read_text(encoding="utf-8").splitlines()
               if line.startswith("## ")}
    assert len(ALERTS) == len(load_rules()), "two alerts share a name"
    for name, rule in ALERTS.items():
        assert name.startswith("Kvgate"), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        path, _, anchor = notes["runbook_url"].partition("#")
        assert path == "docs/runbook.md" and anchor in anchors, f"{name}: {notes['runbook_url']}"


def test_alerts_query_exported_metrics_with_their_labels() -> None:
    wrong = []
    for name, rule in ALERTS.items():
        q = read_promql(rule["expr"])
        available = set(TARGET_LABELS)
        for metric, matchers in q.metrics.items():
            if metric == "up":  # Prometheus' own, per target: the target's labels only
                labels: set[str] | frozenset[str] = TARGET_LABELS
            elif metric not in EXPORTED:
                wrong.append(f"{name}: {metric} is not exported")
                continue
            else:
                labels = EXPORTED[metric][1]
            available |= labels
            wrong += [f"{name}: {metric} has no label {m!r}" for m in matchers - labels]
        wrong += [f"{name}: groups by {g!r}, which none of its metrics has"
                  for g in q.grouping - available]
        used = set(re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values())))
        wrong += [f"{name}: an annotation names {u!r}, which no metric has"
                  for u in used - available]
    assert not wrong, "\n".join(wrong)


def test_scheduler_gauges_are_read_from_the_leader_only() -> None:
    # A replica that stopped leading clears its pool gauges, but one whose scrape failed keeps
    # its last values in Prometheus for a while: alerts read the leader's, as panels do.
    for name, rule in ALERTS.items():
        gauges = {m for m in read_promql(rule["expr"]).metrics
                  if SCHEDULER.get(m, ("",))[0] == "gauge" and m != "kvgate_scheduler_leader"}
        if gauges:
            assert LEADER_ONLY in " ".join(rule["expr"].split()), name


def test_rules_pass_promtool_check() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Prometheus evaluates the rules -----------------------------------------------------------

NS = {"namespace": "ai"}
LEADER = {'kvgate_scheduler_leader{namespace="ai", instance="s0"}': "1x40",
          'kvgate_scheduler_leader{namespace="ai", instance="s1"}': "0x40"}


@dataclass(frozen=True, slots=True)
class Case:
    alert: str
    series: dict[str, str]
    at: str
    fires: dict[str, str] | None = None
    """The alert's labels beyond its name, severity and namespace (None: it must not fire)."""
    value: str = ""
    """How the annotations render `$value` (through humanize, humanizeDuration, ...)."""
    extra: dict[str, str] = field(default_factory=dict)
    interval: str = "1m"
    """Time between two samples of `series` (the chart's ServiceMonitors scrape every 15 s)."""


def series(metric: str, instance: str, labels: str, namespace: str = "ai") -> str:
    return (f'{metric}{{namespace="{namespace}", instance="{instance}"'
            f'{", " if labels else ""}{labels}}}')


def gw(metric: str, labels: str, values: str) -> dict[str, str]:
    return {series(metric, "g0", labels): values}


def sched(metric: str, labels: str, values: str, instance: str = "s0") -> dict[str, str]:
    return {series(metric, instance, labels): values}


def other(metric: str, labels: str, values: str, instance: str = "x0") -> dict[str, str]:
    """A series of another release, in namespace "b"."""
    return {series(metric, instance, labels, "b"): values}


GATEWAY_UP = 'job="kvgate-gateway"'
SCHEDULER_UP = 'job="kvgate-scheduler"'
SCHEDULERS = {series("up", "s0", SCHEDULER_UP): "1x40"}
"""A release's scheduler target, scraped (what KvgateGatewaysDown judges a namespace by)."""
# A release's gateways answer (their counters exist), its schedulers crash-loop from 5m: their
# targets stay, down, and their series go stale.
CRASH_LOOPING_SCHEDULERS = (
    gw("kvgate_gateway_requests_total", 'pool="p", tier="vip", outcome="ok"', "0+10x15")
    | sched("kvgate_scheduler_leader", "", "1x4 stale")
    | {series("up", "s0", 'job="kvgate-scheduler"'): "1x4 0x10"})
BUCKETS_08 = {"0.5": "0x40", "1": "0+10x40", "+Inf": "0+10x40"}  # first tokens in 0.5-1 s
LAG_75MS = {"0.05": "0x40", "0.1": "0+100x40", "+Inf": "0+100x40"}


def histogram(metric: str, labels: str, buckets: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for le, values in buckets.items():
        out |= gw(metric, f'{labels}{", " if labels else ""}le="{le}"', values)
    return out


CASES = [
    # A leader lost at 3m: pending for the rule's minute, then firing.
    Case("KvgateNoSchedulerLeader", sched("kvgate_scheduler_leader", "", "1 1 1 0 0 0"),
         "3m"),
    Case("KvgateNoSchedulerLeader", sched("kvgate_scheduler_leader", "", "1 1 1 0 0 0"),
         "4m", {}),
    Case("KvgateNoSchedulerLeader", LEADER, "10m"),
    # No scheduler scraped at all: absent() has no labels to keep, not even the namespace.
    Case("KvgateNoSchedulerLeader", sched("kvgate_scheduler_epoch", "", "0x5"), "2m",
         {"namespace": ""}),
    # A release whose schedulers are gone, while another release's lead: that one's series
    # exist, so absent() is empty; the gateways' series name the release left without one.
    Case("KvgateNoSchedulerLeader",
         CRASH_LOOPING_SCHEDULERS | other("kvgate_scheduler_leader", "", "1x15")
         | other("kvgate_gateway_requests_total", 'pool="p", tier="vip", outcome="ok"',
                 "0+10x15"), "12m", {}),
    # No scheduler anywhere, gateways scraped: one alert, for their namespace.
    Case("KvgateNoSchedulerLeader", CRASH_LOOPING_SCHEDULERS, "12m", {}),
    Case("KvgateNoSchedulerLeader",
         LEADER | gw("kvgate_gateway_requests_total", 'pool="p", tier="vip", outcome="ok"',
                     "0+10x40")
         | other("kvgate_scheduler_leader", "", "1x40")
         | other("kvgate_gateway_requests_total", 'pool="p", tier="vip", outcome="ok"',
                 "0+10x40"), "12m"),
    # One of two scheduler replicas down from 2m: not yet at 11m, firing from 12m.
    *(Case("KvgateSchedulerNoStandby",
           {series("up", "s0", SCHEDULER_UP): "1x20", series("up", "s1", SCHEDULER_UP): "1 1 0x20"},
           at, fires) for at, fires in (("11m", None), ("12m", {"job": "kvgate-scheduler"}))),
    # One deleted and not replaced: its target gone (stale), not down.
    Case("KvgateSchedulerNoStandby",
         {series("up", "s0", SCHEDULER_UP): "1x20", series("up", "s1", SCHEDULER_UP): "1 1 stale"},
         "15m", {"job": "kvgate-scheduler"}),
    Case("KvgateSchedulerNoStandby",
         {series("up", "s0", SCHEDULER_UP): "1x20", series("up", "s1", SCHEDULER_UP): "1x20"},
         "15m"),
    # One of three down: a standby is left.
    Case("KvgateSchedulerNoStandby",
         {series("up", "s0", SCHEDULER_UP): "1x20", series("up", "s1", SCHEDULER_UP): "1x20",
          series("up", "s2", SCHEDULER_UP): "0x20"}, "15m"),
    # All down is KvgateNoSchedulerLeader's; gateways up do not count as schedulers.
    Case("KvgateSchedulerNoStandby",
         {series("up", "s0", SCHEDULER_UP): "0x20", series("up", "s1", SCHEDULER_UP): "0x20",
          series("up", "g0", GATEWAY_UP): "1x20", series("up", "g1", GATEWAY_UP): "1x20"},
         "15m"),
    Case("KvgateRedisUnavailable", gw("kvgate_gateway_requests_total",
                                      'pool="p", tier="vip", outcome="unavailable"', "0+60x10"),
         "5m", {}, value="1"),
    # Failing from 0m: first seen at 1m, firing 3 minutes later.
    Case("KvgateRedisUnavailable", gw("kvgate_gateway_requests_total",
                                      'pool="p", tier="vip", outcome="unavailable"', "0+60x10"),
         "3m"),
    # The requests stop (the gateways left their Service) while the renewals go on failing:
    # one alert throughout, never resolved and raised again.
    *(Case("KvgateRedisUnavailable",
           gw("kvgate_gateway_requests_total", 'pool="p", tier="vip", outcome="unavailable"',
              "0+60x3 180x12")
           | gw("kvgate_gateway_redis_errors_total", 'op="renew"', "0+20x15"),
           at, {}, value=value) for at, value in (("4m", "500m"), ("9m", "333.3m"))),
    # One request answered 503 (a Redis blip), scraped every 15 s: never a page.
    *(Case("KvgateRedisUnavailable",
           gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="unavailable"',
              "0x4 1x40"), at, interval="15s") for at in ("4m", "6m")),
    # One lease renewal failed, likewise.
    Case("KvgateRedisUnavailable", gw("kvgate_gateway_redis_errors_total", 'op="renew"',
                                      "0x4 1x40"), "4m", interval="15s"),
    # Redis away for 30 s (a failover): renewals (every 3 s) and requests fail, then pass.
    Case("KvgateRedisUnavailable",
         gw("kvgate_gateway_redis_errors_total", 'op="renew"', "0x4 5 10 10x40")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="unavailable"',
              "0x4 40 80 80x40"), "5m", interval="15s"),
    # Away for good from 1m15s, scraped every 15 s: first seen by the 2m evaluation, firing
    # from 5m.
    *(Case("KvgateRedisUnavailable",
           gw("kvgate_gateway_redis_errors_total", 'op="renew"', "0x4 0+5x40"), at,
           fires, value="333.3m", interval="15s")
      for at, fires in (("4m", None), ("5m", {}))),
    Case("KvgateRedisUnavailable", gw("kvgate_gateway_requests_total",
                                      'pool="p", tier="vip", outcome="ok"', "0+60x10")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="vip", outcome="unavailable"',
              "0x10"), "5m"),
    # Redis down with no traffic (the gateways failed /readyz and left their Service): the
    # lease renewals still fail, every 3 s.
    Case("KvgateRedisUnavailable", gw("kvgate_gateway_redis_errors_total", 'op="renew"',
                                      "0+20x10"), "5m", {}, value="333.3m"),
    Case("KvgateRedisUnavailable", gw("kvgate_gateway_redis_errors_total", 'op="renew"',
                                      "0x10"), "5m"),
    Case("KvgateGatewaysDown", {series("up", "g0", 'job="kvgate-gateway"'): "1 1 0x10"},
         "4m", {"job": "kvgate-gateway"}, value="0"),
    Case("KvgateGatewaysDown", {series("up", "g0", 'job="kvgate-gateway"'): "1x10"}, "4m"),
    # Another project's gateway down is not kvgate's.
    Case("KvgateGatewaysDown", {series("up", "g0", 'job="kvgate-gateway"'): "1x10",
                                series("up", "i0", 'job="istio-ingressgateway"'): "0x10"},
         "4m"),
    # No kvgate gateway scraped at all, the schedulers scraped: for their namespace.
    Case("KvgateGatewaysDown", {series("up", "s0", 'job="kvgate-scheduler"'): "1x10"},
         "4m", {}, value="1"),
    # Nothing of kvgate scraped: absent() has no labels to keep, not even the namespace.
    Case("KvgateGatewaysDown", {series("up", "i0", 'job="istio-ingressgateway"'): "1x10"},
         "4m", {"namespace": ""}, value="1"),
    # A release's gateway targets are gone (scaled to 0, or not selected) while its schedulers
    # are scraped, and another release's gateways are up: absent() sees those.
    Case("KvgateGatewaysDown",
         SCHEDULERS | other("up", GATEWAY_UP, "1x40", "g0")
         | other("up", SCHEDULER_UP, "1x40", "s0"),
         "4m", {}, value="1"),
    # No gateway target anywhere, schedulers scraped: one alert, for their namespace.
    Case("KvgateGatewaysDown", SCHEDULERS, "4m", {}, value="1"),
    Case("KvgateGatewaysDown",
         SCHEDULERS | {series("up", "g0", GATEWAY_UP): "1x40"}
         | other("up", GATEWAY_UP, "1x40", "g0") | other("up", SCHEDULER_UP, "1x40", "s0"),
         "4m"),
    # A gateway SIGKILLed: its 31 tasks reaped about a lease TTL later, counted by the leader
    # (the standby's series stays at 0). Then quiet once the reap is out of the window.
    Case("KvgateGatewayTasksReaped",
         sched("kvgate_scheduler_reaped_total", 'pool="p", kind="reaped"', "0 0 31x20")
         | sched("kvgate_scheduler_reaped_total", 'pool="p", kind="reaped"', "0x20", "s1"),
         "4m", {"pool": "p"}, value="31"),
    Case("KvgateGatewayTasksReaped",
         sched("kvgate_scheduler_reaped_total", 'pool="p", kind="reaped"', "0 31x30"), "21m"),
    # Queued tasks expired by the reaper are no gateway's death.
    Case("KvgateGatewayTasksReaped",
         sched("kvgate_scheduler_reaped_total", 'pool="p", kind="expired"', "0+5x20"), "10m"),
    Case("KvgateRequestsDropped", gw("kvgate_gateway_requests_total",
                                     'pool="p", tier="vip", outcome="unknown_node"', "0 0 3x10"),
         "4m", {"pool": "p", "outcome": "unknown_node"}, value="3"),
    Case("KvgateRequestsDropped", gw("kvgate_gateway_requests_total",
                                     'pool="p", tier="vip", outcome="upstream_error"', "0 0 3x10"),
         "4m"),
    Case("KvgateRedisErrors", gw("kvgate_gateway_redis_errors_total", 'op="admit"', "0+30x12"),
         "10m", {"op": "admit"}, value="500m"),
    Case("KvgateRedisErrors", gw("kvgate_gateway_redis_errors_total", 'op="admit"', "0+30x12"),
         "5m"),
    Case("KvgateSchedulerRedisErrors",
         sched("kvgate_scheduler_redis_errors_total", 'pool="p"', "0+6x12"), "10m",
         {"pool": "p"}),
    Case("KvgateSchedulerRedisErrors",
         sched("kvgate_scheduler_redis_errors_total", 'pool="p"', "0 1 2 2x10"), "10m"),
    Case("KvgateFailOpen", gw("kvgate_gateway_fail_open_total", 'pool="p", tier="vip"',
                              "0+1x10"), "6m", {"pool": "p", "tier": "vip"}, value="5"),
    Case("KvgateFailOpen", gw("kvgate_gateway_fail_open_total", 'pool="p", tier="vip"',
                              "0x10"), "6m"),
    Case("KvgateSettlesGivenUp", gw("kvgate_gateway_settles_abandoned_total",
                                    'op="settle", reason="permanent"', "0+1x20"),
         "16m", {"op": "settle", "reason": "permanent"}, value="15"),
    # One given up 20 minutes ago is out of the window.
    Case("KvgateSettlesGivenUp", gw("kvgate_gateway_settles_abandoned_total",
                                    'op="settle", reason="permanent"', "0 1x30"), "21m"),
    # Ejected from 2m: not yet at 6m, firing from 7m.
    Case("KvgateNodeEjected", LEADER | sched("kvgate_scheduler_node_ejected",
                                             'pool="p", node="n1"', "0 0 1x10"), "6m"),
    Case("KvgateNodeEjected", LEADER | sched("kvgate_scheduler_node_ejected",
                                             'pool="p", node="n1"', "0 0 1x10"), "7m",
         {"pool": "p", "node": "n1"}),
    # A standby's last figures (its scrape failed, so Prometheus still holds them) are not read.
    Case("KvgateNodeEjected", LEADER | sched("kvgate_scheduler_node_ejected",
                                             'pool="p", node="n1"', "1x10", "s1"), "8m"),
    # Stuck from 2m: its own alert from 3m; never KvgateNodeEjected, which it also sets.
    Case("KvgateNodeStuck", LEADER | sched("kvgate_scheduler_node_stuck",
                                           'pool="p", node="n1"', "0 0 1x10"), "2m30s"),
    Case("KvgateNodeStuck", LEADER | sched("kvgate_scheduler_node_stuck",
                                           'pool="p", node="n1"', "0 0 1x10"), "3m",
         {"pool": "p", "node": "n1"}),
    Case("KvgateNodeEjected", LEADER | sched("kvgate_scheduler_node_ejected",
                                             'pool="p", node="n1"', "0 0 1x10")
         | sched("kvgate_scheduler_node_stuck", 'pool="p", node="n1"', "0 0 1x10"), "9m"),
    Case("KvgateNodeStuck", LEADER | sched("kvgate_scheduler_node_stuck",
                                           'pool="p", node="n1"', "1x10", "s1"), "5m"),
    # A refused probe: at once. Unanswered ones: three in 15 minutes, unless the node is
    # judged stuck (its own alert says so).
    Case("KvgateNodeProbesFail", LEADER | sched("kvgate_scheduler_probes_total",
                                                'pool="p", node="n1", outcome="refused"',
                                                "0 0 1x10"), "3m",
         {"pool": "p", "node": "n1", "outcome": "refused"}, value="1"),
    Case("KvgateNodeProbesFail", LEADER | sched("kvgate_scheduler_probes_total",
                                                'pool="p", node="n1", outcome="timeout"',
                                                "0 0+1x10"), "4m",
         {"pool": "p", "node": "n1", "outcome": "timeout"}, value="3"),
    Case("KvgateNodeProbesFail", LEADER | sched("kvgate_scheduler_probes_total",
                                                'pool="p", node="n1", outcome="timeout"',
                                                "0 0+1x10"), "3m"),
    Case("KvgateNodeProbesFail", LEADER | sched("kvgate_scheduler_probes_total",
                                                'pool="p", node="n1", outcome="timeout"',
                                                "0 0+1x10")
         | sched("kvgate_scheduler_node_stuck", 'pool="p", node="n1"', "1x10"), "4m"),
    # Stuck, probed in vain, restarted at 4m and back: the window's timeouts are the stuck
    # node's, already told.
    Case("KvgateNodeProbesFail", LEADER | sched("kvgate_scheduler_probes_total",
                                                'pool="p", node="n1", outcome="timeout"',
                                                "0 1 2 3 3x10")
         | sched("kvgate_scheduler_node_stuck", 'pool="p", node="n1"', "1 1 1 1 0x10"), "6m"),
    # The leader that judged it stuck and probed it in vain hands over at 4m (a standby
    # clears its gauges): the new leader has not judged it yet, and its history is the old's.
    Case("KvgateNodeProbesFail",
         sched("kvgate_scheduler_leader", "", "1 1 1 1 0x10")
         | sched("kvgate_scheduler_leader", "", "0 0 0 0 1x10", "s1")
         | sched("kvgate_scheduler_probes_total", 'pool="p", node="n1", outcome="timeout"',
                 "0 1 2 3 3x10")
         | sched("kvgate_scheduler_node_stuck", 'pool="p", node="n1"', "1 1 1 1 0x10")
         | sched("kvgate_scheduler_node_stuck", 'pool="p", node="n1"', "0x14", "s1"), "6m"),
    Case("KvgateNodeProbesFail", LEADER | sched("kvgate_scheduler_probes_total",
                                                'pool="p", node="n1", outcome="ok"',
                                                "0+1x10"), "5m"),
    Case("KvgateNodeRefusesGateway", gw("kvgate_gateway_upstream_errors_total",
                                        'pool="p", node="n1", kind="rejected"', "0+60x10"),
         "7m", {"pool": "p", "node": "n1"}),
    Case("KvgateNodeRefusesGateway", gw("kvgate_gateway_upstream_errors_total",
                                        'pool="p", node="n1", kind="timeout"', "0+60x10"),
         "7m"),
    # A stuck engine: the requests placed on it time out together, the upstream timeout after.
    Case("KvgateNodeTimeouts", gw("kvgate_gateway_upstream_errors_total",
                                  'pool="p", node="n1", kind="timeout"', "0 0 4x20"),
         "4m", {"pool": "p", "node": "n1"}, value="4"),
    Case("KvgateNodeTimeouts", gw("kvgate_gateway_upstream_errors_total",
                                  'pool="p", node="n1", kind="timeout"', "0 1x30"), "21m"),
    Case("KvgateNodeTimeouts", gw("kvgate_gateway_upstream_errors_total",
                                  'pool="p", node="n1", kind="broken_stream"', "0+3x20"),
         "10m"),
    Case("KvgateUpstreamErrors",
         gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="ok"', "0+540x30")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", '
              'outcome="upstream_error"', "0+60x30"), "21m", {"pool": "p"}, value="10%"),
    Case("KvgateUpstreamErrors",
         gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="ok"', "0+588x30")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", '
              'outcome="upstream_error"', "0+12x30"), "21m"),
    # A flood answered 429 (90/s) does not hide a node failing 10% of what reaches it.
    Case("KvgateUpstreamErrors",
         gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="rejected"',
            "0+5400x30")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="ok"', "0+540x30")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", '
              'outcome="upstream_error"', "0+60x30"), "21m", {"pool": "p"}, value="10%"),
    Case("KvgateUpstreamErrors",
         gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="rejected"',
            "0+5400x30")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", outcome="ok"', "0+588x30")
         | gw("kvgate_gateway_requests_total", 'pool="p", tier="normal", '
              'outcome="upstream_error"', "0+12x30"), "21m"),
    Case("KvgateKVPreemptions", LEADER | sched("kvgate_scheduler_node_preemptions",
                                               'pool="p", node="n1"', "0+1x30"), "16m",
         {"pool": "p", "node": "n1"}, value="15"),
    Case("KvgateKVPreemptions", LEADER | sched("kvgate_scheduler_node_preemptions",
                                               'pool="p", node="n1"', "5x30"), "16m"),
    Case("KvgatePoolRed", LEADER | sched("kvgate_scheduler_zone", 'pool="p"', "2x20"), "9m"),
    Case("KvgatePoolRed", LEADER | sched("kvgate_scheduler_zone", 'pool="p"', "2x20"), "10m",
         {"pool": "p"}),
    Case("KvgatePoolRed", LEADER | sched("kvgate_scheduler_zone", 'pool="p"', "1x20"), "15m"),
    Case("KvgateVipQueueTimeouts", gw("kvgate_gateway_rejections_total",
                                      'pool="p", tier="vip", reason="queue_timeout"', "0+1x20"),
         "10m", {"pool": "p"}, value="5"),
    Case("KvgateVipQueueTimeouts", gw("kvgate_gateway_rejections_total",
                                      'pool="p", tier="batch", reason="queue_timeout"',
                                      "0+1x20"), "10m"),
    # Released until 5m, then stuck with 40 queued: rate 0 from 10m, firing 10 minutes later.
    Case("KvgateQueueNotDraining",
         LEADER | sched("kvgate_scheduler_queue_depth", 'pool="p", tier="batch"', "40x30")
         | sched("kvgate_scheduler_released_total", 'pool="p", tier="batch"', "0+5x5 25x25"),
         "19m"),
    Case("KvgateQueueNotDraining",
         LEADER | sched("kvgate_scheduler_queue_depth", 'pool="p", tier="batch"', "40x30")
         | sched("kvgate_scheduler_released_total", 'pool="p", tier="batch"', "0+5x5 25x25"),
         "20m", {"pool": "p", "tier": "batch"}, value="40"),
    Case("KvgateQueueNotDraining",
         LEADER | sched("kvgate_scheduler_queue_depth", 'pool="p", tier="batch"', "40x30")
         | sched("kvgate_scheduler_released_total", 'pool="p", tier="batch"', "0+5x30"),
         "25m"),
    # First tokens at 0.5-1 s: P99 0.995 s, against an objective of 250 ms (fires), 2 s (not).
    Case("KvgateVipTtftOverObjective",
         LEADER | histogram("kvgate_gateway_ttft_seconds_bucket", 'pool="p", tier="vip"',
                            BUCKETS_08)
         | sched("kvgate_scheduler_vip_ttft_objective_seconds", 'pool="p"', "0.25x40"),
         "16m", {"pool": "p"}, value="995ms"),
    Case("KvgateVipTtftOverObjective",
         LEADER | histogram("kvgate_gateway_ttft_seconds_bucket", 'pool="p", tier="vip"',
                            BUCKETS_08)
         | sched("kvgate_scheduler_vip_ttft_objective_seconds", 'pool="p"', "2x40"), "16m"),
    Case("KvgateEventLoopLag",
         histogram("kvgate_gateway_event_loop_lag_seconds_bucket", "", LAG_75MS), "11m",
         {"instance": "g0"}, value="99.5ms"),
    Case("KvgateEventLoopLag",
         histogram("kvgate_gateway_event_loop_lag_seconds_bucket", "",
                   {"0.001": "0+100x40", "+Inf": "0+100x40"}), "11m"),
    Case("KvgateLeadershipFlapping",
         sched("kvgate_scheduler_leadership_changes_total", "", "0+1x30"), "16m", {},
         value="15"),
    Case("KvgateLeadershipFlapping",
         sched("kvgate_scheduler_leadership_changes_total", "", "0 1 1 1 2x30"), "20m"),
    # 20 a second from 0m: the 5-minute rate (not extrapolated below the counter's start)
    # passes 10/s at 3m, and the alert fires 10 minutes later.
    Case("KvgateAuthFailureStorm", gw("kvgate_gateway_auth_failures_total",
                                      'reason="invalid_api_key"', "0+1200x30"), "12m"),
    Case("KvgateAuthFailureStorm", gw("kvgate_gateway_auth_failures_total",
                                      'reason="invalid_api_key"', "0+1200x30"), "13m",
         {"reason": "invalid_api_key"}, value="20"),
    Case("KvgateAuthFailureStorm", gw("kvgate_gateway_auth_failures_total",
                                      'reason="invalid_api_key"', "0+60x30"), "11m"),
]


def render(template: str, labels: dict[str, str], value: str) -> str:
    """An annotation as Prometheus renders it for an alert with `labels` and `value`."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)
    return re.sub(r"\{\{\s*\$value(\s*\|\s*\w+)?\s*\}\}", value, text)


def expected(case: Case) -> list[dict[str, Any]]:
    if case.fires is None:
        return []
    rule = ALERTS[case.alert]
    labels = {**NS, **case.fires, "severity": rule["labels"]["severity"]}
    labels = {k: v for k, v in labels.items() if v}
    return [{"exp_labels": labels,
             "exp_annotations": {k: render(v, labels, case.value)
                                 for k, v in rule["annotations"].items()}}]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (`make promtool` installs Debian's 'prometheus')")
    return found


def promtool_passes(tmp_path: Path, rules: Path, tests: list[dict[str, Any]]) -> None:
    """promtool's unit tests of `rules` (its `tests` entries, evaluated each minute) pass."""
    spec = tmp_path / "alerts-test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                    "tests": tests}), encoding="utf-8")
    result = subprocess.run([promtool(), "test", "rules", str(spec)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_shown_to_fire_and_to_stay_quiet() -> None:
    firing = {c.alert for c in CASES if c.fires is not None}
    quiet = {c.alert for c in CASES if c.fires is None}
    assert firing == set(ALERTS) and quiet == set(ALERTS)


def test_prometheus_fires_each_alert_exactly_in_its_cases(tmp_path: Path) -> None:
    tests = [{"interval": case.interval,
              "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
              "alert_rule_test": [{"eval_time": case.at, "alertname": case.alert,
                                   "exp_alerts": expected(case)}]}
             for case in CASES]
    promtool_passes(tmp_path, RULES, tests)
