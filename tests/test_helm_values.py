"""Bad values for the Helm chart are refused before anything is deployed: by the values schema
(and `helm lint`), by the templates when the schema is skipped (credentials in URLs, integers
Helm cannot hold exactly), by the combinations that cannot work, and by the gateway's init
container for a tenants Secret that is no list of tenants; next to each refusal, the nearest
values that must still render.

Rendering and the init container's run are shared with the other chart tests
(tests/helm_support.py).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from admission import config as cfg
from tests.helm_support import (
    CHART,
    HASHES,
    NAMESPACE,
    RELEASE,
    TENANTS,
    VARIANTS,
    _run_init_container,
    _toml,
    chart,
    check_service_monitor,
    configmap,
    one,
    render,
    with_image,
)

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
    ({"config": {"gateway": {"lease_ttl_ms": 30000, "renew_interval_ms": 3000}}},
     "config.scheduler.stuck_after_ms (30000) must be above config.gateway.lease_ttl_ms + "
     "config.scheduler.reap_interval_ms (31000), or 0"),
    ({"config": {"scheduler": {"stuck_after_ms": 5000, "reap_interval_ms": 500}}},
     "stuck_after_ms (5000) must be above config.gateway.lease_ttl_ms + "
     "config.scheduler.reap_interval_ms (10500)"),
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

