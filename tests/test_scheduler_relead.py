"""A replica that leads again after standing by, or a new one: what it starts from. The real
pool scheduler ticks against real Redis and stand-in vLLM servers on loopback."""

from __future__ import annotations

from typing import Any

from tests.scheduler_stub import FakeVllm, always, make_config, pool_scheduler, serve_fake


async def test_a_new_term_does_not_read_the_last_terms_readings(
        redis_client: Any, redis_url: str) -> None:
    """A standby's readings may be hours old: a node that does not answer the new term's first
    scrape is "not heard yet", and nothing is published from the old reading (it would set the
    zone, here RED, and the budgets)."""
    node = FakeVllm(usage=0.95)
    async with serve_fake(node) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"eject_after_failures": 3})
        async with pool_scheduler(redis_client, config) as ps:
            await ps.tick(1, always)
            before = await ps.store.published_state()
            assert before["zone"] == "RED"
            ps.new_term()
            node.status = 503  # the first scrape of the new term fails
            await ps.tick(2, always)
            assert await ps.store.published_state() == before
            node.status, node.usage = 200, 0.3
            await ps.tick(2, always)
            assert (await ps.store.published_state())["zone"] == "GREEN"


async def test_a_new_leader_starts_from_the_published_zone(
        redis_client: Any, redis_url: str) -> None:
    """RED at 0.90; at 0.83 the pool is in RED's hysteresis band (0.85 - 0.03): the leader
    that published RED keeps it, and so does a new one (which would start GREEN, and publish
    YELLOW: Normal and Batch queued until their timeout instead of an immediate 429)."""
    node = FakeVllm(usage=0.90)
    async with serve_fake(node) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as first:
            await first.tick(1, always)
            assert (await first.store.published_state())["zone"] == "RED"
        node.usage = 0.83
        async with pool_scheduler(redis_client, config) as second:
            await second.tick(2, always)
            assert (await second.store.published_state())["zone"] == "RED"
            node.usage = 0.80  # below the band: down to YELLOW
            await second.tick(2, always)
            assert (await second.store.published_state())["zone"] == "YELLOW"
