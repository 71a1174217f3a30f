"""Chaos with real processes: `python -m gateway`, `python -m scheduler`, vLLM stand-ins
(`tests.chaos_backend`) and a private redis-server, under a few seconds of light load, with
SIGKILL (and SIGSTOP for a hung node). After each scenario every request sent has a terminal
answer and the budget is conserved exactly once everything has settled or been reaped.

Leases, reaping and leadership run on short settings (`tests.chaos_support`): lease 1 s, renew
0.3 s, reap 0.2 s, leader lease 1 s, poll 50 ms, wake fallback 0.2 s, upstream timeout 1.5 s.
With KVGATE_CHAOS_REPORT=<file> each scenario appends its figures (the table in
docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from admission.keys import PoolKeys, SchedulerKeys
from bench.common.localredis import LocalRedis
from tests.chaos_support import (
    FALLBACK_MS,
    LEASE_TTL_MS,
    REAP_MS,
    UPSTREAM_MS_PER_OUTPUT_TOKEN,
    UPSTREAM_TIMEOUT_MS,
    DelayProxy,
    Load,
    Outcome,
    Row,
    answered,
    assert_conserved,
    chaos_config,
    metric,
    report,
    rss_kib,
    run_for,
    settled,
    stats,
    task_records,
    until,
)
from tests.gateway_harness import KEYS, POOL, open_held_stream
from tests.live import Processes, sigkill

pytestmark = pytest.mark.slow
KEYS_OF = PoolKeys(POOL)


async def leader(redis: Any) -> str | None:
    raw = await redis.get(SchedulerKeys().leader)
    return raw.decode() if raw else None


async def published(redis: Any, nodes: int = 1) -> bool:
    return bool(await redis.hlen(KEYS_OF.node_capacity) >= nodes
                and await redis.hget(KEYS_OF.state, "zone") == b"GREEN")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0


# --- 1. a gateway killed mid-stream ----------------------------------------------------------


async def _open_stream(http: aiohttp.ClientSession, url: str) -> tuple[str, Any]:
    """A VIP streaming request read until two chunks arrived (the node then holds it)."""
    return await open_held_stream(http, url, KEYS["vip"], content="stream", max_tokens=8)


async def test_gateway_killed_mid_stream(redis_factory: Callable[..., LocalRedis],
                                         procs: Processes) -> None:
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    try:
        _, node = procs.chaos_backend("node", hold_after=2)
        config = procs.write_config(chaos_config(server.url, [node]))
        procs.scheduler(config, "sched")
        gw_a, gw_b = procs.gateway(config, "gw-a"), procs.gateway(config, "gw-b")
        await until(lambda: published(redis), 10)
        other = Load(gw_b.url, "normal", "gateway B", workers=2, pace_s=0.05)
        stop = asyncio.Event()
        background = await run_for([other], 30, stop)
        async with aiohttp.ClientSession() as http:
            streams = await asyncio.gather(*(_open_stream(http, gw_a.url) for _ in range(4)))
            ids = [task_id for task_id, _ in streams]
            records = await task_records(redis)
            held = sum(int(records[i]["cost"]) for i in ids)
            reserved = int(await redis.hget(KEYS_OF.node_reserved, "node-0") or 0)
            assert reserved >= held > 0
            sigkill(gw_a.child)
            killed = time.monotonic()
            errors: list[str | None] = []
            for _, response in streams:
                try:
                    await asyncio.wait_for(response.content.read(), 5)
                    errors.append(None)
                except aiohttp.ClientError as exc:
                    errors.append(type(exc).__name__)
                response.release()
            seen_error = time.monotonic() - killed

        async def reaped() -> bool:
            records = await task_records(redis)
            return all(records[i]["state"] == "reaped" for i in ids)

        await until(reaped, 5, 0.01)
        recovered = time.monotonic() - killed
        await asyncio.sleep(0.5)  # gateway B keeps serving after the reap
        stop.set()
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        leases = {m.decode() for m in await redis.zrange(KEYS_OF.leases, 0, -1)}
    finally:
        await redis.aclose()
    assert all(errors), errors  # every client of the dead gateway saw its connection break
    assert seen_error < 1.0
    bound = (LEASE_TTL_MS + 2 * REAP_MS) / 1000 + 0.3
    assert recovered <= bound, (recovered, bound)
    assert "gw-a" not in leases
    assert answered(other.results) and other.statuses() == {200: len(other.results)}
    report(Row("gateway SIGKILLed mid-stream", f"4 held streams on gateway A; gateway B 2 "
               f"workers x 20 req/s ({len(other.results)} requests)",
               "A's clients: connection error; A's reservations reaped; B unaffected",
               {"errors seen after (s)": round(seen_error, 3),
                "reservations back after (s)": round(recovered, 3),
                "bound lease+2xreap (s)": bound, "B answered 200": len(other.results),
                "task states": states}))


# --- 2. the leader killed --------------------------------------------------------------------


async def test_leader_killed_standby_takes_over(redis_factory: Callable[..., LocalRedis],
                                                procs: Processes) -> None:
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    try:
        # 100 ms per request, room for about 4 at a time: a burst has to queue.
        _, node = procs.chaos_backend("node", delay_ms=100)
        config = procs.write_config(chaos_config(server.url, [node], capacity_tokens=1000))
        first = procs.scheduler(config, "sched-a")
        await until(lambda: published(redis), 10)
        assert await leader(redis) == "sched-a"
        procs.scheduler(config, "sched-b")
        gateway = procs.gateway(config, "gw")
        steady = Load(gateway.url, "normal", "steady", workers=2, pace_s=0.05,
                      max_tokens=150)
        burst = Load(gateway.url, "batch", "burst", workers=30, pace_s=10.0, max_tokens=150)
        stop = asyncio.Event()
        background = await run_for([steady, burst], 3.0, stop)
        await until(lambda: _queued(redis, 10), 5, 0.01)
        depth = sum([int(await redis.zcard(q)) for q in KEYS_OF.queues])
        sigkill(first.child)
        killed = time.monotonic()
        took_over = await until(lambda: _leads(redis, "sched-b"), 5, 0.01)
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        counters = await stats(redis)
        twice = await metric(node, "chaos:tasks_seen_twice")
        backend_requests = await metric(node, "chaos:requests_total")
    finally:
        await redis.aclose()
    results = steady.results + burst.results
    assert answered(results)
    statuses = {r.status for r in results}
    assert statuses == {200}, statuses
    assert took_over < 2.0
    released = sum(counters.get(f"released_{t}", 0) for t in range(3))
    assert released == len(results) == backend_requests  # each task released once, served once
    assert twice == 0 and states == {"settled": len(results)}
    report(Row("scheduler leader SIGKILLed", f"burst of 30 Batch + 2 Normal workers x 20 req/s "
               f"({len(results)} requests) on a node with room for ~4",
               "standby leads; queued tasks released once each; all answered 200",
               {"queued at kill": depth, "standby leads after (s)": round(took_over, 3),
                "killed -> end (s)": round(time.monotonic() - killed, 2),
                "released": released, "served twice": int(twice),
                "answered 200": len(results)}))


async def _queued(redis: Any, at_least: int) -> bool:
    return sum([int(await redis.zcard(q)) for q in KEYS_OF.queues]) >= at_least


async def _leads(redis: Any, me: str) -> bool:
    return await leader(redis) == me


# --- 3. Redis restarted without persistence --------------------------------------------------


async def test_redis_restarted_empty(redis_factory: Callable[..., LocalRedis],
                                     procs: Processes) -> None:
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    outage_s = 1.5
    try:
        _, node = procs.chaos_backend("node")
        data = chaos_config(server.url, [node], gateway={"fail_open_tiers": ["vip"]})
        config = procs.write_config(data)
        scheduler = procs.scheduler(config, "sched")
        gateway = procs.gateway(config, "gw")
        pids = (scheduler.child.pid, gateway.child.pid)
        await until(lambda: published(redis), 10)
        normal = Load(gateway.url, "normal", "normal", workers=2, pace_s=0.02)
        vip = Load(gateway.url, "vip", "vip", workers=1, pace_s=0.05)
        stop = asyncio.Event()
        background = await run_for([normal, vip], 60, stop)
        await asyncio.sleep(1.0)
        epoch_before = int(await redis.get(SchedulerKeys().epoch))
        server.kill()
        down = time.monotonic()
        await asyncio.sleep(outage_s)
        server = redis_factory(port=server.port)  # the same address, empty
        up = time.monotonic()
        await redis.aclose()
        redis = aioredis.Redis.from_url(server.url)

        def served_after(load: Load, t: float) -> Callable[[], Any]:
            async def check() -> bool:
                return any(r.status == 200 and r.started > t for r in load.results)
            return check

        recovered = await until(served_after(normal, up), 10, 0.01)
        await asyncio.sleep(1.0)
        stop.set()
        await background
        alive = scheduler.child.alive() and gateway.child.alive()
        same = pids == (scheduler.child.pid, gateway.child.pid)
        await settled(redis, 10)
        states = await assert_conserved(redis)
        epoch_after = int(await redis.get(SchedulerKeys().epoch))
        fail_open = await metric(gateway.url, "kvgate_gateway_fail_open_total")
    finally:
        await redis.aclose()
    assert answered(normal.results) and answered(vip.results)
    during = [r for r in normal.results if down + 0.05 < r.started and r.ended < up]
    assert during, "no request was sent during the outage"
    assert all(r.status == 503 and r.code == "admission_unavailable" and r.retry_after
               for r in during), {(r.status, r.code) for r in during}
    slowest = max(r.seconds for r in during)
    assert slowest < 0.1, slowest  # fail closed within 100 ms
    vip_during = [r for r in vip.results if down + 0.05 < r.started and r.ended < up]
    assert vip_during and all(r.status == 200 for r in vip_during)  # fail_open_tiers
    assert fail_open >= len(vip_during)
    others = {(r.status, r.code) for r in normal.results if r not in during} - {(200, None)}
    assert others <= {(503, "admission_unavailable"), (503, "queue_task_lost")}, others
    assert alive and same  # no crash, no restart loop
    assert epoch_after > epoch_before  # fencing epochs restart above the lost ones
    report(Row("Redis restarted empty (no persistence)",
               f"2 Normal workers x 50 req/s + 1 VIP worker x 20 req/s; outage {outage_s} s "
               f"({len(normal.results) + len(vip.results)} requests)",
               "Normal fails closed (503 + Retry-After); VIP fails open; services reconnect, "
               "scripts reload, no restart",
               {"503s during outage": len(during), "slowest 503 (ms)": round(slowest * 1000, 1),
                "VIP served unadmitted": len(vip_during),
                "first Normal 200 after restart (s)": round(recovered, 3),
                "task states (new Redis)": states}))


# --- 4. the pub/sub connections killed -------------------------------------------------------


async def test_pubsub_killed_no_wait_beyond_fallback(redis_factory: Callable[..., LocalRedis],
                                                     procs: Processes) -> None:
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    try:
        _, node = procs.chaos_backend("node", delay_ms=50)
        config = procs.write_config(chaos_config(server.url, [node], capacity_tokens=1000))
        procs.scheduler(config, "sched")
        gateway = procs.gateway(config, "gw")
        await until(lambda: published(redis), 10)
        load = Load(gateway.url, "normal", "normal", workers=8, pace_s=0.02, max_tokens=150)
        stop = asyncio.Event()
        background = await run_for([load], 3.0, stop)
        kills = 0
        while not background.done():
            kills += int(await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
            await asyncio.sleep(0.03)
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        records = await task_records(redis)
        fallbacks = await metric(gateway.url, "kvgate_gateway_wake_fallbacks_total")
        reconnects = await metric(gateway.url, "kvgate_gateway_pubsub_reconnects_total")
    finally:
        await redis.aclose()
    assert answered(load.results) and {r.status for r in load.results} == {200}
    # From the release (Redis time, in the record) to the answer, less the node's 50 ms: how
    # long the gateway took to notice. A lost wake-up costs at most one fallback interval.
    noticed = []
    for r in load.results:
        record = records[r.task_id or ""]
        if "queued_us" in record:  # released by the scheduler, not on the fast path
            noticed.append(r.wall_ended - 0.05 - int(record["released_us"]) / 1e6)
    assert len(noticed) >= 10, len(noticed)  # requests did queue and wait for a wake-up
    worst = max(noticed)
    assert worst <= FALLBACK_MS / 1000 + 0.15, worst
    assert kills >= 10 and reconnects >= 5 and fallbacks >= 1  # wake-ups were really lost
    report(Row("pub/sub connections killed (CLIENT KILL TYPE pubsub every 30 ms)",
               f"8 Normal workers on a node with room for ~4 ({len(load.results)} requests, "
               f"{len(noticed)} queued)", "no queued request waited past the fallback",
               {"kills": kills, "gateway resubscriptions": int(reconnects),
                "found by fallback": int(fallbacks),
                "worst release -> forward (ms)": round(worst * 1000, 1),
                "fallback interval (ms)": FALLBACK_MS, "task states": states}))


# --- 5. a backend node killed, another hung --------------------------------------------------


async def test_node_killed_and_node_hung(redis_factory: Callable[..., LocalRedis],
                                         procs: Processes) -> None:
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    hung = None
    try:
        nodes = [procs.chaos_backend(f"node-{i}", delay_ms=300) for i in range(3)]
        config = procs.write_config(chaos_config(server.url, [url for _, url in nodes]))
        procs.scheduler(config, "sched")
        gateway = procs.gateway(config, "gw")
        await until(lambda: published(redis, 3), 10)
        load = Load(gateway.url, "normal", "normal", workers=6, pace_s=0.02)
        stop = asyncio.Event()
        background = await run_for([load], 4.5, stop)
        await asyncio.sleep(1.0)
        sigkill(nodes[0][0])
        hung = nodes[1][0]
        os.kill(hung.pid, signal.SIGSTOP)  # accepts connections (backlog), never answers
        broken = time.monotonic()

        async def ejected() -> bool:
            capacity = {k.decode() for k in await redis.hkeys(KEYS_OF.node_capacity)}
            return capacity == {"node-2"}

        ejected_after = await until(ejected, 3, 0.01)
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        records = await task_records(redis)
        errors = await metric(gateway.url, "kvgate_gateway_upstream_errors_total")
    finally:
        if hung is not None:
            os.kill(hung.pid, signal.SIGCONT)
        await redis.aclose()
    assert answered(load.results)
    failed = [r for r in load.results if r.status != 200]
    assert failed and {r.status for r in failed} <= {502, 503, 504}, {
        (r.status, r.code) for r in failed}
    on = {r.task_id: records[r.task_id or ""].get("node") for r in failed}
    assert set(on.values()) <= {"node-0", "node-1"}, on
    assert all(records[r.task_id or ""]["state"] == "cancelled" for r in failed)
    quiet_limit_ms = UPSTREAM_TIMEOUT_MS + load.max_tokens * UPSTREAM_MS_PER_OUTPUT_TOKEN
    assert max(r.ended for r in failed) - broken <= quiet_limit_ms / 1000 + 0.7
    later = [r for r in load.results if r.started > broken + ejected_after + 0.1]
    assert later and all(r.status == 200 and records[r.task_id or ""]["node"] == "node-2"
                         for r in later)
    assert errors >= len(failed)
    report(Row("backend node SIGKILLed + another hung (SIGSTOP)",
               f"3 nodes x 300 ms per request, 6 Normal workers ({len(load.results)} "
               "requests)", "both ejected; in-flight requests there answered 502/503 and "
               "refunded; traffic continues on the third",
               {"ejected after (s)": round(ejected_after, 3), "failed (502/503)": len(failed),
                "by status": {str(s): sum(1 for r in failed if r.status == s)
                              for s in sorted({r.status or 0 for r in failed})},
                "slowest failure after break (s)": round(
                    max(r.ended for r in failed) - broken, 3),
                "answered 200 after ejection": len(later), "task states": states}))


# --- 6. Redis made slow ----------------------------------------------------------------------


async def test_redis_made_slow(redis_factory: Callable[..., LocalRedis],
                               procs: Processes) -> None:
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    proxy = DelayProxy(server.port)
    await proxy.start()
    timeout_ms = 300
    try:
        _, node = procs.chaos_backend("node")
        slow_url = f"redis://127.0.0.1:{proxy.port}/0"
        config = procs.write_config(chaos_config(
            slow_url, [node], redis={"socket_timeout_ms": timeout_ms,
                                     "connect_timeout_ms": timeout_ms}))
        procs.scheduler(config, "sched")
        gateway = procs.gateway(config, "gw")
        await until(lambda: published(redis), 10)
        load = Load(gateway.url, "normal", "normal", workers=4, pace_s=0.02)
        stop = asyncio.Event()
        background = await run_for([load], 60, stop)
        phases: dict[str, tuple[float, float]] = {}
        rss: dict[str, int] = {"start": rss_kib(gateway.child.pid)}
        for name, delay, seconds in (("fast", 0.0, 1.0), ("slow 50 ms", 0.05, 1.5),
                                     ("stuck 600 ms", 0.6, 2.0), ("fast again", 0.0, 1.5)):
            proxy.delay_s = delay
            begin = time.monotonic()
            await asyncio.sleep(seconds)
            phases[name] = (begin, time.monotonic())
            rss[name] = rss_kib(gateway.child.pid)
        stop.set()
        await background
        in_flight = await metric(gateway.url, "kvgate_gateway_in_flight")
        await settled(redis, 10)
        states = await assert_conserved(redis)
        await asyncio.sleep(0)
    finally:
        await proxy.close()
        await redis.aclose()
    assert answered(load.results)

    def within(name: str, margin: float = 0.05) -> list[Outcome]:
        begin, end = phases[name]
        return [r for r in load.results if begin + margin < r.started and r.ended < end]

    slow, stuck, again = within("slow 50 ms", 0.3), within("stuck 600 ms", 0.7), within(
        "fast again", 1.0)
    assert slow and all(r.status == 200 for r in slow), {r.status for r in slow}
    assert stuck and all(r.status == 503 for r in stuck), {(r.status, r.code) for r in stuck}
    worst = max(r.seconds for r in stuck)
    assert worst <= 2 * timeout_ms / 1000 + 0.2, worst  # bounded by the socket timeout
    assert again and sum(r.status == 200 for r in again) >= len(again) // 2
    assert in_flight == 0  # nothing piled up in the gateway
    # The gateway lived throughout: none of its tasks may be reaped, although its lease lapsed
    # in Redis while the scheduler, which had lost its own lease, could not reach Redis either.
    assert "reaped" not in states, states
    grown = rss["fast again"] - rss["start"]
    assert grown < 50_000, rss  # KiB
    report(Row("Redis made slow (TCP proxy)",
               f"4 Normal workers x 50 req/s; socket timeout {timeout_ms} ms; delay 0, 50, "
               f"600, 0 ms ({len(load.results)} requests)",
               "slow: served; stuck: 503 within the timeout; then served again; nothing piles "
               "up", {"p99 at 50 ms (ms)": round(p99([r.seconds for r in slow]) * 1000, 1),
                      "503s while stuck": len(stuck),
                      "slowest 503 (ms)": round(worst * 1000, 1),
                      "200s after": sum(r.status == 200 for r in again),
                      "gateway RSS growth (KiB)": grown, "in flight at end": int(in_flight),
                      "task states": states}))


# --- 7. a replica's clock skewed ±60 s -------------------------------------------------------


@contextlib.contextmanager
def skewed_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Any:
    real_time, real_time_ns = time.time, time.time_ns
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: real_time() + seconds)
        patch.setattr(time, "time_ns", lambda: real_time_ns() + int(seconds * 1e9))
        yield


async def test_clock_skew_does_not_change_admissions(
    redis_url: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No client clock enters a script: every time a script compares comes from Redis TIME
    (here frozen, so runs are comparable). The same requests through a gateway whose wall
    clock is skewed by -60, 0 and +60 s get the same answers, leave the same buckets, and no
    script argument is a timestamp."""
    from admission.tiers import Zone
    from gateway.redismux import RedisMux
    from tests.gateway_harness import BIG, running_gateway

    real_execute = RedisMux.execute
    args_seen: list[Any] = []

    async def recording(self: RedisMux, *args: Any) -> Any:
        args_seen.extend(args)
        return await real_execute(self, *args)

    monkeypatch.setattr(RedisMux, "execute", recording)
    outcomes = {}
    for skew in (0.0, -60.0, 60.0):
        await redis_client.flushdb()
        with skewed_clock(monkeypatch, skew):
            async with running_gateway(redis_url) as gw:
                await gw.redis.hset(gw.store.keys.clock, "frozen_us", 1_700_000_000_000_000)
                await gw.publish(Zone.GREEN, BIG)
                answers = []
                async with aiohttp.ClientSession() as http:
                    for max_tokens in (300, 300, 300, 300, 50):
                        async with http.post(gw.url + "/v1/chat/completions", json={
                            "model": POOL, "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": max_tokens}, headers=gw.auth("small")) as response:
                            body = await response.json()
                            answers.append((response.status, body.get("error", {}).get(
                                "code") if response.status != 200 else None))
                await gw.settled()
                bucket = await gw.redis.hget(gw.store.keys.bucket_key("small"), "micro_tokens")
                outcomes[skew] = (answers, bucket)
    assert outcomes[-60.0] == outcomes[0.0] == outcomes[60.0], outcomes
    assert {s for s, _ in outcomes[0.0][0]} == {200, 429}  # quota bites, the same way
    now_s = time.time()
    for arg in args_seen:
        if isinstance(arg, int | float) and not isinstance(arg, bool) and arg > 1e8:
            for scale in (1, 1e3, 1e6):
                assert abs(arg / scale - now_s) > 86_400, arg  # not a timestamp of any unit
    report(Row("gateway wall clock skewed -60 s / +60 s (in-process, time.time patched)",
               "5 requests of one tenant against a frozen Redis clock, per skew",
               "identical answers and bucket levels; no script argument is a timestamp",
               {"answers": [s for s, _ in outcomes[0.0][0]],
                "script args checked": len(args_seen)}))


async def test_reaper_waits_a_lease_after_failed_leadership_calls() -> None:
    """Found by the slow-Redis scenario: a leader whose lease lapsed during an outage recorded
    no Redis failure (only ticks and reaps did, and they stop without the lease), so when it
    led again it reaped the live gateways' tasks before they could renew."""
    from admission.connection import connect
    from admission.scripts import register_scripts
    from bench.common.localredis import free_port
    from scheduler.leader import Elector
    from scheduler.service import SchedulerService
    from tests.scheduler_stub import make_config

    now = [100.0]
    config = make_config(f"redis://127.0.0.1:{free_port()}/0",
                         [{"name": "n1", "url": "http://127.0.0.1:9"}])
    service = SchedulerService(config, me="s1", clock=lambda: now[0])
    client = connect(config.redis)
    try:
        service.elector = Elector(client, register_scripts(client), "s1", 1000,
                                  clock=lambda: now[0])
        assert service.reaping_allowed()
        await service.elector.attempt()  # Redis unreachable
        assert service.elector.failed_at == now[0]
        assert not service.reaping_allowed()
        now[0] += config.gateway.lease_ttl_ms / 1000 - 0.001
        assert not service.reaping_allowed()
        now[0] += 0.002
        assert service.reaping_allowed()
    finally:
        await client.aclose()
