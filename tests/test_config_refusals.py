"""Values the services would read as something else than they say, refused when the file is
loaded, each with the key named once: a backend URL that is a whole endpoint, a Sentinel
address that is not host:port, an empty path, the parts of a Redis URL the client would
ignore or misread, settings of [pools.zones] and [pools.control] that could never apply; and
every error of a file naming the file, but an error in an environment variable's value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from admission.config import ConfigError, load_config, parse_config
from gateway.pools import backend_credentials
from tests.test_config import KEY_HASH, minimal


def refused(data: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={} if env is None else env)
    return str(info.value)


def pool(**settings: Any) -> dict[str, Any]:
    """The minimal config with one pool of two backends and `settings`."""
    return minimal(pools=[{"name": "p", "backends": ["http://10.0.0.1:8000",
                                                     "http://10.0.0.2:8000"], **settings}])


# --- a backend's URL is the server's base ----------------------------------------------------

@pytest.mark.parametrize(("url", "endpoint"), [
    ("http://h:8000/v1/chat/completions", "/v1/chat/completions"),
    ("http://h:8000/v1/completions/", "/v1/completions"),
    ("https://proxy/vllm/node-1/v1/models", "/v1/models"),
    ("http://h:8000/v1", "/v1"),
    ("http://h:8000/metrics", "/metrics"),
    ("http://proxy/vllm/node-1/metrics/", "/metrics"),
])
def test_a_backend_url_naming_an_endpoint_is_refused(url: str, endpoint: str) -> None:
    """The gateway appends /v1/chat/completions to the URL: `.../v1/chat/completions` would
    send every request to `.../v1/chat/completions/v1/chat/completions`."""
    assert refused(minimal(pools=[{"name": "p", "backends": [url]}])) == (
        f"pools[0].backends[0].url: {url!r}: leave out the {endpoint}: the URL is the "
        "server's base, to which the gateway appends /v1/chat/completions and the scheduler "
        "/metrics")


@pytest.mark.parametrize("url", [
    "http://proxy:8080/vllm/node-1", "http://h:8000/v1beta",
    "https://kube-apiserver:6443/api/v1/namespaces/ml/services/vllm:8000/proxy",
    "http://proxy/llm/v1/node-a", "http://h:8000/metrics-proxy/node-1",
    "http://h:8000/api/v10/",
])
def test_a_reverse_proxys_prefix_stays_valid(url: str) -> None:
    config = parse_config(minimal(pools=[{"name": "p", "backends": [url]}]), env={})
    assert config.pools["p"].backends[0].url == url.rstrip("/")


# --- Sentinel addresses ---------------------------------------------------------------------

@pytest.mark.parametrize(("address", "why"), [
    ("redis://127.0.0.1:26379", "leave out the scheme (whether the Sentinels are reached with "
                                "TLS is redis.url's scheme)"),
    ("h h:26379", "it contains a space"),
    ("s1:26379 ", "it contains a space"),
    ("[::1:26379", "unbalanced brackets (an IPv6 address is written [v6addr]:port)"),
    ("::1]:26379", "unbalanced brackets (an IPv6 address is written [v6addr]:port)"),
    ("::1:26379", "an IPv6 address goes in brackets ([v6addr]:port)"),
    ("[::1]", "no port"),
    ("sentinel-0", "no port"),
    ("sentinel-0:", "no port"),
    (":26379", "no host"),
    ("sentinel-0:65536", "port '65536' is not a number from 1 to 65535"),
    ("sentinel-0:2637x", "port '2637x' is not a number from 1 to 65535"),
])
def test_a_sentinel_address_that_is_not_host_port_is_refused(address: str, why: str) -> None:
    message = refused(minimal(redis={"sentinel_master": "kv", "sentinels": [address]}))
    assert message == f"redis.sentinels[0]: {address!r} is not host:port: {why}"


def test_sentinel_addresses_in_the_documented_forms_pass() -> None:
    redis = parse_config(minimal(redis={"sentinel_master": "kv", "sentinels": [
        "sentinel-0.redis:26379", "10.0.0.1:1", "[fd00::1]:65535"]}), env={}).redis
    assert redis.sentinel_addresses() == [("sentinel-0.redis", 26379), ("10.0.0.1", 1),
                                          ("fd00::1", 65535)]


# --- a tier list's type error names its key once ---------------------------------------------

@pytest.mark.parametrize(("data", "message"), [
    (minimal(tenants=[{"name": "t", "tier": 0}]), "tenants[0].tier: expected a string, got int"),
    (minimal(gateway={"fail_open_tiers": [1]}),
     "gateway.fail_open_tiers: expected a string, got int"),
    (pool(dedicated={"nodes": ["node-0"], "tiers": [1]}),
     "pools[0].dedicated.tiers: expected a string, got int"),
])
def test_a_tier_of_the_wrong_type_names_its_key_once(data: dict[str, Any], message: str) -> None:
    assert refused(data) == message


# --- empty paths and names ------------------------------------------------------------------

@pytest.mark.parametrize(("data", "message"), [
    (pool(tokenizer=""), "pools[0].tokenizer: is empty; leave the key out for the bundled "
                         "Qwen2 tokenizer"),
    (pool(backend_ca_file=""), "pools[0].backend_ca_file: is empty; leave the key out for the "
                               "system's CAs only"),
    (pool(served_model_name=""), "pools[0].served_model_name: is empty; leave the key out for "
                                 "the pool's name"),
    (minimal(redis={"url": "rediss://r:6380/0", "ssl_ca_file": ""}),
     "redis.ssl_ca_file: is empty; leave the key out for the system's CAs"),
])
def test_an_empty_optional_path_or_name_is_refused(data: dict[str, Any], message: str) -> None:
    assert refused(data) == message


def test_an_empty_default_system_prompt_is_a_prompt() -> None:
    """Unlike a path, an empty system turn means something: the template's turn, empty."""
    parsed = parse_config(pool(default_system_prompt=""), env={}).pools["p"]
    assert parsed.default_system_prompt == ""


# --- the parts of a Redis URL ---------------------------------------------------------------

@pytest.mark.parametrize(("url", "message"), [
    ("redis://h :6379/0", "'redis://h :6379/0': its host contains a space"),
    ("redis://:pw@h :6379/0", "'redis://***@h :6379/0': its host contains a space"),
    ("redis://h:6379/2147483648",
     "database 2147483648 is out of range: Redis numbers its databases from 0 to 2147483647"),
    ("redis://h:6379/99999999999999999999",
     "database 99999999999999999999 is out of range: Redis numbers its databases from 0 to "
     "2147483647"),
    ("redis://h:6379?db=" + "9" * 5000, "database " + "9" * 5000 + " is out of range"),
    ("unix:///run/redis.sock?db=2147483648", "database 2147483648 is out of range"),
    ("unix://host/run/redis.sock", "'unix://host/run/redis.sock' names host 'host', which a "
                                   "unix:// URL would ignore (expected "
                                   "unix:///path/to/redis.sock)"),
    ("rediss://h:6380/0?ssl_check_hostname=flase",
     "ssl_check_hostname 'flase' must be true or false (or 1, 0, yes, no, on, off, in any "
     "case)"),
    ("rediss://h:6380/0?ssl_check_hostname=nope", "ssl_check_hostname 'nope' must be"),
])
def test_a_redis_url_part_the_client_would_misread_is_refused(url: str, message: str) -> None:
    assert refused(minimal(redis={"url": url})).startswith(f"redis.url: {message}")
    assert refused(minimal(), env={"REDIS_URL": url}).startswith(
        f"REDIS_URL (which overrides redis.url): {message}")


@pytest.mark.parametrize("url", [
    "redis://h:6379/2147483647", "redis://h:6379/00", "unix:///run/redis.sock?db=15",
    *(f"rediss://h:6380/0?ssl_check_hostname={word}"
      for word in ("false", "FALSE", "off", "No", "0", "f", "true", "True", "on", "yes", "1",
                   "Y")),
])
def test_redis_urls_the_client_reads_as_written_pass(url: str) -> None:
    assert parse_config(minimal(redis={"url": url}), env={}).redis.url == url


# --- settings that could never apply --------------------------------------------------------

def test_a_batch_ceiling_of_0_is_refused_as_a_kv_target_of_0_is() -> None:
    assert refused(pool(zones={"batch_ceiling": 0.0})) == (
        "pools[0].zones.batch_ceiling: must be above 0, or no Batch work would ever be placed")
    zones = parse_config(pool(zones={"batch_ceiling": 0.01}), env={}).pools["p"].zones
    assert zones.ceilings()[2] == 0.01


def test_a_running_floor_above_the_running_bound_is_refused() -> None:
    assert refused(pool(control={"running_min": 17, "max_engine_running": 16})) == (
        "pools[0].control.running_min: must be at most pools[0].control.max_engine_running "
        "(16), got 17: the running limit is never below running_min, so a node would be "
        "bounded by max_engine_running before the limit ever applied")
    for control in ({"running_min": 16, "max_engine_running": 16},
                    {"running_min": 64, "max_engine_running": 0}, {"running_min": 8}):
        assert parse_config(pool(control=control), env={}).pools["p"].control.running_min


@pytest.mark.parametrize(("key", "value", "what"), [
    ("lane_output", 1024, "bounds what a lane takes"),
    ("lane_on_miss", True, "times the lanes' cap"),
    ("lane_slowdown", 1.5, "sizes the lanes' cap"),
])
def test_a_lane_setting_without_lanes_is_refused(key: str, value: object, what: str) -> None:
    """As [pools.dedicated] refuses a guests' bound without guests."""
    assert refused(pool(control={key: value})) == (
        f"pools[0].control.{key}: {what}, so it needs lane_nodes (0: no lanes)")
    lanes = parse_config(pool(control={key: value, "lane_nodes": 1}), env={}).pools["p"]
    assert getattr(lanes.control, key) == value


def test_a_lane_setting_at_its_default_passes_without_lanes() -> None:
    control = {"lane_output": 0, "lane_on_miss": False, "lane_slowdown": 1.2}
    assert parse_config(pool(control=control), env={}).pools["p"].control.lane_nodes == 0


# --- the file is named, an environment variable's value is not the file's ------------------

def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvgate.toml"
    path.write_text(text + '\n[[pools]]\nname = "p"\n')
    return path


def test_a_files_error_names_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, '[gateway]\nport = "8080"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value) == f"{path}: gateway.port: expected an integer, got str"
    # A key of the file naming an unset variable is the file's key.
    path = _file(tmp_path, '[redis]\nsentinel_master = "kv"\nsentinels = ["s:26379"]\n'
                           'sentinel_password_env = "KVGATE_TEST_SENTINEL_PW"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(
        f"{path}: redis.sentinel_password_env: names KVGATE_TEST_SENTINEL_PW, which is not set")


@pytest.mark.parametrize(("env", "message"), [
    ({"REDIS_URL": "redis://h:6379/x"}, "REDIS_URL (which overrides redis.url): database 'x'"),
    ({"REDIS_URL": "unix:///run/redis.sock"},
     "REDIS_URL (which overrides redis.url): must be redis:// or rediss:// with Sentinel"),
    ({"KVGATE_ADMIN_TOKEN_SHA256": "hunter2"},
     "KVGATE_ADMIN_TOKEN_SHA256: must be a lowercase hex SHA-256"),
])
def test_an_environment_variables_error_names_the_variable_not_the_file(
    tmp_path: Path, env: dict[str, str], message: str,
) -> None:
    path = _file(tmp_path, '[redis]\nurl = "redis:///0"\nsentinel_master = "kv"\n'
                           'sentinels = ["s:26379"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    assert str(info.value).startswith(message), str(info.value)


# --- the backends' API key ------------------------------------------------------------------

def test_an_unset_backend_key_variable_is_named_by_its_key() -> None:
    pools = [{"name": "a", "backends": ["http://10.0.0.1:8000"]},
             {"name": "b", "backends": ["http://10.0.0.2:8000"],
              "backend_api_key_env": "KVGATE_TEST_VLLM_KEY"}]
    config = parse_config(minimal(pools=pools, tenants=[
        {"name": "t", "tier": "vip", "key_sha256": [KEY_HASH]}]), env={})
    with pytest.raises(ConfigError) as info:
        backend_credentials(config, {"KVGATE_TEST_VLLM_KEY": " "})
    assert str(info.value) == (
        "pools[1].backend_api_key_env: names KVGATE_TEST_VLLM_KEY, which is not set (or "
        "empty) in the gateway's environment")
    with pytest.raises(ConfigError) as info:
        backend_credentials(config, {"KVGATE_TEST_VLLM_KEY": "sk-1\nX-Other: 1"})
    assert str(info.value).startswith("KVGATE_TEST_VLLM_KEY: holds a line break")
    assert info.value.variable == "KVGATE_TEST_VLLM_KEY"
    assert backend_credentials(config, {"KVGATE_TEST_VLLM_KEY": "sk-1"})["b"] == {
        "Authorization": "Bearer sk-1"}
