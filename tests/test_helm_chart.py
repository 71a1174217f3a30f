"""The Helm chart, rendered and linted by Helm's own Go code (helm-python-sdk, no helm binary).

Every rendered manifest is validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail), and the config the pods get is run
through the same steps the pods take (the gateway's init container joins config and tenants)
and then parsed by `admission.config`, so a chart that renders but would crash-loop fails here.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from prometheus_client import generate_latest

from admission import config as cfg
from admission.controlconfig import ControlSettings
from admission.fairconfig import FairnessSettings
from admission.tiers import Tier
from gateway.metrics import REJECTION_REASONS, REQUEST_OUTCOMES, GatewayMetrics
from gateway.shutdown import SETTLE_MARGIN_S
from tests.test_alerts import promtool_passes

CHART = Path(__file__).resolve().parent.parent / "helm" / "kvgate"
RELEASE, NAMESPACE = "kv", "inference"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
PASSWORD = "0123456789abcdef-not-a-real-password"
HASHES = ["5d6bf7b999239eddfd0a32aede86c79e58e1b3a03a2685fbe53c5980581bdc1d",
          "7f6ba71affeeeed6fd1d41c5a5cc85c7a75de664e3548faa8020d85bfbc9237e"]
TENANTS = [
    {"name": "acme", "tier": "vip", "key_sha256": [HASHES[0]], "rate": 20_000,
     "burst": 1_000_000_000, "max_queued": 1000},
    {"name": "nightly-etl", "tier": "batch", "key_sha256": [HASHES[1]], "rate": 5_000,
     "burst": 400_000, "max_queued": 10_000},
]
WITH_TENANTS: dict[str, Any] = {
    "tenants": {"items": TENANTS},
    "redis": {"auth": {"password": PASSWORD}},
    "config": {"pools": [{
        "name": "llama-8b", "served_model_name": "meta-llama/Llama-3.1-8B-Instruct",
        "default_system_prompt": 'Say "hi"\\ then\n\ttab, <b>&</b> ünïcode',
        "backends": [{"name": "gpu-0", "url": "http://vllm-0:8000", "capacity_tokens": 400_000},
                     "http://vllm-1:8000"],
        "zones": {"yellow": 0.7, "red": 0.85, "batch_trickle_rate": 0.5},
    }]},
}
@cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def production_values() -> dict[str, Any]:
    return helm.values_from_yaml((CHART / "values-production.yaml").read_text())


IMAGE = "registry.example.com/kvgate"


def with_image(values: dict[str, Any] | None) -> dict[str, Any]:
    """`values` with `image.repository` set when they leave it out: the one value the chart
    requires (no public registry publishes kvgate)."""
    merged = dict(values or {})
    merged["image"] = {"repository": IMAGE, **(merged.get("image") or {})}
    return merged


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = chart().render(with_image(values), name=RELEASE, namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


VARIANTS: dict[str, Any] = {
    "defaults": lambda: None,
    "production": production_values,
    "tenants": lambda: WITH_TENANTS,
}


def one(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return found


def containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_strings(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {f"{d['metadata']['name']}/{k}": base64.b64decode(v).decode()
            for d in docs if d["kind"] == "Secret" for k, v in d.get("data", {}).items()}


def check_service_monitor(doc: dict[str, Any]) -> None:
    """The fields of monitoring.coreos.com/v1 ServiceMonitor this chart relies on."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"]
    spec = doc["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector"}
    assert spec["selector"]["matchLabels"]
    assert spec["namespaceSelector"] == {"matchNames": [doc["metadata"]["namespace"]]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert isinstance(endpoint["port"], str) and endpoint["path"] == "/metrics"
        for key in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint[key])


def check_prometheus_rule(doc: dict[str, Any]) -> None:
    """The fields of monitoring.coreos.com/v1 PrometheusRule: groups of named rules, each an
    alert or a recording with an expression (the operator's CRD allows no others)."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"]
    assert set(doc["spec"]) == {"groups"}
    for group in doc["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "partial_response_strategy",
                              "limit", "query_offset", "labels"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for",
                                 "labels", "annotations"}
            assert ("alert" in rule) != ("record" in rule) and rule["expr"]
            assert all(isinstance(v, str) for v in rule.get("annotations", {}).values())


def configmap(docs: list[dict[str, Any]]) -> str:
    text: str = one(docs, "ConfigMap", "-config")["data"]["config.toml"]
    return text


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


# --- secrets stay in Secrets ------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_secret_data_in_any_configmap_or_plain_env(variant: str) -> None:
    docs = render(VARIANTS[variant]())
    secrets = secret_strings(docs)
    if variant == "tenants":
        assert secrets[f"{RELEASE}-kvgate-redis-auth/redis-password"] == PASSWORD
        assert all(h in secrets[f"{RELEASE}-kvgate-tenants/tenants.toml"] for h in HASHES)
    # Every secret value whole, and every key hash inside the tenants' TOML.
    needles = [PASSWORD, *HASHES]
    for name, value in secrets.items():
        needles += re.findall(r"[0-9a-f]{64}", value) if name.endswith(".toml") else [value]
        assert "sk-" not in value, name
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        text = json.dumps(cm)
        assert not [n for n in needles if n in text]
        assert not re.search(r"[0-9a-f]{64}", text)  # no key hash of any kind
        assert "password" not in text.lower() and "sk-" not in text
        if "config.toml" in cm["data"]:  # (not in the dashboard's)
            config = cfg.parse_config(_toml(cm["data"]["config.toml"]), env={})
            assert "@" not in config.redis.url
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        for c in containers(w["spec"]["template"]["spec"]):
            for e in c.get("env", []):
                assert PASSWORD not in e.get("value", ""), (c["name"], e["name"])


def _toml(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


# --- the config the pods get is the config the services accept ---------------------------


def _run_init_container(docs: list[dict[str, Any]], tmp: Path) -> tuple[Path, dict[str, str]]:
    """Lay out the gateway pod's volumes in `tmp` and run its init container's command."""
    pod = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    sources: dict[str, dict[str, bytes]] = {}
    for vol in pod["volumes"]:
        if "configMap" in vol:
            sources[vol["name"]] = {name: text.encode() for name, text in
                                    one(docs, "ConfigMap", "-config")["data"].items()}
        elif "secret" in vol and vol["name"] == "tenants":
            # The Secret's bytes as a pod gets them, whatever their encoding.
            data = {f"{d['metadata']['name']}/{k}": base64.b64decode(v) for d in docs
                    if d["kind"] == "Secret" for k, v in d.get("data", {}).items()}
            ref = vol["secret"]
            sources["tenants"] = {item["path"]: data[f"{ref['secretName']}/{item['key']}"]
                                  for item in ref["items"]}
    remap: dict[str, str] = {}
    for m in init["volumeMounts"]:
        folder = tmp / m["name"]
        folder.mkdir()
        for fname, content in sources.get(m["name"], {}).items():
            (folder / fname).write_bytes(content)
        remap[m["mountPath"]] = str(folder)

    def on_disk(path: str) -> str:
        mount = next(m for m in remap if path.startswith(m + "/"))
        return remap[mount] + path[len(mount):]

    command = init["command"]
    assert command[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", command[2], *map(on_disk, command[3:])],
                   check=True, timeout=20, capture_output=True, text=True)
    gw = next(c for c in pod["containers"] if c["name"] == "gateway")
    config_path = gw["args"][gw["args"].index("--config") + 1]
    return Path(on_disk(config_path)), {e["name"]: e.get("value", "") for e in gw["env"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_pod_config_is_accepted(variant: str, tmp_path: Path) -> None:
    values = VARIANTS[variant]()
    docs = render(values)
    if variant == "production":  # tenants from an existing Secret: stand one in
        docs.append({"kind": "Secret", "metadata": {"name": "kvgate-tenants"}, "data": {
            "tenants.toml": base64.b64encode(
                f'[[tenants]]\nname = "t"\ntier = "vip"\nkey_sha256 = ["{HASHES[0]}"]\n'
                .encode()).decode()}})
    path, env = _run_init_container(docs, tmp_path)
    pod_env = {"REDIS_URL": env["REDIS_URL"].replace("$(REDIS_PASSWORD)", "pw")}
    config = cfg.load_config(path, env=pod_env)
    merged = chart().merge_values(values)
    assert list(config.pools) == [p["name"] for p in merged["config"]["pools"]]
    assert (config.gateway.host, config.gateway.port) == ("0.0.0.0", 8080)
    assert config.redis.url == pod_env["REDIS_URL"]
    if variant == "tenants":
        assert [(t.name, t.tier, t.key_sha256, t.rate, t.burst) for t in config.tenants] == [
            ("acme", Tier.VIP, (HASHES[0],), 20_000, 1_000_000_000),
            ("nightly-etl", Tier.BATCH, (HASHES[1],), 5_000, 400_000)]
        pool = config.pools["llama-8b"]
        assert pool.default_system_prompt == WITH_TENANTS["config"]["pools"][0][
            "default_system_prompt"]
        assert [(b.name, b.url, b.capacity_tokens) for b in pool.backends] == [
            ("gpu-0", "http://vllm-0:8000", 400_000), ("node-1", "http://vllm-1:8000", None)]
        assert (pool.zones.yellow, pool.zones.batch_trickle_rate) == (0.7, 0.5)
    if variant == "production":
        assert [t.name for t in config.tenants] == ["t"]
        assert config.pools["llama-8b"].pass_priority is True
        assert config.tiers[Tier.BATCH].queue_timeout_ms == 1_800_000
        ca = config.redis.ssl_ca_file
        gw = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
        (mount,) = [m for m in gw["containers"][0]["volumeMounts"] if m["name"] == "redis-ca"]
        (vol,) = [v for v in gw["volumes"] if v["name"] == "redis-ca"]
        assert ca == f"{mount['mountPath']}/{vol['secret']['items'][0]['path']}"
        assert vol["secret"]["secretName"] == "kvgate-redis-ca"


@pytest.mark.parametrize("variant", VARIANTS)
def test_scheduler_pod_config_is_accepted(variant: str) -> None:
    docs = render(VARIANTS[variant]())
    pod = one(docs, "Deployment", "-scheduler")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    path = c["args"][c["args"].index("--config") + 1]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["configMap"]["name"] == one(docs, "ConfigMap", "-config")["metadata"]["name"]
    text = one(docs, "ConfigMap", "-config")["data"][path[len(mount["mountPath"]) + 1:]]
    config = cfg.parse_config(_toml(text), env={})
    assert (config.scheduler.host, config.scheduler.port) == ("0.0.0.0", 9100)
    assert config.tenants == ()


def test_backends_behind_a_private_ca_get_it_mounted_and_named_on_every_pool() -> None:
    values = {**WITH_TENANTS, "backendTls": {"caSecret": "vllm-ca", "caSecretKey": "bundle.pem"},
              "config": {"pools": [*WITH_TENANTS["config"]["pools"],
                                   {"name": "qwen", "backends": ["https://vllm-9:8000"]}]}}
    docs = render(values)
    text = one(docs, "ConfigMap", "-config")["data"]["config.toml"]
    config = cfg.parse_config(_toml(text), env={})
    paths = {pool.backend_ca_file for pool in config.pools.values()}
    assert len(config.pools) == 2 and len(paths) == 1
    (path,) = paths
    for suffix in ("-gateway", "-scheduler"):
        pod = one(docs, "Deployment", suffix)["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "backend-ca"]
        assert vol["secret"]["secretName"] == "vllm-ca"
        assert vol["secret"]["items"] == [{"key": "bundle.pem", "path": "ca.crt"}]
        for container in pod["containers"]:
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "backend-ca"]
            assert path == f"{mount['mountPath']}/ca.crt"
    # Without the Secret nothing is mounted and no pool names a file.
    plain = render(WITH_TENANTS)
    text = one(plain, "ConfigMap", "-config")["data"]["config.toml"]
    assert "backend_ca_file" not in text
    pod = one(plain, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if v["name"] == "backend-ca"]


def test_schema_covers_every_config_key() -> None:
    """A key added to admission.config must be added to values.schema.json (or listed here)."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]
    props = schema["properties"]
    set_by_chart = {"redis": {"url", "ssl_ca_file", "sentinel_username", "sentinel_password_env"},
                    "gateway": {"host", "port", "id"}, "scheduler": {"host", "port", "id"}}
    # admin_token_sha256 is not written into the ConfigMap: gateway.adminToken sets it from a
    # Secret, through the environment. sentinel_password is no key of the file at all: the
    # services read it from the variable sentinel_password_env names.
    not_exposed = {"gateway": {"admin_token_sha256"}, "redis": {"sentinel_password"}}
    for section, settings in (("redis", cfg.RedisSettings), ("gateway", cfg.GatewaySettings),
                              ("scheduler", cfg.SchedulerSettings)):
        fields = {f.name for f in dataclasses.fields(settings)}
        exposed = set(props[section]["properties"])
        assert exposed | set_by_chart.get(section, set()) | not_exposed.get(section, set()) == (
            fields), section
    pool = props["pools"]["items"]["properties"]
    assert set(pool) == {f.name for f in dataclasses.fields(cfg.PoolSettings)}
    assert set(pool["zones"]["properties"]) == {
        f.name for f in dataclasses.fields(cfg.ZoneSettings)}
    assert set(pool["control"]["properties"]) == {
        f.name for f in dataclasses.fields(ControlSettings)}
    assert set(pool["fairness"]["properties"]) == {
        f.name for f in dataclasses.fields(FairnessSettings)}
    assert set(props["teams"]["items"]["properties"]) == {
        f.name for f in dataclasses.fields(cfg.TeamSettings)}
    assert set(pool["engine"]["properties"]) == {
        f.name for f in dataclasses.fields(cfg.EngineSettings)}
    assert set(props["tiers"]["properties"]) == {t.label for t in Tier}
    tenant = json.loads((CHART / "values.schema.json").read_text())["properties"]["tenants"]
    assert set(tenant["properties"]["items"]["items"]["properties"]) == {
        f.name for f in dataclasses.fields(cfg.TenantSettings)}


# --- bad values are refused before anything is deployed ----------------------------------

CREDENTIALS_IN_URLS: dict[str, tuple[dict[str, Any], str]] = {
    "password in url's query": ({"redis": {"mode": "external", "auth": {"enabled": False},
                                           "external": {"url": "redis://r:6379/0?password=hunter2"}}},
                                "/redis/external/url"),
    "user name in url's query": ({"redis": {"mode": "external", "external": {
        "url": "redis://r:6379/0?db=1&username=kvgate"}}}, "/redis/external/url"),
    "credentials in a backend's url": ({"config": {"pools": [
        {"name": "p", "backends": ["http://admin:hunter2@vllm-0:8000"]}]}},
        "/config/pools/0/backends/0"),
    "credentials in a backend table's url": ({"config": {"pools": [
        {"name": "p", "backends": [{"name": "gpu-0", "url": "https://hunter2@vllm-0:8000"}]}]}},
        "/config/pools/0/backends/0"),
}
"""Credentials in a URL would be shown in the ConfigMap, the pods' environment and the notes."""

BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "plaintext key": ({"tenants": {"items": [
        {"name": "a", "tier": "vip", "key_sha256": ["sk-live-123"]}]}}, "key_sha256"),
    "credentials in url": ({"redis": {"mode": "external", "external": {
        "url": "redis://:hunter2@redis:6379/0"}}}, "/redis/external/url"),
    **CREDENTIALS_IN_URLS,
    "url set in config": ({"config": {"redis": {"url": "redis://x"}}}, "/config/redis"),
    "typo in config": ({"config": {"gateway": {"lease_ttl": 5}}}, "/config/gateway"),
    "no standby possible": ({"scheduler": {"replicas": 0}}, "/scheduler/replicas"),
    "unknown tier": ({"tenants": {"items": [
        {"name": "a", "tier": "gold", "key_sha256": []}]}}, "/tenants/items/0/tier"),
    "pool name with braces": ({"config": {"pools": [
        {"name": "a{b}", "backends": []}]}}, "/config/pools/0/name"),
    # Team names are checked like tenant names by the services, which refuse to start.
    "team name with a space": ({"config": {"teams": [{"name": "ML Research"}]}},
                               "/config/teams/0/name"),
    "team parent with a colon": ({"config": {"teams": [{"name": "ml", "parent": "org:ai"}]}},
                                 "/config/teams/0/parent"),
    "tenant's team with a slash": ({"tenants": {"items": [
        {"name": "a", "tier": "vip", "key_sha256": [], "team": "ai/ml"}]}},
        "/tenants/items/0/team"),
    "dedicated node with a space": ({"config": {"pools": [
        {"name": "p", "backends": [], "dedicated": {"nodes": ["gpu 0"]}}]}},
        "/config/pools/0/dedicated/nodes/0"),
    "external without url": ({"redis": {"mode": "external"}}, "/redis/external/url"),
    "port as text": ({"gateway": {"port": "8080"}}, "/gateway/port"),
    "unsafe password": ({"redis": {"auth": {"password": "a@b/c"}}}, "/redis/auth/password"),
    "sentinel without port": ({"config": {"redis": {"sentinel_master": "kv",
                                                     "sentinels": ["sentinel-0"]}}},
                              "/config/redis/sentinels/0"),
    # The Sentinels' password comes from a Secret alone (redis.sentinelAuth.existingSecret).
    "sentinel password in values": ({"redis": {"sentinelAuth": {"password": "hunter2"}}},
                                    "/redis/sentinelAuth"),
    "sentinel password in config": ({"config": {"redis": {"sentinel_password": "hunter2"}}},
                                    "/config/redis"),
    "sentinel password variable in config": ({"config": {"redis": {
        "sentinel_password_env": "MY_VAR"}}}, "/config/redis"),
    # An empty path or name the services refuse rather than read as unset.
    **{f"empty {key}": ({"config": {"pools": [{"name": "p", "backends": [], key: ""}]}},
                        f"/config/pools/0/{key}")
       for key in ("tokenizer", "served_model_name", "backend_ca_file")},
    "dashboard label key": ({"grafanaDashboard": {"labelKey": "grafana dashboard"}},
                            "/grafanaDashboard/labelKey"),
    "dashboard label value": ({"grafanaDashboard": {"labelValue": 1}},
                              "/grafanaDashboard/labelValue"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_schema_rejects_bad_values(case: str) -> None:
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        chart().validate_schema(chart().merge_values(values))
    report = helm.lint(CHART, with_image(values))
    assert any(where in e for e in report["errors"])


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"},
                "tls": {"enabled": True}}}, "needs a rediss://"),
    ({"redis": {"mode": "external", "external": {"url": "rediss://r:6380/0"},
                "auth": {"existingSecret": "s"}}}, "set redis.tls.enabled=true"),
    ({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"}}},
     "redis.auth: set existingSecret"),
    ({"tenants": {"existingSecret": "t", "items": TENANTS}}, "not both"),
    ({"redis": {"auth": {"enabled": False}}}, "bundled Redis always requires a password"),
    ({"redis": {"auth": {"username": "kvgate"}}}, "the bundled Redis has only the default user"),
    ({"grafanaDashboard": {"enabled": True, "labelKey": "app.kubernetes.io/component"}},
     "is one of the chart's own labels"),
    # Prometheus refuses a scrape timeout above the interval: the operator skips the monitor.
    ({"serviceMonitor": {"enabled": True, "interval": "5s"}},
     "serviceMonitor.scrapeTimeout (10s) is longer than serviceMonitor.interval (5s)"),
    ({"serviceMonitor": {"enabled": True, "interval": "1m", "scrapeTimeout": "61s"}},
     "is longer than serviceMonitor.interval (1m)"),
    ({"serviceMonitor": {"enabled": True, "interval": "1s", "scrapeTimeout": "1001ms"}},
     "is longer than serviceMonitor.interval (1s)"),
    # No public registry publishes kvgate: a default name there could be anyone's image.
    ({"image": {"repository": ""}}, "image.repository is required"),
    # What the services would refuse at start, refused at install.
    ({"config": {"scheduler": {"release_call_ms": 500}}},
     "config.scheduler.release_call_ms (500) must be below config.redis.socket_timeout_ms (500)"),
    ({"config": {"redis": {"socket_timeout_ms": 20}}}, "release_call_ms (20) must be below"),
    ({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0?sockettimeout=3"},
                "auth": {"enabled": False}}},
     "redis.external.url: its query parameter sockettimeout is not supported"),
    # A Sentinel password with nothing to use it, or a user name without one.
    ({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"},
                "auth": {"enabled": False}, "sentinelAuth": {"existingSecret": "s"}}},
     "redis.sentinelAuth.existingSecret needs config.redis.sentinel_master"),
    ({"redis": {"sentinelAuth": {"existingSecret": "s"}},
      "config": {"redis": {"sentinel_master": "kv", "sentinels": ["s-0:26379"]}}},
     "the bundled Redis has none"),
    ({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"},
                "auth": {"enabled": False}, "sentinelAuth": {"username": "kvgate"}},
      "config": {"redis": {"sentinel_master": "kv", "sentinels": ["s-0:26379"]}}},
     "redis.sentinelAuth.username needs redis.sentinelAuth.existingSecret"),
])
def test_combinations_that_cannot_work_fail_with_a_message(values: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


def test_an_external_url_with_the_query_parameters_the_services_read_renders() -> None:
    external = {"mode": "external", "auth": {"enabled": False},
                "external": {"url": "redis://r:6379/0?db=1"}}
    assert one(render({"redis": external}), "Deployment", "-gateway")


@pytest.mark.parametrize(("tenants", "said"), [
    (f'tenants = [{{ name = "t", tier = "vip", key_sha256 = ["{HASHES[0]}"] }}]',
     "write each tenant as a [[tenants]] table"),
    (f'[[tenants]]\nname = "t"\ntier = "vip"\nkey_sha256 = ["{HASHES[0]}"]\n'
     '[[teams]]\nname = "x"\n', "holds teams; it may hold [[tenants]] tables only"),
    ('[[tenants]\nname = "t"\n', "not valid TOML"),
])
def test_a_tenants_secret_is_checked_alone_before_it_is_joined(
    tenants: str, said: str, tmp_path: Path,
) -> None:
    """An existing tenants Secret is appended to config.toml: an inline `tenants = [...]`
    would then be read as a key of the configuration's last table (the gateway's error named
    a backend), and teams there would reach the gateways and never the schedulers. The init
    container refuses both, naming the Secret, and the pod does not start."""
    docs = render(VARIANTS["production"]())
    docs.append({"kind": "Secret", "metadata": {"name": "kvgate-tenants"}, "data": {
        "tenants.toml": base64.b64encode(tenants.encode()).decode()}})
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _run_init_container(docs, tmp_path)
    assert "tenants Secret" in failed.value.stderr and said in failed.value.stderr


def test_a_tenants_secret_with_a_bom_is_read_and_one_not_in_utf8_refused(
    tmp_path: Path,
) -> None:
    """An editor's byte order mark is no TOML statement (it was refused as one); Latin-1
    text is named as such (it ended the init container in a traceback)."""
    table = f'[[tenants]]\nname = "t"\ntier = "vip"\nkey_sha256 = ["{HASHES[0]}"]\n'
    cases = ((b"\xef\xbb\xbf" + table.encode(), None),
             (table.replace('"t"', '"caf\xe9"').encode("latin-1"), "not UTF-8 text"))
    for i, (data, said) in enumerate(cases):
        docs = render(VARIANTS["production"]())
        docs.append({"kind": "Secret", "metadata": {"name": "kvgate-tenants"},
                     "data": {"tenants.toml": base64.b64encode(data).decode()}})
        folder = tmp_path / str(i)
        folder.mkdir()
        if said is None:
            path, env = _run_init_container(docs, folder)
            pod_env = {"REDIS_URL": env["REDIS_URL"].replace("$(REDIS_PASSWORD)", "pw")}
            assert [t.name for t in cfg.load_config(path, env=pod_env).tenants] == ["t"]
        else:
            with pytest.raises(subprocess.CalledProcessError) as failed:
                _run_init_container(docs, folder)
            assert said in failed.value.stderr and "Traceback" not in failed.value.stderr


@pytest.mark.parametrize("url", ["redis://r:6379/0?", "redis://r:6379/0?&db=1"])
def test_an_external_url_with_an_empty_query_renders_as_the_services_accept_it(
    url: str, tmp_path: Path,
) -> None:
    docs = render({"redis": {"mode": "external", "auth": {"enabled": False},
                             "external": {"url": url}}})
    path, env = _run_init_container(docs, tmp_path)
    assert env["REDIS_URL"] == url
    assert cfg.load_config(path, env={"REDIS_URL": url}).redis.url == url


@pytest.mark.parametrize(("values", "where", "shown"), [
    ({"config": {"gateway": {"lease_ttl_ms": 1e20}}}, "config.gateway.lease_ttl_ms",
     "100000000000000000000"),
    # 2^53 + 1 is no float64: Helm holds 2^53, which the services would have been given.
    ({"config": {"gateway": {"max_body_bytes": 2**53 + 1}}}, "config.gateway.max_body_bytes",
     "9007199254740992"),
    ({"config": {"pools": [{"name": "a", "backends": []}, {
        "name": "b", "backends": [{"name": "n", "url": "http://v:8000",
                                   "capacity_tokens": 2**63}]}]}},
     "config.pools[1].backends[0].capacity_tokens", "9223372036854775808"),
    ({"tenants": {"items": [{"name": "t", "tier": "vip", "key_sha256": [], "rate": -1e19}]}},
     "tenants.items[0].rate", "-10000000000000000000"),
])
def test_an_integer_beyond_what_helm_holds_exactly_fails_the_render_naming_it(
    chart_without_schema: helm.Chart, values: dict[str, Any], where: str, shown: str,
) -> None:
    """Rendered, it became another number: 1e20 was written as -9223372036854775808."""
    with pytest.raises(helm.HelmRenderError) as refused:
        chart_without_schema.render(with_image(values), name=RELEASE, namespace=NAMESPACE)
    assert f"{where}: {shown} is beyond 2^53 - 1 (9007199254740991)" in str(refused.value)


def test_the_largest_exact_integer_is_written_as_it_is() -> None:
    text = configmap(render({"config": {"gateway": {"max_body_bytes": 2**53 - 1}}}))
    assert _toml(text)["gateway"]["max_body_bytes"] == 2**53 - 1


@pytest.fixture(scope="module")
def chart_without_schema(tmp_path_factory: pytest.TempPathFactory) -> helm.Chart:
    """The chart as `helm install --skip-schema-validation` renders it."""
    copy = tmp_path_factory.mktemp("chart") / "kvgate"
    shutil.copytree(CHART, copy, symlinks=True)
    (copy / "values.schema.json").unlink()
    return helm.Chart.load(copy)


@pytest.mark.parametrize(("case", "message"), [
    ("password in url's query", "its query parameter password would show a Redis credential"),
    ("user name in url's query", "its query parameter username would show a Redis credential"),
    ("credentials in url", "a user name or password before the host would show"),
    ("credentials in a backend's url", "config.pools[0].backends[0]: a user name or password"),
    ("credentials in a backend table's url",
     "config.pools[0].backends[0]: a user name or password"),
])
def test_credentials_in_urls_are_refused_by_the_templates_too(
    chart_without_schema: helm.Chart, case: str, message: str,
) -> None:
    values, _ = BAD_VALUES[case]
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)) as refused:
        chart_without_schema.render(with_image(values), name=RELEASE, namespace=NAMESPACE)
    assert "hunter2" not in str(refused.value)
    assert "redis.auth" in str(refused.value) or "backend_api_key_env" in str(refused.value)
    # The same values without the credentials render.
    clean = json.loads(re.sub(r"(//)[^/@\"]*@|[?&](password|username)=[^&\"]*", r"\1",
                              json.dumps(values)))
    assert "hunter2" not in json.dumps(clean)
    if "redis" in clean:
        clean["redis"]["auth"] = {"enabled": False}
    chart_without_schema.render(with_image(clean), name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(("interval", "timeout"), [
    ("15s", "10s"), ("1m", "60s"), ("1s", "900ms"), ("1h", "05m"), ("5s", "5s"),
])
def test_service_monitor_timeouts_up_to_the_interval_render(interval: str, timeout: str) -> None:
    docs = render({"serviceMonitor": {"enabled": True, "interval": interval,
                                      "scrapeTimeout": timeout}})
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for sm in monitors:
        check_service_monitor(sm)
        assert sm["spec"]["endpoints"][0]["scrapeTimeout"] == timeout
    # A timeout the interval cannot hold is refused only when ServiceMonitors are rendered.
    render({"serviceMonitor": {"enabled": False, "interval": "5s", "scrapeTimeout": "10s"}})


def test_external_redis_without_auth_and_username_urls() -> None:
    plain = render({"redis": {"mode": "external", "external": {"url": "redis://r:6379/2"},
                              "auth": {"enabled": False}}})
    c = one(plain, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(c)["REDIS_URL"]["value"] == "redis://r:6379/2"
    assert "REDIS_PASSWORD" not in env_of(c)
    acl = render({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"},
                            "auth": {"existingSecret": "s", "username": "kvgate"}}})
    c = one(acl, "Deployment", "-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(c)["REDIS_URL"]["value"] == "redis://kvgate:$(REDIS_PASSWORD)@r:6379/0"
    assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "s", "key": "redis-password"}


def test_redis_behind_sentinel() -> None:
    docs = render({
        "redis": {"mode": "external", "external": {"url": "redis://unused:6379/0"},
                  "auth": {"enabled": False}},
        "config": {"redis": {"sentinel_master": "kvgate",
                             "sentinels": ["sentinel-0:26379", "[fd00::1]:26379"]}},
    })
    redis = cfg.parse_config(_toml(configmap(docs)), env={}).redis
    assert redis.sentinel_master == "kvgate"
    assert redis.sentinel_addresses() == [("sentinel-0", 26379), ("fd00::1", 26379)]
    # Without redis.sentinelAuth the Sentinels get no credentials.
    assert (redis.sentinel_password_env, redis.sentinel_username) == (None, None)
    c = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "KVGATE_SENTINEL_PASSWORD" not in env_of(c)


SENTINEL_PASSWORD = "fedcba9876543210-sentinel-not-real"
SENTINEL_VALUES: dict[str, Any] = {
    **WITH_TENANTS,
    "redis": {"mode": "external", "external": {"url": "redis://unused:6379/0"},
              "auth": {"existingSecret": "redis-auth"},
              "sentinelAuth": {"existingSecret": "redis-sentinel", "username": "kvgate",
                               "existingSecretPasswordKey": "sentinel-password"}},
    "config": {**WITH_TENANTS["config"],
               "redis": {"sentinel_master": "kvgate", "sentinels": ["sentinel-0:26379"]}},
}


def test_the_sentinels_password_comes_from_a_secret_through_the_environment(
    tmp_path: Path,
) -> None:
    docs = render(SENTINEL_VALUES)
    for doc in docs:
        if doc["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    variable = "KVGATE_SENTINEL_PASSWORD"
    for suffix in ("-gateway", "-scheduler"):
        pod = one(docs, "Deployment", suffix)["spec"]["template"]["spec"]
        for c in pod["containers"]:
            entry = env_of(c)[variable]
            assert entry == {"name": variable, "valueFrom": {"secretKeyRef": {
                "name": "redis-sentinel", "key": "sentinel-password"}}}, c["name"]
    # The ConfigMap names the variable and the user, never a password; what the gateway's init
    # container makes of it is what the services accept, given the pod's environment.
    text = configmap(docs)
    redis = cfg.parse_config(_toml(text), env={variable: SENTINEL_PASSWORD}).redis
    assert (redis.sentinel_password_env, redis.sentinel_username) == (variable, "kvgate")
    assert redis.sentinel_password == SENTINEL_PASSWORD
    path, env = _run_init_container(docs, tmp_path)
    pod_env = {"REDIS_URL": env["REDIS_URL"].replace("$(REDIS_PASSWORD)", "pw"),
               variable: SENTINEL_PASSWORD}
    assert cfg.load_config(path, env=pod_env).redis.sentinel_password == SENTINEL_PASSWORD
    # A pod whose Secret did not fill the variable stops at start, naming it.
    with pytest.raises(cfg.ConfigError, match=f"redis.sentinel_password_env: names {variable}"):
        cfg.load_config(path, env={"REDIS_URL": pod_env["REDIS_URL"]})


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
