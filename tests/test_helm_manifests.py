"""The Helm chart's manifests, rendered and linted by Helm's own Go code: lint without errors or
warnings, every manifest valid against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail), the workloads as they must be (a scheduler standby on another
node, the gateway's probes, ports, grace period and autoscaling, restricted containers, the
bundled Redis and its pod left alone by upgrades), and the monitoring objects: the
PrometheusRule holding the alerting rules and matching the gateways' scrape job under any
release name, the series tenant metrics add, and the Grafana dashboard's ConfigMap.

Rendering and the values variants are shared with the other chart tests (tests/helm_support.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from prometheus_client import generate_latest

from admission.tiers import Tier
from gateway.metrics import REJECTION_REASONS, REQUEST_OUTCOMES, GatewayMetrics
from gateway.shutdown import SETTLE_MARGIN_S
from tests.helm_support import (
    CHART,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    VARIANTS,
    chart,
    check_prometheus_rule,
    check_service_monitor,
    configmap,
    containers,
    env_of,
    one,
    production_values,
    render,
    secret_strings,
    with_image,
)
from tests.test_alerts import promtool_passes

# --- lint and validation --------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_has_no_errors_or_warnings(variant: str) -> None:
    report = helm.lint(CHART, with_image(VARIANTS[variant]()), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error; the only note allowed is "icon is recommended".
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_validates_against_kubernetes_schemas(variant: str) -> None:
    docs = render(VARIANTS[variant]())
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE
        if doc["kind"] == "ServiceMonitor":  # a CRD: no schema in kubernetes-validate
            check_service_monitor(doc)
            continue
        if doc["kind"] == "PrometheusRule":  # likewise
            check_prometheus_rule(doc)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_typo_in_a_manifest_would_fail_validation() -> None:
    """The validator really is strict: an unknown field (readOnlyRootFileSystem) is caught."""
    deployment = one(render(), "Deployment", "-gateway")
    sc = deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    sc["readOnlyRootFileSystem"] = sc.pop("readOnlyRootFilesystem")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


# --- what the workloads must be -------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_scheduler_runs_two_replicas_with_a_standby_on_another_node(variant: str) -> None:
    docs = render(VARIANTS[variant]())
    sched = one(docs, "Deployment", "-scheduler")
    assert sched["spec"]["replicas"] == 2
    assert sched["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = sched["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "scheduler"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"] == [9100]
    # Least privilege: the scheduler never mounts the tenants' Secret.
    assert all(v["name"] != "tenants" for v in pod["volumes"])
    assert one(docs, "PodDisruptionBudget", "-scheduler")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_probes_ports_and_service(variant: str) -> None:
    docs = render(VARIANTS[variant]())
    gw = one(docs, "Deployment", "-gateway")
    pod = gw["spec"]["template"]["spec"]
    c = next(c for c in pod["containers"] if c["name"] == "gateway")
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "http"] == [8080]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 5
    svc = one(docs, "Service", "-gateway")
    assert svc["spec"]["selector"].items() <= gw["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert one(docs, "PodDisruptionBudget", "-gateway")["spec"]["selector"]["matchLabels"] == (
        gw["spec"]["selector"]["matchLabels"])


@pytest.mark.parametrize("gateway", [
    None, {"shutdownTimeoutSeconds": 7, "preStopSleepSeconds": 0},
    {"shutdownTimeoutSeconds": 0, "preStopSleepSeconds": 12},
])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_grace_period_is_prestop_plus_timeout_plus_settle_margin(
    variant: str, gateway: dict[str, int] | None,
) -> None:
    """The kubelet SIGKILLs the pod when the grace period ends: it must cover the preStop
    sleep, the gateway's --shutdown-timeout and the margin the gateway needs after it to settle
    and exit (`gateway.shutdown.SETTLE_MARGIN_S`), no less (settles cut short) and no more
    (rolling updates waiting for nothing)."""
    values = VARIANTS[variant]() or {}
    if gateway is not None:
        values = {**values, "gateway": {**values.get("gateway", {}), **gateway}}
    pod = one(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]
    c = next(c for c in pod["containers"] if c["name"] == "gateway")
    shutdown = float(c["args"][c["args"].index("--shutdown-timeout") + 1])
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    if gateway is not None:
        assert (shutdown, pre_stop) == (gateway["shutdownTimeoutSeconds"],
                                        gateway["preStopSleepSeconds"])
    assert pod["terminationGracePeriodSeconds"] == (
        pre_stop + shutdown + math.ceil(SETTLE_MARGIN_S))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_runs_restricted(variant: str) -> None:
    docs = render(VARIANTS[variant]())
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == (2 if variant == "production" else 3)
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]


def test_production_autoscales_and_is_scraped() -> None:
    docs = render(production_values())
    gw = one(docs, "Deployment", "-gateway")
    assert "replicas" not in gw["spec"]  # the HPA owns the count
    hpa = one(docs, "HorizontalPodAutoscaler", "-gateway")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 16)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": gw["metadata"]["name"]}
    assert one(docs, "PodDisruptionBudget", "-gateway")["spec"] == {
        "minAvailable": 3, "selector": gw["spec"]["selector"]}
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    services = [d for d in docs if d["kind"] == "Service"]
    for sm in monitors:
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        selector = sm["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in services if s["metadata"]["labels"].items() >= selector.items()]
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    dashboard = one(docs, "ConfigMap", "-dashboard")["metadata"]
    assert dashboard["labels"]["grafana_dashboard"] == "1"
    assert dashboard["annotations"] == {"grafana_folder": "Inference"}
    # External Redis: no bundled StatefulSet, no chart-made Redis Secret, TLS with the CA.
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert 'url = "rediss://kvgate-redis.prod.internal:6380/0"' in configmap(docs)


def test_defaults_have_no_hpa_or_servicemonitor_and_bundle_a_noeviction_redis() -> None:
    docs = render()
    assert {d["kind"] for d in docs}.isdisjoint({"HorizontalPodAutoscaler", "ServiceMonitor"})
    assert one(docs, "Deployment", "-gateway")["spec"]["replicas"] == 2
    sts = one(docs, "StatefulSet", "-redis")
    assert sts["spec"]["replicas"] == 1
    (redis,) = sts["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    secret_name = env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"]
    generated = secret_strings(docs)[f"{secret_name}/redis-password"]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", generated)
    svc = one(docs, "Service", "-redis")
    gw = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(gw)["REDIS_URL"]["value"] == (
        f"redis://:$(REDIS_PASSWORD)@{svc['metadata']['name']}:"
        f"{svc['spec']['ports'][0]['port']}/0")


def test_a_long_release_name_still_gets_a_bundled_redis_pod() -> None:
    """A StatefulSet's pods carry the label controller-revision-hash, its name and an 11
    character suffix: named over 52 characters it never gets a pod (a label value is at most
    63). The gateways must still find the Redis Service by its name."""
    docs = render({"fullnameOverride": "x" * 60})
    sts = one(docs, "StatefulSet", "-redis")
    svc = one(docs, "Service", "-redis")
    assert len(sts["metadata"]["name"]) <= 52
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    for d in docs:
        assert len(d["metadata"]["name"]) <= 63, d["metadata"]["name"]
    gw = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(gw)["REDIS_URL"]["value"].endswith(
        f"@{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0")
    # Names that fit keep their form: <fullname>-redis.
    assert one(render(), "StatefulSet", "-redis")["metadata"]["name"] == f"{RELEASE}-kvgate-redis"


@pytest.mark.parametrize("persistence", [False, True])
def test_a_chart_upgrade_leaves_the_bundled_redis_pod_alone(persistence: bool,
                                                            tmp_path: Path) -> None:
    """A change to a StatefulSet's pod template restarts its pod, and the bundled Redis' pod
    holds every queue (in memory only, without persistence): a new chart version or kvgate
    version must not change it."""
    bumped = tmp_path / "kvgate"
    shutil.copytree(CHART, bumped, symlinks=True)
    meta = (bumped / "Chart.yaml").read_text(encoding="utf-8")
    assert 'version: 0.1.0\nappVersion: "0.1.0"\n' in meta
    (bumped / "Chart.yaml").write_text(
        meta.replace('version: 0.1.0\nappVersion: "0.1.0"\n',
                     'version: 0.2.0+build.7\nappVersion: "0.2.0"\n'), encoding="utf-8")
    values = with_image({"redis": {"bundled": {"persistence": {"enabled": persistence}}}})
    releases = [helm.Chart.load(path).render(values, name=RELEASE, namespace=NAMESPACE)
                for path in (CHART, bumped)]
    old, new = ([d for path, text in out.items() if path.endswith(".yaml")
                 for d in yaml.safe_load_all(text) if d] for out in releases)
    # The bump reaches what it should: labels everywhere, and the gateways' image.
    assert one(old, "StatefulSet", "-redis")["metadata"] != one(new, "StatefulSet", "-redis")[
        "metadata"]
    assert one(old, "Deployment", "-gateway")["spec"]["template"] != one(
        new, "Deployment", "-gateway")["spec"]["template"]
    assert one(old, "StatefulSet", "-redis")["spec"] == one(new, "StatefulSet", "-redis")["spec"]
    labels = one(new, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= one(new, "Service", "-redis")["spec"]["selector"].items()



# --- the alerting rules ----------------------------------------------------------------

ALERT_RULES = CHART.parent.parent / "deploy" / "prometheus" / "kvgate-alerts.yaml"


def test_no_prometheus_rule_by_default() -> None:
    assert [d for d in render() if d["kind"] == "PrometheusRule"] == []


@pytest.mark.parametrize("base", ["", "https://git.example.com/kvgate/-/blob/main/"])
def test_prometheus_rule_holds_the_alerting_rules(base: str) -> None:
    """The PrometheusRule is the rule file as it is (tests/test_alerts.py tests the rules),
    its runbook links prefixed with runbookBaseUrl."""
    values = {"prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                                 "runbookBaseUrl": base}}
    report = helm.lint(CHART, with_image(values), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    docs = render(values)
    (doc,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    check_prometheus_rule(doc)
    assert doc["metadata"]["namespace"] == NAMESPACE
    assert doc["metadata"]["labels"]["release"] == "prometheus"
    assert doc["metadata"]["labels"]["app.kubernetes.io/component"] == "alerts"
    groups = yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))["groups"]
    links = jobs = 0
    for group in groups:
        for rule in group["rules"]:
            rule["annotations"]["runbook_url"] = base + rule["annotations"]["runbook_url"]
            links += 1
            jobs += rule["expr"].count(ANY_GATEWAY_JOB)
            rule["expr"] = rule["expr"].replace(
                ANY_GATEWAY_JOB, f'job="{RELEASE}-kvgate-gateway"').replace(
                ANY_SCHEDULER_JOB, f'job="{RELEASE}-kvgate-scheduler"')
    assert links >= 10 and jobs >= 1 and doc["spec"] == {"groups": groups}


ANY_GATEWAY_JOB = 'job=~".*kvgate.*-gateway"'
ANY_SCHEDULER_JOB = 'job=~".*kvgate.*-scheduler"'
"""How the rule file, for a Prometheus configured by hand, matches the gateways' scrape job."""


@pytest.mark.parametrize(("names", "release"), [
    ({"fullnameOverride": "llm-admission"}, RELEASE),
    ({"nameOverride": "gate"}, "prod"),
    ({}, RELEASE),
])
def test_the_rules_match_the_gateways_job_the_service_monitor_makes(
    names: dict[str, str], release: str, tmp_path: Path,
) -> None:
    """The Prometheus Operator names a ServiceMonitor's job after the Service it selects (the
    chart sets no jobLabel): KvgateGatewaysDown must match that name, whatever the release's
    names, or it reads no gateway as up and fires for good."""
    values = {**names, "serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    out = chart().render(with_image(values), name=release, namespace=NAMESPACE)
    docs = [d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    svc = one(docs, "Service", "-gateway")
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor" and d["spec"]["selector"][
        "matchLabels"].items() <= svc["metadata"]["labels"].items()]
    assert "jobLabel" not in monitor["spec"]
    job = svc["metadata"]["name"]
    scheduler_job = one(docs, "Service", "-scheduler")["metadata"]["name"]
    (rule_doc,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    rules = {r["alert"]: r for g in rule_doc["spec"]["groups"] for r in g["rules"]}
    matchers = set(re.findall(r"job\s*(?:=~|!~|!=|=)\s*\"[^\"]*\"", rules["KvgateGatewaysDown"][
        "expr"]))
    assert matchers == {f'job="{job}"', f'job="{scheduler_job}"'}
    assert not [r for r in rules.values() if ANY_GATEWAY_JOB in r["expr"]]
    # Prometheus evaluates the rendered rule: this release's gateways down fire it, up keep
    # it quiet, whatever another release in another namespace runs (its schedulers up, its
    # gateways scraped under its own job).
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(yaml.safe_dump(rule_doc["spec"]), encoding="utf-8")
    up = f'up{{namespace="{NAMESPACE}", instance="g0", job="{job}"}}'
    leader = f'up{{namespace="{NAMESPACE}", instance="s0", job="{scheduler_job}"}}'
    other_up = 'up{namespace="other", instance="g9", job="other-kvgate-gateway"}'
    other_leader = 'up{namespace="other", instance="s9", job="other-kvgate-scheduler"}'
    down = {"exp_labels": {"severity": "critical", "namespace": NAMESPACE, "job": job},
            "exp_annotations": rules["KvgateGatewaysDown"]["annotations"]}
    assert "{{" not in json.dumps(down)  # annotations without templates, compared as they are
    tests = [{"interval": "1m",
              "input_series": [{"series": up, "values": samples},
                               {"series": leader, "values": "1x10"},
                               {"series": other_up, "values": "1x10"},
                               {"series": other_leader, "values": "1x10"}],
              "alert_rule_test": [{"eval_time": "4m", "alertname": "KvgateGatewaysDown",
                                   "exp_alerts": alerts}]}
             for samples, alerts in (("1 1 0x10", [down]), ("1x10", []))]
    promtool_passes(tmp_path, rule_file, tests)


def test_the_production_example_counts_the_series_tenant_metrics_adds() -> None:
    """values-production.yaml turns `tenant_metrics` on and says what it costs: its formula
    and figure are what a gateway with that config exports per tenant."""
    text = (CHART / "values-production.yaml").read_text(encoding="utf-8")
    comments = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines()
                        if line.strip().startswith("#"))
    found = re.search(r"\((\d+) x pools \+ (\d+)\) per configured tenant, (\d+) here", comments)
    assert found, "values-production.yaml no longer states the series per tenant"
    per_pool, extra, here = map(int, found.groups())
    parts = re.search(r"request outcome \((\d+)\), rejection reason \((\d+)\) and token counter "
                      r"\((\d+)\)", comments)
    assert parts, "values-production.yaml no longer says what the series per pool are"
    outcomes, reasons, tokens = map(int, parts.groups())
    assert (outcomes, reasons, tokens) == (len(REQUEST_OUTCOMES), len(REJECTION_REASONS), 2)
    assert outcomes + reasons + tokens == per_pool
    values = production_values()
    assert values["config"]["gateway"]["tenant_metrics"] is True
    pools = {p["name"]: [b["name"] for b in p["backends"]] for p in values["config"]["pools"]}

    def tenant_series(tenants: int) -> int:
        metrics = GatewayMetrics(tenant_labels=True, pools=pools,
                                 tenants=[(f"t{i}", Tier.NORMAL) for i in range(tenants)])
        exposition = generate_latest(metrics.registry).decode()
        return len(re.findall(r'^kvgate_\w+\{[^}]*tenant="', exposition, re.MULTILINE))

    assert tenant_series(1) == tenant_series(2) - tenant_series(1) == (
        per_pool * len(pools) + extra) == here
    example = re.search(r"(\d+) tenants: ([\d,]+) series per gateway, ([\d,]+) at (\d+) gateways",
                        comments)
    assert example, "values-production.yaml no longer works an example through"
    tenants, per_gateway, total, gateways = (int(n.replace(",", "")) for n in example.groups())
    assert gateways == values["gateway"]["autoscaling"]["maxReplicas"]
    assert (per_gateway, total) == (tenants * here, tenants * here * gateways)


def test_the_production_example_installs_the_alerts() -> None:
    (doc,) = [d for d in render(production_values()) if d["kind"] == "PrometheusRule"]
    assert doc["metadata"]["labels"]["release"] == "prometheus"


# --- the Grafana dashboard ConfigMap ---------------------------------------------------

DASHBOARD = CHART.parent.parent / "deploy" / "grafana" / "kvgate-dashboard.json"


def test_the_dashboard_is_one_file_in_the_chart() -> None:
    """Helm reads files only from inside the chart, so the dashboard lives there; the path
    operators import it from, deploy/grafana/, is a link to it, never a second copy."""
    assert DASHBOARD.is_symlink()
    assert DASHBOARD.resolve() == (CHART / "dashboards" / "kvgate-dashboard.json").resolve()


def test_no_dashboard_configmap_by_default() -> None:
    assert [d for d in render() if d["metadata"]["name"].endswith("-dashboard")] == []


@pytest.mark.parametrize(("settings", "label"), [
    ({}, ("grafana_dashboard", "1")),
    ({"labelKey": "grafana.example.com/dashboard", "labelValue": "kvgate",
      "annotations": {"grafana_folder": "Inference"}},
     ("grafana.example.com/dashboard", "kvgate")),
])
def test_dashboard_configmap_for_the_grafana_sidecar(
    settings: dict[str, Any], label: tuple[str, str]
) -> None:
    values = {"grafanaDashboard": {"enabled": True, **settings}}
    report = helm.lint(CHART, with_image(values), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    doc = one(render(values), "ConfigMap", "-dashboard")
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)
    meta = doc["metadata"]
    assert meta["labels"][label[0]] == label[1]
    assert meta["labels"]["app.kubernetes.io/component"] == "dashboard"
    assert meta.get("annotations", {}) == settings.get("annotations", {})
    (key,) = doc["data"]
    assert key.endswith(".json")
    assert json.loads(doc["data"][key]) == json.loads(DASHBOARD.read_text())
