"""Which Redis failures of admission a gateway lets pass, and whose deadline ends a wait.

Fail-open (`gateway.fail_open_tiers`) and the retryable 503 are for an outage: an error that
passes by itself (`admission.errors.is_transient`). A Redis that answers and refuses the same
way every time (a wrong password, an ACL, a key of the wrong type, a failing script) is a 500
`admission_misconfigured` that says not to retry, for every tier, logged once per streak with
the error's class. The multiplexed connection's circuit breaker keeps that class while it is
open, so neither admission nor the settler takes refused credentials for an outage.

A queued request whose client's deadline ends its wait before its tier's queue timeout is
counted with rejection reason `client_deadline`, not `queue_timeout` (which the VIP alert
reads as "waited the whole queue timeout").

Real redis-servers (the session's and private ones), a real gateway and backend on loopback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from redis import exceptions as rexc

from admission.config import RedisSettings
from admission.errors import ScriptReplyError, describe, is_transient
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore
from admission.tiers import Zone
from bench.common.localredis import LocalRedis, free_port
from gateway.metrics import GatewayMetrics
from gateway.redismux import RedisMux, mux_scripts
from gateway.settle import LiveTasks, Settler
from tests.gateway_harness import BIG, Harness, running_gateway
from tests.test_gateway_redismux import refusal

PASSWORD = "s3cret-store"
MESSAGES = [{"role": "user", "content": "hello"}]
BODY = {"model": "demo", "messages": MESSAGES, "max_tokens": 3}
REFUSED_LOG = "admission store call (refused for good"


async def _post(gw: Harness, who: str, headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + "/v1/chat/completions", json=BODY,
            headers={**gw.auth(who), **(headers or {})}) as response:
        return response.status, await response.json(), response.headers


def _sample(registry: Any, name: str, **labels: str) -> float:
    return float(registry.get_sample_value(name, labels) or 0.0)


# --- the classification ------------------------------------------------------------------------

CLASSIFIED: list[tuple[BaseException, bool]] = [
    # Permanent: only an operator changes these.
    (rexc.AuthenticationError("WRONGPASS invalid username-password pair"), False),
    (rexc.ResponseError("NOAUTH Authentication required."), False),
    (rexc.NoPermissionError("this user has no permissions to run the 'evalsha' command"),
     False),
    (rexc.ResponseError("NOPERM this user has no permissions to access one of the keys"),
     False),
    (rexc.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
     False),
    (rexc.ResponseError("ERR user_script:12: attempt to compare nil with number"), False),
    (ScriptReplyError("unexpected admit reply [b'what']"), False),
    # Transient: they pass by themselves.
    (rexc.ConnectionError("Error connecting to Redis: ConnectionRefusedError"), True),
    (rexc.TimeoutError("Timeout reading from Redis"), True),
    (TimeoutError(), True),
    (rexc.ReadOnlyError("You can't write against a read only replica."), True),
    (rexc.ConnectionError("Redis is a replica now: READONLY You can't write"), True),
    (rexc.ResponseError("MASTERDOWN Link with MASTER is down"), True),
    (rexc.BusyLoadingError("Redis is loading the dataset in memory"), True),
    (rexc.ResponseError("LOADING Redis is loading the dataset in memory"), True),
    (rexc.ResponseError("BUSY Redis is busy running a script."), True),
    (rexc.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's "
                        "currently unable to persist to disk."), True),
    # Before Redis 7.0 a command's error inside a script came wrapped in the script's ERR:
    # the command's condition decides, not the wrapper.
    (rexc.ResponseError("Error running script (call to f_3a1b): @user_script:12: "
                        "@user_script: 12: -OOM command not allowed when used memory > "
                        "'maxmemory'."), True),
    (rexc.ResponseError("ERR Error running script (call to f_3a1b): @user_script:9: "
                        "@user_script: 9: -READONLY You can't write against a read only "
                        "replica."), True),
    (rexc.ResponseError("Error running script (call to f_3a1b): @user_script:4: "
                        "user_script:4: attempt to perform arithmetic on a nil value"), False),
]


@pytest.mark.parametrize(("exc", "transient"), CLASSIFIED,
                         ids=lambda e: f"{type(e).__name__}:{e}"[:50])
def test_each_error_class_is_transient_or_permanent(exc: BaseException,
                                                    transient: bool) -> None:
    assert is_transient(exc) is transient


async def test_an_open_circuit_raises_the_class_of_the_failure_that_opened_it(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = redis_factory(password=PASSWORD)
    wrong = RedisMux(RedisSettings(url=f"redis://:wrong@127.0.0.1:{server.port}/0"))
    dead = RedisMux(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        refused = await refusal(wrong)
        assert isinstance(refused, rexc.AuthenticationError), describe(refused)
        for _ in range(3):  # within the circuit's first 100 ms: no connect attempted
            again = await refusal(wrong)
            assert isinstance(again, rexc.AuthenticationError), describe(again)
            assert "circuit open" in str(again) and again.__cause__ is refused
            assert not is_transient(again)
            assert describe(again) == "AuthenticationError"
        assert wrong.connects == 1

        down = await refusal(dead)
        again = await refusal(dead)
        assert type(again) is rexc.ConnectionError and "circuit open" in str(again)
        assert again.__cause__ is down and is_transient(again)
        assert dead.connects == 1
    finally:
        await wrong.close()
        await dead.close()


# --- the gateway's answers ---------------------------------------------------------------------


@pytest.mark.parametrize("refusal", ["wrong_password", "noperm"])
async def test_a_redis_that_refuses_for_good_is_a_500_for_every_tier_not_a_fail_open(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture, refusal: str,
) -> None:
    server = redis_factory(password=PASSWORD)
    if refusal == "wrong_password":
        url, logged = f"redis://:wrong@127.0.0.1:{server.port}/0", "AuthenticationError"
    else:
        admin: Any = aioredis.Redis.from_url(server.url)
        # Everything but running scripts: pub/sub and readiness work, every admit is refused.
        await admin.execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "~*", "&*",
                                    "+@all", "-evalsha", "-eval")
        await admin.aclose()
        url, logged = f"redis://narrow:pw@127.0.0.1:{server.port}/0", "NOPERM"
    caplog.set_level(logging.INFO, logger="kvgate.gateway")
    async with running_gateway(url, fail_open_tiers=["vip"], wait_subscribed=False) as gw:
        for who in ("vip", "vip", "vip", "normal", "normal"):
            status, payload, headers = await _post(gw, who)
            assert status == 500, (who, payload)
            assert payload == {"error": {
                "message": payload["error"]["message"], "type": "server_error", "param": None,
                "code": "admission_misconfigured"}}
            assert headers["x-should-retry"] == "false"
            assert "Retry-After" not in headers and "retry-after-ms" not in headers
        assert gw.backends[0].received == []  # nothing went to a node unadmitted
        registry = gw.gateway.metrics.registry
        assert _sample(registry, "kvgate_gateway_fail_open_total", pool="demo", tier="vip") == 0
        for tier, count in (("vip", 3), ("normal", 2)):
            assert _sample(registry, "kvgate_gateway_requests_total", pool="demo", tier=tier,
                           outcome="misconfigured") == count
            assert _sample(registry, "kvgate_gateway_requests_total", pool="demo", tier=tier,
                           outcome="unavailable") == 0
        assert _sample(registry, "kvgate_gateway_redis_errors_total", op="admit") == 5
        # Not ready either, whichever the refusal: a PING and SCRIPT EXISTS pass the ACL that
        # refuses scripts, so readiness runs one on each pool's keys as the admits do.
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/readyz") as ready:
            assert ready.status == 503
            assert logged in (await ready.json())["detail"]
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("admission store call")]
    assert len(lines) == 1 and logged in lines[0], lines  # once for the streak, its class
    assert lines[0].startswith(REFUSED_LOG)
    assert PASSWORD not in caplog.text and "wrong" not in "".join(lines)


async def test_a_redis_that_went_down_still_fails_open_for_the_fail_open_tiers(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory(password=PASSWORD)
    caplog.set_level(logging.INFO, logger="kvgate.gateway")
    async with running_gateway(server.url, fail_open_tiers=["vip"]) as gw:
        await gw.publish(Zone.GREEN, BIG)
        assert (await _post(gw, "vip"))[0] == 200
        server.kill()
        for _ in range(3):
            status, _, _ = await _post(gw, "vip")
            assert status == 200  # straight to the node, unadmitted
        status, payload, headers = await _post(gw, "normal")
        assert status == 503 and payload["error"]["code"] == "admission_unavailable"
        assert int(headers["Retry-After"]) >= 1
        registry = gw.gateway.metrics.registry
        assert _sample(registry, "kvgate_gateway_fail_open_total", pool="demo", tier="vip") == 3
        assert _sample(registry, "kvgate_gateway_requests_total", pool="demo", tier="vip",
                       outcome="misconfigured") == 0
    assert not any(r.getMessage().startswith(REFUSED_LOG) for r in caplog.records)


# --- settles and abandons stop on a permanent error --------------------------------------------


async def test_a_settle_refused_for_good_is_given_up_at_once_and_abandons_stop_the_round(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    """Behind the open circuit of refused credentials a settle was taken for an outage and
    retried for up to 30 s; and each renewal round tried to abandon every given-up task, each
    refused alike."""
    server = redis_factory(password=PASSWORD)
    url = f"redis://:wrong@127.0.0.1:{server.port}/0"
    client = aioredis.Redis.from_url(url)
    mux = RedisMux(RedisSettings(url=url))
    store = PoolStore(client, mux_scripts(register_scripts(client), mux), "p", PoolPolicy())
    metrics, live = GatewayMetrics(), LiveTasks()
    settler = Settler(metrics, live)
    registry = metrics.registry
    try:
        assert isinstance(await refusal(mux), rexc.AuthenticationError)  # the circuit opens
        for task_id in ("a", "b", "c"):
            live.add(task_id)
            assert await settler.finish(store, task_id, 10, cancelled=False,
                                        labels=None) is None
        assert _sample(registry, "kvgate_gateway_settles_abandoned_total", op="settle",
                       reason="permanent") == 3
        assert _sample(registry, "kvgate_gateway_settle_retries_total") == 0
        assert _sample(registry, "kvgate_gateway_redis_errors_total", op="settle") == 3
        assert settler.given_up == {"a", "b", "c"}
        await settler.abandon_given_up(store, "gw")
        # One refusal ends the round; the tasks stay held (their lease, not renewed while
        # Redis refuses this gateway, runs out and the reaper returns their budgets).
        assert _sample(registry, "kvgate_gateway_redis_errors_total", op="abandon") == 1
        assert settler.given_up == {"a", "b", "c"} and all(t in live for t in "abc")
    finally:
        await mux.close()
        await client.aclose()


# --- whose deadline ends a queued request's wait -----------------------------------------------


def _short_batch_timeout(data: dict[str, Any]) -> None:
    data["tiers"]["batch"]["queue_timeout_ms"] = 300


@pytest.mark.parametrize(("tier_timeout", "client_timeout", "reason"), [
    (False, "0.3", "client_deadline"),  # the client's 0.3 s before the tier's 20 s
    (True, None, "queue_timeout"),  # the tier's 0.3 s, no deadline of the client's
    (True, "10", "queue_timeout"),  # the tier's 0.3 s before the client's 10 s
])
async def test_a_wait_the_clients_deadline_ends_is_counted_apart_from_a_queue_timeout(
    redis_url: str, redis_client: aioredis.Redis, tier_timeout: bool,
    client_timeout: str | None, reason: str,
) -> None:
    async with running_gateway(
            redis_url, adjust=_short_batch_timeout if tier_timeout else None) as gw:
        # YELLOW, Batch not draining: a Batch request queues and nothing releases it.
        await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})
        headers = {} if client_timeout is None else {"X-Request-Timeout": client_timeout}
        status, payload, response_headers = await _post(gw, "batch", headers)
        assert status == 429 and payload["error"]["code"] == "capacity_exceeded"
        assert "waited" in payload["error"]["message"]
        assert int(response_headers["retry-after-ms"]) >= 1
        registry = gw.gateway.metrics.registry
        other = "queue_timeout" if reason == "client_deadline" else "client_deadline"
        assert _sample(registry, "kvgate_gateway_rejections_total", pool="demo", tier="batch",
                       reason=reason) == 1
        # Exported at 0 (not absent): an alert's increase() sees the first one of either.
        assert registry.get_sample_value("kvgate_gateway_rejections_total", {
            "pool": "demo", "tier": "batch", "reason": other}) == 0
        # The request's outcome and its answer are a queue timeout's either way.
        assert _sample(registry, "kvgate_gateway_requests_total", pool="demo", tier="batch",
                       outcome="queue_timeout") == 1
        await gw.settled()
        assert await gw.queued(2) == 0  # the task left the queue
