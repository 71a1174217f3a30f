"""deploy/grafana/kvgate-dashboard.json queries only what the gateway and the scheduler export.

The metric registries are built the way the services build them: `gateway.app.create_app`
and `scheduler.app.create_app` (both do no I/O until started) from a parsed configuration,
then every labelled metric gets one child so that `registry.collect()` lists the sample names
Prometheus will store (`_total` for counters, `_bucket`/`_sum`/`_count` for histograms)
with their label names.

Every PromQL expression of the dashboard (panel targets, annotations, the `pool` variable's
`label_values(...)`) is tokenised: string literals, `[...]` ranges, `{...}` matchers and
`by/without/on/ignoring/group_left/group_right (...)` label lists are set apart, an identifier
followed by `(` must be a PromQL function or aggregation, and every other identifier is a
metric name, which must be one of the exported sample names. Label names in matchers must be
labels of that metric, grouping labels and `{{legend}}` labels must exist on the metrics of
the expression (plus the target labels Prometheus adds: job, instance, pod, ...).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from admission.config import parse_config
from admission.tiers import Zone
from gateway.app import create_app as gateway_app
from gateway.state import METRICS
from scheduler.app import SERVICE
from scheduler.app import create_app as scheduler_app
from scheduler.metrics import ZONE_LEVEL

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate-dashboard.json"

TARGET_LABELS = frozenset({"job", "instance", "pod", "namespace", "service", "container",
                           "endpoint"})
"""Labels Prometheus (and the Prometheus Operator) attach to every scraped series."""

AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
})
FUNCTIONS = AGGREGATIONS | frozenset({
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters",
    "double_exponential_smoothing", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate",
    "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label",
    "sort_by_label_desc", "sqrt", "time", "timestamp", "vector", "year", "avg_over_time",
    "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
    "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time",
    "mad_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin",
    "sinh", "tan", "tanh", "deg", "rad", "pi",
})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})

TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<number>\d[\w.]*|\.\d\w*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@:])
  | (?P<space>\s+)
""", re.VERBOSE)
GRAFANA_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|\w+)")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<expr>.*\S)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")


# --- What the services export ----------------------------------------------------------------


def _config() -> dict[str, Any]:
    return {
        "pools": [{"name": "demo", "backends": [{"name": "node-0",
                                                 "url": "http://127.0.0.1:9"}]}],
        "tenants": [{"name": "acme", "tier": "vip"}],
    }


def _exercise(metrics_object: object, least: int = 10) -> None:
    """Create one child of every labelled metric, so that its samples are collected."""
    found = 0
    for metric in vars(metrics_object).values():
        if isinstance(metric, MetricWrapperBase):
            found += 1
            if metric._labelnames:
                metric.labels(*("x" for _ in metric._labelnames))
    assert found >= least, f"{type(metrics_object).__name__}: no metrics found on it"


def _samples(registry: CollectorRegistry) -> dict[str, tuple[str, frozenset[str]]]:
    """Sample name -> (metric type, label names), as a Prometheus scrape would store them."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family in registry.collect():
        assert family.samples, f"{family.name}: no samples even after exercising its labels"
        for sample in family.samples:
            out[sample.name] = (family.type, frozenset(sample.labels))
    return out


def gateway_samples(*, tenant_metrics: bool = False) -> dict[str, tuple[str, frozenset[str]]]:
    data = _config()
    data["gateway"] = {"tenant_metrics": tenant_metrics}
    app = gateway_app(parse_config(data, env={}), gateway_id="gw-test")
    metrics = app[METRICS]
    _exercise(metrics)
    return _samples(metrics.registry)


def scheduler_samples() -> dict[str, tuple[str, frozenset[str]]]:
    app = scheduler_app(parse_config(_config(), env={}), me="sched-test")
    metrics = app[SERVICE].metrics
    _exercise(metrics)
    _exercise(metrics.fair, least=8)  # per tenant and team (scheduler.fairmetrics)
    return _samples(metrics.registry)


GATEWAY = gateway_samples()
SCHEDULER = scheduler_samples()
EXPORTED = {**GATEWAY, **SCHEDULER}


# --- PromQL, read just enough ----------------------------------------------------------------


@dataclass(slots=True)
class Query:
    expr: str
    metrics: dict[str, set[str]] = field(default_factory=dict)
    """Metric name -> label names used in its matchers."""
    grouping: set[str] = field(default_factory=set)
    """Labels of by / without / on / ignoring / group_left / group_right lists."""
    output: set[str] = field(default_factory=set)
    """Labels of by (...) lists: what an aggregated result keeps."""


def for_promql(expr: str) -> str:
    """The expression with Grafana's variables replaced by something PromQL accepts."""
    return GRAFANA_VARIABLE.sub("5m", expr)


def tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = for_promql(expr)
    depth = 0
    while pos < len(text):
        match = TOKEN.match(text, pos)
        assert match is not None, f"cannot read {text[pos:pos + 20]!r} in {expr!r}"
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, match.group()))
        depth += {"(": 1, ")": -1}.get(match.group(), 0)
        assert depth >= 0, f"unbalanced ) in {expr!r}"
        pos = match.end()
    assert depth == 0, f"unbalanced ( in {expr!r}"
    return out


def read_promql(expr: str) -> Query:
    q = Query(expr)
    toks = tokens(expr)
    i = 0

    def next_is(index: int, value: str) -> bool:
        return index < len(toks) and toks[index][1] == value

    last_metric: str | None = None
    while i < len(toks):
        kind, value = toks[i]
        if value == "[":  # a range or subquery: durations only
            depth = 1
            while depth:
                i += 1
                assert i < len(toks), f"unclosed [ in {expr!r}"
                depth += {"[": 1, "]": -1}.get(toks[i][1], 0)
        elif value == "{":  # matchers of the metric just before (if any)
            i += 1
            while not next_is(i, "}"):
                assert i < len(toks), f"unclosed {{ in {expr!r}"
                label_kind, label = toks[i]
                assert label_kind == "ident", f"label name expected, got {label!r} in {expr!r}"
                assert label != "__name__", f"__name__ matchers are not checked: {expr!r}"
                assert toks[i + 1][1] in ("=", "!=", "=~", "!~"), f"matcher expected: {expr!r}"
                assert toks[i + 2][0] == "string", f"string expected after {label}: {expr!r}"
                if last_metric is not None:
                    q.metrics[last_metric].add(label)
                i += 3
                if next_is(i, ","):
                    i += 1
        elif kind == "ident":
            lower = value.lower()
            if lower in GROUPING:
                if next_is(i + 1, "("):
                    i += 2
                    while not next_is(i, ")"):
                        assert i < len(toks), f"unclosed label list in {expr!r}"
                        if toks[i][0] == "ident":
                            q.grouping.add(toks[i][1])
                            if lower == "by":
                                q.output.add(toks[i][1])
                        i += 1
            elif next_is(i + 1, "(") and lower not in KEYWORDS:  # `a or (b)`: an operator
                assert value in FUNCTIONS, f"unknown PromQL function {value!r} in {expr!r}"
            elif value in AGGREGATIONS:
                pass  # `sum by (...) (...)`: the label list comes first
            elif lower not in KEYWORDS:
                q.metrics.setdefault(value, set())
                last_metric = value
                i += 1
                continue
        last_metric = None
        i += 1
    return q


# --- The dashboard ---------------------------------------------------------------------------


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # inside collapsed rows


@dataclass(frozen=True, slots=True)
class Expr:
    where: str
    expr: str
    legend: str = ""


def expressions(dashboard: dict[str, Any]) -> list[Expr]:
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append(Expr(f"panel {panel['title']!r} {target['refId']}", target["expr"],
                            target.get("legendFormat", "")))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            out.append(Expr(f"annotation {annotation['name']!r}", annotation["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            match = LABEL_VALUES.match(text)
            assert match and match["expr"], f"variable {variable['name']}: {text!r}"
            out.append(Expr(f"variable {variable['name']!r}", match["expr"],
                            "{{" + match["label"] + "}}"))
    return out


DASH = load()
EXPRS = expressions(DASH)


def test_dashboard_loads_with_schema_and_variables() -> None:
    assert DASH["schemaVersion"] >= 36
    assert DASH["uid"] and DASH["title"]
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    pool = variables["pool"]
    assert pool["type"] == "query"
    assert pool["datasource"]["uid"] == "${datasource}"
    assert LABEL_VALUES.match(pool["definition"])


def test_panel_ids_are_unique_and_every_panel_has_a_datasource_and_targets() -> None:
    panels = list(all_panels(DASH))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    queried = [p for p in panels if p["type"] != "row"]
    assert len(queried) >= 15
    for panel in panels:
        if panel["type"] == "row":
            # Rows only lay the dashboard out: they must not carry queries of their own.
            assert not panel.get("targets"), f"row {panel['title']!r} has targets"
            continue
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], f"{title}: no targets"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{title}: duplicate refId"
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", title
            assert t["expr"].strip(), title
        assert panel.get("description"), f"{title}: say what the panel shows"


def test_panels_fit_the_grid_without_overlapping() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(DASH):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_registries_are_the_services_own() -> None:
    # The derivation must see both services' metrics, with counters and histograms exposed
    # the way prometheus_client writes them.
    assert GATEWAY["kvgate_gateway_requests_total"][0] == "counter"
    assert "le" in GATEWAY["kvgate_gateway_ttft_seconds_bucket"][1]
    assert SCHEDULER["kvgate_scheduler_zone"] == ("gauge", frozenset({"pool"}))
    assert "kvgate_gateway_requests" not in EXPORTED
    # Tenant labels change labels, not names.
    assert set(gateway_samples(tenant_metrics=True)) == set(GATEWAY)


def test_the_promql_reader_finds_metrics_and_rejects_unknown_functions() -> None:
    q = read_promql('histogram_quantile(0.99, sum by (tier, le) (rate('
                    'kvgate_gateway_ttft_seconds_bucket{pool=~"$pool", tier!="batch"}'
                    '[$__rate_interval]))) and on (instance) up offset 5m')
    assert q.metrics == {"kvgate_gateway_ttft_seconds_bucket": {"pool", "tier"}, "up": set()}
    assert q.grouping == {"tier", "le", "instance"}
    assert q.output == {"tier", "le"}
    # A set operator before a parenthesis is no function call.
    q = read_promql('up == 0 or (group by (namespace) (kvgate_scheduler_leader) unless on '
                    '(namespace) group by (namespace) (up{job="g"}))')
    assert q.metrics == {"up": {"job"}, "kvgate_scheduler_leader": set()}
    assert q.grouping == {"namespace"}
    with pytest.raises(AssertionError, match="unknown PromQL function"):
        read_promql("sum(rated(kvgate_gateway_requests_total[5m]))")
    with pytest.raises(AssertionError, match="unbalanced"):
        read_promql("sum(rate(kvgate_gateway_requests_total[5m]) by (tier)")


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    unknown = []
    for e in EXPRS:
        for name in read_promql(e.expr).metrics:
            if name not in EXPORTED:
                hint = [n for n in EXPORTED if n.startswith(name)]
                unknown.append(f"{e.where}: {name}" + (f" (exported: {hint})" if hint else ""))
    assert not unknown, "metrics no service exports:\n" + "\n".join(unknown)


def test_labels_used_by_the_dashboard_exist_on_its_metrics() -> None:
    wrong = []
    for e in EXPRS:
        q = read_promql(e.expr)
        available = set(TARGET_LABELS)
        for name, matchers in q.metrics.items():
            labels = EXPORTED[name][1] if name in EXPORTED else frozenset()
            available |= labels
            for label in matchers - labels - TARGET_LABELS:
                wrong.append(f"{e.where}: {name} has no label {label!r}")
        for label in q.grouping - available:
            wrong.append(f"{e.where}: grouping by {label!r}, which none of its metrics has")
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", e.legend))
        keeps = q.output if q.output else available
        for label in legend - keeps:
            wrong.append(f"{e.where}: legend uses {label!r}, not in the result")
    assert not wrong, "\n".join(wrong)


def test_scheduler_gauges_are_read_from_the_leader_only() -> None:
    # A replica that stopped leading drops its gauges, but one whose scrape failed keeps them in
    # Prometheus for five minutes: without this filter its stale zone, usage or queue depth
    # would be summed with the leader's.
    allowed = {"kvgate_scheduler_leader", "kvgate_scheduler_epoch"}
    leader_only = re.compile(r"and on \(instance\) \(kvgate_scheduler_leader == 1\)")
    unfiltered = []
    for e in EXPRS:
        gauges = {n for n in read_promql(e.expr).metrics
                  if n in SCHEDULER and SCHEDULER[n][0] == "gauge" and n not in allowed}
        if gauges and not leader_only.search(e.expr) and not e.where.startswith("variable"):
            unfiltered.append(f"{e.where}: {sorted(gauges)}")
    assert not unfiltered, "\n".join(unfiltered)


def test_every_query_reads_the_chosen_namespace_only() -> None:
    """Two releases scraped by one Prometheus (staging and production) were summed in every
    panel: "Scheduler leaders" showed 2 and pools of one name merged. Every selector of a
    kvgate metric carries the namespace variable, except the leader filter, which matches on
    `instance` (a target's own)."""
    selector = re.compile(r"\b(kvgate_[a-z0-9_]+)(\{[^}]*\})?")
    unscoped = []
    for e in EXPRS:
        if e.where == "variable 'namespace'":
            continue  # the list of namespaces to choose from
        text = e.expr.replace("(kvgate_scheduler_leader == 1)", "")
        unscoped += [f"{e.where}: {m[1]}" for m in selector.finditer(text)
                     if 'namespace=~"$namespace"' not in (m[2] or "")]
    assert not unscoped, "\n".join(unscoped)
    variables = [v["name"] for v in DASH["templating"]["list"]]
    assert variables.index("namespace") < variables.index("pool")  # pools of the namespace


def test_the_dashboard_covers_what_operators_need() -> None:
    used = {name for e in EXPRS for name in read_promql(e.expr).metrics}
    needed = {
        "zone": {"kvgate_scheduler_zone"},
        "KV usage per node": {"kvgate_scheduler_kv_usage"},
        "projected usage": {"kvgate_scheduler_projected_usage", "kvgate_scheduler_pool_usage"},
        "queue depth per tier": {"kvgate_scheduler_queue_depth"},
        "429s by reason": {"kvgate_gateway_rejections_total"},
        "requests by tier and outcome": {"kvgate_gateway_requests_total"},
        "TTFT per tier": {"kvgate_gateway_ttft_seconds_bucket"},
        "queue wait per tier": {"kvgate_gateway_queue_wait_seconds_bucket"},
        "tokens reserved vs settled": {"kvgate_gateway_tokens_reserved_total",
                                       "kvgate_gateway_tokens_settled_total"},
        "leader and epoch": {"kvgate_scheduler_leader", "kvgate_scheduler_epoch"},
        "scrape health": {"kvgate_scheduler_scrape_errors_total",
                          "kvgate_scheduler_stale_scrapes_total"},
        "Redis errors and fail-open": {"kvgate_gateway_redis_errors_total",
                                       "kvgate_scheduler_redis_errors_total",
                                       "kvgate_gateway_fail_open_total"},
    }
    missing = {topic: sorted(names - used) for topic, names in needed.items() if names - used}
    assert not missing, missing
    quantiles = {e.expr.split(",")[0] for e in EXPRS if "ttft_seconds_bucket" in e.expr}
    assert quantiles == {"histogram_quantile(0.5", "histogram_quantile(0.99"}


def test_zone_panels_map_the_exported_levels_to_zone_names() -> None:
    zone_panels = [p for p in all_panels(DASH) if any(
        "kvgate_scheduler_zone" in t["expr"] for t in p.get("targets", []))]
    assert {p["type"] for p in zone_panels} >= {"state-timeline"}
    for panel in zone_panels:
        mapped = {}
        for mapping in panel["fieldConfig"]["defaults"]["mappings"]:
            if mapping["type"] == "value":
                mapped.update({int(k): v["text"] for k, v in mapping["options"].items()})
        assert mapped == {level: zone.value for zone, level in ZONE_LEVEL.items()}, (
            panel["title"])
        assert set(mapped.values()) == {z.value for z in Zone}


def test_expressions_parse_with_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (`make promtool` installs Debian's 'prometheus')")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvgate:dashboard:expr{i}", "expr": for_promql(e.expr)}
        for i, e in enumerate(EXPRS)
    ]}]}
    path = tmp_path / "rules.json"  # JSON is YAML
    path.write_text(json.dumps(rules), encoding="utf-8")
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr



def _panel(title: str) -> dict[str, Any]:
    (panel,) = [p for p in all_panels(DASH) if p["title"] == title]
    return panel


def _promtool_eval(tmp_path: Path, series: dict[str, str], expr: str,
                   expected: list[dict[str, Any]]) -> None:
    """`expr` evaluated by Prometheus itself (promtool's rule unit tests) one minute after
    `series` (promtool's expanding notation, one value a minute) start: `expected` samples."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (`make promtool` installs Debian's 'prometheus')")
    last = max(len(v.split()) for v in series.values()) - 1
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        # Every pool selected (the variable's allValue), then the range variables.
        "promql_expr_test": [{"expr": for_promql(
            expr.replace("$pool", ".*").replace("$namespace", ".*")),
                              "eval_time": f"{last}m",
                              "exp_samples": expected}],
    }]}
    path = tmp_path / "test.json"
    path.write_text(json.dumps(test), encoding="utf-8")
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_zone_stat_says_no_leader_when_no_replica_leads(tmp_path: Path) -> None:
    panel = _panel("Zone now")
    (target,) = panel["targets"]
    leading = {'kvgate_scheduler_leader{instance="s1"}': "1 1",
               'kvgate_scheduler_zone{instance="s1",pool="demo"}': "2 2"}
    _promtool_eval(tmp_path, leading, target["expr"], [{"labels": '{pool="demo"}', "value": 2}])
    # The leader died: its replica (or a standby) exports leader 0 and drops its pool gauges.
    # The query then returns no series at all, which Grafana shows as the panel's noValue: a
    # mapping of null never applies, and "No data" reads like a broken dashboard.
    gone = {'kvgate_scheduler_leader{instance="s1"}': "1 0",
            'kvgate_scheduler_zone{instance="s1",pool="demo"}': "2 stale"}
    _promtool_eval(tmp_path, gone, target["expr"], [])
    assert panel["fieldConfig"]["defaults"].get("noValue") == "no leader"


def test_the_leader_stat_colours_the_count_only_and_shows_the_epoch_whole() -> None:
    panel = _panel("Scheduler leaders")
    legends = {t["legendFormat"] for t in panel["targets"]}
    assert legends == {"leaders", "epoch"}
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    # An epoch starts from Redis TIME in µs: the thresholds meant for the leader count (red
    # from 2 replicas up) would paint it red, and "short" would show it as "2 Quadr".
    epoch = 1_796_574_936_306_695
    assert epoch >= max(s["value"] for s in steps if s["value"] is not None)
    (override,) = [o for o in panel["fieldConfig"]["overrides"]
                   if o["matcher"] == {"id": "byName", "options": "epoch"}]
    props = {p["id"]: p["value"] for p in override["properties"]}
    assert props["unit"] == "none" and props["decimals"] == 0
    assert props["color"]["mode"] == "fixed"
