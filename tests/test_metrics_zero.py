"""Counter series are exported at 0 before their first event, as the services build them.

Prometheus' `rate()` and `increase()` see nothing of a series whose first scrape shows it at 1,
so the first upstream error, orphan, fenced write or failed scrape of its kind would never
reach a dashboard or an alert. Two halves:

- the label values the code passes are read out of its source (ast) and must be in the
  vocabulary the metrics module pre-creates (`UPSTREAM_ERROR_KINDS`, `REQUEST_OUTCOMES`,
  `REJECTION_REASONS`, `REAP_KINDS`, `SCRAPE_FAILURES`): a value added to the code and not to
  the vocabulary fails here (the reader must also find the values known today, or a reader
  that stopped seeing them would pass everything);
- the registries that `gateway.app.create_app` and `scheduler.app.create_app` build from a
  configuration (no I/O) hold every series of that vocabulary x the configured pools, nodes,
  teams and tiers at 0 (with tenant labels, per configured tenant too).

The source reader resolves a label argument through string constants, module constants (also
imported ones), conditional expressions, `a or b`, local assignments, a function's returns, a
parameter through the calls of its function in the same file, and an attribute through every
assignment to that attribute; anything else must be named in `OVERRIDES` or the test fails.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter, Gauge, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from admission.config import Config, parse_config
from admission.outcomes import RejectReason
from admission.tiers import Tier
from gateway.app import create_app as gateway_app
from gateway.metrics import (
    INVALID,
    REJECTION_REASONS,
    REQUEST_OUTCOMES,
    UNPARSED_POOL,
    UPSTREAM_ERROR_KINDS,
    GatewayMetrics,
)
from gateway.state import METRICS
from scheduler.app import SERVICE
from scheduler.app import create_app as scheduler_app
from scheduler.metrics import REAP_KINDS, SchedulerMetrics
from scheduler.nodestate import NodeRoom
from scheduler.scrape import SCRAPE_FAILURES

ROOT = Path(__file__).resolve().parent.parent
# The metrics modules are left out: they hold the vocabularies, and create every series.
GATEWAY_SOURCES = sorted(set((ROOT / "gateway").glob("*.py")) - {ROOT / "gateway/metrics.py"})
SCHEDULER_SOURCES = sorted(
    set((ROOT / "scheduler").glob("*.py")) - {ROOT / "scheduler/metrics.py"})
OPEN = "*"
"""Appended to an f-string's literal prefix: the values it stands for are an open set."""
OVERRIDES = {"str(result.reason)": {reason.value for reason in RejectReason}}
"""Label expressions the reader cannot follow, by their source text -> the values they take."""

Function = ast.FunctionDef | ast.AsyncFunctionDef


# --- reading label values out of the source ---------------------------------------------------


@dataclass(slots=True)
class Module:
    path: Path
    tree: ast.Module
    constants: dict[str, ast.expr] = field(default_factory=dict)
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Local name -> (module, name) of a `from module import name`."""
    functions: dict[str, list[Function]] = field(default_factory=dict)
    enclosing: dict[int, Function] = field(default_factory=dict)
    """id(node) -> the innermost function holding it."""


def _load(path: Path) -> Module:
    module = Module(path, ast.parse(path.read_text(encoding="utf-8")))
    for node in module.tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    module.constants[target.id] = node.value
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                module.imported[alias.asname or alias.name] = (node.module, alias.name)
    for each in ast.walk(module.tree):
        if isinstance(each, ast.FunctionDef | ast.AsyncFunctionDef):
            module.functions.setdefault(each.name, []).append(each)
            for inner in ast.walk(each):
                if inner is not each:
                    module.enclosing[id(inner)] = each  # inner functions are walked later
    return module


class Unresolved(AssertionError):
    """A label expression the reader cannot follow."""


class Reader:
    def __init__(self, paths: list[Path]) -> None:
        self.modules = [_load(p) for p in paths]

    def values(self, expr: ast.expr, module: Module, seen: frozenset[int] = frozenset()
               ) -> set[str]:
        if id(expr) in seen:
            return set()  # a parameter passed along a recursive call
        seen |= {id(expr)}
        text = ast.unparse(expr)
        if text in OVERRIDES:
            return OVERRIDES[text]
        if isinstance(expr, ast.Constant):
            return {expr.value} if isinstance(expr.value, str) else set()
        if isinstance(expr, ast.JoinedStr):
            head = expr.values[0] if expr.values else None
            prefix = str(head.value) if isinstance(head, ast.Constant) else ""
            return {prefix + OPEN}
        if isinstance(expr, ast.IfExp):
            return self.values(expr.body, module, seen) | self.values(expr.orelse, module, seen)
        if isinstance(expr, ast.BoolOp):
            return set().union(*(self.values(v, module, seen) for v in expr.values))
        if isinstance(expr, ast.Name):
            return self._name(expr, module, seen)
        if isinstance(expr, ast.Attribute):
            return self._attribute(expr, module, seen)
        if isinstance(expr, ast.Call):
            name = _called(expr)
            if name in module.functions:
                return set().union(*(
                    self.values(r.value, module, seen)
                    for f in module.functions[name] for r in ast.walk(f)
                    if isinstance(r, ast.Return) and r.value is not None))
        raise Unresolved(f"{module.path.name}: cannot follow {text!r}")

    def _name(self, expr: ast.Name, module: Module, seen: frozenset[int]) -> set[str]:
        function = module.enclosing.get(id(expr))
        if function is not None:
            assigned = [n.value for n in ast.walk(function)
                        if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None
                        and any(isinstance(t, ast.Name) and t.id == expr.id
                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            if assigned:
                return set().union(*(self.values(v, module, seen) for v in assigned))
            params = [a.arg for a in function.args.args]
            if expr.id in params:
                return self._arguments(function, params.index(expr.id), expr.id, module, seen)
        if expr.id in module.constants:
            return self.values(module.constants[expr.id], module, seen)
        if expr.id in module.imported:
            return _imported(*module.imported[expr.id])
        raise Unresolved(f"{module.path.name}: cannot follow name {expr.id!r}")

    def _arguments(self, function: Function, index: int, name: str, module: Module,
                   seen: frozenset[int]) -> set[str]:
        """What the calls of `function` in its module pass for its parameter `name`."""
        if function.args.args and function.args.args[0].arg == "self":
            index -= 1
        passed = []
        for call in ast.walk(module.tree):
            if isinstance(call, ast.Call) and _called(call) == function.name:
                passed += [k.value for k in call.keywords if k.arg == name]
                if len(call.args) > index:
                    passed.append(call.args[index])
        if not passed:
            raise Unresolved(f"{module.path.name}: nothing calls {function.name} here")
        return set().union(*(self.values(arg, module, seen) for arg in passed))

    def _attribute(self, expr: ast.Attribute, module: Module, seen: frozenset[int]
                   ) -> set[str]:
        base = expr.value
        if isinstance(base, ast.Name) and base.id in module.imported:
            source, attr = module.imported[base.id]
            if importlib.util.find_spec(f"{source}.{attr}") is not None:  # `from a import mod`
                return _imported(f"{source}.{attr}", expr.attr)
        found: set[str] = set()
        assignments = 0
        for other in self.modules:
            for node in ast.walk(other.tree):
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Attribute) and t.attr == expr.attr for t in targets):
                        assignments += 1
                        found |= self.values(node.value, other, seen)
        if not assignments:
            raise Unresolved(f"{module.path.name}: nothing assigns .{expr.attr}")
        return found

    def counted(self, match: Callable[[ast.Call], bool]) -> set[str]:
        """The values of the last label argument of every call `match` accepts."""
        out: set[str] = set()
        for module in self.modules:
            for call in ast.walk(module.tree):
                if isinstance(call, ast.Call) and match(call) and call.args:
                    out |= self.values(call.args[-1], module)
        return out


def _called(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _imported(source: str, attr: str) -> set[str]:
    value = getattr(importlib.import_module(source), attr)
    assert isinstance(value, str), (source, attr, value)
    return {value}


def increments(metric: str) -> Callable[[ast.Call], bool]:
    """`metrics.child(metrics.<metric>, ...)` or `metrics.<metric>.labels(...)`."""
    def match(call: ast.Call) -> bool:
        func = call.func
        if not isinstance(func, ast.Attribute):
            return False
        if func.attr == "child":
            return bool(call.args) and isinstance(call.args[0], ast.Attribute) and (
                call.args[0].attr == metric)
        return func.attr == "labels" and isinstance(func.value, ast.Attribute) and (
            func.value.attr == metric)
    return match


GATEWAY_CODE = Reader(GATEWAY_SOURCES)
SCHEDULER_CODE = Reader(SCHEDULER_SOURCES)


def in_vocabulary(found: set[str], vocabulary: tuple[str, ...], known: set[str]) -> None:
    assert known <= found, f"the reader no longer sees {sorted(known - found)}"
    assert found <= set(vocabulary), f"not exported at 0: {sorted(found - set(vocabulary))}"


def test_every_upstream_error_kind_the_proxy_counts_is_in_the_vocabulary() -> None:
    in_vocabulary(GATEWAY_CODE.counted(increments("upstream_errors")), UPSTREAM_ERROR_KINDS,
                  {"unreachable", "error", "rejected", "timeout", "broken_stream",
                   "oversized_event"})


def test_every_request_outcome_and_rejection_reason_counted_is_in_the_vocabulary() -> None:
    in_vocabulary(GATEWAY_CODE.counted(increments("requests")), REQUEST_OUTCOMES,
                  set(REQUEST_OUTCOMES))
    in_vocabulary(GATEWAY_CODE.counted(increments("rejections")), REJECTION_REASONS,
                  {"zone_red", "queue_timeout"})


def test_every_reap_kind_and_scrape_failure_reason_is_in_the_vocabulary() -> None:
    in_vocabulary(SCHEDULER_CODE.counted(increments("reaped")), REAP_KINDS, set(REAP_KINDS))
    # The reason reaches the counter through the poller's hook: what the poller reports. Its
    # one open-ended reason, http_<status>, appears with its first occurrence.
    reasons = SCHEDULER_CODE.counted(
        lambda call: isinstance(call.func, ast.Attribute) and call.func.attr == "on_scrape")
    in_vocabulary(reasons - {"http_" + OPEN}, SCRAPE_FAILURES, set(SCRAPE_FAILURES))
    assert "http_" + OPEN in reasons


def test_the_reader_follows_what_it_claims_and_refuses_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "sample.py"
    path.write_text(
        "from gateway import metrics as m\n"
        "from gateway.metrics import OK\n"
        "LOCAL = 'local'\n"
        "def pick(e):\n"
        "    if e: return m.INVALID\n"
        "    return e.tag\n"
        "class C:\n"
        "    def fail(self, kind):\n"
        "        self.metrics.child(self.metrics.x, 'p', kind).inc()\n"
        "    def run(self, e):\n"
        "        self.fail('a' if e else LOCAL)\n"
        "        self.fail(kind=OK)\n"
        "        k = pick(e) or f'http_{e}'\n"
        "        self.metrics.x.labels('p', k).inc()\n"
        "        e.tag = 'tagged'\n"
        "        self.metrics.y.labels('p', e.unknown).inc()\n", encoding="utf-8")
    reader = Reader([path])
    assert reader.counted(increments("x")) == {"a", "local", "ok", "invalid", "tagged",
                                               "http_" + OPEN}
    with pytest.raises(Unresolved, match=r"nothing assigns \.unknown"):
        reader.counted(increments("y"))


# --- the registries as the services build them ------------------------------------------------


def config(**gateway: Any) -> Config:
    return parse_config({
        "gateway": gateway,
        "scheduler": {"stale_policy": "last"},
        "pools": [
            {"name": "llama", "backends": [{"name": "n1", "url": "http://127.0.0.1:9"},
                                           {"name": "n2", "url": "http://127.0.0.1:10"}]},
            {"name": "qwen", "backends": [{"name": "q1", "url": "http://127.0.0.1:9"}]},
        ],
        "teams": [{"name": "crew"}, {"name": "ops", "parent": "crew"}],
        "tenants": [{"name": "acme", "tier": "vip", "team": "ops"}],
    }, env={})


NODES = {"llama": ("n1", "n2"), "qwen": ("q1",)}
TIERS = tuple(t.label for t in Tier)

Key = tuple[str, frozenset[tuple[str, str]]]
Series = dict[Key, float]


def series(metrics: GatewayMetrics | SchedulerMetrics) -> Series:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in metrics.registry.collect() for s in family.samples
            if not s.name.endswith("_created")}


def counters(metrics: object) -> Iterator[tuple[str, Counter]]:
    for name, metric in vars(metrics).items():
        if isinstance(metric, Counter):
            yield name, metric


def has_series(metric: MetricWrapperBase) -> bool:
    return any(family.samples for family in metric.collect())


def label(key: Key, name: str) -> str:
    return dict(key[1])[name]


def expect(found: Series, name: str, *label_sets: dict[str, str]) -> None:
    for labels in label_sets:
        key = (name + "_total", frozenset(labels.items()))
        assert found.get(key) == 0.0, f"{name}{labels}: {found.get(key)}"


def test_the_gateway_exports_its_counters_at_zero_from_the_start() -> None:
    metrics = gateway_app(config(fail_open_tiers=["vip"]), gateway_id="gw-test")[METRICS]
    found = series(metrics)
    p = "kvgate_gateway_"
    for pool, nodes in NODES.items():
        expect(found, p + "upstream_errors", *({"pool": pool, "node": n, "kind": k}
                                               for n in nodes for k in UPSTREAM_ERROR_KINDS))
        expect(found, p + "orphans", {"pool": pool})
        expect(found, p + "wake_fallbacks", {"pool": pool})
        expect(found, p + "fail_open", {"pool": pool, "tier": "vip"})
        expect(found, p + "quota_rejections", *({"pool": pool, "scope": s}
                                                for s in ("key", "team:crew", "team:ops")))
        expect(found, p + "requests", *({"pool": pool, "tier": t, "outcome": o}
                                        for t in TIERS for o in REQUEST_OUTCOMES))
        expect(found, p + "rejections", *({"pool": pool, "tier": t, "reason": r}
                                          for t in TIERS for r in REJECTION_REASONS))
        for name in ("tokens_reserved", "tokens_settled"):
            expect(found, p + name, *({"pool": pool, "tier": t} for t in TIERS))
    expect(found, p + "requests", *({"pool": UNPARSED_POOL, "tier": t, "outcome": INVALID}
                                    for t in TIERS))
    # Only the tiers that can fail open; no node, pool or scope the configuration lacks.
    assert {label(k, "tier") for k in found if k[0] == p + "fail_open_total"} == {"vip"}
    assert {label(k, "node") for k in found if k[0] == p + "upstream_errors_total"} == {
        "n1", "n2", "q1"}
    # Every labelled counter has its series: a counter added later is caught here.
    for name, counter in counters(metrics):
        assert has_series(counter), f"{name} has no series at start"
    # The first event is an increase of 1 between two scrapes.
    metrics.child(metrics.upstream_errors, "qwen", "q1", "unreachable").inc()
    key = (p + "upstream_errors_total",
           frozenset({"pool": "qwen", "node": "q1", "kind": "unreachable"}.items()))
    assert series(metrics)[key] - found[key] == 1.0


def test_tenant_labelled_counters_exist_at_zero_for_each_configured_tenant() -> None:
    """With `tenant_metrics` (as the chart's production values set it) the per-tier series
    carry a tenant: created for each configured tenant, in its own tier, so the alerts on them
    see a tenant's first event too (they missed it before)."""
    conf = config(tenant_metrics=True, fail_open_tiers=["batch"])
    conf = dataclasses.replace(conf, tenants=(
        *conf.tenants, dataclasses.replace(conf.tenants[0], name="bulk", tier=Tier.BATCH)))
    metrics = gateway_app(conf, gateway_id="gw-test")[METRICS]
    found = series(metrics)
    for name, counter in counters(metrics):
        assert has_series(counter), name
    expect(found, "kvgate_gateway_orphans", {"pool": "llama"})
    for pool in NODES:
        expect(found, "kvgate_gateway_requests", *(
            {"pool": pool, "tier": "vip", "tenant": "acme", "outcome": outcome}
            for outcome in REQUEST_OUTCOMES))
        expect(found, "kvgate_gateway_rejections", *(
            {"pool": pool, "tier": "vip", "tenant": "acme", "reason": reason}
            for reason in REJECTION_REASONS))
    tenant_tiers = {(label(key, "tenant"), label(key, "tier")) for key in found
                    if "tenant" in dict(key[1])}
    assert tenant_tiers == {("acme", "vip"), ("bulk", "batch")}


def test_the_scheduler_exports_its_counters_at_zero_and_keeps_them_on_stepping_down() -> None:
    metrics = scheduler_app(config(), me="sched-test")[SERVICE].metrics
    found = series(metrics)
    p = "kvgate_scheduler_"
    for pool, nodes in NODES.items():
        for name in ("fenced", "expired", "redis_errors"):
            expect(found, p + name, {"pool": pool})
        expect(found, p + "released", *({"pool": pool, "tier": t} for t in TIERS))
        expect(found, p + "reaped", *({"pool": pool, "kind": k} for k in REAP_KINDS))
        expect(found, p + "scrape_errors", *({"pool": pool, "node": n, "reason": r}
                                             for n in nodes for r in SCRAPE_FAILURES))
        expect(found, p + "stale_scrapes", *({"pool": pool, "node": n, "policy": "last"}
                                             for n in nodes))
    for name, counter in counters(metrics):
        assert has_series(counter), f"{name} has no series at start"
    # A replica that stops leading drops its per-pool gauges, never its counters.
    metrics.zone.labels("llama").set(1)
    metrics.forget_pools()
    assert not any(isinstance(m, Gauge) and m._labelnames and has_series(m)
                   for m in vars(metrics).values())
    assert series(metrics) == found


def test_the_pages_carry_no_created_series() -> None:
    """A `_created` series per counter series doubled the pages (a gateway of 10 pools of 256
    nodes served 3.7 MB); nothing reads them."""
    gateway = GatewayMetrics.of(config()).render()
    assert b"kvgate_gateway_upstream_errors_total{" in gateway
    scheduler = generate_latest(SchedulerMetrics.of(config()).registry)
    assert b"kvgate_scheduler_scrape_errors_total{" in scheduler
    assert b"_created" not in gateway and b"_created" not in scheduler


def test_a_node_the_tick_gives_no_room_loses_its_release_control_series() -> None:
    """An ejected node (or one gone from the config) kept exporting its last window, room and
    rate: a dashboard showed room on a dead node."""
    metrics = SchedulerMetrics.of(config())

    def room(tokens: int) -> NodeRoom:
        return NodeRoom(window=tokens, backlog=0, room=tokens, gain=1.0, rate=15_000.0,
                        reason="", running_limit=None)

    def sample(node: str) -> float | None:
        return metrics.registry.get_sample_value("kvgate_scheduler_prefill_room_tokens",
                                                 {"pool": "llama", "node": node})

    metrics.set_rooms("llama", {"n1": room(1875), "n2": room(900)})
    assert sample("n1") == 1875 and sample("n2") == 900
    metrics.set_rooms("llama", {"n1": room(1000)})
    assert sample("n1") == 1000 and sample("n2") is None
    room_series = {"kvgate_scheduler_" + name for name in (
        "prefill_window_tokens", "prefill_backlog_tokens", "prefill_room_tokens",
        "prefill_rate_tokens_per_second", "control_gain", "running_limit", "lane_cap",
        "decode_step_seconds", "calm_decode_step_seconds")}
    left = [s.name for m in metrics.registry.collect() for s in m.samples
            if s.name in room_series and s.labels.get("node") == "n2"]
    assert left == []
    assert {s.name for m in metrics.registry.collect() for s in m.samples
            if s.labels.get("node") == "n1"} >= room_series  # the names above are the gauges'
    metrics.set_rooms("llama", {"n1": room(1000), "n2": room(700)})  # back: series again
    assert sample("n2") == 700
