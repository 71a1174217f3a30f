"""Leadership in-process against real Redis: one leader, a lease trusted only by the local
clock, immediate handover on resignation, and a fenced leader stepping down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from admission.errors import FencedError
from admission.failurelog import FAILURE_LOG_EVERY_S
from admission.keys import SchedulerKeys
from admission.leadership import leadership
from admission.scripts import register_scripts
from admission.tiers import Tier, Zone
from bench.common.localredis import LocalRedis, free_port
from scheduler.leader import SAFETY, Elector
from scheduler.service import SchedulerService, default_id
from tests.scheduler_stub import FakeClock, FakeVllm, admit, eventually, make_config, serve_fake


async def test_replicas_that_share_a_hostname_and_a_pid_do_not_share_an_id(
    redis_client: Any,
) -> None:
    """Two containers on the host's network share its hostname and are both PID 1: ids made of
    those alone were equal, and two electors holding one id both lead, under one epoch."""
    first, second = default_id(), default_id()
    assert first != second
    scripts = register_scripts(redis_client)
    a, b = (Elector(redis_client, scripts, me, 3_000) for me in (first, second))
    await a.attempt()
    await b.attempt()
    assert a.leading and not b.leading


async def test_one_leader_and_a_standby_told_when_to_retry(redis_client: Any) -> None:
    scripts = register_scripts(redis_client)
    a = Elector(redis_client, scripts, "a", 3_000)
    b = Elector(redis_client, scripts, "b", 3_000)
    assert await a.attempt() == 1.0  # renew every ttl / 3
    retry = await b.attempt()
    assert a.leading and not b.leading
    first = a.epoch
    assert first is not None and b.holder == "a"
    assert 0.9 < retry <= 1.0
    await a.attempt()  # a renewal keeps the epoch
    assert a.epoch == first


async def test_leader_stops_by_its_own_clock_before_the_lease_ends(redis_client: Any) -> None:
    clock = FakeClock()
    a = Elector(redis_client, register_scripts(redis_client), "a", 2_000, clock=clock)
    await a.attempt()
    clock.advance(2.0 * (1 - SAFETY) - 0.01)
    assert a.leading
    clock.advance(0.02)
    # Redis still holds the lease for this replica; it no longer trusts it.
    assert not a.leading
    assert (await redis_client.get(SchedulerKeys().leader)) == b"a"


async def test_a_lease_lapsed_in_a_stall_is_one_change_and_regaining_it_none(
    redis_client: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """Renewals that fail until the replica's own deadline passes: it steps down (said and
    counted at once, its metrics told). When Redis answers again and the lease outlived the
    stall there, it leads again with the same epoch: no one else led, so that is no second
    change (two per blip would page KvgateLeadershipFlapping on a flaky network)."""
    clock = FakeClock()
    told: list[bool] = []
    scripts = register_scripts(redis_client)
    # A lease long enough to outlive, in Redis's real time, the failing calls' own retries.
    a = Elector(redis_client, scripts, "a", 30_000, clock=clock)
    a.on_change = lambda: told.append(a.leading)
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.leader")
    await a.attempt()
    epoch = a.epoch
    assert a.leading and a.changes == 1 and told == [True]
    unreachable = aioredis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    try:
        a.client, a.scripts = unreachable, register_scripts(unreachable)  # as in an outage
        clock.advance(30.0 * (1 - SAFETY) + 0.01)
        await a.attempt()
    finally:
        a.client, a.scripts = redis_client, scripts
        await unreachable.aclose()
    assert not a.leading and a.epoch is None and a.changes == 2 and told == [True, False]
    assert any("lease lapsed" in r.getMessage() for r in caplog.records)
    await a.attempt()  # the lease is still "a"'s in Redis (its TTL runs in real time)
    assert a.leading and a.epoch == epoch and a.changes == 2 and told == [True, False, True]
    assert any("leads again with epoch" in r.getMessage() for r in caplog.records)


async def test_resignation_hands_over_at_once(redis_client: Any) -> None:
    scripts = register_scripts(redis_client)
    a = Elector(redis_client, scripts, "a", 5_000)
    b = Elector(redis_client, scripts, "b", 5_000)
    await a.attempt()
    first = a.epoch
    assert first is not None
    runner = asyncio.create_task(b.run())
    try:
        await asyncio.sleep(0.05)  # let b subscribe; its timed retry is ~1.7 s away
        await a.resign()
        took = await eventually(lambda: b.leading)
        assert took < 0.5
        assert b.epoch is not None and b.epoch > first and not a.leading
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner


async def test_fenced_leader_steps_down_and_releases_nothing(
    redis_client: Any, redis_url: str
) -> None:
    async with serve_fake(FakeVllm()) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"poll_interval_ms": 10, "leader_ttl_ms": 60_000})
        service = SchedulerService(config, me="old", client=redis_client)
        await service.start()
        try:
            await eventually(lambda: service.leading and service.ticks > 0)
            old_epoch = service.elector.epoch if service.elector else None
            # The lease vanishes (a partition, a paused process) and another replica leads and
            # writes: from then on the old leader's epoch is refused.
            await redis_client.delete(SchedulerKeys().leader)
            scripts = register_scripts(redis_client)
            new = await leadership(redis_client, scripts, "new", 60_000)
            store = service.pools[0].store
            await store.publish_state(new.epoch, Zone.GREEN, {})
            await eventually(lambda: not service.leading)
            assert service.metrics.fenced.labels("p")._value.get() >= 1
            await admit(store, "v0", Tier.VIP, 100)
            await asyncio.sleep(0.05)  # several of the old leader's poll intervals
            assert (await store.task("v0") or {})["state"] == "queued"
            assert old_epoch is not None and new.epoch > old_epoch
            try:
                await store.release(old_epoch, (1, 1, 1))
            except FencedError as exc:
                assert exc.current == new.epoch
            else:
                raise AssertionError("release with the old epoch was accepted")
        finally:
            await service.stop()


async def test_an_outage_is_logged_once_then_every_interval_and_its_end_once(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    """A standby retries every ttl/10 while Redis is down; the log gets one line when the
    calls start failing, one per FAILURE_LOG_EVERY_S with the count, and one when they pass."""
    server = redis_factory()
    client = aioredis.Redis.from_url(server.url)
    clock = FakeClock()
    failed: list[None] = []
    elector = Elector(client, register_scripts(client), "a", 2_000, clock=clock,
                      on_failure=lambda: failed.append(None))
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.leader")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kvgate.scheduler.leader"]

    try:
        server.stop()
        for _ in range(50):
            assert await elector.attempt() == pytest.approx(0.2)  # ttl / 10
            clock.advance(0.2)
        assert elector.failures == len(failed) == 50 and not elector.leading
        (first,) = lines()
        assert first.startswith("leadership call failed: ") and str(server.port) in first
        clock.advance(FAILURE_LOG_EVERY_S - 10.0)  # 30 s after the first failure in all
        await elector.attempt()
        assert len(lines()) == 2
        assert lines()[1].startswith("leadership call failed 51 times in a row in 30 s")
        redis_factory(port=server.port)  # back, empty
        for _ in range(3):  # a pooled connection may still report the old socket's end
            await elector.attempt()
            if elector.leading:
                break
        assert elector.leading and elector.failures == 0
        assert len(failed) >= 51  # every failed call counted, the run of failures over
        assert lines()[2].startswith("leadership calls succeed again after ")
        assert lines()[3].startswith("a leads with epoch ")
        await elector.attempt()
        assert len(lines()) == 4  # a renewal logs nothing
    finally:
        await client.aclose()
