"""Security: Redis AUTH and TLS against real redis-servers, keys hashed at rest and compared in
constant time, no tier escalation, no secrets in logs, per-tenant queue caps, and the admin
API behind its token."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import ipaddress
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.exceptions import RedisError

from admission.config import Config, ConfigError, RedisSettings, parse_config
from admission.connection import connect
from admission.keys import PoolKeys
from admission.scripts import register_scripts
from admission.store import PoolStore
from admission.tiers import Zone
from bench.common.instant_backend import InstantBackend
from bench.common.localredis import LocalRedis
from gateway.auth import AdminToken, TenantDirectory
from gateway.errors import ApiError
from scheduler.service import SchedulerService
from tests.gateway_harness import (
    BIG,
    KEYS,
    POOL,
    Harness,
    config_data,
    eventually,
    running_gateway,
    serve_backend,
    sha,
    start_gateway_process,
)
from tests.live import to_toml

PASSWORD = "pw-7Zq1-never-logged"
ADMIN_TOKEN = "adm-token-31d9e0"
SECRET_PROMPT = "the vault combination is TANGERINE-77-OTTER"
MESSAGES = [{"role": "user", "content": "Say hi."}]


# --- helpers ---------------------------------------------------------------------------------


def make_tls_dir(where: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 / localhost signed by it (ca.crt,
    server.crt, server.key), made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgate test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    where.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (where / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    (where / "server.crt").write_bytes(cert.public_bytes(pem))
    (where / "server.key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return where


def openai_error(payload: Any) -> dict[str, Any]:
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
    error: dict[str, Any] = payload["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    return error


async def request(url: str, *, method: str = "POST", body: Any = None,
                  headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http, http.request(
            method, url, json=body, headers=headers or {}) as response:
        text = await response.text()
        try:
            payload = await response.json(content_type=None)
        except ValueError:
            payload = text
        return response.status, payload, response.headers


def chat(max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {"model": POOL, "messages": MESSAGES, "max_tokens": max_tokens, **extra}


@asynccontextmanager
async def scheduler_for(config: Config, me: str) -> AsyncIterator[SchedulerService]:
    service = SchedulerService(config, me=me)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def leader_published(redis: Any, me: str) -> None:
    """Until `me` leads and has published the pool's state (zone and node budgets)."""
    keys = PoolKeys(POOL)

    async def check() -> bool:
        leader = await redis.hget(keys.state, "leader")
        capacity = int(await redis.hlen(keys.node_capacity))
        return bool(leader == me.encode()) and capacity > 0

    await eventually(check, within_s=10.0)


# --- Redis AUTH ------------------------------------------------------------------------------


async def test_gateway_and_scheduler_run_against_a_password_protected_redis(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = redis_factory(password=PASSWORD)
    assert server.url.startswith(f"redis://:{PASSWORD}@")
    async with running_gateway(server.url) as gw, \
            scheduler_for(gw.config, "sched-auth") as scheduler:
        await leader_published(gw.redis, "sched-auth")
        assert scheduler.leading
        status, payload, headers = await request(
            gw.url + "/v1/chat/completions", body=chat(), headers=gw.auth("normal"))
        assert status == 200, payload
        await gw.settled()
        record = await gw.task(headers["X-Request-Id"])
        assert record["state"] == "settled" and record["node"] == "node-0"
        assert gw.gateway.hub.subscribed.is_set()  # pub/sub authenticated too


async def test_wrong_redis_password_fails_clearly_and_is_never_shown(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory(password=PASSWORD)
    wrong = f"wrong-{PASSWORD[::-1]}"
    url = f"redis://:{wrong}@127.0.0.1:{server.port}/0"
    caplog.set_level(logging.DEBUG)
    async with running_gateway(url, wait_subscribed=False) as gw:
        status, payload, headers = await request(
            gw.url + "/v1/chat/completions", body=chat(), headers=gw.auth("normal"))
        # Refused for good: no retry would pass, so none is invited.
        assert status == 500 and headers["x-should-retry"] == "false"
        assert "Retry-After" not in headers
        assert openai_error(payload)["code"] == "admission_misconfigured"
        status, ready, _ = await request(gw.url + "/readyz", method="GET")
        assert status == 503 and ready["detail"] == "redis: AuthenticationError WRONGPASS"
        seen = [payload, ready]
        async with scheduler_for(gw.config, "sched-wrong-pw") as scheduler:
            async def refused() -> bool:
                return "leadership call failed" in caplog.text

            await eventually(refused, within_s=5.0)
            assert not scheduler.leading
    logged = caplog.text
    assert "AuthenticationError" in logged  # the gateway says why
    assert "invalid username-password pair" in logged  # the scheduler too
    for secret in (wrong, PASSWORD):
        assert secret not in logged
        assert all(secret not in str(answer) for answer in seen)


# --- TLS -------------------------------------------------------------------------------------


async def test_gateway_and_scheduler_over_tls_with_the_configured_ca(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    tls = make_tls_dir(tmp_path / "tls")
    server = redis_factory(tls_dir=tls, password=PASSWORD)
    assert server.url.startswith("rediss://")
    settings = RedisSettings(url=server.url, ssl_ca_file=str(tls / "ca.crt"))
    verify = connect(settings)
    plain = connect(RedisSettings(url=f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"))
    try:
        assert await verify.ping()
        with pytest.raises(RedisError):  # plaintext on a TLS-only port
            await plain.ping()

        def with_ca(data: dict[str, Any]) -> None:
            data["redis"]["ssl_ca_file"] = str(tls / "ca.crt")

        async with running_gateway(server.url, adjust=with_ca, wait_subscribed=True) as gw, \
                scheduler_for(gw.config, "sched-tls"):
            await leader_published(verify, "sched-tls")
            for who in ("vip", "batch"):
                status, payload, headers = await request(
                    gw.url + "/v1/chat/completions", body=chat(stream=True),
                    headers=gw.auth(who))
                assert status == 200, payload
            await gw.settled()
            record = await verify.hgetall(gw.store.keys.task_key(headers["X-Request-Id"]))
            assert record[b"state"] == b"settled"

        # Without the CA the server's certificate is not trusted: fail closed, no plaintext.
        async with running_gateway(server.url, wait_subscribed=False) as untrusting:
            status, payload, _ = await request(
                untrusting.url + "/v1/chat/completions", body=chat(),
                headers=untrusting.auth("vip"))
            assert status == 500 and openai_error(payload)["code"] == "admission_misconfigured"

        # The URL's own TLS parameters hold for every connection, the gateway's multiplexed
        # one (every admit) as much as the client library's (readiness, the scheduler): a
        # server trusted by `ssl_cert_reqs=none` alone serves requests.
        lax_url = f"{server.url}?ssl_cert_reqs=none"
        async with running_gateway(lax_url, wait_subscribed=True) as lax, \
                scheduler_for(lax.config, "sched-lax"):
            await leader_published(verify, "sched-lax")
            status, payload, _ = await request(
                lax.url + "/v1/chat/completions", body=chat(), headers=lax.auth("vip"))
            assert status == 200, payload  # admitted: through the multiplexed connection
    finally:
        await verify.aclose()
        await plain.aclose()


# --- keys at rest, constant-time comparison --------------------------------------------------


def test_config_holds_only_key_digests() -> None:
    base = config_data("redis://127.0.0.1:1/0", ["http://127.0.0.1:9"])
    base["tenants"][0]["key_sha256"] = [KEYS["vip"]]
    with pytest.raises(ConfigError) as info:
        parse_config(base, env={})
    assert "tenants[0].key_sha256[0]" in str(info.value) and KEYS["vip"] not in str(info.value)
    base = config_data("redis://127.0.0.1:1/0", ["http://127.0.0.1:9"],
                       admin_token_sha256=ADMIN_TOKEN)
    with pytest.raises(ConfigError) as info:
        parse_config(base, env={})
    assert "gateway.admin_token_sha256" in str(info.value)
    assert ADMIN_TOKEN not in str(info.value)
    config = parse_config(config_data("redis://127.0.0.1:1/0", ["http://127.0.0.1:9"],
                                      admin_token_sha256=sha(ADMIN_TOKEN)), env={})
    text = repr(config)
    assert all(key not in text for key in KEYS.values()) and ADMIN_TOKEN not in text
    assert sha(KEYS["vip"]) in text


class CountingCompare:
    """Wraps hmac.compare_digest, counting calls on 32-byte digests."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = hmac.compare_digest

    def __call__(self, a: Any, b: Any) -> bool:
        if isinstance(a, bytes) and len(a) == 32:
            self.calls += 1
        return self.real(a, b)


async def test_a_key_costs_one_constant_time_comparison_at_any_number_of_keys(
    redis_url: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = CountingCompare()
    monkeypatch.setattr(hmac, "compare_digest", counter)
    async with running_gateway(redis_url, admin_token_sha256=sha(ADMIN_TOKEN)) as gw:
        await gw.publish(Zone.GREEN, BIG)
        digests = sum(len(t.key_sha256) for t in gw.config.tenants)
        assert digests == len(KEYS) == len(gw.gateway.tenants)
        # The first tenant's key, the last one's and an unknown key: the same work for each,
        # one hmac.compare_digest against the digest looked up (or a digest of no key), however
        # many keys are configured.
        for key, expected in ((KEYS["vip"], 200), (KEYS["frozen"], 200), ("sk-unknown", 401)):
            counter.calls = 0
            status, _, _ = await request(gw.url + "/v1/models", method="GET",
                                         headers={"Authorization": f"Bearer {key}"})
            assert status == expected
            assert counter.calls == 1, (key, counter.calls)
        counter.calls = 0
        status, _, _ = await request(gw.url + "/admin/pools", method="GET",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 200 and counter.calls == 1
    directory = TenantDirectory(gw.config.tenants)
    counter.calls = 0
    assert directory.authenticate(f"Bearer {KEYS['batch']}").name == "batch"
    assert counter.calls == 1


# --- no tier escalation ----------------------------------------------------------------------


async def test_batch_key_cannot_escalate_through_headers_or_body(
    redis_url: str, redis_client: Any,
) -> None:
    def pass_priority(data: dict[str, Any]) -> None:
        data["pools"][0]["pass_priority"] = True

    async with running_gateway(redis_url, adjust=pass_priority) as gw:
        await gw.publish(Zone.GREEN, BIG)
        attempts: list[tuple[dict[str, str], dict[str, Any]]] = [
            ({"X-Priority": "vip"}, {}),
            ({"X-Priority": "0"}, {}),
            ({"X-Priority": "normal"}, {}),
            ({"X-Tier": "vip", "X-Tenant": "vip", "X-Kvgate-Tier": "0"}, {}),
            ({}, {"priority": 0}),
            ({}, {"priority": -1000}),
            ({}, {"user": "vip", "metadata": {"tier": "vip", "priority": "0"}}),
            ({}, {"tier": "vip", "tenant": "vip", "extra_body": {"priority": 0}}),
            ({"X-Priority": "vip"}, {"priority": 0, "stream": True}),
        ]
        backend = gw.backends[0]
        for extra_headers, extra_body in attempts:
            sent = len(backend.received)
            status, payload, headers = await request(
                gw.url + "/v1/chat/completions", body=chat(**extra_body),
                headers={**gw.auth("batch"), **extra_headers})
            assert status == 200, (extra_headers, extra_body, payload)
            record = await gw.task(headers["X-Request-Id"])
            assert record["tier"] == "2" and record["tenant"] == "batch", (extra_headers,
                                                                          extra_body)
            forwarded = backend.received[sent]
            assert forwarded.body["priority"] == 2  # the engine sees Batch, whatever was sent
            assert not any(h.lower().startswith("x-priority") for h in forwarded.headers)
        # A VIP key that asks for less is lowered (the header works in that direction only).
        status, _, headers = await request(
            gw.url + "/v1/chat/completions", body=chat(),
            headers={**gw.auth("vip"), "X-Priority": "batch"})
        assert status == 200 and (await gw.task(headers["X-Request-Id"]))["tier"] == "2"
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": POOL, "tier": "vip", "outcome": "ok"}) == 0
        await gw.settled()
        # Nothing secret at rest in Redis: no key, no digest, no prompt.
        dump = await _redis_dump(gw.redis)
        assert "batch" in dump
        for secret in (*KEYS.values(), *(sha(k) for k in KEYS.values()), "Say hi."):
            assert secret not in dump


async def _redis_dump(redis: Any) -> str:
    parts: list[str] = []
    async for key in redis.scan_iter(count=500):
        kind = (await redis.type(key)).decode()
        value: Any = {
            "hash": redis.hgetall, "zset": lambda k: redis.zrange(k, 0, -1, withscores=True),
            "set": redis.smembers, "string": redis.get, "list": lambda k: redis.lrange(k, 0, -1),
        }[kind](key)
        parts.append(f"{key!r} {await value!r}")
    return "\n".join(parts)


# --- logs ------------------------------------------------------------------------------------


async def test_gateway_process_logs_hold_no_key_password_or_prompt(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    """A real `python -m gateway` at DEBUG with its access log, against a password-protected
    Redis, through successes, a stream, a failing node, a wrong key and a Redis outage."""
    server = redis_factory(password=PASSWORD)
    good, failing = InstantBackend(model=POOL), InstantBackend(model=POOL, fail_status=500)
    async with serve_backend(good) as good_url, serve_backend(failing) as bad_url:
        data = config_data("redis://127.0.0.1:1/0", [good_url, bad_url])
        config_file = tmp_path / "gw.toml"
        config_file.write_text(to_toml(data))
        config = parse_config(data, env={"REDIS_URL": server.url})
        process, url = await start_gateway_process(config_file, server.url,
                                                   "--log-level", "DEBUG")
        try:
            redis = connect(config.redis)
            store = PoolStore(redis, register_scripts(redis), POOL, config.pool_policy(POOL))
            await store.publish_state(1, Zone.GREEN, {"node-0": BIG})
            body = {"model": POOL, "messages": [{"role": "user", "content": SECRET_PROMPT}],
                    "max_tokens": 2}
            auth = {"Authorization": f"Bearer {KEYS['vip']}"}
            assert (await request(url + "/v1/chat/completions", body=body, headers=auth))[0] \
                == 200
            assert (await request(url + "/v1/chat/completions", body={**body, "stream": True},
                                  headers=auth))[0] == 200
            await store.publish_state(1, Zone.GREEN, {"node-1": BIG})  # the failing node
            assert (await request(url + "/v1/chat/completions", body=body, headers=auth))[0] \
                == 502
            leaked = "sk-leaked-7731-KEY"
            assert (await request(url + "/v1/completions", body={
                "model": POOL, "prompt": SECRET_PROMPT},
                headers={"Authorization": f"Bearer {leaked}"}))[0] == 401
            assert (await request(url + "/v1/chat/completions", body={
                "model": POOL, "messages": SECRET_PROMPT}, headers=auth))[0] == 400
            await redis.aclose()
            server.kill()  # Redis gone: warnings about admission, renewals, subscription
            status, _, _ = await request(url + "/v1/chat/completions", body=body, headers=auth)
            assert status == 503
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(process.communicate(), 30)
    logged = err.decode(errors="replace")
    assert "POST /v1/chat/completions" in logged  # the access log ran
    # The start line names the Redis it uses, without its password.
    assert f"serving pools {POOL}, Redis redis://127.0.0.1:{server.port}/0" in logged
    assert "task " in logged and "admission store call failed" in logged
    for secret in (PASSWORD, SECRET_PROMPT, "TANGERINE", leaked, *KEYS.values()):
        assert secret not in logged, secret


# --- per-tenant queue caps -------------------------------------------------------------------


async def test_one_tenant_cannot_fill_the_queue_for_the_others(
    redis_url: str, redis_client: Any,
) -> None:
    def flood_tenant(data: dict[str, Any]) -> None:
        data["tenants"].append({"name": "flood", "tier": "normal", "key_sha256": [sha("sk-fl")],
                                "rate": 1_000_000, "burst": 1_000_000, "max_queued": 3})
        data["tiers"]["normal"]["max_queued"] = 5

    async with running_gateway(redis_url, adjust=flood_tenant) as gw:
        await gw.publish(Zone.GREEN, 0)  # no room anywhere: every request queues
        flood = {"Authorization": "Bearer sk-fl"}
        url = gw.url + "/v1/chat/completions"
        queued = [asyncio.create_task(request(url, body=chat(), headers=flood))
                  for _ in range(3)]
        tq = gw.store.keys.tenant_queued
        await eventually(lambda: _hget_int(gw, tq, "flood", 3))
        # Its fourth is refused at once; nothing of it is charged.
        before = await gw.bucket("flood")
        status, payload, headers = await request(url, body=chat(), headers=flood)
        assert status == 429 and openai_error(payload)["code"] == "capacity_exceeded"
        assert "too many requests queued" in payload["error"]["message"]
        assert int(headers["Retry-After"]) >= 1 and await gw.bucket("flood") == before
        # Another tenant of the same tier still gets a place in the queue.
        others = [asyncio.create_task(request(url, body=chat(), headers=gw.auth(who)))
                  for who in ("normal", "small")]
        await eventually(lambda: _hget_int(gw, tq, "normal", 1))
        await eventually(lambda: _hget_int(gw, tq, "small", 1))
        assert await gw.queued(1) == 5
        await gw.publish(Zone.GREEN, BIG)
        await gw.release()
        answers = await asyncio.wait_for(asyncio.gather(*queued, *others), 10)
        assert [a[0] for a in answers] == [200] * 5
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_gateway_rejections_total", {
            "pool": POOL, "tier": "normal", "reason": "tenant_queue_full"}) == 1


async def _hget_int(gw: Harness, key: str, field: str, expected: int) -> bool:
    raw = await gw.redis.hget(key, field)
    return raw is not None and int(raw) == expected


# --- admin API -------------------------------------------------------------------------------


async def test_admin_endpoint_needs_the_admin_token(redis_url: str, redis_client: Any) -> None:
    async with running_gateway(redis_url, admin_token_sha256=sha(ADMIN_TOKEN)) as gw:
        await gw.publish(Zone.GREEN, BIG)
        assert (await request(gw.url + "/v1/chat/completions", body=chat(),
                              headers=gw.auth("normal")))[0] == 200
        url = gw.url + "/admin/pools"
        refused = {
            "missing_admin_token": [{}, {"Authorization": f"Basic {ADMIN_TOKEN}"},
                                    {"Authorization": "Bearer "}],
            "invalid_admin_token": [{"Authorization": f"Bearer {KEYS['vip']}"},
                                    {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
                                    {"Authorization": f"Bearer {sha(ADMIN_TOKEN)}"}],
        }
        for code, header_sets in refused.items():
            for headers in header_sets:
                status, payload, answer = await request(url, method="GET", headers=headers)
                assert status == 401 and openai_error(payload)["code"] == code, headers
                assert answer["WWW-Authenticate"] == "Bearer"
        status, snap, _ = await request(url, method="GET",
                                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 200
        pool = snap["pools"][0]
        assert pool["pool"] == POOL and pool["zone"] == "GREEN"
        assert {t["tenant"] for t in pool["tenants"]} >= {"normal", "vip", "batch"}
        assert pool["stats"]["fast_path"] == 1 and "scheduler" in snap
        text = str(snap)
        assert all(sha(k) not in text and k not in text for k in KEYS.values())
        # The operational endpoints stay open (documented): probes and Prometheus use them.
        assert (await request(gw.url + "/metrics", method="GET"))[0] == 200
    async with running_gateway(redis_url) as off:
        status, payload, headers = await request(
            off.url + "/admin/pools", method="GET",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 403 and openai_error(payload)["code"] == "admin_disabled"
        assert openai_error(payload)["type"] == "invalid_request_error"  # not a quota
        assert headers["x-should-retry"] == "false"


def test_admin_token_check_without_a_server() -> None:
    token = AdminToken(sha(ADMIN_TOKEN))
    token.check(f"Bearer {ADMIN_TOKEN}")
    token.check(f"bearer   {ADMIN_TOKEN}  ")
    assert hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest() == sha(ADMIN_TOKEN)
    for header in (None, "", "Bearer", f"Token {ADMIN_TOKEN}", f"Bearer {ADMIN_TOKEN[:-1]}",
                   "Bearer \udcff"):
        with pytest.raises(ApiError) as info:
            token.check(header)
        assert info.value.status == 401
    assert not AdminToken(None).enabled
    with pytest.raises(ApiError) as off:
        AdminToken(None).check(f"Bearer {ADMIN_TOKEN}")
    assert (off.value.status, off.value.code, off.value.type) == (
        403, "admin_disabled", "invalid_request_error")
