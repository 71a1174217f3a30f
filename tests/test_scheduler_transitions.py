"""The leader's log lines for a pool's changes: one when a node is ejected, one when it rejoins,
one when the pool enters RED and one when it leaves, never one per poll. The real pool
scheduler ticks against real Redis and stand-in vLLM servers on loopback."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from scheduler.pool import PoolScheduler
from tests.scheduler_stub import FakeVllm, always, make_config, pool_scheduler, serve_fake

LOGGER = "kvgate.scheduler.pool"


class Lines:
    """The pool logger's records since the last call, as (level, message)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.INFO, logger=LOGGER)
        self.caplog = caplog
        self.seen = 0

    def new(self) -> list[tuple[str, str]]:
        records = [r for r in self.caplog.records if r.name == LOGGER]
        fresh, self.seen = records[self.seen:], len(records)
        return [(r.levelname, r.getMessage()) for r in fresh]


async def ticks(ps: PoolScheduler, n: int) -> None:
    for _ in range(n):
        await ps.tick(1, always)


def ejected(node: str) -> tuple[str, str]:
    return ("WARNING", f"pool p: node {node} ejected after 2 failed scrapes in a row "
                       "(last: http_503); no work goes to it until it answers")


def rejoined(node: str) -> tuple[str, str]:
    return ("INFO", f"pool p: node {node} answers again and rejoins the pool")


async def test_ejections_rejoins_and_red_are_each_logged_once(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    lines = Lines(caplog)
    n1, n2 = FakeVllm(usage=0.3), FakeVllm(usage=0.3)
    async with serve_fake(n1) as u1, serve_fake(n2) as u2:
        config = make_config(redis_url, [{"name": "n1", "url": u1}, {"name": "n2", "url": u2}],
                             scheduler={"eject_after_failures": 2})
        async with pool_scheduler(redis_client, config) as ps:
            await ticks(ps, 3)
            assert lines.new() == []
            n1.status = 503
            await ticks(ps, 1)
            assert lines.new() == []  # one failure: stale, not ejected yet
            await ticks(ps, 1)
            assert lines.new() == [ejected("n1")]
            await ticks(ps, 3)
            assert lines.new() == []
            n2.status = 503
            await ticks(ps, 2)
            assert lines.new() == [
                ejected("n2"),
                ("WARNING", "pool p entered RED (no usable node): Normal and Batch requests "
                            "get 429"),
            ]
            await ticks(ps, 3)
            assert lines.new() == []
            n1.status = n2.status = 200
            await ticks(ps, 1)
            assert lines.new() == [rejoined("n1"), rejoined("n2"),
                                   ("INFO", "pool p left RED for GREEN, usage 0.300")]
            await ticks(ps, 3)
            assert lines.new() == []


async def test_red_by_usage_is_logged_on_entry_and_exit_only(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    lines = Lines(caplog)
    fake = FakeVllm(usage=0.5)
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}])
        async with pool_scheduler(redis_client, config) as ps:
            await ticks(ps, 2)
            fake.usage = 0.9
            await ticks(ps, 3)
            assert lines.new() == [("WARNING", "pool p entered RED (usage 0.900 at or above "
                                               "red 0.85): Normal and Batch requests get 429")]
            fake.usage = 0.84  # within the hysteresis below the line: still RED
            await ticks(ps, 3)
            assert lines.new() == []
            fake.usage = 0.75
            await ticks(ps, 3)
            assert lines.new() == [("INFO", "pool p left RED for YELLOW, usage 0.750")]
            fake.usage = 0.2  # YELLOW to GREEN is not a line of its own
            await ticks(ps, 2)
            assert lines.new() == []


async def test_a_new_leadership_logs_what_it_finds(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The new leader's log names the nodes still ejected and the RED zone it inherits, once;
    it does not say that nodes ejected in an earlier term rejoined."""
    lines = Lines(caplog)
    fake = FakeVllm(usage=0.3)
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"eject_after_failures": 2})
        async with pool_scheduler(redis_client, config) as ps:
            await ticks(ps, 1)
            fake.status = 503
            await ticks(ps, 2)
            red = ("WARNING", "pool p entered RED (no usable node): Normal and Batch requests "
                              "get 429")
            assert lines.new() == [ejected("n1"), red]
            ps.new_term()
            await ticks(ps, 3)
            assert lines.new() == [ejected("n1"), red]
            fake.status = 200
            ps.new_term()
            await ticks(ps, 2)
            assert lines.new() == []
