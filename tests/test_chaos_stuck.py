"""A stuck engine, with real processes (`python -m gateway`, `python -m scheduler`, two
`tests.chaos_backend` nodes, a private redis-server): one node's engine stops answering while
its /metrics still answers, frozen as a hung vLLM engine's page is, either inside a step (its
page says it holds requests) or between two requests (its page says it holds none). The leader
ejects it after `stuck_after_ms`, and the gateway ends the requests the node holds with a 502
the client may send again, long before the upstream timeout; new requests go to the other
node; the budget is conserved."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from admission.keys import PoolKeys
from bench.common.localredis import LocalRedis
from gateway.stucknodes import CUT_QUIET_S
from scheduler.stuck import FROZEN_SLACK_S
from tests.chaos_support import (
    POLL_MS,
    RENEW_MS,
    Load,
    Row,
    answered,
    assert_conserved,
    chaos_config,
    metric,
    report,
    run_for,
    settled,
    task_records,
    until,
)
from tests.gateway_harness import POOL
from tests.live import Gateway, Processes

pytestmark = pytest.mark.slow

KEYS_OF = PoolKeys(POOL)
STUCK_AFTER_MS = 1_500
UPSTREAM_TIMEOUT_MS = 60_000


@dataclass
class Stack:
    """Two stand-in nodes, a scheduler and a gateway on a private redis-server."""

    redis: Any
    nodes: list[str]
    """The stand-ins' base URLs, node-0 first."""
    gateway: Gateway
    leader: str
    """The scheduler's base URL (its /metrics)."""


@asynccontextmanager
async def stack(redis_factory: Callable[..., LocalRedis], procs: Processes, *,
                delay_ms: float, gateway: dict[str, Any] | None = None
                ) -> AsyncIterator[Stack]:
    """The processes up, both nodes in the pool (`stuck_after_ms` STUCK_AFTER_MS)."""
    server = redis_factory()
    redis: Any = aioredis.Redis.from_url(server.url)
    try:
        nodes = [procs.chaos_backend(f"node-{i}", delay_ms=delay_ms)[1] for i in range(2)]
        config = procs.write_config(chaos_config(
            server.url, nodes, gateway=gateway or {},
            scheduler={"stuck_after_ms": STUCK_AFTER_MS}))
        scheduler = procs.scheduler(config, "sched")
        running = Stack(redis, nodes, procs.gateway(config, "gw"),
                        f"http://127.0.0.1:{scheduler.port}")
        await until(functools.partial(both_in, redis), 10)
        yield running
    finally:
        await redis.aclose()


async def vip_load(st: Stack, seconds: float
                   ) -> tuple[Load, asyncio.Event, asyncio.Task[Any]]:
    """6 VIP workers for `seconds` (or until the event is set), once 20 have been answered."""
    load = Load(st.gateway.url, "vip", "vip", workers=6, pace_s=0.02, timeout_s=30.0)
    stop = asyncio.Event()
    background = await run_for([load], seconds, stop)

    async def serving() -> bool:
        return sum(1 for r in load.results if r.status == 200) >= 20

    await until(serving, 10)
    return load, stop, background


async def both_in(redis: Any) -> bool:
    return {k.decode() for k in await redis.hkeys(KEYS_OF.node_capacity)} == {"node-0", "node-1"}


@pytest.mark.parametrize("idle", [False, True], ids=["inside a step", "between requests"])
async def test_a_stuck_engine_is_ejected_and_the_requests_it_holds_end_early(
    redis_factory: Callable[..., LocalRedis], procs: Processes, idle: bool
) -> None:
    async with stack(redis_factory, procs, delay_ms=100,
                     gateway={"upstream_timeout_ms": UPSTREAM_TIMEOUT_MS}) as st:
        redis = st.redis
        load, _, background = await vip_load(st, 5.0)
        async with aiohttp.ClientSession() as http, \
                http.post(st.nodes[0] + "/chaos/stuck" + ("?idle=1" if idle else "")) as response:
            assert response.status == 200
            held_at_start = (await response.json())["held"]
        broken = time.monotonic()

        async def ejected() -> bool:
            out = await redis.hget(KEYS_OF.state, "nodes_out")
            capacity = {k.decode() for k in await redis.hkeys(KEYS_OF.node_capacity)}
            return out == b"node-0:stuck" and capacity == {"node-1"}

        ejected_after = await until(ejected, 10, 0.01)
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        records = await task_records(redis)
        stuck_errors = await metric(st.gateway.url, "kvgate_gateway_upstream_errors_total",
                                    kind="stuck")
        still_out = await redis.hget(KEYS_OF.state, "nodes_out")
        stuck_gauge = await metric(st.leader, "kvgate_scheduler_node_stuck", node="node-0")
    assert answered(load.results)
    failed = [r for r in load.results if r.status != 200]
    assert failed, "no request was held by the stuck node"
    assert {(r.status, r.code, r.should_retry) for r in failed} == {
        (502, "upstream_stuck", "true")}
    assert {records[r.task_id or ""]["node"] for r in failed} == {"node-0"}
    assert all(records[r.task_id or ""]["state"] == "cancelled" for r in failed)
    # Judged stuck after stuck_after_ms, published within a poll, the held requests ended at
    # the gateway's next round once silent for CUT_QUIET_S: seconds, not the upstream timeout.
    # Frozen while idle, it is judged on a request sent more than FROZEN_SLACK_S after its
    # page last changed (the next one the load sends it: within a second more), once the
    # leader's probe has gone unanswered (its timeout: half of stuck_after_ms here).
    slowest = max(r.ended for r in failed) - broken
    bound = (STUCK_AFTER_MS / 1000 + CUT_QUIET_S + 2 * RENEW_MS / 1000 + 10 * POLL_MS / 1000
             + 1.0 + (FROZEN_SLACK_S + 1.0 + STUCK_AFTER_MS / 1000 if idle else 0.0))
    assert slowest <= bound < UPSTREAM_TIMEOUT_MS / 1000, (slowest, bound)
    assert stuck_errors == len(failed)
    later = [r for r in load.results if r.started > broken + ejected_after + 0.1]
    assert later and all(r.status == 200 and records[r.task_id or ""]["node"] == "node-1"
                         for r in later)
    # The engine stays frozen (its page too): the node stays out.
    assert still_out == b"node-0:stuck" and stuck_gauge == 1
    if idle:
        assert held_at_start == 0
    report(Row("backend engine stuck " + ("between requests (its /metrics answers, frozen "
                                          "idle)" if idle else
                                          "(its /metrics answers, frozen)"),
               f"2 nodes x 100 ms per request, 6 VIP workers ({len(load.results)} requests), "
               f"stuck_after_ms {STUCK_AFTER_MS}, upstream timeout {UPSTREAM_TIMEOUT_MS} ms",
               "ejected as stuck; the requests it held answered 502 upstream_stuck "
               "(x-should-retry: true) and refunded; traffic continues on the other node",
               {"ejected after (s)": round(ejected_after, 3),
                "held when it got stuck": held_at_start, "ended (502)": len(failed),
                "slowest end after the break (s)": round(slowest, 3),
                "answered 200 after ejection": len(later), "task states": states}))


async def test_a_stuck_engine_that_runs_again_rejoins_through_a_probe(
    redis_factory: Callable[..., LocalRedis], procs: Processes
) -> None:
    """An engine paused, not hung: once it runs again its page stays frozen (vLLM's changes
    only at a step, and the gateways ended the requests it held), so only the leader's probe
    (scheduler.probe) makes it step and brings the node back."""
    async with stack(redis_factory, procs, delay_ms=100,
                     gateway={"upstream_timeout_ms": UPSTREAM_TIMEOUT_MS}) as st:
        redis, leader = st.redis, st.leader
        load, stop, background = await vip_load(st, 30.0)
        async with aiohttp.ClientSession() as http:
            async with http.post(st.nodes[0] + "/chaos/stuck") as response:
                assert response.status == 200

            async def ejected() -> bool:
                return bool(await redis.hget(KEYS_OF.state, "nodes_out") == b"node-0:stuck")

            await until(ejected, 10, 0.01)

            async def held_ended() -> bool:
                return any(r.code == "upstream_stuck" for r in load.results)

            await until(held_ended, 10, 0.01)
            async def probe_timed_out() -> bool:
                return bool(await metric(leader, "kvgate_scheduler_probes_total",
                                         node="node-0", outcome="timeout") >= 1)

            # Paused a while: the first probe gets no answer, and the node stays out.
            await until(probe_timed_out, 10, 0.05)
            assert await redis.hget(KEYS_OF.state, "nodes_out") == b"node-0:stuck"
            async with http.post(st.nodes[0] + "/chaos/resume") as response:
                assert (await response.json())["frozen_page"] is True
            rejoined_after = await until(functools.partial(both_in, redis), 10, 0.01)
            rejoined = time.monotonic()

            async def node_0_serves() -> bool:
                records = await task_records(redis)
                return any(r.status == 200 and r.started > rejoined
                           and records.get(r.task_id or "", {}).get("node") == "node-0"
                           for r in load.results)

            await until(node_0_serves, 10, 0.05)
        stop.set()
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        probes_ok = await metric(leader, "kvgate_scheduler_probes_total", node="node-0",
                                 outcome="ok")
        probes_timeout = await metric(leader, "kvgate_scheduler_probes_total", node="node-0",
                                      outcome="timeout")
    # Probed every stuck_after_ms while stuck: the next probe came within one interval of
    # the resume, answered after the stand-in's 100 ms, and the node rejoined at the next
    # reading.
    assert rejoined_after <= STUCK_AFTER_MS / 1000 + 10 * POLL_MS / 1000 + 1.0
    assert probes_ok == 1 and probes_timeout >= 1
    report(Row("backend engine paused, then running again (its page frozen until a step)",
               f"2 nodes x 100 ms per request, 6 VIP workers ({len(load.results)} requests), "
               f"stuck_after_ms {STUCK_AFTER_MS}",
               "ejected as stuck; probed every stuck_after_ms (no answer while paused); once "
               "it runs again, the next probe makes it step and it rejoins; requests reach it "
               "again",
               {"rejoined after the resume (s)": round(rejoined_after, 3),
                "probes answered": probes_ok, "probes timed out": probes_timeout,
                "task states": states}))


async def test_a_page_left_stale_by_aborted_requests_is_corrected_by_a_probe(
    redis_factory: Callable[..., LocalRedis], procs: Processes
) -> None:
    """vLLM's page after every request it held was aborted at once: still counting them, its
    cache nearly full, and frozen, since an idle engine takes no step. kvgate leaves room for
    that usage and sends the node nothing, which would keep it so; with the default zone
    aggregate (the fullest node) the whole pool is RED and refuses Normal work meanwhile. The
    leader's probe makes the engine step, and the pool serves again."""
    async with stack(redis_factory, procs, delay_ms=20) as st:
        redis, leader = st.redis, st.leader
        async with aiohttp.ClientSession() as http, \
                http.post(st.nodes[0] + "/chaos/ghost") as response:
            assert response.status == 200
        ghosted = time.time()

        async def ghost_read() -> bool:  # else a request admitted meanwhile would end it
            return bool(await metric(leader, "kvgate_scheduler_kv_usage",
                                     node="node-0") == 0.904)

        await until(ghost_read, 10)
        load = Load(st.gateway.url, "normal", "normal", workers=4, pace_s=0.02, timeout_s=30.0)
        stop = asyncio.Event()
        background = await run_for([load], 30.0, stop)

        async def node_0_serves() -> bool:
            records = await task_records(redis)
            return any(r.status == 200
                       and records.get(r.task_id or "", {}).get("node") == "node-0"
                       for r in load.results)

        back_after = await until(node_0_serves, 15, 0.05)
        stop.set()
        await background
        await settled(redis, 10)
        states = await assert_conserved(redis)
        records = await task_records(redis)
        probes_ok = await metric(leader, "kvgate_scheduler_probes_total", node="node-0",
                                 outcome="ok")
    on_node_0 = sorted(float(rec["released_us"]) / 1e6 - ghosted for rec in records.values()
                       if rec.get("node") == "node-0" and "released_us" in rec)
    assert answered(load.results) and probes_ok == 1
    refused = [r for r in load.results if r.status != 200]
    assert all((r.status, r.code) == (429, "capacity_exceeded") for r in refused)
    # Nothing went to it while its page stood still: the first task came after the probe,
    # which the leader sends once the page has not changed for stuck_after_ms.
    assert on_node_0 and on_node_0[0] >= STUCK_AFTER_MS / 1000 - 0.1, on_node_0[:3]
    assert back_after <= STUCK_AFTER_MS / 1000 + 10 * POLL_MS / 1000 + 2.0
    report(Row("backend page left stale by aborted requests (106 running, KV 90.4%, frozen)",
               f"2 nodes x 20 ms per request, 4 Normal workers ({len(load.results)} "
               f"requests), stuck_after_ms {STUCK_AFTER_MS}",
               "no work for it while the page stands still, and the pool RED (the fullest "
               "node sets the zone: Normal gets 429); the leader probes it after "
               "stuck_after_ms, the engine steps, the page shows it empty, and it takes work",
               {"first task on it after the page froze (s)": round(on_node_0[0], 3),
                "serving again after (s)": round(back_after, 3),
                "Normal refused meanwhile (429)": len(refused), "probes answered": probes_ok,
                "task states": states}))
