"""The frozen test clock is a test's alone: a service's scripts and reads never honour the pool
clock's ``frozen_us``, and no product code can turn it on."""

from __future__ import annotations

import ast
from pathlib import Path

import redis.asyncio as aioredis

import admission.scripts as scripts_module
from admission.keys import PoolKeys
from admission.outcomes import AdmitOutcome
from admission.reads import read_tick
from admission.scripts import (
    SCRIPT_NAMES,
    Script,
    Scripts,
    frozen_clock_allowed,
    register_scripts,
    script_source,
)
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier

ROOT = Path(__file__).resolve().parent.parent
FROZEN = 10**15  # 2001-09-09: far from any real Redis TIME


def service_scripts(client: aioredis.Redis) -> Scripts:
    """The scripts exactly as a service registers them (no test clock)."""
    return Scripts(**{name: Script(name, script_source(name, False), client)
                      for name in SCRIPT_NAMES})


async def _admit_and_read_queue_score(client: aioredis.Redis, scripts: Scripts) -> float:
    store = PoolStore(client, scripts, "clock", PoolPolicy())
    await client.hset(store.keys.clock, "frozen_us", FROZEN)
    tenant = TenantQuota("a", rate=0, burst=1_000, max_queued=10)
    admitted = await store.admit(task_id="t1", tenant=tenant, tier=Tier.BATCH, prompt_tokens=10,
                                 max_tokens=10, gateway="gw", queue_timeout_ms=60_000)
    assert admitted.outcome is AdmitOutcome.QUEUED  # no state published: nothing to place on
    score = await client.zscore(store.keys.queue(Tier.BATCH), "t1")
    assert score is not None
    return float(score)


async def test_a_services_scripts_ignore_a_frozen_clock(redis_client: aioredis.Redis) -> None:
    score = await _admit_and_read_queue_score(redis_client, service_scripts(redis_client))
    real_us = (await redis_client.time())[0] * 1_000_000
    assert abs(score - real_us) < 60 * 1_000_000


async def test_the_suites_scripts_honour_it(redis_client: aioredis.Redis) -> None:
    assert frozen_clock_allowed()  # tests/conftest.py
    score = await _admit_and_read_queue_score(redis_client, register_scripts(redis_client))
    assert score == FROZEN


def test_the_two_variants_differ_only_in_the_flag_line() -> None:
    for name in SCRIPT_NAMES:
        service, test = script_source(name, False), script_source(name, True)
        assert service.splitlines()[0] == "local TEST_CLOCK = false"
        assert test.splitlines()[0] == "local TEST_CLOCK = true"
        assert service.splitlines()[1:] == test.splitlines()[1:]


async def test_a_services_tick_reading_does_not_fetch_it(redis_client: aioredis.Redis) -> None:
    keys = PoolKeys("clock")
    await redis_client.hset(keys.clock, "frozen_us", FROZEN)
    scripts_module._test_clock = False
    try:
        reading = await read_tick(redis_client, keys, control=False, running=True)
    finally:
        scripts_module._test_clock = True
    assert reading.frozen_us is None
    reading = await read_tick(redis_client, keys, control=False, running=True)
    assert int(reading.frozen_us) == FROZEN


def test_no_product_code_turns_the_test_clock_on() -> None:
    callers = []
    for package in ("admission", "gateway", "scheduler", "lua", "bench", "clients"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(
                        node.func, "id", getattr(node.func, "attr", None)) == "allow_frozen_clock":
                    callers.append(str(path.relative_to(ROOT)))
    assert callers == []
