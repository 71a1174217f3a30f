"""The wake-up hub's fallback: lost messages are found by one check for all waiters."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from gateway.metrics import GatewayMetrics
from gateway.waiter import WakeHub, wait_for_release


async def _calls(client: aioredis.Redis, command: str) -> int:
    stats = await client.info("commandstats")
    entry = stats.get(f"cmdstat_{command}")
    return int(entry["calls"]) if entry else 0


async def test_one_check_finds_every_task_whose_wake_up_was_lost(
    redis_client: aioredis.Redis,
) -> None:
    store = PoolStore(redis_client, register_scripts(redis_client), "p",
                      PoolPolicy(stale_after_ms=0))
    await store.publish_state(1, Zone.YELLOW, {"n": 10_000_000})  # Batch queues in YELLOW
    tenant = TenantQuota("t", 1_000_000, 1_000_000, 1000)
    metrics = GatewayMetrics()
    hub = WakeHub(redis_client, [store.keys.wake_channel("g")], metrics, poll_s=60)
    futures = {}
    for i in range(300):
        task_id = f"task{i}"
        futures[task_id] = hub.expect(task_id)
        result = await store.admit(task_id=task_id, tenant=tenant, tier=Tier.BATCH,
                                   prompt_tokens=10, max_tokens=10, gateway="g",
                                   queue_timeout_ms=60_000)
        assert result.outcome is AdmitOutcome.QUEUED
        hub.queued(task_id, store, Tier.BATCH)
    released = await store.release(1, (0, 0, 100))  # no notify: every message "lost"
    assert len(released) == 100
    zmscore, hmget = await _calls(redis_client, "zmscore"), await _calls(redis_client, "hmget")
    assert await hub.poll_once() == 100
    assert await _calls(redis_client, "zmscore") - zmscore == 1  # one check for 300 waiters
    assert await _calls(redis_client, "hmget") - hmget == 100  # records of those that left
    for task in released:
        woken = await wait_for_release(futures[task.task_id], timeout_s=0)
        assert woken is not None and woken.node == "n" and woken.polled
    still = [f for f in futures.values() if not f.done()]
    assert len(still) == 200
    assert await wait_for_release(still[0], timeout_s=0.01) is None
    assert metrics.registry.get_sample_value("kvgate_gateway_wake_fallbacks_total",
                                             {"pool": "p"}) == 100


async def test_a_message_resolves_the_waiter_without_any_read(
    redis_client: aioredis.Redis,
) -> None:
    hub = WakeHub(redis_client, ["unused"], GatewayMetrics(), poll_s=60)
    released, expired = hub.expect("a"), hub.expect("b")
    hub.deliver(b"a node-3")
    hub.deliver("b ")
    hub.deliver(b"unknown node-1")  # a task this gateway no longer waits for: ignored
    a = await asyncio.wait_for(released, 1)
    b = await asyncio.wait_for(expired, 1)
    assert (a.node, a.state, a.polled) == ("node-3", "released", False)
    assert (b.node, b.state) == (None, "expired")


async def test_the_subscription_comes_back_after_its_connection_is_killed(
    redis_client: aioredis.Redis,
) -> None:
    metrics = GatewayMetrics()
    hub = WakeHub(redis_client, ["wake:g"], metrics, poll_s=60)  # no fallback in this test
    listener = asyncio.create_task(hub.run())
    try:
        await asyncio.wait_for(hub.subscribed.wait(), 2)
        assert await redis_client.client_kill_filter(_type="pubsub") == 1
        woken = hub.expect("t1")

        async def deliver_until_woken() -> None:
            # Published until the new subscription hears it: what is sent while it reconnects
            # is lost (the fallback, off here, covers that in production).
            while not woken.done():
                await redis_client.publish("wake:g", "t1 node-1")
                await asyncio.sleep(0.02)

        await asyncio.wait_for(deliver_until_woken(), 3)
        assert woken.result().node == "node-1" and not woken.result().polled
        assert not listener.done()
        assert metrics.registry.get_sample_value(
            "kvgate_gateway_pubsub_reconnects_total") == 1
    finally:
        hub.stop.set()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def test_a_pool_whose_check_fails_does_not_hide_the_other_pools_releases(
    redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """Pool "q" has a queue key of the wrong type (WRONGTYPE on every check of its Batch
    waiters), and its waiter is checked first. Pool "p"'s release, whose wake-up is lost, is
    still found by the fallback: the failing group is counted and logged once per streak,
    and skipped."""
    caplog.set_level(logging.INFO, logger="kvgate.gateway")
    scripts = register_scripts(redis_client)
    healthy = PoolStore(redis_client, scripts, "p", PoolPolicy(stale_after_ms=0))
    broken = PoolStore(redis_client, scripts, "q", PoolPolicy(stale_after_ms=0))
    await healthy.publish_state(1, Zone.YELLOW, {"n": 10_000_000})  # Batch queues in YELLOW
    await redis_client.set(broken.keys.queue(Tier.BATCH), "not a sorted set")
    metrics = GatewayMetrics()
    hub = WakeHub(redis_client, ["unused"], metrics, poll_s=0.05)
    stranded = hub.expect("q-task")
    hub.queued("q-task", broken, Tier.BATCH)
    tenant = TenantQuota("t", 1_000_000, 1_000_000, 1000)
    woken = hub.expect("p-task")
    result = await healthy.admit(task_id="p-task", tenant=tenant, tier=Tier.BATCH,
                                 prompt_tokens=10, max_tokens=10, gateway="g",
                                 queue_timeout_ms=60_000)
    assert result.outcome is AdmitOutcome.QUEUED
    hub.queued("p-task", healthy, Tier.BATCH)
    assert len(await healthy.release(1, (0, 0, 1))) == 1  # no notify: the message is lost

    poller = asyncio.create_task(hub.poll_forever())
    try:
        found = await asyncio.wait_for(asyncio.shield(woken), 5)
    finally:
        hub.stop.set()
        await asyncio.wait_for(poller, 5)
        hub.stop.clear()  # checked by hand below
    assert (found.node, found.polled) == ("n", True)
    assert not stranded.done()
    failed = metrics.registry.get_sample_value("kvgate_gateway_redis_errors_total",
                                               {"op": "poll"})
    assert failed is not None and failed >= 1
    for _ in range(3):  # the streak goes on: counted each time, not logged again
        assert await hub.poll_once() == 0
    assert metrics.registry.get_sample_value("kvgate_gateway_redis_errors_total",
                                             {"op": "poll"}) == failed + 3
    lines = [r.getMessage() for r in caplog.records if "pool q" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "ResponseError WRONGTYPE" in lines[0] and "not a sorted set" not in lines[0]

    await redis_client.delete(broken.keys.queue(Tier.BATCH))  # fixed: the task left its queue
    assert await hub.poll_once() == 1
    assert (await stranded).state == "unknown"
    recovered = [r.getMessage() for r in caplog.records if "pool q" in r.getMessage()]
    assert len(recovered) == 2 and "succeeds again" in recovered[1]
