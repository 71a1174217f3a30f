"""Reading vLLM's /metrics: both usage names, capacity with and without cache_config_info,
ejection after failures in a row and return on the first answer, stale scrapes counted."""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import pytest

from admission.tiers import Tier, Zone
from bench.common.localredis import free_port
from scheduler.scrape import USAGE_V0, USAGE_V1, MetricsError, Poller, parse_vllm_metrics
from tests.scheduler_stub import (
    FakeVllm,
    always,
    make_config,
    one_node_poller,
    pool_scheduler,
    queue_tasks,
    serve_fake,
    state,
)


def test_parses_v1_page() -> None:
    m = parse_vllm_metrics(FakeVllm(usage=0.4375, running=7, waiting=2, preemptions=3).render())
    assert m.usage_metric == USAGE_V1
    assert m.kv_usage == 0.4375
    assert (m.running, m.waiting, m.preemptions) == (7, 2, 3.0)
    assert m.capacity_tokens == 6_250 * 16
    assert m.block_size == 16


def test_parses_v0_page() -> None:
    m = parse_vllm_metrics(FakeVllm(usage=0.25, v0=True, num_gpu_blocks=1_952).render())
    assert m.usage_metric == USAGE_V0
    assert m.kv_usage == 0.25
    assert m.capacity_tokens == 1_952 * 16


def test_v1_name_wins_when_both_present() -> None:
    page = FakeVllm(usage=0.5).render() + f'{USAGE_V0}{{model_name="m"}} 0.9\n'
    assert parse_vllm_metrics(page).kv_usage == 0.5


def test_missing_cache_config_info_leaves_capacity_unknown() -> None:
    m = parse_vllm_metrics(FakeVllm(usage=0.1, num_gpu_blocks=None).render())
    assert m.capacity_tokens is None
    assert m.block_size == 16


def test_several_engines_take_the_fullest_and_sum_capacity() -> None:
    page = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 4\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0\n'
    )
    m = parse_vllm_metrics(page)
    assert (m.kv_usage, m.running, m.waiting, m.capacity_tokens) == (0.6, 7, 2, 3_200)


@pytest.mark.parametrize("missing", ["vllm:num_requests_running", "vllm:num_requests_waiting"])
def test_a_page_without_the_request_counts_is_unusable(missing: str) -> None:
    """A page with a usage but no running or waiting count (a broken exporter, not a vLLM
    server) read as an idle node, and the running limit released into it."""
    page = "".join(line + "\n" for line in FakeVllm(usage=0.3).render().splitlines()
                   if missing not in line)
    assert missing not in page
    with pytest.raises(MetricsError, match=f"{missing} is not on the page"):
        parse_vllm_metrics(page)


def _itl(name: str, engine: int, total: float, count: float) -> str:
    labels = f'engine="{engine}",model_name="m"'
    return (f"# TYPE {name} histogram\n"
            f'{name}_bucket{{{labels},le="0.01"}} {count / 2}\n'
            f'{name}_bucket{{{labels},le="+Inf"}} {count}\n'
            f"{name}_count{{{labels}}} {count}\n{name}_sum{{{labels}}} {total}\n")


def test_the_inter_token_histogram_is_read_by_its_sum_and_count() -> None:
    """Summed over engines; the V1 name first, the V0 one without it; none: None."""
    base = FakeVllm(usage=0.1).render()
    v1, v0 = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
    m = parse_vllm_metrics(base + _itl(v1, 0, 1.5, 100) + _itl(v1, 1, 0.5, 20))
    assert m.itl == (2.0, 120.0)
    assert parse_vllm_metrics(base + _itl(v0, 0, 0.25, 10)).itl == (0.25, 10.0)
    assert parse_vllm_metrics(base + _itl(v0, 0, 9.0, 9) + _itl(v1, 0, 1.0, 4)).itl == (1.0, 4.0)
    assert parse_vllm_metrics(base).itl is None


def test_an_inter_token_histogram_missing_its_sum_or_count_is_absent() -> None:
    """A _count without its _sum read as a sum of 0: a step time of 0 s, which the running
    limit and a lane's cap divide by. Read as absent (the other name, when complete, is read
    instead), as a counter that is not finite is."""
    base = FakeVllm(usage=0.1).render()
    v1, v0 = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
    count_only = f'{v1}_count{{engine="0",model_name="m"}} 100\n'
    sum_only = f'{v1}_sum{{engine="0",model_name="m"}} 1.5\n'
    assert parse_vllm_metrics(base + count_only).itl is None
    assert parse_vllm_metrics(base + sum_only).itl is None
    assert parse_vllm_metrics(base + count_only + _itl(v0, 0, 0.25, 10)).itl == (0.25, 10.0)


COUNTS = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
"""The request counts, so that the pages below fail on their usage and not on these."""


@pytest.mark.parametrize(("page", "why"), [
    ("", "neither"), (COUNTS, "neither"), (COUNTS + "vllm:kv_cache_usage_perc NaN\n", "is nan"),
    (COUNTS + "vllm:kv_cache_usage_perc {\n", "unparsable")])
def test_page_without_usable_usage_is_an_error(page: str, why: str) -> None:
    with pytest.raises(MetricsError, match=why):
        parse_vllm_metrics(page)


@pytest.mark.parametrize("values", [("0.5", "NaN"), ("NaN", "0.5"), ("0.5", "-Inf")])
def test_an_engine_whose_usage_is_not_a_number_makes_the_page_unusable(
        values: tuple[str, str]) -> None:
    """Whichever engine it is: max() keeps the first of a number and NaN, and a NaN (or -Inf)
    engine listed after a finite one was left out of the node's usage."""
    page = COUNTS + "".join(f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} {value}\n'
                            for i, value in enumerate(values))
    with pytest.raises(MetricsError, match="vllm:kv_cache_usage_perc is"):
        parse_vllm_metrics(page)


async def test_poller_ejects_after_failures_in_a_row_and_readmits() -> None:
    fake = FakeVllm(usage=0.3)
    async with one_node_poller(fake, timeout_s=1.0, eject_after=3) as (poller, errors):
        view = (await poller.poll(1.0))[0]
        assert (view.stale, view.ejected, view.metrics is not None) == (False, False, True)
        fake.status = 503
        for expected_ejected in (False, False, True):
            view = (await poller.poll(1.0))[0]
            assert view.stale
            assert view.ejected is expected_ejected
        assert errors == [None, "http_503", "http_503", "http_503"]
        fake.status = 200
        view = (await poller.poll(1.0))[0]
        assert (view.stale, view.ejected) == (False, False)


async def test_slow_node_is_stale_for_the_tick_but_does_not_delay_it() -> None:
    slow, fast = FakeVllm(usage=0.5, delay_s=1.5), FakeVllm(usage=0.2)
    async with serve_fake(slow) as slow_url, serve_fake(fast) as fast_url, \
            aiohttp.ClientSession() as session:
        config = make_config("redis://x", [{"name": "slow", "url": slow_url},
                                           {"name": "fast", "url": fast_url}])
        poller = Poller(config.pools["p"].backends, session, timeout_s=3.0, stale_after_s=1.0,
                        eject_after=3)
        views = {v.name: v for v in await poller.poll(0.5)}
        assert views["fast"].metrics is not None and not views["fast"].stale
        assert views["slow"].metrics is None and views["slow"].stale
        # Its scrape was not abandoned: it completes in the background and is not a failure.
        assert not views["slow"].ejected
        await poller.close()


@pytest.mark.parametrize(("policy", "budget_expected"), [("full", 0), ("last", 85_000)])
async def test_stale_policy_is_applied_and_counted(
    redis_client: Any, redis_url: str, policy: str, budget_expected: int
) -> None:
    fake = FakeVllm(usage=0.0)
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"stale_policy": policy, "eject_after_failures": 5})
        async with pool_scheduler(redis_client, config) as ps:
            await ps.tick(1, always)
            fake.status = 500
            result = await ps.tick(1, always)
            plan = result.plans[0]
            assert plan.stale and not plan.ejected
            assert plan.budget == budget_expected
            stale = ps.metrics.stale.labels("p", "n1", policy)._value.get()
            assert stale == 1
            capacity = await redis_client.hget(ps.store.keys.node_capacity, "n1")
            assert int(capacity) == budget_expected
            if policy == "full":
                assert (await state(ps.store))["nodes_out"] == "n1:stale"


async def test_capacity_from_config_when_cache_config_info_missing(
    redis_client: Any, redis_url: str
) -> None:
    with_info, without = FakeVllm(usage=0.0), FakeVllm(usage=0.0, num_gpu_blocks=None, v0=True)
    unknown = FakeVllm(usage=0.0, num_gpu_blocks=None)
    async with serve_fake(with_info) as u1, serve_fake(without) as u2, \
            serve_fake(unknown) as u3:
        config = make_config(redis_url, [
            {"name": "info", "url": u1},
            {"name": "configured", "url": u2, "capacity_tokens": 50_000},
            {"name": "unknown", "url": u3},
        ])
        async with pool_scheduler(redis_client, config) as ps:
            await queue_tasks(ps.store, [("a", Tier.VIP, 1_000)])
            result = await ps.tick(1, always)
            plans = {p.name: p for p in result.plans}
            # VIP's budget, at its 0.85 ceiling; Normal's stops at kv_target 0.78.
            assert plans["info"].budget == 85_000
            assert plans["configured"].budget == 42_500
            assert plans["info"].tier_budgets == (85_000, 78_000, 70_000)
            # Without cache_config_info nor capacity_tokens the node gets nothing, and says why.
            assert plans["unknown"].budget is None and plans["unknown"].reason == "no_capacity"
            assert math.isnan(plans["unknown"].projected)
            caps = await redis_client.hgetall(ps.store.keys.node_capacity)
            assert {k.decode(): int(v) for k, v in caps.items()} == {
                "info": 85_000, "configured": 42_500}
            normal = await redis_client.hgetall(ps.store.keys.tier_capacity(Tier.NORMAL))
            assert {k.decode(): int(v) for k, v in normal.items()} == {
                "info": 78_000, "configured": 39_000}
            assert [t.task_id for t in result.released] == ["a"]


async def test_unreachable_pool_publishes_nothing_until_ejected_then_red(
    redis_client: Any, redis_url: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    config = make_config(redis_url, [{"name": "n1", "url": dead}],
                         scheduler={"eject_after_failures": 3})
    async with pool_scheduler(redis_client, config) as ps:
        for _ in range(2):
            # Never heard from: a new leader keeps the previous state rather than saying RED.
            result = await ps.tick(1, always)
            assert not result.published
            assert await redis_client.exists(ps.store.keys.state) == 0
        result = await ps.tick(1, always)
        assert result.published and result.zone is Zone.RED
        assert result.plans[0].reason == "ejected"
        assert await redis_client.exists(*ps.store.keys.tier_capacities) == 0
        assert (await state(ps.store))["nodes_out"] == "n1:ejected"
