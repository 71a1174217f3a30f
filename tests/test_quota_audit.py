"""Quota answers as a tenant sees them through a real gateway (real sockets, the session's
redis-server, an instant vLLM-speaking backend): which limit bound, whether a retry can ever
succeed, and what the message says.

- A bucket that never refills (`rate = 0`, a prepaid allowance) is spent for good only when
  the requests it still holds could not give back enough: while some of its requests are
  queued or running, a request it cannot pay now gets a 429 to come back, not the 429
  `insufficient_quota` with `x-should-retry: false` that would make the client give up on
  tokens it still has. At the key level and at a team's.
- Over `max_queued_tokens`, the message names the tokens the key has queued, not its cap.
- A team's 429 names the team in a sentence that reads.
- `kvgate-inspect`'s tenant table shows the tenant's own allowances used, beside its bucket.
- Two tenants of one name, or one key under two tenants: the error names both entries.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from admission import inspect
from admission.config import ConfigError, parse_config
from admission.outcomes import AdmitOutcome, RejectReason
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, QuotaLevel, TenantQuota
from admission.tiers import Tier, Zone
from tests.gateway_harness import (
    POOL,
    Harness,
    config_data,
    eventually,
    open_held_stream,
    running_gateway,
    sha,
)

S = 1_000_000
DAY_US = 86_400 * S

BURST = 1_000
OUT = 600
"""max_tokens of each request: two of them do not fit in BURST at once."""
USED = 10
PROMPT = 9
"""Prompt tokens of the one-message chat every request sends (the gateway's count)."""
"""Tokens the backend generates per request: most of a reservation comes back at its end."""


def prepaid(data: dict[str, Any]) -> None:
    data["tenants"] += [
        {"name": "prepaid", "tier": "normal", "key_sha256": [sha("sk-prepaid")], "rate": 0,
         "burst": BURST, "max_queued": 10},
        {"name": "member", "tier": "normal", "key_sha256": [sha("sk-member")],
         "rate": 1_000_000, "burst": BURST, "max_queued": 10, "team": "prepaid-team"},
        # Refills a request's cost in microseconds: only its queued tokens bind.
        {"name": "queuer", "tier": "normal", "key_sha256": [sha("sk-queuer")],
         "rate": 100_000_000, "burst": BURST, "max_queued": 10, "max_queued_tokens": 2 * BURST},
        {"name": "crewmate", "tier": "normal", "key_sha256": [sha("sk-crewmate")],
         "rate": 1_000_000, "burst": BURST, "max_queued": 10, "team": "crew"},
    ]
    data["teams"] = [{"name": "prepaid-team", "rate": 0, "burst": BURST},
                     {"name": "crew", "rate": 10, "burst": BURST}]


async def post(http: aiohttp.ClientSession, h: Harness, key: str, max_tokens: int = OUT
               ) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with http.post(h.url + "/v1/chat/completions", json={
            "model": POOL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, dict(r.headers), (await r.json())["error"] if r.status != 200 else {}


async def check_prepaid_level(h: Harness, http: aiohttp.ClientSession, key: str,
                              scope: str) -> None:
    """One request of `key` held mid-stream; a second the level cannot pay meanwhile; the
    first ends; then the level pays again, until it is really spent."""
    h.backends[0].gate.clear()
    h.backends[0].held.clear()
    _, held = await open_held_stream(http, h.url, key, content="hi", max_tokens=OUT)
    status, headers, error = await post(http, h, key)
    assert status == 429, error
    assert error["code"] == "rate_limit_exceeded"
    assert headers["X-RateLimit-Scope"] == scope
    assert "x-should-retry" not in headers
    assert int(headers["retry-after-ms"]) >= 1000  # the floor: no one knows when it ends
    assert "give back what they do not use" in error["message"]
    h.backends[0].gate.set()
    await held.read()
    held.release()
    await h.settled()
    status, _, error = await post(http, h, key)  # most of the first came back: it pays
    assert status == 200, error
    await h.settled()
    # A full burst can never be paid now: nothing held comes back, and no wait refills it.
    status, headers, error = await post(http, h, key, max_tokens=BURST - PROMPT)
    assert status == 429, error  # OpenAI's status for a spent quota
    assert error["code"] == error["type"] == "insufficient_quota"
    assert headers["x-should-retry"] == "false"
    assert headers["X-RateLimit-Scope"] == scope


async def test_a_prepaid_quota_with_requests_in_flight_says_come_back_not_spent(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    async with running_gateway(redis_url, adjust=prepaid, backend_options={
            "hold_after": 2, "output_tokens": USED}) as h, aiohttp.ClientSession() as http:
        await h.publish(Zone.GREEN)
        await check_prepaid_level(h, http, "sk-prepaid", "key")
        await check_prepaid_level(h, http, "sk-member", "team:prepaid-team")
        # Nothing is held once every request ended: the counters went back to none.
        for key in (h.store.keys.bucket_key("prepaid"), h.store.keys.quota_key("prepaid-team")):
            assert await redis_client.hget(key, "held") is None


async def test_the_queued_tokens_429_names_what_is_queued(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    async with running_gateway(redis_url, adjust=prepaid) as h, aiohttp.ClientSession() as http:
        await h.publish(Zone.YELLOW)  # Normal queues
        waiting = [asyncio.create_task(post(http, h, "sk-queuer", 500)) for _ in range(3)]
        await eventually(lambda: _queued(h, 3))
        status, headers, error = await post(http, h, "sk-queuer", 500)
        assert status == 429, error
        assert error["code"] == "rate_limit_exceeded_queued_tokens"
        assert headers["X-RateLimit-Scope"] == "key"
        cost = PROMPT + 500
        assert f"has {3 * cost} tokens of requests queued and a cap of {2 * BURST}" in (
            error["message"]), error["message"]
        assert f"needs {cost} more" in error["message"]
        await h.publish(Zone.GREEN)
        await h.release()
        assert [(await w)[0] for w in waiting] == [200, 200, 200]


async def _queued(h: Harness, n: int) -> bool:
    return await h.queued(1) >= n


async def test_a_team_429_names_the_team_in_a_sentence(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    async with running_gateway(redis_url, adjust=prepaid) as h, aiohttp.ClientSession() as http:
        await h.publish(Zone.GREEN)
        await h.freeze_clock()
        assert (await post(http, h, "sk-crewmate", 900))[0] == 200
        status, headers, error = await post(http, h, "sk-crewmate", 900)
        assert status == 429 and headers["X-RateLimit-Scope"] == "team:crew"
        assert error["message"].startswith(
            "Token rate limit exceeded at team:crew: team crew's bucket (shared by every key "
            "of team crew) cannot pay the 909 tokens this request needs; it refills enough "
            "in "), error["message"]


async def test_inspect_shows_a_tenants_own_allowance_beside_its_bucket(
        redis_client: aioredis.Redis) -> None:
    """A tenant refused by its daily allowance has a full bucket: the tenant table must show
    the allowance used, or it reads as a tenant with room."""
    store = PoolStore(redis_client, register_scripts(redis_client), "audit", PoolPolicy())
    quota = TenantQuota("daily", rate=1_000_000, burst=1_000, max_queued=1,
                        daily_tokens=1_500, monthly_tokens=10_000)
    now = 10**15  # a day (and month) well inside, whatever the real date
    await redis_client.hset(store.keys.clock, "frozen_us", now)
    await store.publish_state(1, Zone.GREEN, {"gpu": 100_000})
    first = await store.admit(task_id="a", tenant=quota, tier=Tier.NORMAL, prompt_tokens=100,
                              max_tokens=800, gateway="gw", queue_timeout_ms=1_000)
    assert first.outcome is AdmitOutcome.RELEASED
    await store.settle("a", 900)
    await redis_client.hset(store.keys.clock, "frozen_us", now + 10 * S)  # bucket full again
    second = await store.admit(task_id="b", tenant=quota, tier=Tier.NORMAL, prompt_tokens=100,
                               max_tokens=800, gateway="gw", queue_timeout_ms=1_000)
    assert (second.reason, second.scope, second.limit) == (RejectReason.QUOTA, "key", "daily")
    (pool,) = (await inspect.snapshot(redis_client, ["audit"])).pools
    (view,) = pool.tenants
    assert (view.percent, view.day_used, view.month_used) == (100.0, 900, 900)
    rendered = inspect.render(await inspect.snapshot(redis_client, ["audit"]))
    header = next(line for line in rendered.splitlines() if line.strip().startswith("tenant "))
    assert "used today" in header and "used this month" in header


async def test_a_daily_allowance_survives_the_clock_stepping_back_across_midnight(
        redis_client: aioredis.Redis) -> None:
    """Redis's clock steps back over midnight (a failover to a replica whose clock is behind):
    the request admitted then counts in the later day, already begun, which keeps what it had
    used; read as the earlier day's, the later day's use was forgotten once the clock passed
    midnight again, and the allowance paid for more than its size."""
    store = PoolStore(redis_client, register_scripts(redis_client), "stepback", PoolPolicy())
    quota = TenantQuota("daily", rate=1_000_000, burst=1_000_000, max_queued=1,
                        daily_tokens=1_000)
    day_us = 86_400 * S
    midnight = (10**15 // day_us + 1) * day_us
    await store.publish_state(1, Zone.GREEN, {"gpu": 100_000})

    async def admit(task_id: str, at_us: int, max_tokens: int) -> Any:
        await redis_client.hset(store.keys.clock, "frozen_us", at_us)
        return await store.admit(task_id=task_id, tenant=quota, tier=Tier.NORMAL,
                                 prompt_tokens=100, max_tokens=max_tokens, gateway="gw",
                                 queue_timeout_ms=1_000)

    assert (await admit("after", midnight + S, 700)).outcome is AdmitOutcome.RELEASED
    assert (await admit("stepped-back", midnight - S // 2, 100)).outcome is AdmitOutcome.RELEASED
    late = await admit("later", midnight + 2 * S, 700)  # 800 + 200 used: 800 more is over
    assert (late.reason, late.scope, late.limit) == (RejectReason.QUOTA, "key", "daily")
    bucket = await redis_client.hmget(store.keys.bucket_key("daily"), "day", "day_used")
    assert bucket == [str(midnight // day_us).encode(), b"1000"]
    # A clock that ran a month ahead and was set right: the day it stored is no later day of
    # the clock's, and counting in it would pile the next month's use into one day.
    ahead = await admit("ahead", midnight + 30 * day_us, 600)  # 700 used "in" that day
    assert ahead.outcome is AdmitOutcome.RELEASED
    back = await admit("set-right", midnight + day_us + S, 700)  # the next day: 800 of 1,000
    assert back.outcome is AdmitOutcome.RELEASED


async def test_unused_tokens_go_back_to_the_period_each_level_counted_them_in(
        redis_client: aioredis.Redis) -> None:
    """The clock steps back across a midnight that is also a month's end: a request admitted
    then counts in the later day and month wherever they had begun (its key's, and its team's
    when another key's request began them there) and in the earlier ones elsewhere; its unused
    tokens go back to those same periods. Read as the clock's day, the tokens the request did
    not use never came back to the later day and month, which kept them as used."""
    store = PoolStore(redis_client, register_scripts(redis_client), "stepback-refund",
                      PoolPolicy())
    crew = QuotaLevel("crew", rate=1_000_000, burst=1_000_000, daily_tokens=100_000,
                      monthly_tokens=1_000_000)

    def tenant(name: str) -> TenantQuota:
        return TenantQuota(name, rate=1_000_000, burst=1_000_000, max_queued=1,
                           daily_tokens=20_000, monthly_tokens=200_000, levels=(crew,))

    early, late = tenant("early"), tenant("late")
    midnight = int(datetime.datetime(2031, 3, 1, tzinfo=datetime.UTC).timestamp()) * S
    day, month = midnight // DAY_US, 2031 * 12 + 2  # 1 March 2031, and March's index
    await store.publish_state(1, Zone.GREEN, {"gpu": 10**6})

    async def admit(task_id: str, quota: TenantQuota, at_us: int) -> None:
        await redis_client.hset(store.keys.clock, "frozen_us", at_us)
        got = await store.admit(task_id=task_id, tenant=quota, tier=Tier.NORMAL,
                                prompt_tokens=100, max_tokens=900, gateway="gw",
                                queue_timeout_ms=1_000)
        assert got.outcome is AdmitOutcome.RELEASED

    async def used(key: str) -> list[int]:
        fields = await redis_client.hmget(key, "day", "day_used", "month", "month_used")
        return [int(v or -1) for v in fields]

    await admit("early-before", early, midnight - 10 * S)  # February's last day
    await admit("late-after", late, midnight + S)  # begins March 1st for late and the team
    await admit("early-back", early, midnight - 2 * S)  # the clock stepped back
    await admit("late-back", late, midnight - 2 * S)
    record = await redis_client.hmget(store.keys.task_key("early-back"), "quota_day",
                                      "quota_month")
    assert record == [f"{day - 1} {day}".encode(), f"{month - 1} {month}".encode()]
    assert await used(store.keys.bucket_key("late")) == [day, 2_000, month, 2_000]
    assert await used(store.keys.quota_key("crew")) == [day, 3_000, month, 3_000]
    await store.settle("early-back", 100)
    await store.settle("late-back", 100)
    assert await used(store.keys.bucket_key("early")) == [day - 1, 1_100, month - 1, 1_100]
    assert await used(store.keys.bucket_key("late")) == [day, 1_100, month, 1_100]
    assert await used(store.keys.quota_key("crew")) == [day, 1_200, month, 1_200]
    # Past midnight again: what February's day and month did not use stays there.
    await redis_client.hset(store.keys.clock, "frozen_us", midnight + 5 * S)
    await store.settle("early-before", 100)
    await store.settle("late-after", 100)
    assert await used(store.keys.bucket_key("early")) == [day - 1, 1_100, month - 1, 1_100]
    assert await used(store.keys.bucket_key("late")) == [day, 200, month, 200]
    assert await used(store.keys.quota_key("crew")) == [day, 300, month, 300]


def test_duplicate_tenants_and_keys_name_both_entries() -> None:
    data = config_data("redis://127.0.0.1:1/0", ["http://127.0.0.1:9"])
    twin = dict(data["tenants"][1], key_sha256=[sha("sk-other")])
    with pytest.raises(ConfigError, match=r"tenants\[5\]\.name: tenant 'normal' is already "
                                          r"defined by tenants\[1\]"):
        parse_config({**data, "tenants": [*data["tenants"], twin]}, env={})
    thief = dict(data["tenants"][1], name="thief")
    with pytest.raises(ConfigError, match=r"tenants\[5\]\.key_sha256\[0\]: also listed for "
                                          r"tenant 'normal' \(tenants\[1\]\)"):
        parse_config({**data, "tenants": [*data["tenants"], thief]}, env={})
    doubled = dict(data["tenants"][1], key_sha256=[sha("sk-x"), sha("sk-x")])
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.key_sha256\[1\]: listed twice"):
        parse_config({**data, "tenants": [data["tenants"][0], doubled]}, env={})
