"""Which Redis errors are retried, for how long, and what a given-up settle leaves behind.

The classification (`admission.errors.is_transient`) is checked on exceptions as redis-py and
the gateway's multiplexed connection raise them, and on real replies of a private
redis-server (WRONGTYPE, a failing script, NOPERM, BUSY, a refused connection). The retry
policy is a pure function, checked as properties. The settler is driven against a real
redis-server: a permanent error is not retried, transient ones stop at the policy's bound,
and the given-up task leaves the renewed set so that its lease expires and the reaper
returns its budget while the gateway's other tasks stay alive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from admission.config import RedisSettings
from admission.errors import (
    REDIS_ERRORS,
    FencedError,
    RetryPolicy,
    ScriptReplyError,
    describe,
    is_transient,
    reply_code,
)
from admission.keys import abandoned_lease
from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.localredis import LocalRedis, free_port
from gateway.metrics import GatewayMetrics
from gateway.redismux import RedisMux
from gateway.settle import SETTLE_RETRY, LiveTasks, Settler
from tests.properties import PROPERTIES, examples
from tests.test_security import make_tls_dir

TRANSIENT: list[BaseException] = [
    rexc.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
    rexc.TimeoutError("Timeout reading from socket"),
    TimeoutError(),
    ConnectionResetError(),
    rexc.BusyLoadingError("Redis is loading the dataset in memory"),
    rexc.MaxConnectionsError("Too many connections"),
    rexc.ReadOnlyError("You can't write against a read only replica."),
    rexc.TryAgainError("Multiple keys request during rehashing of slot"),
    rexc.ClusterDownError("The cluster is down"),
    rexc.MasterDownError("Link with MASTER is down"),
    rexc.MovedError("3999 127.0.0.1:6381"),
    rexc.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    rexc.InvalidResponse("Protocol error"),
    # As gateway/redismux.py raises replies: the code is the first word of the message.
    rexc.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL"),
    rexc.ResponseError("LOADING Redis is loading the dataset in memory"),
    rexc.ResponseError("MASTERDOWN Link with MASTER is down"),
    rexc.ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"),
    rexc.ResponseError("CLUSTERDOWN Hash slot not served"),
    rexc.ResponseError("NOREPLICAS Not enough good replicas to write."),
    rexc.ResponseError("OOM command not allowed when used memory > 'maxmemory'. script: x"),
]
PERMANENT: list[BaseException] = [
    rexc.AuthenticationError("invalid username-password pair"),
    rexc.NoPermissionError("this user has no permissions to run the 'evalsha' command"),
    rexc.ResponseError("NOPERM this user has no permissions to access one of the keys"),
    rexc.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    rexc.ResponseError("ERR user_script:12: attempt to compare nil with number"),
    rexc.ResponseError("Error running script (call to f_0123): @user_script:1: bad"),
    rexc.ExecAbortError("Transaction discarded because of previous errors."),
    rexc.DataError("Invalid input of type: 'NoneType'."),
    ScriptReplyError("unexpected admit reply [b'what']"),
    FencedError("p", 1, 2),
    ValueError("a bug"),
]


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: f"{type(e).__name__}:{e}"[:60])
def test_errors_that_can_pass_are_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", PERMANENT, ids=lambda e: f"{type(e).__name__}:{e}"[:60])
def test_errors_that_fail_the_same_way_every_time_are_permanent(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_the_code_comes_from_redis_py_or_from_the_message() -> None:
    stripped = rexc.ResponseError("Operation against a key holding the wrong kind of value")
    stripped.status_code = "WRONGTYPE"  # redis-py >= 6 strips the code into this attribute
    assert reply_code(stripped) == "WRONGTYPE" and not is_transient(stripped)
    assert reply_code(rexc.ResponseError("BUSY Redis is busy")) == "BUSY"
    assert reply_code(rexc.ConnectionError("Error connecting")) is None
    # What logs may show: class and code, never the message (it can quote keys or values).
    assert describe(rexc.ResponseError("NOPERM user has no access to kvg:{p}:task:x")) == (
        "ResponseError NOPERM")


async def _raised(call: Callable[[], Awaitable[Any]]) -> BaseException:
    try:
        await call()
    except Exception as exc:
        return exc
    raise AssertionError("the call succeeded")


async def test_real_replies_of_redis_are_classified_alike_by_redis_py_and_the_mux(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = redis_factory(args=["--lua-time-limit", "20"])
    admin: Any = aioredis.Redis.from_url(server.url)
    await admin.execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "~allowed:*", "&*",
                                "+@all")
    narrow_url = f"redis://narrow:pw@127.0.0.1:{server.port}/0"
    narrow, blocker = aioredis.Redis.from_url(narrow_url), aioredis.Redis.from_url(server.url)
    mux, narrow_mux = RedisMux(RedisSettings(url=server.url)), RedisMux(
        RedisSettings(url=narrow_url))
    dead = RedisMux(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    dead_client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    script_error = "return redis.call('HGET', KEYS[1], 'f')"
    busy: asyncio.Future[Any] | None = None
    try:
        await admin.set("s", "x")
        permanent = [
            await _raised(lambda: admin.hget("s", "f")),
            await _raised(lambda: mux.execute("HGET", "s", "f")),
            await _raised(lambda: admin.eval(script_error, 1, "s")),
            await _raised(lambda: mux.execute("EVAL", script_error, 1, "s")),
            await _raised(lambda: admin.eval("error('boom')", 0)),
            await _raised(lambda: narrow.get("elsewhere")),
            await _raised(lambda: narrow_mux.execute("GET", "elsewhere")),
        ]
        assert [reply_code(e) for e in permanent] == [
            "WRONGTYPE", "WRONGTYPE", "WRONGTYPE", "WRONGTYPE", "ERR", "NOPERM", "NOPERM"]
        assert not any(is_transient(e) for e in permanent)
        transient = [await _raised(lambda: dead.execute("PING")),
                     await _raised(lambda: dead_client.ping())]
        # A script that runs past busy-reply-threshold: every other client gets BUSY.
        busy = asyncio.ensure_future(blocker.eval("while true do end", 0))
        while True:
            try:
                await admin.ping()
            except rexc.ResponseError as exc:
                transient.append(exc)
                break
            await asyncio.sleep(0.01)
        transient.append(await _raised(lambda: mux.execute("PING")))
        assert [reply_code(e) for e in transient[2:]] == ["BUSY", "BUSY"]
        assert all(is_transient(e) for e in transient), [describe(e) for e in transient]
    finally:
        if busy is not None:
            await admin.script_kill()
            await asyncio.wait((busy,))
            assert reply_code(busy.exception() or AssertionError()) == "ERR"  # killed
        for closing in (mux, narrow_mux, dead):
            await closing.close()
        for client in (admin, narrow, blocker, dead_client):
            await client.aclose()


async def test_a_cluster_or_a_certificate_is_classified_by_what_the_error_was_raised_from(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    """redis-py's cluster client raises a cluster none of whose nodes answers as a
    RedisClusterException, no RedisError: it is a Redis failure (`REDIS_ERRORS`) that passes
    when the cluster is back, unlike a seed that is not in cluster mode. A certificate that does
    not verify reaches the caller as a ConnectionError raised from it (redis-py and the mux
    alike): permanent, where it was retried for the settle's whole deadline."""
    unreachable = RedisCluster.from_url(f"redis://127.0.0.1:{free_port()}/0")
    not_a_cluster = RedisCluster.from_url(redis_factory().url)
    secure = redis_factory(tls_dir=make_tls_dir(tmp_path / "tls"))
    # No CA configured: the system's store does not know the test CA, as when an operator's
    # rotated server certificate is signed by a CA the services were not given.
    unverified = aioredis.Redis.from_url(secure.url)
    unverified_mux = RedisMux(RedisSettings(url=secure.url))
    try:
        down = await _raised(lambda: unreachable.ping())
        assert not isinstance(down, rexc.RedisError), describe(down)  # why REDIS_ERRORS
        assert isinstance(down, REDIS_ERRORS) and is_transient(down), describe(down)
        wrong = await _raised(lambda: not_a_cluster.ping())
        assert isinstance(wrong, REDIS_ERRORS) and not is_transient(wrong), describe(wrong)
        for refused in (await _raised(lambda: unverified.ping()),
                        await _raised(lambda: unverified_mux.execute("PING"))):
            assert isinstance(refused, REDIS_ERRORS), describe(refused)
            assert not is_transient(refused), describe(refused)
            # The log line names the cause an operator must fix, not a bare ConnectionError.
            assert describe(refused).startswith(f"{type(refused).__name__} from "
                                                "SSLCertVerificationError ("), describe(refused)
    finally:
        await unverified_mux.close()
        for client in (unreachable, not_a_cluster, unverified):
            await client.aclose()


# --- the policy ------------------------------------------------------------------------------

policies = st.builds(
    RetryPolicy,
    initial_delay_s=st.floats(0.001, 1.0),
    max_delay_s=st.floats(0.001, 10.0),
    max_attempts=st.integers(1, 50),
    deadline_s=st.floats(0.0, 60.0),
    jitter=st.floats(0.0, 0.5),
)


@settings(PROPERTIES, max_examples=examples(100))
@given(policies, st.lists(st.floats(0.0, 0.999), min_size=1, max_size=60))
def test_waits_grow_to_the_cap_and_stop_at_the_bounds(policy: RetryPolicy,
                                                     rands: list[float]) -> None:
    """Calls that fail at once: the waits never exceed the cap, shrink by at most the jitter,
    and the loop stops within both the attempts and the deadline."""
    elapsed, failures, previous_base = 0.0, 0, 0.0
    for rand in rands:
        failures += 1
        wait = policy.next_delay(failures, elapsed, rand)
        base = policy.delay(failures)
        assert base <= policy.max_delay_s and base >= previous_base
        assert policy.delay(failures, rand) == pytest.approx(base * (1 - policy.jitter * rand))
        previous_base = base
        if wait is None:
            assert failures >= policy.max_attempts or elapsed + policy.delay(
                failures, rand) > policy.deadline_s
            break
        assert wait == policy.delay(failures, rand)
        elapsed += wait
        assert failures < policy.max_attempts and elapsed <= policy.deadline_s
    assert failures <= policy.max_attempts


def test_the_settle_policy_and_a_huge_attempt_count() -> None:
    waits = [SETTLE_RETRY.delay(n) for n in range(1, 11)]
    assert waits == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.0, 2.0])
    assert SETTLE_RETRY.delay(10**9) == SETTLE_RETRY.max_delay_s  # no overflow
    elapsed, failures = 0.0, 0
    while (wait := SETTLE_RETRY.next_delay(failures + 1, elapsed)) is not None:
        failures += 1
        elapsed += wait
    assert elapsed <= SETTLE_RETRY.deadline_s and 15 <= failures < SETTLE_RETRY.max_attempts


# --- the settler against a real Redis ----------------------------------------------------------

TENANT = TenantQuota("t", rate=0, burst=100_000, max_queued=10)
TTL_MS = 10_000


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _frozen_now(admin: aioredis.Redis, store: PoolStore, at_us: int | None = None) -> int:
    if at_us is None:
        seconds, micros = await admin.time()
        at_us = seconds * 1_000_000 + micros
    await admin.hset(store.keys.clock, "frozen_us", at_us)
    return at_us


async def test_a_permanent_error_is_not_retried_and_the_task_is_left_to_its_lease(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory()
    admin: Any = aioredis.Redis.from_url(server.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all")
    client = aioredis.Redis.from_url(f"redis://gw:pw@127.0.0.1:{server.port}/0")
    policy = PoolPolicy(lease_ttl_ms=TTL_MS, stale_after_ms=0)
    store = PoolStore(client, register_scripts(client), "p", policy)
    reaper = PoolStore(admin, register_scripts(admin), "p", policy)
    keys = store.keys
    try:
        now = await _frozen_now(admin, store)
        await reaper.publish_state(1, Zone.GREEN, {"n": 100_000})
        for task_id in ("doomed", "healthy"):
            admitted = await store.admit(task_id=task_id, tenant=TENANT, tier=Tier.VIP,
                                         prompt_tokens=100, max_tokens=900, gateway="gw",
                                         queue_timeout_ms=1000)
            assert admitted.outcome is AdmitOutcome.RELEASED
        await store.renew("gw")
        lease = await admin.zscore(keys.leases, "gw")
        assert lease == now + TTL_MS * 1000
        metrics, live = GatewayMetrics(), LiveTasks()
        live.add("doomed")
        live.add("healthy")
        settler = Settler(metrics, live)
        # The gateway's user loses the right to run scripts.
        await admin.execute_command("ACL", "SETUSER", "gw", "-evalsha", "-eval")
        with caplog.at_level(logging.INFO, logger="kvgate.gateway"):
            assert await settler.finish(store, "doomed", 500, cancelled=False,
                                        labels=None) is None
        assert _sample(metrics, "kvgate_gateway_settles_abandoned_total", op="settle",
                       reason="permanent") == 1
        assert _sample(metrics, "kvgate_gateway_redis_errors_total", op="settle") == 1
        assert _sample(metrics, "kvgate_gateway_settle_retries_total") == 0
        given_up = [r for r in caplog.records if "giving up" in r.getMessage()]
        assert len(given_up) == 1 and "NOPERM" in given_up[0].getMessage()
        assert "permission" not in caplog.text  # Redis' own message stays out of the logs
        # Held (the orphan sweep leaves it alone) until it is out of the renewed set; moving
        # it fails too while scripts are refused, and is tried again.
        assert "doomed" in live and settler.given_up == {"doomed"}
        await settler.abandon_given_up(store, "gw")
        assert settler.given_up == {"doomed"}
        assert _sample(metrics, "kvgate_gateway_redis_errors_total", op="abandon") == 1
        await admin.execute_command("ACL", "SETUSER", "gw", "+@all")
        await settler.abandon_given_up(store, "gw")
        assert settler.given_up == frozenset() and "doomed" not in live
        assert await admin.smembers(keys.gateway_tasks_key("gw")) == {b"healthy"}
        assert await admin.smembers(keys.abandoned_tasks_key("gw")) == {b"doomed"}
        assert await admin.zscore(keys.leases, abandoned_lease("gw")) == lease
        # The gateway keeps renewing; the abandoned lease runs out and the reaper returns the
        # doomed task's whole reservation, and only that one.
        later = await _frozen_now(admin, store, now + TTL_MS * 1000 + 1)
        await store.renew("gw")
        assert await admin.zscore(keys.leases, "gw") == later + TTL_MS * 1000
        result = await reaper.reap()
        assert (result.reaped, result.returned_tokens) == (1, 1000)
        assert (await reaper.task("doomed") or {})["state"] == "reaped"
        assert (await reaper.task("healthy") or {})["state"] == "released"
        assert await admin.hgetall(keys.node_reserved) == {b"n": b"1000"}
        assert await admin.zscore(keys.leases, abandoned_lease("gw")) is None
        assert await admin.exists(keys.abandoned_tasks_key("gw")) == 0
        bucket = int(await admin.hget(keys.bucket_key("t"), "micro_tokens") or 0)
        assert bucket == (100_000 - 1000) * 1_000_000  # rate 0: exact; "healthy" still holds
        # A late settle of the reaped task (any retry) would be a no-op.
        assert (await store.settle("doomed", 500)).outcome == "noop"
    finally:
        await client.aclose()
        await admin.aclose()


async def test_transient_errors_are_retried_only_within_the_policy() -> None:
    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0",
                                   socket_connect_timeout=0.2)
    store = PoolStore(dead, register_scripts(dead), "p", PoolPolicy())
    loop = asyncio.get_running_loop()
    try:
        metrics, live = GatewayMetrics(), LiveTasks()
        deadline = RetryPolicy(initial_delay_s=0.01, max_delay_s=0.05, max_attempts=1000,
                               deadline_s=0.3)
        settler = Settler(metrics, live, policy=deadline)
        live.add("a")
        started = loop.time()
        assert await settler.finish(store, "a", None, cancelled=True, labels=None) is None
        took = loop.time() - started
        calls = _sample(metrics, "kvgate_gateway_redis_errors_total", op="settle")
        assert took < 0.3 + 0.2 and calls >= 4
        assert _sample(metrics, "kvgate_gateway_settle_retries_total") == calls - 1
        assert _sample(metrics, "kvgate_gateway_settles_abandoned_total", op="cancel",
                       reason="deadline") == 1
        # Moving it out of the renewed set cannot work either: kept for the next round.
        await settler.abandon_given_up(store, "gw")
        assert settler.given_up == {"a"} and "a" in live

        metrics = GatewayMetrics()
        attempts = RetryPolicy(initial_delay_s=0.001, max_delay_s=0.001, max_attempts=3,
                               deadline_s=60.0)
        settler = Settler(metrics, LiveTasks(), policy=attempts)
        assert await settler.finish(store, "b", 10, cancelled=False, labels=None) is None
        assert _sample(metrics, "kvgate_gateway_redis_errors_total", op="settle") == 3
        assert _sample(metrics, "kvgate_gateway_settles_abandoned_total", op="settle",
                       reason="deadline") == 1
    finally:
        await dead.aclose()
