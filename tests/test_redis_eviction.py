"""The services warn when their Redis may evict kvgate's keys (budgets, queues, leases), and say
nothing when it cannot be known: real redis-servers with each policy. They name a Redis too old
for the scripts (older than 6.2; than 7.0 with sharded pub/sub)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from admission.config import RedisSettings
from admission.connection import connect, eviction_warning, version_error, version_problem
from bench.common.localredis import LocalRedis
from scheduler.service import SchedulerService
from tests.scheduler_stub import make_config


@pytest.mark.parametrize(("args", "warned"), [
    ((), False),                                         # Redis's default: noeviction
    (("--maxmemory-policy", "allkeys-lru"), True),
    (("--maxmemory-policy", "volatile-ttl"), True),
    (("--rename-command", "CONFIG", ""), False),         # managed services forbid CONFIG
])
async def test_the_warning_names_an_evicting_policy_and_only_that(
        redis_factory: Callable[..., LocalRedis], args: tuple[str, ...], warned: bool) -> None:
    server = redis_factory(args=args)
    client = connect(RedisSettings(url=server.url))
    try:
        warning = await eviction_warning(client)
    finally:
        await client.aclose()
    assert (warning is not None) == warned
    if warning is not None:
        assert args[1] in warning and "noeviction" in warning


async def test_a_scheduler_on_an_evicting_redis_says_so_once_at_start(
        redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture) -> None:
    server = redis_factory(args=("--maxmemory-policy", "allkeys-lfu"))
    service = SchedulerService(make_config(server.url, [{"name": "n1", "url": "http://127.0.0.1:9"}]),
                               me="s1")
    caplog.set_level(logging.WARNING)
    await service.start()
    try:
        warnings = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert len(warnings) == 1 and "allkeys-lfu" in warnings[0]
    finally:
        await service.stop()


@pytest.mark.parametrize(("version", "sharded", "needs"), [
    ("6.0.16", False, "older than 6.2"),     # Ubuntu 22.04's package
    ("6.2.0", False, None),
    ("6.2.14", True, "no sharded pub/sub"),
    ("7.0.15", True, None),
    ("10.1.0", True, None),                  # compared as numbers, not as text
    ("unstable", True, None),                # a fork's own numbering: nothing said
])
def test_a_redis_too_old_for_the_scripts_is_named(version: str, sharded: bool,
                                                  needs: str | None) -> None:
    problem = version_problem(version, sharded_pubsub=sharded)
    assert (problem is None) == (needs is None)
    if problem is not None and needs is not None:
        assert needs in problem and version in problem


async def test_the_test_servers_redis_is_new_enough(
        redis_factory: Callable[..., LocalRedis]) -> None:
    """The real server's INFO is read (a version too old for the test here would be named)."""
    server = redis_factory()
    client = connect(RedisSettings(url=server.url, sharded_pubsub=True))
    try:
        version = str((await client.info("server"))["redis_version"])
        expected = version_problem(version, sharded_pubsub=True)
        assert await version_error(client, RedisSettings(url=server.url,
                                                         sharded_pubsub=True)) == expected
    finally:
        await client.aclose()
    assert version.count(".") == 2
