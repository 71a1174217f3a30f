"""`kvgate-inspect` names the Redis it reads and fails loudly when that Redis is the wrong one.

The CLI runs as a subprocess against private redis-servers (`redis_factory`): one populated
through the admission core, one empty, and a closed port. The machine's own Redis on
127.0.0.1:6379 is never contacted: every subprocess gets an explicit address and an
environment without ``REDIS_URL``; the default address is checked by resolving it, not by
connecting to it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from admission.config import ConfigError, RedisSettings
from admission.connection import redis_address
from admission.inspect_target import discover_pools, resolve_target
from bench.common.localredis import LocalRedis, free_port
from tests.test_inspect import POOL, populate

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "redis://127.0.0.1:6379/0"
UNREACHABLE_BOUND_S = 10.0
"""Generous for a loaded 2-core machine: a refused connect fails at once, a silent server after
the 500 ms read timeout; the interpreter's start is most of it."""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return {**env, **extra}


async def _cli(*args: str, env: Mapping[str, str]) -> tuple[int, str, str, float]:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admission.inspect", *args, cwd=ROOT, env=dict(env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - started


def _config(tmp_path: Path, url: str | None, pool: str = POOL) -> Path:
    redis = "" if url is None else f'[redis]\nurl = "{url}"\n\n'
    path = tmp_path / "kvgate.toml"
    path.write_text(f'{redis}[[pools]]\nname = "{pool}"\nbackends = ["http://127.0.0.1:1"]\n')
    return path


# --- Which Redis: resolved without I/O ------------------------------------------------------


def test_with_nothing_given_the_default_is_named_as_the_default() -> None:
    target = resolve_target(config=None, redis_url=None, cluster=False, ssl_ca_file=None,
                            pools=[], env={})
    assert target.settings.url == RedisSettings().url == DEFAULT_URL
    assert target.announce() == (
        "reading redis://127.0.0.1:6379/0 "
        "(the default: no --config, no --redis-url and REDIS_URL is not set)")
    assert target.pools == ()
    assert "kvg:{*}:*" in target.pools_source


def test_sources_in_the_services_order_and_no_credentials(tmp_path: Path) -> None:
    def resolve(config: Path | None = None, url: str | None = None,
                env: Mapping[str, str] | None = None) -> tuple[str, str, str]:
        t = resolve_target(config=None if config is None else str(config), redis_url=url,
                           cluster=False, ssl_ca_file=None, pools=[], env=env or {})
        return t.settings.url, t.address, t.source

    secret = "rediss://admin:hunter2@redis.internal:6380/3"
    assert resolve(env={"REDIS_URL": secret}) == (
        secret, "rediss://redis.internal:6380/3", "REDIS_URL")
    assert resolve(url="redis://:pw@10.0.0.7/2", env={"REDIS_URL": secret})[1:] == (
        "redis://10.0.0.7:6379/2", "--redis-url")
    in_file = _config(tmp_path, "redis://:pw@file-host:7000/5")
    assert resolve(in_file) == ("redis://:pw@file-host:7000/5", "redis://file-host:7000/5",
                                f"redis.url of {in_file}")
    # REDIS_URL overrides the file's redis.url, as in the gateway and the scheduler.
    assert resolve(in_file, env={"REDIS_URL": secret})[1:] == (
        "rediss://redis.internal:6380/3",
        f"REDIS_URL, which overrides redis.url of {in_file}")
    no_url = _config(tmp_path, None)
    assert resolve(no_url) == (
        DEFAULT_URL, "redis://127.0.0.1:6379/0",
        f"the default: {no_url} sets no redis.url and REDIS_URL is not set")
    assert redis_address(RedisSettings(url="unix:///run/redis.sock?db=4")) == (
        "unix:///run/redis.sock?db=4")
    assert redis_address(RedisSettings(url="redis://u:p@[::1]:7000", cluster=True)) == (
        "Redis Cluster via redis://[::1]:7000")
    assert redis_address(RedisSettings(url="redis://:p@x/1", sentinel_master="mymaster",
                                       sentinels=("s1:26379", "s2:26379"))) == (
        "Sentinel master mymaster via s1:26379, s2:26379 (redis, db 1)")
    with pytest.raises(ConfigError, match="REDIS_URL: must start with redis://"):
        resolve(env={"REDIS_URL": "localhost:6379"})


def test_an_empty_redis_url_flag_is_refused_not_replaced_by_another_server() -> None:
    # `kvgate-inspect --redis-url "$REDIS_URL"` (the runbook's line) in a shell where it is
    # unset passes "": the CLI read REDIS_URL's server or the default one instead, and said
    # "no --redis-url".
    for env in ({}, {"REDIS_URL": "redis://elsewhere:6379/0"}):
        with pytest.raises(ConfigError, match=r"^--redis-url: is empty \(an unset variable"):
            resolve_target(config=None, redis_url="", cluster=False, ssl_ca_file=None,
                           pools=[], env=env)


async def test_an_empty_redis_url_flag_exits_2_before_reading() -> None:
    code, out, err, _ = await _cli("--redis-url", "", "--pool", POOL, env=_env())
    assert (code, out) == (2, ""), err
    assert "kvgate-inspect: --redis-url: is empty" in err
    assert "reading" not in err and "Traceback" not in err


def test_with_a_config_file_the_ca_flag_overrides_it_and_the_cluster_flag_is_refused(
        tmp_path: Path) -> None:
    path = _config(tmp_path, "rediss://file-host:6380/0")
    path.write_text(path.read_text().replace(
        '[[pools]]', f'ssl_ca_file = "{tmp_path / "pod-ca.pem"}"\n\n[[pools]]', 1))

    def resolve(**flags: Any) -> Any:
        args: dict[str, Any] = {"redis_url": None, "cluster": False, "ssl_ca_file": None,
                                "pools": [], "env": {}, **flags}
        return resolve_target(config=str(path), **args)

    assert resolve().settings.ssl_ca_file == str(tmp_path / "pod-ca.pem")
    mine = resolve(ssl_ca_file="/home/me/ca.pem")
    assert mine.settings.ssl_ca_file == "/home/me/ca.pem"
    assert mine.settings.url == "rediss://file-host:6380/0"
    assert mine.source == f"redis.url of {path}, with the CA of --ssl-ca-file"
    # A CA named in the URL (the pod's path) would win in the client: the flag replaces it.
    in_url = resolve_target(
        config=None, redis_url="rediss://h:6380/0?ssl_ca_certs=/pod/ca.pem&ssl_cert_reqs=required",
        cluster=False, ssl_ca_file="/home/me/ca.pem", pools=[], env={})
    assert in_url.settings.url == "rediss://h:6380/0?ssl_cert_reqs=required"
    assert in_url.settings.ssl_ca_file == "/home/me/ca.pem"
    with pytest.raises(ConfigError, match=rf"^--cluster: with --config, redis.cluster of "
                                          rf"{re.escape(str(path))} decides"):
        resolve(cluster=True)


def test_a_ca_without_tls_is_refused_naming_the_flag_and_the_url(tmp_path: Path) -> None:
    # As the services refuse redis.ssl_ca_file beside a redis:// URL: a CA that goes unused
    # would leave someone who asked for TLS reading in clear text, unwarned.
    def resolve(ca: str, config: Path | None = None, url: str | None = None,
                env: Mapping[str, str] | None = None) -> Any:
        return resolve_target(config=None if config is None else str(config), redis_url=url,
                              cluster=False, ssl_ca_file=ca, pools=[], env=env or {})

    needs_tls = r"^--ssl-ca-file: needs a rediss:// URL \(TLS\), and "
    with pytest.raises(ConfigError, match=needs_tls + r"redis://h:1/0 \(--redis-url\)"):
        resolve("/missing/ca.pem", url="redis://:pw@h:1/0")
    with pytest.raises(ConfigError, match=needs_tls + r"redis://h:2/0 \(REDIS_URL\)"):
        resolve("/missing/ca.pem", env={"REDIS_URL": "redis://h:2/0"})
    with pytest.raises(ConfigError, match=needs_tls + re.escape(DEFAULT_URL)):
        resolve("/missing/ca.pem")
    with pytest.raises(ConfigError, match=needs_tls + r"unix:///tmp/r.sock\?db=0"):
        resolve("/missing/ca.pem", url="unix:///tmp/r.sock")
    config = _config(tmp_path, "rediss://file-host:6380/0")
    with pytest.raises(ConfigError, match=needs_tls + re.escape(
            f"redis://h:3/0 (REDIS_URL, which overrides redis.url of {config})")):
        resolve("/missing/ca.pem", config=config, env={"REDIS_URL": "redis://h:3/0"})
    with pytest.raises(ConfigError, match=r"^--ssl-ca-file: must name a CA bundle"):
        resolve("", url="rediss://h:1/0")
    assert resolve("/my/ca.pem", url="rediss://h:1/0").settings.ssl_ca_file == "/my/ca.pem"
    assert resolve("/my/ca.pem", config=config).settings.url == "rediss://file-host:6380/0"


# --- The command against real servers -----------------------------------------------------


async def test_unreachable_redis_fails_fast_naming_it_without_password() -> None:
    port = free_port()  # nothing listens there
    code, out, err, took = await _cli(
        "--redis-url", f"redis://:hunter2@127.0.0.1:{port}/0", "--pool", POOL, env=_env())
    assert code == 1, err
    assert out == ""
    assert f"kvgate-inspect: reading redis://127.0.0.1:{port}/0 (--redis-url)" in err
    assert f"cannot read Redis at redis://127.0.0.1:{port}/0:" in err
    assert "hunter2" not in err and "Traceback" not in err
    assert took < UNREACHABLE_BOUND_S


async def test_a_server_that_never_answers_is_bounded_by_the_timeouts() -> None:
    with socket.socket() as silent:  # the kernel completes the handshake; nobody replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        code, out, err, took = await _cli(
            "--redis-url", f"redis://127.0.0.1:{port}/0", env=_env())
    assert (code, out) == (1, ""), err
    assert f"cannot read Redis at redis://127.0.0.1:{port}/0: Timeout" in err
    assert "Traceback" not in err
    assert took < UNREACHABLE_BOUND_S


async def test_an_empty_redis_is_an_error_naming_what_was_looked_for(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    empty = redis_factory()
    code, out, err, _ = await _cli("--redis-url", empty.url, env=_env())
    assert (code, out) == (3, ""), err
    assert f"reading redis://127.0.0.1:{empty.port}/0 (--redis-url)" in err
    assert f"no kvgate keys in redis://127.0.0.1:{empty.port}/0: no key matches kvg:{{*}}:*" in err

    code, out, err, _ = await _cli("--redis-url", empty.url, "--pool", "llama", env=_env())
    assert (code, out) == (3, ""), err
    assert "no kvgate keys of pool llama" in err and "kvg:{llama}:*" in err

    # The config's pools, on the Redis that REDIS_URL names over the file's (closed) one.
    config = _config(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    code, out, err, _ = await _cli("--config", str(config), env=_env(REDIS_URL=empty.url))
    assert (code, out) == (3, ""), err
    assert (f"reading redis://127.0.0.1:{empty.port}/0 "
            f"(REDIS_URL, which overrides redis.url of {config})") in err
    assert f"kvg:{{{POOL}}}:*" in err
    assert "Traceback" not in err


async def test_a_pool_in_redis_is_shown_with_where_it_was_read(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    server = redis_factory(password="s3cret")
    client = aioredis.Redis.from_url(server.url)
    try:
        await populate(client)
    finally:
        await client.aclose()
    address = f"redis://127.0.0.1:{server.port}/0"

    config = _config(tmp_path, server.url)
    code, out, err, _ = await _cli("--config", str(config), env=_env())
    assert code == 0, err
    assert f"kvgate-inspect: reading {address} (redis.url of {config})" in err
    assert f"kvgate-inspect: pools {POOL} (the pools of {config})" in err
    assert out.splitlines()[0] == f"redis {address}"
    assert f"pool {POOL}  zone YELLOW" in out
    assert "s3cret" not in out + err

    code, out, err, _ = await _cli("--redis-url", server.url, env=_env())
    assert code == 0, err
    assert f"pools {POOL} (every pool found (kvg:{{*}}:*))" in err
    assert f"pool {POOL}  zone YELLOW" in out

    # One named pool without keys beside one with keys: shown, with a warning.
    code, out, err, _ = await _cli("--redis-url", server.url, "--pool", POOL, "--pool", "gone",
                                   "--json", env=_env())
    assert code == 0, err
    assert "pool gone: no key matches kvg:{gone}:* (shown empty)" in err
    assert '"pool": "gone"' in out and f'"pool": "{POOL}"' in out


async def test_a_cluster_that_cannot_be_reached_or_is_no_cluster_is_one_line(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    # redis-py reports both through RedisClusterException, which is no RedisError: the CLI
    # must still say which server it could not read instead of dumping a traceback.
    closed = free_port()
    code, out, err, took = await _cli(
        "--redis-url", f"redis://:hunter2@127.0.0.1:{closed}", "--cluster", env=_env())
    assert (code, out) == (1, ""), err
    assert "Traceback" not in err and "hunter2" not in err
    assert len(err.strip().splitlines()) == 2, err  # what it reads, then why it cannot
    assert f"cannot read Redis at Redis Cluster via redis://127.0.0.1:{closed}:" in err
    assert took < UNREACHABLE_BOUND_S

    standalone = redis_factory()
    code, out, err, _ = await _cli("--redis-url", standalone.url, "--cluster", env=_env())
    assert (code, out) == (1, ""), err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 2, err
    assert "Cluster mode is not enabled" in err


async def test_a_ca_flag_that_would_go_unused_or_cannot_be_loaded_is_a_usage_error(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    server = redis_factory()  # readable in clear text: the CLI must not quietly do so
    code, out, err, _ = await _cli("--redis-url", server.url, "--ssl-ca-file",
                                   str(tmp_path / "missing.pem"), env=_env())
    assert (code, out) == (2, ""), err
    assert (f"kvgate-inspect: --ssl-ca-file: needs a rediss:// URL (TLS), and "
            f"redis://127.0.0.1:{server.port}/0 (--redis-url) is not one") in err
    config = _config(tmp_path, server.url)
    code, out, err, _ = await _cli("--config", str(config), "--ssl-ca-file",
                                   str(tmp_path / "missing.pem"), env=_env())
    assert (code, out) == (2, ""), err
    assert f"(redis.url of {config}) is not one" in err

    # With TLS, a CA that cannot be loaded is the flag's error (or the file's key's), not a
    # connection error that reads like the server's.
    port = free_port()
    code, out, err, _ = await _cli("--redis-url", f"rediss://127.0.0.1:{port}/0",
                                   "--ssl-ca-file", str(tmp_path / "missing.pem"), env=_env())
    assert (code, out) == (2, ""), err
    assert (f"kvgate-inspect: --ssl-ca-file: cannot load {str(tmp_path / 'missing.pem')!r} "
            "([Errno 2] No such file or directory)") in err
    tls = _config(tmp_path, f"rediss://127.0.0.1:{port}/0")
    tls.write_text(tls.read_text().replace(
        "[[pools]]", f'ssl_ca_file = "{tmp_path / "pod-ca.pem"}"\n\n[[pools]]', 1))
    code, out, err, _ = await _cli("--config", str(tls), env=_env())
    assert (code, out) == (2, ""), err
    assert (f"redis.ssl_ca_file of {tls}: cannot load {str(tmp_path / 'pod-ca.pem')!r}" in err
            and "name a copy with --ssl-ca-file" in err)
    assert "Traceback" not in err


async def _populated(redis_factory: Callable[..., LocalRedis]) -> LocalRedis:
    server = redis_factory()
    client = aioredis.Redis.from_url(server.url)
    try:
        await populate(client)
    finally:
        await client.aclose()
    return server


async def test_a_reader_that_stops_reading_ends_it_quietly(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    # `kvgate-inspect --watch | head -n 1`: head exits after one line, and the next frame's
    # write fails with EPIPE. That is no Redis failure: it was reported as "cannot read Redis
    # at ...: [Errno 32] Broken pipe" with status 1. Without --count only EPIPE ends the run.
    server = await _populated(redis_factory)
    script = '"$@" | head -n 1; exit "${PIPESTATUS[0]}"'
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, "bash", sys.executable, "-m", "admission.inspect",
        "--redis-url", server.url, "--pool", POOL, "--watch", "0.05", cwd=ROOT, env=_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
    err = err_bytes.decode()
    assert proc.returncode == 0, err
    assert out.decode() == f"redis redis://127.0.0.1:{server.port}/0\n"
    assert "cannot read Redis" not in err and "Broken pipe" not in err, err
    assert "Exception ignored" not in err and "Traceback" not in err, err


async def test_watch_outlives_a_redis_restart_and_says_what_failed(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    # --watch runs through an incident: Redis killed after the first frame, then restarted on
    # its port (empty). A refresh that fails is said on stderr and the next one follows; it
    # used to end the watch with status 1 at the first timeout or refused connection.
    server = await _populated(redis_factory)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admission.inspect", "--redis-url", server.url, "--pool", POOL,
        "--json", "--watch", "1", "--count", "5", cwd=ROOT, env=_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    assert json.loads(first)["pools"][0]["queued"] == 2
    server.kill()
    said: list[str] = []
    while not any("refresh 2 failed" in line for line in said):
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, said  # it ended instead
        said.append(line)
    redis_factory(port=server.port)
    out, rest = await asyncio.wait_for(proc.communicate(), 60)
    err = "".join(said) + rest.decode()
    assert proc.returncode == 0, err  # the last refresh read the restarted Redis
    docs = [first, *out.decode().splitlines()]
    failures = [line for line in err.splitlines() if " failed: cannot read Redis at " in line]
    assert len(docs) >= 2 and len(docs) + len(failures) == 5, err
    assert (f"kvgate-inspect: refresh 2 failed: cannot read Redis at "
            f"redis://127.0.0.1:{server.port}/0: ") in err
    assert "trying again in 1 s" in err and "Traceback" not in err
    assert json.loads(docs[-1])["pools"][0]["queued"] == 0  # the restarted Redis is empty


async def test_watch_with_a_count_exits_1_when_its_last_refresh_failed(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = await _populated(redis_factory)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admission.inspect", "--redis-url", server.url, "--pool", POOL,
        "--json", "--watch", "0.5", "--count", "3", cwd=ROOT, env=_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.readline(), 30)
    server.kill()
    out, err_bytes = await asyncio.wait_for(proc.communicate(), 60)
    err = err_bytes.decode()
    assert proc.returncode == 1, err
    docs = [first.decode(), *out.decode().splitlines()]
    failures = [line for line in err.splitlines() if " failed: cannot read Redis at " in line]
    assert failures and len(docs) + len(failures) == 3, err
    assert err.splitlines()[-1].startswith("kvgate-inspect: refresh 3 failed: "), err
    assert "Traceback" not in err


async def test_keys_whose_tag_is_no_pool_name_are_named_and_left_out(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    # Keys of kvgate's pattern written by hand or by another program: read as pools, their
    # tags raised ValueError (or UnicodeDecodeError) and the CLI ended with a traceback.
    server = await _populated(redis_factory)
    empty = redis_factory()
    for url in (server.url, empty.url):
        client = aioredis.Redis.from_url(url)
        try:
            await client.set("kvg:{not a pool}:x", 1)
            await client.set("kvg:{}:y", 1)
            await client.set(b"kvg:{\xff}:z", 1)
            assert await discover_pools(client) == ([POOL] if url == server.url else [])
        finally:
            await client.aclose()
    code, out, err, _ = await _cli("--redis-url", server.url, env=_env())
    assert code == 0, err
    assert f"pool {POOL}  zone YELLOW" in out
    assert "ignored the keys matching kvg:{*}:* whose tag is no pool name: ''," in err
    assert "'not a pool'" in err and "Traceback" not in err
    # Nothing but such keys: no kvgate key, as on an empty server.
    code, out, err, _ = await _cli("--redis-url", empty.url, env=_env())
    assert (code, out) == (3, ""), err
    assert "no kvgate keys in" in err and "Traceback" not in err
