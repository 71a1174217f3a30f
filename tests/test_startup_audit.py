"""Mistakes made when deploying for the first time: each is refused at start with one line
naming the setting (or the file, or the variable) at fault, never a traceback or a value the
services would silently read as something else."""

from __future__ import annotations

import copy
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from admission.config import (
    ConfigError,
    RedisSettings,
    check_mounted_files,
    check_redis_ca,
    load_config,
    parse_config,
    tls_context,
)
from admission.connection import connect
from admission.inspect_target import resolve_target
from gateway.__main__ import tokenizer_error

KEY = "5d6bf7b999239eddfd0a32aede86c79e58e1b3a03a2685fbe53c5980581bdc1d"
BASE: dict[str, Any] = {
    "pools": [{"name": "demo", "backends": [{"name": "node-0", "url": "http://127.0.0.1:8001"}]}],
    "tenants": [{"name": "vip", "tier": "vip", "key_sha256": [KEY]}],
}
ROOT = Path(__file__).resolve().parent.parent


def with_(path: str, value: Any) -> dict[str, Any]:
    """BASE with the setting at dotted `path` (list indexes as numbers) set to `value`."""
    data = copy.deepcopy(BASE)
    cur: Any = data
    *parents, last = path.split(".")
    for part in parents:
        cur = cur[int(part)] if part.isdigit() else cur.setdefault(part, {})
    cur[last] = value
    return data


def refused(data: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={} if env is None else env)
    return str(info.value)


def test_a_config_path_that_is_a_directory_or_not_text_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read it \(Is a directory\)"):
        load_config(tmp_path, env={})
    binary = tmp_path / "kvgate.toml"
    binary.write_bytes(b"\xff\xfe[redis]\n")
    with pytest.raises(ConfigError, match="not valid TOML: not UTF-8"):
        load_config(binary, env={})


@pytest.mark.parametrize(("url", "message"), [
    ("redis://", "names no host"),
    ("redis://host:99999/0", "port that is not a number from 1 to 65535"),
    ("redis://host:port/0", "port that is not a number from 1 to 65535"),
    ("redis://host:6379/abc", "database 'abc' is not a database number"),
    ("redis://host:6379/-1", "database '-1'"),
    ("unix://", "names no socket path"),
    ("unix:///run/redis.sock?db=x", "database 'x'"),
    ("redis://host:6379/0?socket_timeout=abc", "socket_timeout"),
    ("redis://[::1:6379/0", "is not a valid URL"),
    # TLS parameters: only those every connection honours, only with TLS, only valid values.
    ("rediss://host:6380/0?ssl_ciphers=HIGH", "ssl_ciphers is not supported"),
    ("redis://host:6379/0?ssl_cert_reqs=none", "ssl_cert_reqs needs a rediss:// URL"),
    ("rediss://host:6380/0?ssl_cert_reqs=maybe", "ssl_cert_reqs 'maybe' must be none, optional"),
    ("rediss://host:6380/0?ssl_keyfile=/k.pem", "ssl_keyfile needs ssl_certfile"),
    ("rediss://host:6380/0?ssl_cert_reqs=NONE", "ssl_cert_reqs 'NONE' must be none, optional"),
])
def test_a_redis_url_the_client_would_misread_is_refused(url: str, message: str) -> None:
    assert refused(with_("redis.url", url)).startswith("redis.url: ")
    assert message in refused(with_("redis.url", url))


@pytest.mark.parametrize("url", [
    "redis://:s3cret-pw@:6379/0",  # REDIS_URL=redis://:${PASSWORD}@${HOST}:6379/0, HOST unset
    "rediss://app:s3cret-pw@",
    "redis://:6379/0?password=s3cret-pw",  # redis-py reads a password from the query too
    "redis://:6379/0?db=0&Username=s3cret-user&password=s3cret-pw",
])
def test_a_refused_redis_url_is_named_without_its_password(url: str) -> None:
    """The message is printed to stderr at start, which is the log. (A password that ends the
    address early, an unencoded '/', is refused as such:
    test_a_password_that_breaks_the_redis_url_is_refused_without_showing_it.)"""
    for message in (refused(with_("redis.url", url)), refused(BASE, env={"REDIS_URL": url})):
        assert "names no host" in message and "s3cret" not in message, message
        assert "***" in message


@pytest.mark.parametrize("url", [
    "http://svc:t0ken-x@/",
    "http://svc:t0ken-x@node:8000/v1",
    "http://svc:t0ken-x@node:8000?x=1",
])
def test_a_refused_backend_url_is_named_without_its_credentials(url: str) -> None:
    message = refused(with_("pools.0.backends", [{"name": "n", "url": url}]))
    assert message.startswith("pools[0].backends[0].url: ") and "t0ken" not in message, message
    same = [{"name": "n", "url": "http://svc:t0ken-x@a:1"},
            {"name": "m", "url": "http://svc:t0ken-x@a:1/"}]
    assert "t0ken" not in refused(with_("pools.0.backends", same))


def test_good_redis_urls_pass() -> None:
    for url in ("redis://:pw@redis.internal:6380/3", "rediss://r:6379", "unix:///r.sock?db=2",
                "redis://[::1]:6379/0"):
        assert parse_config(with_("redis.url", url), env={}).redis.url == url


@pytest.mark.parametrize("password", ["s3cr3t/XYZ", "s3cr3t#XYZ", "s3cr3t?XYZ"])
def test_a_password_that_breaks_the_redis_url_is_refused_without_showing_it(
    password: str,
) -> None:
    """The Helm chart puts a Secret's password into REDIS_URL as is; one made with `openssl
    rand -base64` often holds a '/', which ends the address there. The start-up error the
    pods log must say so without the password (nor the half read as host or database)."""
    url = f"redis://:{password}@redis.internal:6379/0"
    sentinel = with_("redis", {"url": f"redis://:{password}@/0", "sentinel_master": "kv",
                               "sentinels": ["sentinel-0:26379"]})
    for data, env in ((with_("redis.url", url), {}), (BASE, {"REDIS_URL": url}),
                      (sentinel, {})):
        message = refused(data, env)
        assert "percent-encode" in message
        assert "s3cr3t" not in message and "XYZ" not in message
    # A URL without a host shows no password either; an '@' in a password is read right.
    assert "s3cr3t" not in refused(with_("redis.url", "redis://:s3cr3t@/0"))
    url = "redis://:s3cr3t@XYZ@redis.internal:6379/0"
    assert parse_config(with_("redis.url", url), env={}).redis.url == url


def test_a_malformed_redis_url_variable_is_named_not_the_files_key() -> None:
    message = refused(BASE, env={"REDIS_URL": "redis://h:6379/x"})
    assert message.startswith("REDIS_URL (which overrides redis.url): database 'x'")
    message = refused(BASE, env={"REDIS_URL": "localhost:6379"})
    assert message.startswith("REDIS_URL (which overrides redis.url): must start with")


def test_redis_tls_options_must_agree(tmp_path: Path) -> None:
    assert refused(with_("redis.ssl_ca_file", "/ca.pem")).startswith(
        "redis.ssl_ca_file: needs a rediss:// redis.url")
    config = tmp_path / "kvgate.toml"
    config.write_text('[redis]\nurl = "rediss://r:6379/0"\nssl_ca_file = "/no/such/ca.pem"\n'
                      '[[pools]]\nname = "demo"\n')
    with pytest.raises(ConfigError, match=r"^redis.ssl_ca_file '/no/such/ca.pem': cannot load"):
        check_redis_ca(load_config(config, env={}))


def test_a_backend_ca_file_error_names_the_pools_key(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('[[pools]]\nname = "a"\n[[pools]]\nname = "b"\n'
                      'backend_ca_file = "/no/such/ca.pem"\n')
    with pytest.raises(ConfigError,
                       match=r"^pools\[1\].backend_ca_file '/no/such/ca.pem': cannot"):
        check_mounted_files(load_config(config, env={}))
    # kvgate-inspect reads the same file for its Redis settings alone, and never loads the
    # backends' CA: a copy of a pod's file, off the pod, is enough.
    target = resolve_target(config=str(config), redis_url=None, cluster=False,
                            ssl_ca_file=None, pools=[], env={})
    assert target.pools == ("a", "b")


def test_the_multiplexed_connection_reads_the_urls_tls_as_redis_py_does() -> None:
    """The gateway's own connection and redis-py's must trust the same server: the same words
    for false, the first of a repeated parameter."""
    def context(query: str) -> ssl.SSLContext:
        made = tls_context(RedisSettings(url=f"rediss://h:6380/0{query}"))
        assert made is not None
        return made

    assert context("").check_hostname and context("").verify_mode == ssl.CERT_REQUIRED
    assert not context("?ssl_check_hostname=off").check_hostname
    assert context("?ssl_check_hostname=yes").check_hostname
    assert context("?ssl_cert_reqs=optional").verify_mode == ssl.CERT_OPTIONAL
    lax = context("?ssl_cert_reqs=none&ssl_cert_reqs=required")
    assert (lax.verify_mode, lax.check_hostname) == (ssl.CERT_NONE, False)
    assert tls_context(RedisSettings(url="redis://h:6379/0")) is None


async def test_a_sentinel_urls_tls_parameters_reach_the_sentinels_and_the_primary() -> None:
    """Under Sentinel, the URL's TLS parameters are used to reach the Sentinels as well as the
    primary, and win over `ssl_ca_file`; given with it, they were a TypeError at start (the
    same keyword twice)."""
    settings = RedisSettings(url="rediss://:pw@/0?ssl_ca_certs=/url-ca.pem&ssl_cert_reqs=none",
                             ssl_ca_file="/file-ca.pem", sentinel_master="kvgate",
                             sentinels=("127.0.0.1:1",))
    client = connect(settings)  # no I/O until the first command
    try:
        pool = client.connection_pool
        for kwargs in (pool.sentinel_manager.sentinel_kwargs, pool.connection_kwargs):
            assert (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"]) == ("/url-ca.pem", "none")
    finally:
        await client.aclose()


def test_the_services_refuse_a_redis_tls_file_of_the_url_they_cannot_load(tmp_path: Path
                                                                          ) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('[redis]\nurl = "rediss://r:6379/0?ssl_certfile=/no/client.pem"\n'
                      '[[pools]]\nname = "demo"\n')
    with pytest.raises(ConfigError, match=r"^redis.url's ssl_certfile '/no/client.pem': cannot"):
        check_mounted_files(load_config(config, env={}))


@pytest.mark.parametrize(("url", "message"), [
    ("http://127.0.0.1:8001/v1", "leave out the /v1"),
    ("http://127.0.0.1:8001/v1/", "leave out the /v1"),
    ("http://", "names no host"),
    ("http://host:99999", "port that is not a number"),
    ("http://host:0", "port 0"),
    ("http://host:8000?x=1", "query or fragment"),
    ("http://ho st:8000", "contains a space"),
    ("http://[fd00::5:8000", "is not a valid URL"),
])
def test_a_backend_url_that_cannot_be_a_servers_root_is_refused(url: str, message: str) -> None:
    text = refused(with_("pools.0.backends", [{"name": "n", "url": url}]))
    assert text.startswith("pools[0].backends[0].url: ") and message in text
    # The short form, a list of URLs, is checked as the table form is.
    text = refused(with_("pools.0.backends", ["http://127.0.0.1:8001", url]))
    assert text.startswith("pools[0].backends[1].url: ") and message in text


def test_a_backend_url_behind_a_proxy_prefix_passes() -> None:
    data = with_("pools.0.backends", [{"name": "n", "url": "https://proxy:8443/llama/"}])
    assert parse_config(data, env={}).pools["demo"].backends[0].url == "https://proxy:8443/llama"


def test_duplicates_are_named_with_both_places() -> None:
    two = [{"name": "n", "url": "http://a:1"}, {"name": "n", "url": "http://a:2"}]
    assert refused(with_("pools.0.backends", two)) == (
        "pools[0].backends[1].name: backend 'n' is already pools[0].backends[0]; names must "
        "be unique")
    same = [{"name": "n", "url": "http://a:1"}, {"name": "m", "url": "http://A:1/"}]
    assert refused(with_("pools.0.backends", same)).startswith(
        "pools[0].backends[1].url: 'http://A:1' is also pools[0].backends[0]'s")
    assert refused(with_("pools", [{"name": "x"}, {"name": "x"}])).startswith(
        "pools[1].name: pool 'x' is already defined by pools[0]")
    # The short form names backends node-0, node-1... in every pool; pools may share a server.
    shared = with_("pools", [{"name": "a", "backends": ["http://a:1"]},
                             {"name": "b", "backends": ["http://a:1"]}])
    assert len(parse_config(shared, env={}).pools) == 2


def test_a_dedicated_node_listed_twice_is_named() -> None:
    two = [{"name": "a", "url": "http://a:1"}, {"name": "b", "url": "http://a:2"}]
    data = with_("pools.0.backends", two)
    data["pools"][0]["dedicated"] = {"nodes": ["a", "a"], "tiers": ["vip"]}
    assert refused(data).endswith("dedicated.nodes[1]: 'a' is listed twice")


def test_a_backend_capacity_must_be_positive() -> None:
    backend = {"name": "n", "url": "http://a:1", "capacity_tokens": 0}
    assert refused(with_("pools.0.backends", [backend])) == (
        "pools[0].backends[0].capacity_tokens: must be >= 1, got 0")


@pytest.mark.parametrize(("path", "value", "message"), [
    ("gateway.lease_ttl_ms", 10**20, "must be at most 31536000000 (one year)"),
    ("scheduler.leader_ttl_ms", 31_536_000_001, "must be at most 31536000000 (one year)"),
    ("gateway.retention_s", 10**9, "must be at most 31536000 (one year)"),
    ("tiers.vip.queue_timeout_ms", 10**30, "must be at most 31536000000 (one year)"),
    ("redis.max_connections", 2**53, "must be at most 9007199254740991 (2^53 - 1)"),
    ("tenants.0.monthly_tokens", 10**17, "must be at most 9007199254740991 (2^53 - 1)"),
    ("pools.0.control.prefill_tokens_per_s", 2**53,
     "must be at most 9007199254740991 (2^53 - 1)"),
])
def test_huge_integers_are_refused(path: str, value: int, message: str) -> None:
    key = path.replace(".0.", "[0].")
    assert refused(with_(path, value)) == f"{key}: {message}, got {value}"


def test_a_year_is_still_accepted() -> None:
    data = with_("tiers.batch.queue_timeout_ms", 31_536_000_000)
    assert parse_config(data, env={}).tiers  # a week-long batch queue is a real setting


def test_a_rate_per_second_is_not_capped_as_a_duration() -> None:
    """`*_per_s` is tokens per second, not seconds: 40 million was refused as "at most
    31536000 (one year)"."""
    data = with_("pools.0.control.prefill_tokens_per_s", 40_000_000)
    pool = next(iter(parse_config(data, env={}).pools.values()))
    assert pool.control.prefill_tokens_per_s == 40_000_000


def test_inspect_checks_a_redis_url_flag_as_the_services_do() -> None:
    with pytest.raises(ConfigError, match=r"^--redis-url: has a port that is not a number"):
        resolve_target(config=None, redis_url="redis://h:99999/0", cluster=False,
                       ssl_ca_file=None, pools=(), env={})
    with pytest.raises(ConfigError, match=r"^REDIS_URL: database 'abc'"):
        resolve_target(config=None, redis_url=None, cluster=False, ssl_ca_file=None,
                       pools=(), env={"REDIS_URL": "redis://h:6379/abc"})


def test_a_tokenizer_that_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    missing = parse_config(with_("pools.0.tokenizer", str(tmp_path / "nope.json")), env={})
    assert (tokenizer_error(missing) or "").startswith("pools[0].tokenizer: cannot read")
    empty_dir = parse_config(with_("pools.0.tokenizer", str(tmp_path)), env={})
    assert "tokenizer.json" in (tokenizer_error(empty_dir) or "")
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    text = tokenizer_error(parse_config(with_("pools.0.tokenizer", str(junk)), env={}))
    assert (text or "").startswith(f"pools[0].tokenizer: {str(junk)!r} is not a tokenizer.json")
    assert tokenizer_error(parse_config(BASE, env={})) is None


def test_the_gateway_process_exits_2_with_one_line_on_a_bad_tokenizer(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('[redis]\nurl = "redis://127.0.0.1:1/0"\n[[pools]]\nname = "demo"\n'
                      f'tokenizer = "{tmp_path / "nope.json"}"\n')
    done = subprocess.run([sys.executable, "-m", "gateway", "--config", str(config), "--port",
                           "0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"configuration error: {config}: pools[0].tokenizer: cannot read "
        f"'{tmp_path / 'nope.json'}' "
        "(No such file or directory)"]
