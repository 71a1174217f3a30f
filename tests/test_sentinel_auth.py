"""Sentinels that require a password (`requirepass` in sentinel.conf).

A primary with a password of its own and a Sentinel watching it with another, both real
redis-server processes on loopback. kvgate gives the Sentinels `redis.sentinel_password_env`'s
password (and `redis.sentinel_username`) and the primary the URL's: every connection that asks
the Sentinels where the primary is (redis-py's pool, pub/sub, the gateway's multiplexed
connection through its locator, kvgate-inspect) authenticates to them, and Sentinels that refuse
are one permanent error, SentinelAuthenticationError, never taken for an outage and never the
primary's AuthenticationError.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer
from redis import exceptions as rexc

from admission import inspect
from admission.config import RedisSettings, parse_config
from admission.connection import SentinelAuthenticationError, connect, primary_locator
from admission.errors import describe, is_transient
from admission.scripts import CommandTransport, register_scripts
from admission.store import PoolStore
from admission.tiers import Zone
from bench.common.instant_backend import InstantBackend
from bench.common.localredis import LocalRedis, start_redis, start_sentinel
from gateway.app import create_app
from gateway.redismux import RedisMux
from tests.gateway_harness import BIG, POOL, Harness, config_data, serve_backend
from tests.test_gateway_redismux import refusal

MASTER = "kvgate"
PRIMARY_PASSWORD = "primary-pw-not-real"
SENTINEL_PASSWORD = "sentinel-pw-not-real"
WRONG = "wrong-sentinel-pw"
VARIABLE = "KVGATE_TEST_SENTINEL_PASSWORD"
REFUSED_LOG = "admission store call (refused for good"


@dataclass
class Guarded:
    primary: LocalRedis
    sentinel: LocalRedis


@pytest.fixture
def guarded() -> Iterator[Guarded]:
    primary = start_redis(password=PRIMARY_PASSWORD)
    try:
        sentinel = start_sentinel(primary.port, name=MASTER, quorum=1,
                                  password=SENTINEL_PASSWORD, primary_password=PRIMARY_PASSWORD)
    except BaseException:
        primary.stop()
        raise
    try:
        yield Guarded(primary, sentinel)
    finally:
        for server in (sentinel, primary):
            server.stop()
            shutil.rmtree(server.workdir, ignore_errors=True)


def redis_table(g: Guarded, secret: str | None, *,
                url_password: str = PRIMARY_PASSWORD) -> dict[str, Any]:
    """`[redis]` under the Sentinel; `secret` None: no sentinel_password_env at all."""
    table: dict[str, Any] = {
        "url": f"redis://:{url_password}@/0", "sentinel_master": MASTER,
        "sentinels": [f"127.0.0.1:{g.sentinel.port}"],
        "socket_timeout_ms": 2_000, "connect_timeout_ms": 2_000}
    if secret is not None:
        table["sentinel_password_env"] = VARIABLE
    return table


def environment(secret: str | None) -> dict[str, str]:
    return {} if secret is None else {VARIABLE: secret}


def settings(g: Guarded, secret: str | None, **kwargs: Any) -> RedisSettings:
    data = {"redis": redis_table(g, secret, **kwargs), "pools": [{"name": POOL}]}
    return parse_config(data, env=environment(secret)).redis


async def next_message(pubsub: Any) -> dict[str, Any]:
    async with asyncio.timeout(5):
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None:
                return dict(message)


# --- the admission core: redis-py's pool, pub/sub, the multiplexed connection -----------------


async def test_with_the_sentinels_password_every_connection_reaches_the_primary(
    guarded: Guarded,
) -> None:
    bare = aioredis.Redis(port=guarded.sentinel.port)
    try:
        with pytest.raises(rexc.AuthenticationError):  # the Sentinel does demand AUTH
            await bare.sentinel_masters()
    finally:
        await bare.aclose()
    config = settings(guarded, SENTINEL_PASSWORD)
    client = connect(config)
    mux = RedisMux(config, locate=primary_locator(client))
    primary = aioredis.Redis.from_url(guarded.primary.url)
    pubsub = client.pubsub()
    try:
        await client.set("written", "via the Sentinel")
        assert await primary.get("written") == b"via the Sentinel"  # the primary it named
        assert await mux.execute("GET", "written") == b"via the Sentinel"
        assert mux.connects == 1
        await pubsub.subscribe("wake")
        assert (await next_message(pubsub))["type"] == "subscribe"
        await primary.publish("wake", "up")
        assert (await next_message(pubsub))["data"] == b"up"
    finally:
        await pubsub.aclose()
        await mux.close()
        await client.aclose()
        await primary.aclose()


@pytest.mark.parametrize("secret", [WRONG, None], ids=["wrong password", "no password"])
async def test_sentinels_that_refuse_are_one_permanent_error_naming_them(
    guarded: Guarded, secret: str | None,
) -> None:
    config = settings(guarded, secret)
    client = connect(config)
    mux = RedisMux(config, locate=primary_locator(client))
    pubsub = client.pubsub()
    try:
        with pytest.raises(SentinelAuthenticationError) as by_pool:
            await client.ping()
        with pytest.raises(SentinelAuthenticationError) as by_pubsub:
            await pubsub.subscribe("wake")
        by_mux = await refusal(mux)
        assert type(by_mux) is SentinelAuthenticationError
        behind_circuit = await refusal(mux)  # the circuit it opened keeps its class
        assert "circuit open" in str(behind_circuit) and mux.connects == 1
        for exc in (by_pool.value, by_pubsub.value, by_mux, behind_circuit):
            assert not is_transient(exc)
            assert describe(exc) == "SentinelAuthenticationError"
        for exc in (by_pool.value, by_mux):
            message = str(exc)
            assert message.startswith("the Sentinels refused kvgate's credentials"), message
            assert f"127.0.0.1:{guarded.sentinel.port}: " in message
            for secret_text in (SENTINEL_PASSWORD, PRIMARY_PASSWORD, WRONG):
                assert secret_text not in message
    finally:
        await pubsub.aclose()
        await mux.close()
        await client.aclose()


async def test_the_primary_is_asked_with_the_urls_credentials_not_the_sentinels(
    guarded: Guarded,
) -> None:
    """The Sentinels accept theirs; the primary, given the Sentinels' password in the URL,
    refuses: its own AuthenticationError, not the Sentinels'."""
    config = settings(guarded, SENTINEL_PASSWORD, url_password=SENTINEL_PASSWORD)
    client = connect(config)
    mux = RedisMux(config, locate=primary_locator(client))
    try:
        with pytest.raises(rexc.AuthenticationError) as by_pool:
            await client.ping()
        by_mux = await refusal(mux)
        for exc in (by_pool.value, by_mux):
            assert isinstance(exc, rexc.AuthenticationError)
            assert not isinstance(exc, SentinelAuthenticationError), describe(exc)
            assert not is_transient(exc)
    finally:
        await mux.close()
        await client.aclose()


# --- a gateway --------------------------------------------------------------------------------


@asynccontextmanager
async def sentinel_gateway(g: Guarded, secret: str | None, **gateway: Any
                           ) -> AsyncIterator[Harness]:
    """A gateway whose Redis is found through the Sentinel; the harness's own store writes to
    the primary directly (the test plays the scheduler)."""
    backend = InstantBackend(model=POOL, max_model_len=4096)
    async with serve_backend(backend) as url:
        data = config_data(g.primary.url, [url], **gateway)
        data["redis"] = redis_table(g, secret)
        config = parse_config(data, env=environment(secret))
        app = create_app(config, gateway_id="gw-sentinel", settle_drain_s=0.5)
        server = TestServer(app, host="127.0.0.1")
        client = aioredis.Redis.from_url(g.primary.url)
        store = PoolStore(client, register_scripts(client), POOL, config.pool_policy(POOL))
        harness = Harness(config, app, server, client, store, [backend])
        await server.start_server()
        try:
            yield harness
        finally:
            await server.close()
            await client.aclose()


async def post(gw: Harness, who: str) -> tuple[int, dict[str, Any]]:
    body = {"model": POOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + "/v1/chat/completions", json=body, headers=gw.auth(who)) as response:
        return response.status, await response.json()


async def test_a_gateway_admits_through_sentinels_that_require_a_password(
    guarded: Guarded,
) -> None:
    async with sentinel_gateway(guarded, SENTINEL_PASSWORD) as gw:
        # The wake-up subscription found the primary through the Sentinel.
        await asyncio.wait_for(gw.gateway.hub.subscribed.wait(), 10)
        await gw.publish(Zone.GREEN, BIG)
        status, payload = await post(gw, "vip")
        assert status == 200, payload
        assert len(gw.backends[0].received) == 1
        await gw.settled()
        stats = await gw.redis.hgetall(gw.store.keys.stats)
        assert int(stats[b"settled"]) == 1  # admitted and settled in the primary's records
        transport = gw.gateway.pools[POOL].store.scripts.admit.transport
        assert isinstance(transport, CommandTransport)
        mux = transport.connection
        assert isinstance(mux, RedisMux) and mux.locate is not None and mux.connects >= 1


async def test_a_gateway_whose_sentinel_password_is_wrong_answers_500_and_logs_it_once(
    guarded: Guarded, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.gateway")
    async with sentinel_gateway(guarded, WRONG, fail_open_tiers=["vip"]) as gw:
        await gw.publish(Zone.GREEN, BIG)
        for who in ("vip", "vip", "normal"):
            status, payload = await post(gw, who)
            assert status == 500, (who, payload)
            assert payload["error"]["code"] == "admission_misconfigured"
        assert gw.backends[0].received == []  # the fail-open tier did not fail open
    messages = [r.getMessage() for r in caplog.records]
    refused = [m for m in messages if m.startswith("admission store call")]
    assert len(refused) == 1 and refused[0].startswith(REFUSED_LOG), refused
    assert "SentinelAuthenticationError" in refused[0]
    assert any(m.startswith("Redis unavailable at start (SentinelAuthenticationError")
               for m in messages), messages
    for secret_text in (SENTINEL_PASSWORD, PRIMARY_PASSWORD, WRONG):
        assert secret_text not in caplog.text


# --- kvgate-inspect ---------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [SENTINEL_PASSWORD, WRONG], ids=["right", "wrong"])
def test_kvgate_inspect_asks_the_sentinels_with_the_files_credentials(
    guarded: Guarded, secret: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = redis_table(guarded, secret)
    config = tmp_path / "kvgate.toml"
    config.write_text(
        f'[redis]\nurl = "{table["url"]}"\nsentinel_master = "{MASTER}"\n'
        f'sentinels = ["{table["sentinels"][0]}"]\nsentinel_password_env = "{VARIABLE}"\n'
        f'\n[[pools]]\nname = "{POOL}"\n')
    monkeypatch.setenv(VARIABLE, secret)
    code = inspect.main(["--config", str(config), "--pool", POOL])
    err = capsys.readouterr().err
    if secret == SENTINEL_PASSWORD:
        # The primary answered: it holds no key of the pool (nothing ran), which is said.
        assert code == inspect.EXIT_NOTHING, err
        assert f"no kvgate keys of pool {POOL} in Sentinel master {MASTER}" in err
    else:
        assert code == inspect.EXIT_REDIS, err
        assert "the Sentinels refused kvgate's credentials" in err
    for secret_text in (SENTINEL_PASSWORD, PRIMARY_PASSWORD, WRONG):
        assert secret_text not in err
