"""What the Helm chart gives the pods is what the services accept: no secret in a ConfigMap or a
plain environment variable, the gateway's init container run on the rendered ConfigMap and
Secret and its result loaded by `admission.config` (so a chart that renders but would
crash-loop fails here), the scheduler's config, a private CA for the backends, every config key
covered by the values schema, and the Redis connection (external, with or without auth, behind
Sentinel, whose password comes from a Secret through the environment).

Rendering, the values variants and the init container's run are shared with the other chart
tests (tests/helm_support.py).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from admission import config as cfg
from admission.controlconfig import ControlSettings
from admission.fairconfig import FairnessSettings
from admission.tiers import Tier
from tests.helm_support import (
    CHART,
    HASHES,
    K8S_VERSIONS,
    PASSWORD,
    RELEASE,
    VARIANTS,
    WITH_TENANTS,
    _run_init_container,
    _toml,
    chart,
    configmap,
    containers,
    env_of,
    one,
    render,
    secret_strings,
)

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



# --- the config the pods get is the config the services accept ---------------------------


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


def test_a_long_lease_renders_with_stuck_judging_off_and_the_services_accept_it() -> None:
    """`stuck_after_ms = 0` is off, not unset: the chart's check must not read it as the
    default (30 s), which a 60 s lease would fail."""
    docs = render({"config": {"gateway": {"lease_ttl_ms": 60_000, "renew_interval_ms": 3_000},
                              "scheduler": {"stuck_after_ms": 0}}})
    text = next(iter(one(docs, "ConfigMap", "-config")["data"].values()))
    config = cfg.parse_config(_toml(text), env={})
    assert (config.gateway.lease_ttl_ms, config.scheduler.stuck_after_ms) == (60_000, 0)


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



# --- the Redis the pods connect to -------------------------------------------------------


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

