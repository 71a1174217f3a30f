"""The chart under the overrides platform teams make: fail-open tiers, a private registry,
disruption budgets and autoscaling, probe settings the API server refuses, tokenizer volumes,
the admin token's Secret, and the README's table of values.

Rendering, validation and the config check are those of tests/helm_support.py.
"""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from admission import config as cfg
from gateway.app import create_app as gateway_app
from scheduler.app import create_app as scheduler_app
from tests.helm_support import (
    CHART,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    VARIANTS,
    _toml,
    chart,
    configmap,
    one,
    production_values,
    render,
    with_image,
)


def pod_of(docs: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment", suffix)["spec"]["template"]["spec"]
    return spec


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def get_routes(app: Any) -> set[str]:
    return {r.resource.canonical for r in app.router.routes()
            if r.method == "GET" and r.resource is not None}


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def notes(values: dict[str, Any] | None) -> str:
    text: str = chart().render(with_image(values), name=RELEASE, namespace=NAMESPACE)[
        "kvgate/templates/NOTES.txt"]
    return text


# --- probes ---------------------------------------------------------------------------


FAIL_OPEN: dict[str, Any] = {"config": {"gateway": {"fail_open_tiers": ["vip"]}}}


@pytest.mark.parametrize("variant", [*VARIANTS, "fail-open"])
def test_every_probe_hits_a_route_of_its_service_on_its_port(variant: str) -> None:
    docs = render(FAIL_OPEN if variant == "fail-open" else VARIANTS[variant]())
    config = cfg.parse_config(_toml(configmap(docs)), env={})
    for suffix, name, app in (("-gateway", "gateway", gateway_app(config)),
                              ("-scheduler", "scheduler", scheduler_app(config))):
        c = container(pod_of(docs, suffix), name)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        listens = config.gateway.port if name == "gateway" else config.scheduler.port
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert get["path"] in get_routes(app), (name, probe)
                assert ports[get["port"]] == listens, (name, probe)


def test_gateways_that_fail_open_stay_in_the_service_while_redis_is_down() -> None:
    """/readyz answers 503 on every gateway while Redis is unreachable: with it as readiness
    the Service loses every endpoint, and the requests fail_open_tiers should let through
    never reach a gateway."""
    probe = container(pod_of(render(FAIL_OPEN), "-gateway"), "gateway")["readinessProbe"]
    assert probe["httpGet"]["path"] == "/healthz"
    # Failing closed, an unready gateway (its own Redis path broken) still leaves the Service.
    probe = container(pod_of(render(), "-gateway"), "gateway")["readinessProbe"]
    assert probe["httpGet"]["path"] == "/readyz"


# --- images from a private registry ----------------------------------------------------


def test_bundled_redis_pulls_like_the_rest_from_a_private_registry() -> None:
    digest = "sha256:" + "b" * 64
    docs = render({
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"repository": "registry.corp/kvgate", "digest": "sha256:" + "a" * 64},
        "redis": {"bundled": {"image": {"repository": "registry.corp/redis", "digest": digest}}},
    })
    validate_all(docs)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in (
        "Deployment", "StatefulSet")]
    assert len(pods) == 3
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    (redis,) = one(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"]
    assert redis["image"] == f"registry.corp/redis@{digest}"
    (redis,) = one(render(), "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"]
    assert redis["image"] == "redis:7.4-alpine"
    assert "imagePullSecrets" not in one(render(), "StatefulSet", "-redis")["spec"]["template"][
        "spec"]


# --- disruption budgets and autoscaling ------------------------------------------------


def pdb(component: str, **fields: Any) -> dict[str, Any]:
    return {component: {"podDisruptionBudget": {"maxUnavailable": None, "minAvailable": None,
                                                **fields}}}


HPA_ON: dict[str, Any] = {"enabled": True, "minReplicas": 3, "maxReplicas": 6}


@pytest.mark.parametrize(("values", "message"), [
    (pdb("gateway"), "gateway.podDisruptionBudget: set exactly one of"),
    (pdb("scheduler", maxUnavailable=1, minAvailable=1),
     "scheduler.podDisruptionBudget: set exactly one of"),
    (pdb("gateway", minAvailable=2), "allows no pod to be evicted with gateway.replicas=2"),
    (pdb("gateway", minAvailable="100%"), "allows no pod to be evicted"),
    # A percentage is rounded up: 50% of 1 pod keeps that pod, 51% of 2 keeps both.
    ({"gateway": {"replicas": 1, **pdb("gateway", minAvailable="50%")["gateway"]}},
     "allows no pod to be evicted with gateway.replicas=1"),
    (pdb("scheduler", minAvailable="51%"), "allows no pod to be evicted with scheduler.replicas=2"),
    ({"gateway": {"autoscaling": HPA_ON, **pdb("gateway", minAvailable="67%")["gateway"]}},
     "with gateway.autoscaling.minReplicas=3"),
    (pdb("gateway", maxUnavailable=0), "allows no pod to be evicted"),
    (pdb("scheduler", minAvailable=2), "allows no pod to be evicted with scheduler.replicas=2"),
    ({"gateway": {"autoscaling": HPA_ON, **pdb("gateway", minAvailable=3)["gateway"]}},
     "with gateway.autoscaling.minReplicas=3"),
    ({"gateway": {"autoscaling": {**HPA_ON, "minReplicas": 8}}},
     "minReplicas (8) is above maxReplicas (6)"),
    ({"gateway": {"autoscaling": HPA_ON, "resources": {"requests": {"cpu": None}}}},
     "set gateway.resources.requests.cpu"),
    ({"gateway": {"autoscaling": {**HPA_ON, "targetMemoryUtilizationPercentage": 80},
                  "resources": {"requests": {"memory": None}}}},
     "set gateway.resources.requests.memory"),
])
def test_budgets_and_autoscalers_that_cannot_work_fail_with_a_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


def test_a_ca_for_redis_without_tls_is_refused_not_ignored() -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape("redis.tls.caSecret is set but")):
        render({"redis": {"tls": {"caSecret": "redis-ca"}}})


@pytest.mark.parametrize("values", [
    pdb("gateway", minAvailable="50%"),
    pdb("scheduler", minAvailable="50%"),
    {"gateway": {"autoscaling": HPA_ON, **pdb("gateway", minAvailable="66%")["gateway"]}},
    pdb("gateway", maxUnavailable="25%"),
    pdb("scheduler", minAvailable=1),
    {"gateway": {"replicas": 1}, "scheduler": {"replicas": 1}},
    {"gateway": {"autoscaling": {**HPA_ON, "targetMemoryUtilizationPercentage": 80}}},
    {"gateway": {"podDisruptionBudget": {"enabled": False, "maxUnavailable": None}}},
])
def test_budgets_and_autoscalers_that_work_render_and_validate(values: dict[str, Any]) -> None:
    docs = render(values)
    validate_all(docs)
    budgets = [d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert all(len(b) == 2 for b in budgets)  # one of the two fields, and the selector


# --- probe settings the API server refuses ---------------------------------------------


@pytest.mark.parametrize(("values", "where"), [
    ({"gateway": {"readinessProbe": {"terminationGracePeriodSeconds": 5}}},
     "/gateway/readinessProbe"),
    ({"scheduler": {"readinessProbe": {"terminationGracePeriodSeconds": 5}}},
     "/scheduler/readinessProbe"),
    ({"gateway": {"livenessProbe": {"successThreshold": 2}}},
     "/gateway/livenessProbe/successThreshold"),
    ({"gateway": {"startupProbe": {"successThreshold": 2}}},
     "/gateway/startupProbe/successThreshold"),
])
def test_schema_rejects_probe_settings_kubernetes_refuses(
    values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        chart().validate_schema(chart().merge_values(values))


def test_probe_settings_kubernetes_accepts_pass_the_schema() -> None:
    values = {"gateway": {"readinessProbe": {"successThreshold": 2},
                          "livenessProbe": {"terminationGracePeriodSeconds": 10}}}
    chart().validate_schema(chart().merge_values(values))
    c = container(pod_of(render(values), "-gateway"), "gateway")
    assert c["readinessProbe"]["successThreshold"] == 2
    assert c["livenessProbe"]["terminationGracePeriodSeconds"] == 10


# --- tokenizers on a volume ------------------------------------------------------------


def test_a_pools_tokenizer_can_be_mounted_into_the_gateway() -> None:
    """A pool's `tokenizer` is a path the gateway reads at start; the served model's
    tokenizer.json (megabytes, over a ConfigMap's limit) must come from a volume."""
    path = "/models/llama-3.1-8b/tokenizer.json"
    values = {
        "config": {"pools": [{"name": "llama-8b", "tokenizer": path,
                              "backends": ["http://vllm-0:8000"]}]},
        "gateway": {"extraVolumes": [{"name": "models", "persistentVolumeClaim": {
                        "claimName": "tokenizers", "readOnly": True}}],
                    "extraVolumeMounts": [{"name": "models", "mountPath": "/models",
                                           "readOnly": True}]},
        "scheduler": {"extraVolumes": [{"name": "extra", "emptyDir": {}}],
                      "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}]},
    }
    docs = render(values)
    validate_all(docs)
    config = cfg.parse_config(_toml(configmap(docs)), env={})
    assert config.pools["llama-8b"].tokenizer == path
    pod = pod_of(docs, "-gateway")
    mounts = container(pod, "gateway")["volumeMounts"]
    (mount,) = [m for m in mounts if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "tokenizers"
    pod = pod_of(docs, "-scheduler")
    assert {"name": "extra", "mountPath": "/extra"} in container(pod, "scheduler")["volumeMounts"]
    assert {"name": "extra", "emptyDir": {}} in pod["volumes"]
    assert "without a `tokenizer`" not in notes(values)


# --- the admin API -------------------------------------------------------------------------


def test_the_admin_tokens_hash_comes_from_a_secret_and_turns_the_admin_api_on() -> None:
    """Off by default (no variable, so the gateway answers 403 admin_disabled); with a Secret
    named, the gateway gets the hash from it under the name the config loader reads."""
    assert not [e for e in container(pod_of(render(None), "-gateway"), "gateway")["env"]
                if e["name"] == cfg.ADMIN_TOKEN_ENV]
    docs = render({"gateway": {"adminToken": {"existingSecret": "kvgate-admin",
                                              "key": "sha"}}})
    validate_all(docs)
    (env,) = [e for e in container(pod_of(docs, "-gateway"), "gateway")["env"]
              if e["name"] == cfg.ADMIN_TOKEN_ENV]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "kvgate-admin", "key": "sha"}
    assert all(e["name"] != cfg.ADMIN_TOKEN_ENV
               for e in container(pod_of(docs, "-scheduler"), "scheduler").get("env", []))
    # The hash is never written into the ConfigMap.
    assert "admin_token_sha256" not in _toml(configmap(docs)).get("gateway", {})


def test_notes_name_the_pools_counted_with_the_bundled_tokenizer() -> None:
    text = notes(production_values())
    assert "pools without a `tokenizer` (llama-8b, qwen-72b)" in text
    assert "gateway.extraVolumes" in text


# --- the README's table of values -------------------------------------------------------


WHOLE = {"config", "resources", "podSecurityContext", "containerSecurityContext",
         "livenessProbe", "readinessProbe", "startupProbe"}


def leaves(values: Any, prefix: str = "") -> set[str]:
    """Dotted paths of values.yaml's settings. A list or an empty map is one setting, and so
    are Kubernetes objects passed through (resources, probes, security contexts) and `config`
    (its keys are documented in docs/configuration.md)."""
    if not isinstance(values, dict) or not values or prefix.rsplit(".", 1)[-1] in WHOLE:
        return {prefix}
    found: set[str] = set()
    for key, value in values.items():
        found |= leaves(value, f"{prefix}.{key}" if prefix else key)
    return found


def test_readme_values_table_lists_every_value_with_its_default() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Za-z0-9_.]+)` \| `([^`]*)` \|", readme, re.MULTILINE)
    assert len(rows) == len({key for key, _ in rows}), "a key listed twice"
    table = dict(rows)
    assert set(table) == leaves(defaults)
    for key, shown in table.items():
        if key == "config":
            continue
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        assert yaml.safe_load(shown) == value, key


# --- a vLLM API key for the nodes ---------------------------------------------------------


def test_the_documented_way_to_give_the_gateways_the_nodes_api_key_renders() -> None:
    """The chart README's recipe: the pool names the variable, `gateway.extraEnv` fills it
    from a Secret. The gateway container gets it by reference (the key is in no manifest),
    and the config the pods get names it."""
    values = {"gateway": {"extraEnv": [{"name": "VLLM_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "vllm-key", "key": "key"}}}]},
              "config": {"pools": [{"name": "llama", "served_model_name": "llama",
                                    "backend_api_key_env": "VLLM_API_KEY",
                                    "backends": ["http://vllm-0:8000"]}]}}
    docs = render(values)
    validate_all(docs)
    env = {e["name"]: e for e in container(pod_of(docs, "-gateway"), "gateway")["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "vllm-key", "key": "key"}
    config = cfg.parse_config(_toml(configmap(docs)), env={})
    assert config.pools["llama"].backend_api_key_env == "VLLM_API_KEY"
    readme = (CHART / "README.md").read_text()
    assert "backend_api_key_env: VLLM_API_KEY" in readme and "secretKeyRef" in readme


# --- the runbook's commands against a release -------------------------------------------

RUNBOOK = CHART.parent.parent / "docs" / "runbook.md"


def test_the_runbooks_kubectl_commands_name_the_releases_objects() -> None:
    """docs/runbook.md addresses a release's pods as deploy/<fullname>-<part> and finds them by
    the release's instance label; its `kubectl exec` lines read the file the pod's service
    reads (kvgate-inspect's and kvgate-prune's)."""
    text = RUNBOOK.read_text(encoding="utf-8")
    docs = render()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    named = set(re.findall(r"deploy/<fullname>-([a-z]+)", text))
    assert named == {"gateway", "scheduler"}
    assert {f"{RELEASE}-kvgate-{part}" for part in named} == set(deployments)
    assert "`kubectl get deploy -l app.kubernetes.io/instance=<release>`" in " ".join(text.split())
    for d in deployments.values():
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    execs = re.findall(r"kubectl exec deploy/<fullname>-([a-z]+)(?: -c ([a-z]+))? -- "
                       r"kvgate-(?:inspect|prune) --config ([^\s`]+)", text)
    assert len(execs) >= 4
    for part, name, path in execs:
        pod = deployments[f"{RELEASE}-kvgate-{part}"]["spec"]["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == (name or part)]
        assert c["args"][c["args"].index("--config") + 1] == path, (part, path)


def test_a_node_added_rolls_gateways_and_schedulers_from_one_configmap() -> None:
    """Why the runbook pauses one Deployment while a node is added or removed: both mount the
    one ConfigMap, and both roll on the upgrade that changes it."""
    values: dict[str, Any] = {"config": {"pools": [
        {"name": "p", "backends": ["http://vllm-0:8000"]}]}}
    before = render(values)
    values["config"]["pools"][0]["backends"].append("http://vllm-1:8000")
    after = render(values)
    (cm,) = [d["metadata"]["name"] for d in after if d["kind"] == "ConfigMap"]
    for suffix in ("-gateway", "-scheduler"):
        assert one(before, "Deployment", suffix)["spec"]["template"] != one(
            after, "Deployment", suffix)["spec"]["template"], suffix
        mounted = {v["configMap"]["name"] for v in pod_of(after, suffix)["volumes"]
                   if "configMap" in v}
        assert mounted == {cm}, suffix
