"""The scheduler as its on-call operator meets it: odd nodes, several pools, failures that last.

Each test pins down a defect that was found in the leader's behaviour, with real Redis and real
HTTP (tests/scheduler_stub.py's vLLM stand-in)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.config import Config, parse_config
from admission.outcomes import AdmitOutcome
from admission.tiers import Tier
from scheduler.app import SERVICE, create_app
from scheduler.scrape import MetricsError, parse_vllm_metrics
from scheduler.service import SchedulerService
from tests.scheduler_stub import (
    FakeClock,
    FakeVllm,
    admit,
    always,
    eventually,
    make_config,
    one_node_poller,
    pool_scheduler,
    reserved,
    serve_fake,
)


def _with_value(page: str, name: str, value: str) -> str:
    """`page` with the sample of `name` set to `value` (as the text writes it)."""
    return re.sub(rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", rf"\1 {value}", page, flags=re.M)


# --- a node's page ---------------------------------------------------------------------------


def test_counts_that_are_not_numbers_make_the_page_unusable_and_counters_absent() -> None:
    page = FakeVllm(usage=0.4, running=3, prompt_tokens=100.0, itl=(1.0, 10.0)).render()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        with pytest.raises(MetricsError):
            parse_vllm_metrics(_with_value(page, name, "NaN"))
    for value in ("+Inf", "-Inf"):
        with pytest.raises(MetricsError):
            parse_vllm_metrics(_with_value(page, "vllm:kv_cache_usage_perc", value))
    # A counter that is NaN is no reading: stored, it compared false with every later value
    # and hid the node's preemptions for good.
    odd = parse_vllm_metrics(_with_value(
        _with_value(page, "vllm:num_preemptions_total", "NaN"), "vllm:prompt_tokens_total",
        "NaN"))
    assert odd.preemptions is None and odd.prompt_tokens is None
    assert odd.running == 3 and math.isclose(odd.kv_usage, 0.4)


@pytest.mark.parametrize("body", [
    _with_value(FakeVllm(usage=0.3).render(), "vllm:num_requests_running", "NaN").encode(),
    b"vllm:kv_cache_usage_perc 0.3\n# \xff\xfe not UTF-8\n",
], ids=["nan-running", "not-utf8"])
async def test_a_page_that_cannot_be_read_is_a_failed_scrape_and_the_node_is_ejected(
    body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Both pages raised out of the scrape task: the node kept its last reading, was never
    counted as failed nor ejected, and asyncio logged the lost exception at every poll."""
    fake = FakeVllm(usage=0.3)
    async with one_node_poller(fake, timeout_s=2.0, eject_after=2) as (poller, errors):
        assert not (await poller.poll(2.0))[0].stale
        fake.body = body
        for ejected in (False, True):
            view = (await poller.poll(2.0))[0]
            assert (view.stale, view.ejected, view.error) == (True, ejected, "parse")
        assert errors == [None, "parse", "parse"]
        fake.body = None
        view = (await poller.poll(2.0))[0]
        assert (view.stale, view.ejected) == (False, False)
    assert not [r for r in caplog.records if r.name == "asyncio"]


# --- log lines once per transition -----------------------------------------------------------


async def test_a_node_that_preempts_at_every_poll_is_logged_once_per_cool_down(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeVllm(usage=0.2)
    clock = FakeClock()
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"preemption_cooldown_ms": 1_000})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            caplog.set_level(logging.INFO, logger="kvgate.scheduler.pool")
            await ps.tick(1, always)
            for _ in range(10):  # 0.5 s of an engine preempting at every poll
                fake.preemptions += 1
                clock.advance(0.05)
                await ps.tick(1, always)
            clock.advance(1.0)
            await ps.tick(1, always)
            fake.preemptions += 1
            clock.advance(0.05)
            await ps.tick(1, always)
    lines = [r.getMessage() for r in caplog.records if "n1" in r.getMessage()]
    assert lines == [
        "pool p node n1 preempted: no overcommit for 1000 ms",
        "pool p node n1: no preemption for 1000 ms, overcommit resumes",
        "pool p node n1 preempted: no overcommit for 1000 ms",
    ]


async def test_every_published_tick_is_timed_not_only_those_that_release(
    redis_client: Any, redis_url: str
) -> None:
    """The tick duration histogram (the dashboard's tick p99) was observed only by ticks that
    found work queued: an idle pool showed no data, and a slow Redis went unseen until the
    queues filled."""
    async with serve_fake(FakeVllm(usage=0.2)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            for _ in range(3):
                assert (await ps.tick(1, always)).published
            count = ps.metrics.registry.get_sample_value(
                "kvgate_scheduler_tick_duration_seconds_count", {"pool": "p"})
            assert count == 3


# --- several pools ---------------------------------------------------------------------------


def two_pools(redis_url: str, a_url: str, b_url: str, **scheduler: Any) -> Config:
    config = parse_config({
        "redis": {"url": redis_url},
        "scheduler": {"poll_interval_ms": 20, "reap_interval_ms": 20, **scheduler},
        "pools": [{"name": name, "backends": [{"name": f"{name}1", "url": url}],
                   "control": {"enabled": False}}
                  for name, url in (("a", a_url), ("b", b_url))],
    }, env={})
    return dataclasses.replace(config, gateway=dataclasses.replace(
        config.gateway, lease_ttl_ms=100, renew_interval_ms=50))


@asynccontextmanager
async def running(config: Config) -> AsyncIterator[SchedulerService]:
    service = SchedulerService(config, me="s1")
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def test_a_pool_failing_every_tick_neither_floods_the_log_nor_stops_the_others_reaper(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Pool b's Redis calls fail at every tick (here a key of the wrong type; in production its
    shard of a Redis Cluster down). Every failure pushed back the reaper of every pool, so a
    dead gateway's reservation in pool a was never returned; and each failed tick logged a
    WARNING, 50 lines a second."""
    caplog.set_level(logging.INFO, logger="kvgate.scheduler")
    await redis_client.set("kvg:{b}:node_reserved", "not a hash")
    async with AsyncExitStack() as stack:
        a_url = await stack.enter_async_context(serve_fake(FakeVllm(usage=0.1)))
        b_url = await stack.enter_async_context(serve_fake(FakeVllm(usage=0.1)))
        service = await stack.enter_async_context(running(two_pools(redis_url, a_url, b_url)))
        await eventually(lambda: "a" in service.last)
        store = service.pools[0].store
        assert store.pool == "a"
        result = await admit(store, "t1", Tier.VIP, 5_000, gateway="doomed")
        assert result.outcome is AdmitOutcome.RELEASED
        # The gateway never renews its 100 ms lease: it died.
        for _ in range(300):
            if (await store.task("t1") or {}).get("state") == "reaped":
                break
            await asyncio.sleep(0.01)
        assert (await store.task("t1") or {}).get("state") == "reaped"
        assert await reserved(store) == {}
        await eventually(lambda: (service.metrics.registry.get_sample_value(
            "kvgate_scheduler_redis_errors_total", {"pool": "b"}) or 0) > 20)
        failed = [r for r in caplog.records if r.getMessage().startswith("pool b tick failed")]
        assert len(failed) == 1 and "WRONGTYPE" in failed[0].getMessage()
        assert not [r for r in caplog.records if r.getMessage().startswith("pool a ")]
        await redis_client.delete("kvg:{b}:node_reserved")
        await eventually(lambda: any(r.getMessage().startswith("pool b tick succeeds again")
                                     for r in caplog.records))
        assert service.reaping_allowed("a") and not service.reaping_allowed("b")


async def test_a_pool_whose_nodes_hang_does_not_hold_back_another_pools_ticks(
    redis_client: Any, redis_url: str
) -> None:
    """The first poll of a term waits a whole scrape timeout for its nodes; with every pool's
    tick awaited together, pool a ticked once and then waited for pool b's hung node."""
    async with AsyncExitStack() as stack:
        a_url = await stack.enter_async_context(serve_fake(FakeVllm(usage=0.1)))
        b_url = await stack.enter_async_context(serve_fake(FakeVllm(usage=0.1, delay_s=1.6)))
        service = await stack.enter_async_context(
            running(two_pools(redis_url, a_url, b_url, scrape_timeout_ms=1_500)))
        published: set[bytes] = set()
        while len(published) < 5:  # five of pool a's ticks
            assert "b" not in service.last, "pool a waited for pool b's first tick"
            published.add(await redis_client.hget("kvg:{a}:state", "updated_us") or b"")
            published.discard(b"")
            await asyncio.sleep(0.005)
        assert "b" not in service.last
        health = service.health()
        assert health["pools"]["a"]["ticks"] >= 5 and "b" not in health["pools"]



async def test_healthz_fails_once_a_loop_of_the_replica_ended(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that ended (an exception no handler expected, or a lost task) left a replica that
    answered 200 for ever: a leader that renews its lease but no longer reaps, or ticks, is
    never replaced. The liveness probe reads /healthz."""
    async with serve_fake(FakeVllm(usage=0.1)) as url:
        app = create_app(make_config(redis_url, [{"name": "n1", "url": url}],
                                     scheduler={"poll_interval_ms": 20}), me="s1")
        async with TestClient(TestServer(app)) as client:
            service = app[SERVICE]
            await eventually(lambda: service.leading and service.ticks > 1)
            assert (await client.get("/healthz")).status == 200
            reaper = next(t for t in service._tasks if t.get_name() == "reaper")
            reaper.cancel()
            await asyncio.wait([reaper])
            answer = await client.get("/healthz")
            assert answer.status == 503
            assert (await answer.json())["ended_loops"] == ["reaper"]
    assert [r.levelname for r in caplog.records if "loop reaper ended" in r.getMessage()] == [
        "ERROR"]
