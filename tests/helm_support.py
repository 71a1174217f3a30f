"""What the Helm chart's tests share: the chart loaded once through Helm's own Go code
(helm-python-sdk, no helm binary), `render` with the one value the chart requires filled in,
the values variants most tests run under (`VARIANTS`: the defaults, values-production.yaml, and
inline tenants with a password and a pool that exercises quoting), the Kubernetes versions every
manifest is validated against, lookups into the rendered documents, checks of the two
Prometheus Operator kinds kubernetes-validate has no schema for, and `_run_init_container`,
which lays out the gateway pod's volumes on disk and runs its init container's command the way
the pod would.

Used by tests/test_helm_manifests.py, tests/test_helm_config.py, tests/test_helm_values.py and
tests/test_helm_audit.py.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import yaml

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


def _toml(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


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
