"""An engine that froze while idle: its /metrics answers and says it holds nothing, as a
healthy idle engine's does, but a request sent to it leaves no trace on its page. The leader
ejects it as stuck once a task kvgate released after the page's last change is
`stuck_after_ms` old, and takes it back when the page changes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from scheduler.scrape import parse_vllm_metrics
from scheduler.stuck import FROZEN_SLACK_S, ClockMatch, StuckWatch
from tests.scheduler_stub import FakeVllm, always, state
from tests.stuck_support import STUCK_AFTER_MS, busy, stuck_pool

AFTER_S = STUCK_AFTER_MS / 1000


def idle(**kw: Any) -> FakeVllm:
    """A node that holds nothing, its token counters on the page."""
    return busy(running=0, usage=0.0, **kw)


async def test_an_idle_node_that_takes_no_request_is_ejected_and_rejoins_when_its_page_changes(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.pool")
    frozen, healthy = idle(), idle()
    async with stuck_pool(redis_client, redis_url, {"n1": frozen, "n2": healthy}) as (
            ps, clock):
        reasons = []

        async def tick(seconds: float) -> None:
            await clock.advance(seconds)
            result = await ps.tick(1, always)
            reasons.append({p.name: p.reason for p in result.plans})

        await tick(0.0)
        await clock.advance(1.0)
        await clock.hold_task("n1")  # sent after the page last changed; it never takes it
        await clock.hold_task("n2")  # n2 takes its own, and its client reads it slowly
        healthy.generation_tokens = 401.0
        await tick(AFTER_S - 0.1)    # n1's task is not old enough yet
        await tick(0.1)
        assert (await state(ps.store))["nodes_out"] == "n1:stuck"
        assert ps.metrics.stuck.labels("p", "n1")._value.get() == 1
        await redis_client.delete(ps.store.keys.running)  # the gateways ended it
        await tick(1.0)
        await tick(60.0)
        frozen.generation_tokens = 401.0
        await tick(0.05)
    assert [r["n1"] for r in reasons] == ["", "", "stuck", "stuck", "stuck", ""]
    lines = [r.getMessage() for r in caplog.records if "n1" in r.getMessage()]
    assert lines == [
        "pool p: node n1 ejected as stuck: its page has not changed for 6 s, not even for the "
        "requests sent to it since; no work goes to it until its page changes",
        "pool p: node n1 moves again and rejoins the pool",
    ]
    assert [r["n2"] for r in reasons] == [""] * 6


async def test_a_request_the_engine_took_keeps_the_node_in_however_long_its_task_lasts(
    redis_client: Any, redis_url: str
) -> None:
    """A client reading a finished answer slowly keeps its task in the running index: the
    page moved after the release, so the node is not judged."""
    node = idle()
    async with stuck_pool(redis_client, redis_url, {"n1": node}) as (ps, clock):
        await ps.tick(1, always)
        await clock.advance(1.0)
        await clock.hold_task("n1")
        await clock.advance(0.05)
        node.running, node.generation_tokens = 1, 401.0
        await ps.tick(1, always)
        node.running = 0
        reasons = []
        for _ in range(3):
            await clock.advance(AFTER_S)
            reasons.append((await ps.tick(1, always)).plans[0].reason)
    assert reasons == ["", "", ""]


@pytest.mark.parametrize(("after_change_s", "judged"), [
    (FROZEN_SLACK_S - 0.1, False), (FROZEN_SLACK_S + 0.1, True)])
async def test_a_task_released_within_the_slack_of_the_last_change_does_not_count(
    redis_client: Any, redis_url: str, after_change_s: float, judged: bool
) -> None:
    async with stuck_pool(redis_client, redis_url, {"n1": idle()}) as (ps, clock):
        await ps.tick(1, always)
        await clock.advance(after_change_s)
        await clock.hold_task("n1")
        await clock.advance(AFTER_S)
        reason = (await ps.tick(1, always)).plans[0].reason
    assert reason == ("stuck" if judged else "")


def two_engines(first: FakeVllm, second: FakeVllm) -> bytes:
    other = [line.replace('engine="0"', 'engine="1"') for line in second.render().splitlines()
             if not line.startswith("#") and "cache_config_info" not in line]
    return (first.render() + "\n".join(other) + "\n").encode()


@pytest.mark.parametrize(("what", "page", "scheduler"), [
    ("another engine of a data-parallel server steps (the page changes)", "two engines", None),
    ("the page counts no decoded token", "no counter", None),
    ("stuck_after_ms is 0", "idle", {"stuck_after_ms": 0}),
])
async def test_a_still_idle_page_is_not_judged_when(
    redis_client: Any, redis_url: str, what: str, page: str, scheduler: dict[str, Any] | None
) -> None:
    still, moving = idle(), idle()
    fake = {"two engines": FakeVllm(body=two_engines(still, moving)),
            "no counter": FakeVllm(prompt_tokens=9.0), "idle": idle()}[page]
    async with stuck_pool(redis_client, redis_url, {"n1": fake}, scheduler) as (ps, clock):
        await ps.tick(1, always)
        await clock.advance(1.0)
        await clock.hold_task("n1")
        reasons = []
        for tokens in (500.0, 600.0, 700.0):
            moving.generation_tokens = tokens
            if fake.body is not None:
                fake.body = two_engines(still, moving)
            await clock.advance(AFTER_S)
            reasons.append((await ps.tick(1, always)).plans[0].reason)
    assert reasons == ["", "", ""], what


async def test_a_new_leader_judges_a_frozen_idle_page_afresh(
    redis_client: Any, redis_url: str
) -> None:
    """Published stuck, a page that shows nothing held is not kept out by a new leader (a
    restarted idle engine would never change again); the tasks it sends there judge it."""
    async with stuck_pool(redis_client, redis_url, {"n1": idle()}) as (ps, clock):
        await ps.tick(1, always)
        await clock.advance(1.0)
        await clock.hold_task("n1")
        await clock.advance(AFTER_S)
        assert [p.reason for p in (await ps.tick(1, always)).plans] == ["stuck"]
        ps.new_term()
        await redis_client.delete(ps.store.keys.running)
        assert [p.reason for p in (await ps.tick(2, always)).plans] == [""]
        await clock.advance(1.0)
        await clock.hold_task("n1")
        await clock.advance(AFTER_S)
        assert [p.reason for p in (await ps.tick(2, always)).plans] == ["stuck"]


def test_the_watch_judges_a_frozen_page_on_the_latest_release_after_its_last_change() -> None:
    watch = StuckWatch(AFTER_S)
    page = parse_vllm_metrics(idle().render())
    watch.reading("n1", page, 100.0)
    watch.reading("n1", page, 104.0)
    assert watch.frozen_s("n1", page, 104.0) == 4.0
    assert not watch.frozen_candidate("n1", 4.0)
    watch.reading("n1", page, 105.0)
    assert watch.frozen_candidate("n1", watch.frozen_s("n1", page, 105.0))
    assert watch.frozen_release("n1", 100.0 + FROZEN_SLACK_S) is None
    counts = 100.0 + FROZEN_SLACK_S + 0.01
    assert watch.frozen_release("n1", counts) == counts
    watch.judge_frozen("n1")
    assert watch.frozen("n1") and watch.stuck("n1", 0.0)
    watch.reading("n1", page, 106.0)
    assert watch.stuck("n1", 0.0)
    watch.reading("n1", parse_vllm_metrics(idle(prompt_tokens=1_001.0).render()), 107.0)
    assert not watch.stuck("n1", 0.0) and not watch.frozen("n1")
    assert watch.frozen_s("n1", page, 107.0) == 0.0


async def test_a_node_whose_scrapes_fail_after_the_release_is_not_judged_frozen(
    redis_client: Any, redis_url: str
) -> None:
    """Without a good reading taken stuck_after_ms after the release, nothing says the engine
    left the request untouched (a node too busy to answer /metrics is ejected for that)."""
    node = idle()
    async with stuck_pool(redis_client, redis_url, {"n1": node}) as (ps, clock):
        await ps.tick(1, always)
        await clock.advance(AFTER_S)
        await ps.tick(1, always)  # still for AFTER_S: a candidate, as read
        await clock.advance(1.0)
        await clock.hold_task("n1")
        node.status = 500
        reasons = []
        for _ in range(4):
            await clock.advance(AFTER_S / 2)
            reasons.append((await ps.tick(1, always)).plans[0].reason)
        node.status = 200  # answers again, unchanged: now the page says it
        await clock.advance(0.05)
        reasons.append((await ps.tick(1, always)).plans[0].reason)
    assert reasons == ["stale", "stale", "ejected", "ejected", "stuck"]


def test_the_clock_match_errs_towards_an_earlier_release() -> None:
    """Each sample's local time is read before its call: at most the true offset, whatever
    the call's way and the loop's lag; the greatest recent one is kept."""
    true_offset = 50.0  # local = pool + 50 s
    match = ClockMatch(keep_s=10.0)
    assert match.local(1_000_000) is None
    for local_before, delay in ((100.0, 0.030), (100.5, 0.002), (101.0, 0.200)):
        pool_us = int((local_before + delay - true_offset) * 1_000_000)
        match.sample(pool_us, local_before)
    mapped = match.local(int((101.0 - true_offset) * 1_000_000))
    assert mapped is not None and 101.0 - 0.002 - 1e-6 <= mapped <= 101.0
    # A sample older than keep_s is forgotten, even the best one.
    match.sample(int((120.0 + 0.1 - true_offset) * 1_000_000), 120.0)
    mapped = match.local(int((120.0 - true_offset) * 1_000_000))
    assert mapped is not None and abs(mapped - (120.0 - 0.1)) < 1e-6
    match.clear()
    assert match.local(0) is None
