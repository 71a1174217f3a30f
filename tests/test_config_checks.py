"""Settings that are valid one by one but not together, or that a loader could read as something
else (an empty string as the default, a URL's query as settings): each is refused at load with
the key (and the other key it clashes with) named, or, when the configuration is valid but
turns requests away, warned about at start."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest
import redis.asyncio as aioredis

from admission import inspect
from admission.config import ConfigError, parse_config, startup_warnings
from admission.configschema import Config, GatewaySettings
from admission.keys import PoolKeys, check_name
from gateway.app import create_app
from tests.test_config import KEY_HASH, minimal


def refused(data: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={} if env is None else env)
    return str(info.value)


# --- a release call and the client's timeout -------------------------------------------------

def test_a_release_call_must_end_before_the_redis_client_gives_up() -> None:
    message = refused(minimal(scheduler={"release_call_ms": 500}))
    assert message.startswith("scheduler.release_call_ms: must be below "
                              "redis.socket_timeout_ms (500), got 500: "), message
    assert "still runs the script" in message
    message = refused(minimal(redis={"socket_timeout_ms": 100},
                              scheduler={"release_call_ms": 250}))
    assert message.startswith("scheduler.release_call_ms: must be below "
                              "redis.socket_timeout_ms (100), got 250"), message
    config = parse_config(minimal(redis={"socket_timeout_ms": 100},
                                  scheduler={"release_call_ms": 99}), env={})
    assert (config.scheduler.release_call_ms, config.redis.socket_timeout_ms) == (99, 100)


def test_an_unbounded_release_call_is_refused_saying_why() -> None:
    message = refused(minimal(scheduler={"release_call_ms": 0}))
    assert message.startswith("scheduler.release_call_ms: must be >= 1, got 0: 0 (no bound) "
                              "lets one release call run past redis.socket_timeout_ms"), message


# --- connections the subscriptions keep -----------------------------------------------------

@pytest.mark.parametrize("size", [1, 3])
def test_a_connection_pool_too_small_for_the_subscription_is_refused(size: int) -> None:
    message = refused(minimal(redis={"max_connections": size}))
    assert message.startswith(f"redis.max_connections: must be >= 4, got {size}: each process "
                              "keeps one connection for good for its pub/sub subscription"
                              ), message
    assert parse_config(minimal(redis={"max_connections": 4}), env={}).redis.max_connections == 4


def test_sharded_subscriptions_on_a_cluster_need_a_connection_per_pool() -> None:
    pools = [{"name": f"p{i}", "backends": [f"http://127.0.0.1:{9001 + i}"]} for i in range(5)]
    cluster = {"url": "redis://10.0.0.1:7000", "cluster": True, "sharded_pubsub": True}
    message = refused(minimal(pools=pools, redis={**cluster, "max_connections": 7}))
    assert message.startswith("redis.max_connections: must be at least 8 with redis.cluster "
                              "and redis.sharded_pubsub, got 7: a gateway keeps one connection "
                              "for good for each pool's wake-ups (5 pools)"), message
    ok = parse_config(minimal(pools=pools, redis={**cluster, "max_connections": 8}), env={})
    assert ok.redis.max_connections == 8
    # Without sharded pub/sub, or without a cluster, one subscription holds one connection.
    for redis in ({**cluster, "sharded_pubsub": False, "max_connections": 4},
                  {"sharded_pubsub": True, "max_connections": 4}):
        assert parse_config(minimal(pools=pools, redis=redis), env={}).redis.max_connections == 4


# --- the Redis URL's query ------------------------------------------------------------------

@pytest.mark.parametrize("query", ["sockettimeout=3", "socket_timeout=30", "max_connections=2",
                                   "protocol=3", "DB=1"])
def test_a_redis_url_query_parameter_that_is_a_redis_setting_or_a_typo_is_refused(
    query: str,
) -> None:
    name = query.partition("=")[0]
    url = f"redis://10.0.0.1:6379/0?{query}"
    expected = (f"its query parameter {name} is not supported: a Redis URL may carry db, "
                "username, password and, on rediss://, ssl_cert_reqs, ")
    message = refused(minimal(redis={"url": url}))
    assert message.startswith(f"redis.url: {expected}"), message
    assert "are [redis] settings (socket_timeout_ms, " in message
    message = refused(minimal(), env={"REDIS_URL": url})
    assert message.startswith(f"REDIS_URL (which overrides redis.url): {expected}"), message


def test_the_redis_url_query_parameters_every_connection_reads_pass() -> None:
    for url in ("redis://10.0.0.1:6379?db=3", "unix:///run/redis.sock?db=2",
                "redis://10.0.0.1:6379/0?username=app&password=pw",
                "rediss://10.0.0.1:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false"):
        assert parse_config(minimal(redis={"url": url}), env={}).redis.url == url


# --- Redis Cluster --------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "message"), [
    ("redis://10.0.0.1:6379/2", "redis.url: database 2 with redis.cluster = true; a Redis "
                                "Cluster has database 0 only"),
    ("redis://10.0.0.1:6379/0?db=3", "redis.url: database 3 with redis.cluster = true"),
    ("unix:///run/redis.sock", "redis.url: must be redis:// or rediss:// with redis.cluster = "
                               "true (a cluster's nodes are found by host and port"),
])
def test_a_cluster_url_the_cluster_client_cannot_use_is_refused(url: str, message: str) -> None:
    text = refused(minimal(redis={"url": url, "cluster": True}))
    assert text.startswith(message), text
    # The same URLs are fine for a standalone Redis.
    assert parse_config(minimal(redis={"url": url}), env={}).redis.url == url


def test_a_cluster_url_with_database_0_passes() -> None:
    for url in ("redis://10.0.0.1:7000", "redis://10.0.0.1:7000/0", "rediss://h:7000/"):
        assert parse_config(minimal(redis={"url": url, "cluster": True}), env={}).redis.cluster


# --- the admin token ------------------------------------------------------------------------

def test_an_admin_token_that_is_a_tenants_key_is_refused_naming_the_tenant() -> None:
    tenants = [{"name": "other", "tier": "batch"},
               {"name": "acme", "tier": "vip",
                "key_sha256": [hashlib.sha256(b"sk-first").hexdigest(), KEY_HASH]}]
    message = refused(minimal(tenants=tenants, gateway={"admin_token_sha256": KEY_HASH}))
    assert message == ("gateway.admin_token_sha256: is also the key_sha256[1] of tenant 'acme' "
                       "(tenants[1]), whose API key would then open the admin API; give the "
                       "admin a token of its own")
    message = refused(minimal(tenants=tenants), env={"KVGATE_ADMIN_TOKEN_SHA256": KEY_HASH})
    assert message.startswith("KVGATE_ADMIN_TOKEN_SHA256 (which overrides "
                              "gateway.admin_token_sha256): is also the key_sha256[1] of tenant "
                              "'acme'"), message
    assert KEY_HASH not in message
    own = hashlib.sha256(b"admin").hexdigest()
    config = parse_config(minimal(tenants=tenants, gateway={"admin_token_sha256": own}), env={})
    assert config.gateway.admin_token_sha256 == own


# --- start-up warnings ----------------------------------------------------------------------

def test_a_burst_at_a_pools_default_max_tokens_is_warned_about() -> None:
    pools = [{"name": "chat", "default_max_tokens": 1024, "backends": ["http://127.0.0.1:9001"]},
             {"name": "docs", "default_max_tokens": 256, "backends": ["http://127.0.0.1:9002"]}]
    tenants = [{"name": "acme", "tier": "vip", "key_sha256": [KEY_HASH], "burst": 1024},
               {"name": "roomy", "tier": "normal", "burst": 1025}]
    assert startup_warnings(parse_config(minimal(pools=pools, tenants=tenants), env={})) == [
        "tenants[0] ('acme'): burst 1024 is at or below pools[0].default_max_tokens 1024: "
        "every chat request of it to pool 'chat' without max_tokens (prompt + 1024) gets 400 "
        "exceeds_burst"]


def test_a_pool_without_backends_is_warned_about() -> None:
    pools = [{"name": "llama", "backends": ["http://127.0.0.1:9001"]}, {"name": "empty"}]
    assert startup_warnings(parse_config(minimal(pools=pools), env={})) == [
        "pools[1] ('empty') has no backends: nothing is ever released to it; it is RED with no "
        "usable node, and every request to it gets 429 (VIP's after waiting its "
        "queue_timeout_ms)"]


# --- empty strings --------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "key", "default"), [
    ("redis", "url", "redis://127.0.0.1:6379/0"),
    ("gateway", "host", "127.0.0.1"),
    ("scheduler", "host", "127.0.0.1"),
    ("scheduler", "stale_policy", "full"),
])
def test_an_empty_string_is_refused_not_read_as_the_default(section: str, key: str,
                                                             default: str) -> None:
    assert refused(minimal(**{section: {key: ""}})) == (
        f"{section}.{key}: is empty; leave the key out for its default {default!r}")


def test_a_file_url_the_environment_overrides_is_not_judged() -> None:
    """A chart or an operator may leave `url = ""` in the file and give the address in
    REDIS_URL: the file's value is not used, so it does not stop the service."""
    config = parse_config(minimal(redis={"url": ""}), env={"REDIS_URL": "redis://h:6379/0"})
    assert config.redis.url == "redis://h:6379/0"


@pytest.mark.parametrize("key", ["aggregate", "projection"])
def test_an_empty_zone_choice_is_refused(key: str) -> None:
    pools = [{"name": "p", "zones": {key: ""}}]
    assert refused(minimal(pools=pools)).startswith(f"pools[0].zones.{key}: is empty")


# --- the gateway's id -----------------------------------------------------------------------

@pytest.mark.parametrize("gid", ["gw 1", "", "gw:1", "gw-1\n"])
def test_a_gateway_id_is_checked_when_the_file_is_loaded(gid: str) -> None:
    assert refused(minimal(gateway={"id": gid})).startswith(
        f"gateway.id: gateway name {gid!r} must be 1-64 characters")
    assert parse_config(minimal(gateway={"id": "gw-1.a_b"}), env={}).gateway.id == "gw-1.a_b"


def test_the_id_flag_is_named_when_it_cannot_be_a_gateway_id() -> None:
    config = parse_config(minimal(), env={})
    with pytest.raises(ValueError, match=r"^--id \(the gateway id\): gateway name 'gw 1' must"):
        create_app(config, gateway_id="gw 1")
    # A Config built in code bypasses the loader's check: its key is named.
    built: Config = dataclasses.replace(config, gateway=GatewaySettings(id="gw 2"))
    with pytest.raises(ValueError, match=r"^gateway\.id \(the gateway id\): gateway name 'gw 2'"):
        create_app(built)
    assert create_app(config, gateway_id="gw-ok") is not None


# --- names ----------------------------------------------------------------------------------

def test_a_name_ending_in_a_newline_is_refused() -> None:
    with pytest.raises(ValueError, match="pool name 'p\\\\n' must be"):
        check_name("pool", "p\n")
    assert refused(minimal(pools=[{"name": "p\n"}])).startswith(
        "pools[0].name: pool name 'p\\n' must be")
    assert refused(minimal(tenants=[{"name": "t\n", "tier": "vip"}])).startswith(
        "tenants[0].name: tenant name 't\\n' must be")
    backends = [{"name": "gpu-0\n", "url": "http://127.0.0.1:9001"}]
    assert refused(minimal(pools=[{"name": "p", "backends": backends}])).startswith(
        "pools[0].backends[0].name: backend name 'gpu-0\\n' must be")


# --- one server, two URLs -------------------------------------------------------------------

@pytest.mark.parametrize(("first", "second"), [
    ("http://node-1", "http://node-1:80"),
    ("https://node-1:443", "https://NODE-1"),
    ("http://Node-1:80/", "http://node-1"),
    ("http://[fd00::1]:80", "http://[FD00::1]"),
    ("http://svc:k@node-1:8000/llama", "http://node-1:8000/llama/"),
])
def test_one_server_written_two_ways_is_one_backend(first: str, second: str) -> None:
    pools = [{"name": "p", "backends": [first, second]}]
    assert refused(minimal(pools=pools)).startswith(
        "pools[0].backends[1].url: "), first
    assert "is also pools[0].backends[0]'s; one server is one backend" in refused(
        minimal(pools=pools))
    # In two pools it is legitimate (one server, several models), and warned about.
    two = [{"name": "a", "backends": [first]}, {"name": "b", "backends": [second]}]
    warnings = startup_warnings(parse_config(minimal(pools=two), env={}))
    assert len(warnings) == 1 and warnings[0].startswith("pools[1].backends[0].url "), warnings


def test_other_ports_schemes_and_prefixes_are_other_servers() -> None:
    backends = ["http://node-1", "http://node-1:8000", "https://node-1", "http://node-1/a",
                "http://node-2:80"]
    pool = parse_config(minimal(pools=[{"name": "p", "backends": backends}]), env={}).pools["p"]
    assert len(pool.backends) == 5


# --- kvgate-inspect and a stray key ---------------------------------------------------------

async def test_a_key_of_another_type_under_a_pools_prefix_is_left_out_of_the_snapshot(
    redis_client: aioredis.Redis,
) -> None:
    """A key written by hand under the prefix of the tenants', buckets' or quota levels'
    hashes failed the whole snapshot with WRONGTYPE: kvgate-inspect exited 1 and the admin
    API answered 503, showing nothing of the pool."""
    keys = PoolKeys("stray")
    await redis_client.hset(keys.bucket_key("acme"), mapping={
        "micro_tokens": 5_000_000, "updated_us": 1, "rate": 0, "burst": 10})
    await redis_client.hset(keys.tenant_key("acme"), mapping={"weight": 2, "vt_1": 7})
    await redis_client.set(keys.tenant_key("zzz"), 1)
    await redis_client.set(keys.bucket_key("zzz"), 1)
    await redis_client.rpush(keys.quota_key("zzz"), 1)
    snap = await inspect.snapshot(redis_client, ["stray"])
    (pool,) = snap.pools
    assert [(t.tenant, t.tokens) for t in pool.tenants] == [("acme", 5.0)]
    assert pool.fairness is not None
    assert [(t.tenant, t.weight) for t in pool.fairness.tenants] == [("acme", 2.0)]
    assert pool.fairness.levels == []
