"""The services warn when their Redis may evict kvgate's keys (budgets, queues, leases), and say
nothing when it cannot be known: real redis-servers with each policy."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from admission.config import RedisSettings
from admission.connection import connect, eviction_warning
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
