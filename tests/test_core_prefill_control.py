"""The release control's signals in Redis: the VIP first-token counts and 10%-wide histogram
buckets the finish script keeps against the objective, and the leader's ticks against a real
metrics page (tests/scheduler_stub.py's FakeVllm): rooms from the measured backlog, light
tenants' overdraws taken out of the next room, a new leader ageing released tasks by the Redis
clock and resuming the published prefill rate, gain and calm step time, the decode step time,
and the lane it keeps and the cap it publishes for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from admission.config import Config
from admission.tiers import Tier, Zone
from scheduler.control import REFILL_POLLS
from tests.prefill_support import (
    BIG,
    FROZEN_US,
    _admit,
    _at_ms,
    _count,
    _s,
    _store,
)
from tests.scheduler_stub import FakeVllm, always, make_config, pool_scheduler, serve_fake, state


async def test_the_finish_script_counts_vip_first_tokens_against_the_objective(
        redis_client: aioredis.Redis) -> None:
    store = await _store(redis_client)
    k = store.keys
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG})
    assert (await _admit(store, "v0", Tier.VIP, 10))[0] == "released"
    await store.finish("v0", 20, cancelled=False, ttft_ms=500)
    # No objective published: nothing counted.
    assert await redis_client.hgetall(k.node_vip_ttft) == {}
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, {"vip_ttft_objective_ms": 250})
    for task_id, tier, ttft in (("v1", Tier.VIP, 100), ("v2", Tier.VIP, 251),
                                ("v3", Tier.VIP, None), ("n1", Tier.NORMAL, 900)):
        assert (await _admit(store, task_id, tier, 10))[0] == "released"
        await store.finish(task_id, 20, cancelled=False, ttft_ms=ttft)
    counts = {_s(f): int(v) for f, v in (await redis_client.hgetall(k.node_vip_ttft)).items()}
    # ...and each in its 10% bucket: 100 ms in [1.1^48, 1.1^49), 251 in [1.1^57, 1.1^58).
    # The histogram is the pool's, one field a bucket however many nodes.
    assert counts == {"node-a:n": 2, "node-a:over": 1, "h48": 1, "h57": 1}
    # The leader reads them per node, the field format parsed in admission.reads; per-node
    # buckets that an earlier version of the script wrote still count.
    await redis_client.hset(k.node_vip_ttft, "node-old:h48", 2)
    reading = await store.read_tick(control=True, running=False)
    assert reading.vip_reports == {"node-a": (2, 1)}
    assert reading.vip_histogram == {48: 3, 57: 1}
    await redis_client.hdel(k.node_vip_ttft, "node-old:h48")
    # A repeated settle is a no-op: counted once.
    await store.finish("v2", 20, cancelled=False, ttft_ms=251)
    counts = {_s(f): int(v) for f, v in (await redis_client.hgetall(k.node_vip_ttft)).items()}
    assert counts == {"node-a:n": 2, "node-a:over": 1, "h48": 1, "h57": 1}


@pytest.mark.parametrize("ttft_ms", [0, 1, 2, 10, 11, 12, 99, 1_000, 45_000, 10**7])
async def test_the_finish_scripts_buckets_are_ten_percent_wide(
        redis_client: aioredis.Redis, ttft_ms: int) -> None:
    """The bucket of a first token is the k with 1.1^k <= ms < 1.1^(k+1), from 0 (below
    1.1 ms) to 120 (the last holds everything above ~92 s); scheduler.calm reads them so."""
    store = await _store(redis_client)
    await store.publish_state(1, Zone.GREEN, {"node-a": BIG}, {"vip_ttft_objective_ms": 250})
    assert (await _admit(store, "v", Tier.VIP, 10))[0] == "released"
    await store.finish("v", 20, cancelled=False, ttft_ms=ttft_ms)
    [bucket] = (await store.read_tick(control=True, running=False)).vip_histogram
    assert 0 <= bucket <= 120
    assert bucket == 0 or 1.1 ** bucket <= ttft_ms * 1.000001
    assert bucket == 120 or ttft_ms < 1.1 ** (bucket + 1) * 1.000001


def _control_config(redis_url: str, node_url: str) -> Config:
    """One node, the release control on: a window of 10,000 tokens/s x 0.2 s x 1/2 = 1,000."""
    return make_config(redis_url, [{"name": "n1", "url": node_url}],
                       control={"vip_ttft_objective_ms": 200, "prefill_tokens_per_s": 10_000})


@asynccontextmanager
async def _one_node_control(redis_client: aioredis.Redis, redis_url: str
                            ) -> AsyncIterator[tuple[FakeVllm, Any]]:
    """A pool scheduler with the release control on (window 10,000 tokens/s x 0.2 s x 1/2 =
    1,000 tokens) over one node whose metrics page a test drives; the scripts' clock stopped
    at FROZEN_US (the rooms refill only as a test moves it)."""
    fake = FakeVllm(running=1, prompt_tokens=0.0)
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as ps:
            await _at_ms(redis_client, ps.store, 0)
            yield fake, ps


async def test_the_leader_publishes_rooms_from_the_measured_backlog(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """A tick against a real metrics page: window, backlog and room in the state hash and the
    scripts' hash, the room shrinking by what a gateway released, and growing back when the
    engine's prompt counter shows it prefilled."""
    async with _one_node_control(redis_client, redis_url) as (fake, ps):
        k = ps.store.keys
        await ps.tick(1, always)  # window 10,000 tokens/s x 0.2 s x 1/2
        published = await state(ps.store)
        assert (published["prefill_window:n1"], published["prefill_backlog:n1"],
                published["prefill_room:n1"]) == ("1000", "0", "1000")
        assert published["vip_ttft_objective_ms"] == "200"
        rooms = {_s(f): int(v) for f, v in (await redis_client.hgetall(k.node_prefill)).items()}
        refill_us = REFILL_POLLS * ps.settings.poll_interval_ms * 1000
        assert rooms == {"n1": 1_000, "n1:window": 1_000, "n1:rate": 10_000, "n1:running": 1,
                         "n1:vips": 0, ":at": FROZEN_US, ":until": FROZEN_US + refill_us}
        assert ps.metrics.prefill_window.labels("p", "n1")._value.get() == 1_000
        assert (await _admit(ps.store, "a", Tier.NORMAL, 800))[0] == "released"
        await ps.tick(1, always)  # the counter has not moved: 800 queued for prefill
        published = await state(ps.store)
        assert (published["prefill_backlog:n1"], published["prefill_room:n1"]) == ("800", "200")
        assert (await _admit(ps.store, "b", Tier.NORMAL, 300))[0] == "queued"
        fake.prompt_tokens = 800.0
        result = await ps.tick(1, always)  # prefilled: the whole window again
        assert [t.task_id for t in result.released] == ["b"]
        published = await state(ps.store)
        assert (published["prefill_backlog:n1"], published["prefill_room:n1"]) == ("0", "1000")
        assert await _count(redis_client, k.node_prefill_released, "n1") == 1_100


async def test_the_leader_takes_light_overdraws_out_of_the_next_room(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """A light tenant's overdraw prefilled before the next poll does not come on top of the
    next room: 300 overdrawn (the scripts' n1:light count) leave the next room 700, then the
    whole window again; a count already there when the leader first reads it is not owed."""
    async with _one_node_control(redis_client, redis_url) as (_fake, ps):
        k = ps.store.keys
        await redis_client.hset(k.node_prefill_released, "n1:light", 5_000)
        rooms = []
        for overdraw in (0, 300, 0):
            await redis_client.hincrby(k.node_prefill_released, "n1:light", overdraw)
            await ps.tick(1, always)
            rooms.append((await state(ps.store))["prefill_room:n1"])
            limit = await _count(redis_client, k.node_prefill, "n1")
            assert limit == int(rooms[-1])  # nothing released: the limit is the room
        assert rooms == ["1000", "700", "1000"]


async def test_a_new_leader_ages_released_tasks_by_the_redis_clock(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """A takeover: the last publish is the previous leader's, from before the pause, and the
    fast path released a task after it, long enough ago to be prefilled at the configured rate.
    The new leader's first room is the whole window: it ages the task by Redis TIME. Against
    the last publish the task would look released in the future, so still queued, and the room
    would stay shut for as long as the task runs (the engine's counter, which would correct
    the estimate, does not move once everything is prefilled)."""
    fake = FakeVllm(running=1, prompt_tokens=0.0)
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as old:
            k = old.store.keys
            await old.tick(1, always)
            assert (await _admit(old.store, "a", Tier.NORMAL, 800))[0] == "released"
        # The history, moved back: the publish 10 s ago, the release 5 s ago.
        now_us = await old.store.redis_time_us()
        await redis_client.hset(k.state, "updated_us", now_us - 10_000_000)
        members = [_s(m) for m in await redis_client.zrange(k.running, 0, -1)]
        assert len(members) == 1
        await redis_client.zadd(k.running, {members[0]: now_us - 5_000_000})
        async with pool_scheduler(redis_client, config) as new:
            await new.tick(2, always)
            published = await state(new.store)
            assert (published["prefill_backlog:n1"], published["prefill_room:n1"]) == ("0", "1000")
            # The control: a task released just now is queued for its prefill.
            assert (await _admit(new.store, "b", Tier.NORMAL, 300))[0] == "released"
            await new.tick(2, always)
            assert (await state(new.store))["prefill_backlog:n1"] == "300"


async def test_a_new_leader_resumes_the_published_prefill_rate_and_gain(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """The rate and gain the last leader measured (the state hash's prefill_rate and
    prefill_gain) carry over a takeover: the new leader's first window is built on them, not
    on the configured rate (10,000 tokens/s: a window of 1,000), and it publishes them on."""
    fake = FakeVllm(running=1, prompt_tokens=0.0)
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as ps:
            await redis_client.hset(ps.store.keys.state, mapping={
                "prefill_rate:n1": "8000", "prefill_gain:n1": "0.900",
                "prefill_rate:gone": "nan"})
            await ps.tick(1, always)
            published = await state(ps.store)
            # 0.9 x 8,000 tokens/s x 0.2 s x 1/2
            assert (published["prefill_window:n1"], published["prefill_rate:n1"],
                    published["prefill_gain:n1"]) == ("720", "8000", "0.900")


async def test_the_leader_publishes_the_decode_step_time_and_resumes_the_calm_one(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """The running limit's signal against a real metrics page: the mean step time between two
    readings of the inter-token histogram (0.5 s over 20 tokens: 25 ms) in the state hash and
    the metrics, and the calm step time the last leader published carried over a takeover."""
    fake = FakeVllm(running=1, prompt_tokens=0.0, itl=(1.0, 100.0))
    async with serve_fake(fake) as url:
        config = _control_config(redis_url, url)
        async with pool_scheduler(redis_client, config) as ps:
            await redis_client.hset(ps.store.keys.state, mapping={
                "prefill_rate:n1": "8000", "calm_step_ms:n1": "12.50"})
            await ps.tick(1, always)
            published = await state(ps.store)
            assert (published["decode_step_ms:n1"], published["calm_step_ms:n1"]) == ("", "12.50")
            fake.itl = (1.5, 120.0)
            await ps.tick(1, always)
            published = await state(ps.store)
            assert published["decode_step_ms:n1"] == "25.00"
            assert published["calm_step_ms:n1"] == "12.50"  # one calm poll moves it by ~nothing
            assert ps.metrics.decode_step.labels("p", "n1")._value.get() == pytest.approx(0.025)


async def test_the_leader_keeps_the_first_shared_node_as_a_lane_and_publishes_its_cap(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    """Three nodes, n1 dedicated to VIP: the lane is n2, the first shared node by name (n3 is
    not one: at most all but one shared node). Before any step time is read it may start one
    task; once its engine reports a step within budget, the cap is the batch that step allows
    less the sequences that are not the lane's Normal and Batch tasks. Published in the
    scripts' hash, the state hash and the metrics, with the lane's bound on declared outputs;
    with lane_nodes 0 there is none."""
    fakes = [FakeVllm(running=4, prompt_tokens=0.0, itl=(0.0, 0.0)) for _ in range(3)]
    async with (serve_fake(fakes[0]) as u1, serve_fake(fakes[1]) as u2,
                serve_fake(fakes[2]) as u3):
        backends = [{"name": f"n{i + 1}", "url": u} for i, u in enumerate((u1, u2, u3))]
        for lane_nodes, lanes in ((1, ["n2"]), (0, [])):
            config = make_config(redis_url, backends, dedicated={"nodes": ["n1"],
                                                                 "tiers": ["vip"]},
                                 control={"vip_ttft_objective_ms": 300,
                                          "lane_nodes": lane_nodes,
                                          "lane_output": 600 * lane_nodes})
            async with pool_scheduler(redis_client, config) as ps:
                for fake in fakes:
                    fake.itl = (0.0, 0.0)
                await ps.tick(1, always)
                published = await state(ps.store)
                scripts = {_s(f): _s(v) for f, v in
                           (await redis_client.hgetall(ps.store.keys.node_prefill)).items()}
                if not lanes:
                    assert not any(f.startswith("lane_cap:") for f in published)
                    assert not any(f.endswith(":lane") for f in scripts)
                    continue
                assert published["lane_cap:n2"] == "1" and scripts["n2:lane"] == "1"
                assert published["lane_output"] == "600"  # what the scripts bound outputs by
                assert "lane_cap:n3" not in published and "n3:lane" not in scripts
                # 10 tokens at 20 ms, the shortest step read; the objective (300 ms) stands
                # in for the calm P99: the step may reach 20 + 20 ms.
                fakes[1].itl = (0.2, 10.0)
                await ps.tick(1, always)
                # 4 running, 0 of them the lane's tasks: 4 x 40 / 20 - 4 = 4.
                published = await state(ps.store)
                assert (published["lane_cap:n2"], published["floor_step_ms:n2"]) == ("4", "20.00")
                assert "floor_step_ms:n3" not in published
                assert ps.metrics.lane_cap.labels("p", "n2")._value.get() == 4
            await redis_client.flushdb()
