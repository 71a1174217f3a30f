"""Quotas in levels through two real gateways (real sockets, one redis-server): a team of three
keys whose bucket is smaller than the keys' together, 200 requests at once spread over the keys
and both gateways.

Exactly the team's budget is admitted (its bucket debited in the same atomic call as each
key's: never overdrawn, never a token lost), every refusal is a 429 naming the team's level
(`X-RateLimit-Scope: team:crew`, and the message) with the team's refill time as its hint,
and the keys' own buckets never bound. The clock is frozen so that no bucket refills during the
burst and the count is exact.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer

from admission.config import Config, parse_config
from admission.scripts import register_scripts
from admission.store import PoolStore
from admission.tiers import Zone
from bench.common.instant_backend import InstantBackend
from gateway.app import create_app
from gateway.state import GATEWAY
from tests.gateway_harness import POOL, config_data, eventually, serve_backend, sha

MEMBERS = ("crew-a", "crew-b", "crew-c")
KEY_BURST = 5_000
TEAM_BURST = 6_000
TEAM_RATE = 40
REQUESTS = 200
MESSAGES = [{"role": "user", "content": "hi"}]


def config(redis_url: str, backend: str) -> Config:
    data = config_data(redis_url, [backend])
    data["tenants"] += [
        {"name": name, "tier": "normal", "key_sha256": [sha(f"sk-{name}")], "rate": 1_000,
         "burst": KEY_BURST, "max_queued": 200, "team": "crew"} for name in MEMBERS]
    data["teams"] = [
        {"name": "crew", "parent": "corp", "rate": TEAM_RATE, "burst": TEAM_BURST},
        {"name": "corp", "rate": 1_000, "burst": 1_000_000},
    ]
    return parse_config(data, env={})


@asynccontextmanager
async def two_gateways(redis_url: str) -> AsyncIterator[tuple[list[str], PoolStore]]:
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_backend(InstantBackend(model=POOL)))
        cfg = config(redis_url, url)
        urls = []
        for gid in ("gw-a", "gw-b"):
            app = create_app(cfg, gateway_id=gid, settle_drain_s=0.5)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            stack.push_async_callback(server.close)
            await app[GATEWAY].hub.subscribed.wait()
            urls.append(str(server.make_url("/v1/chat/completions")))
        client = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(client.aclose)
        store = PoolStore(client, register_scripts(client), POOL, cfg.pool_policy(POOL))
        seconds, micros = await client.time()
        await client.hset(store.keys.clock, "frozen_us", seconds * 1_000_000 + micros)
        await store.publish_state(1, Zone.GREEN, {"node-0": 10_000_000})
        yield urls, store


async def test_the_team_bucket_binds_exactly_across_keys_and_gateways(
        redis_client: aioredis.Redis, redis_url: str) -> None:
    async with two_gateways(redis_url) as (urls, store), aiohttp.ClientSession() as http:
        async def one(i: int) -> tuple[int, dict[str, Any], dict[str, str], str]:
            member = MEMBERS[i % len(MEMBERS)]
            async with http.post(urls[i % 2], json={"model": POOL, "messages": MESSAGES,
                                                    "max_tokens": 40},
                                 headers={"Authorization": f"Bearer sk-{member}"}) as r:
                return r.status, await r.json(), dict(r.headers), member

        results = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        cost = ok[0][1]["usage"]["total_tokens"]
        assert all(r[1]["usage"]["total_tokens"] == cost for r in ok)  # one size: an exact count
        assert len(ok) == TEAM_BURST // cost, (len(ok), cost)
        assert len(ok) + len(refused) == REQUESTS
        for status, body, headers, _ in refused:
            assert status == 429
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert headers["X-RateLimit-Scope"] == "team:crew"
            assert "team crew" in body["error"]["message"]
            # The team's refill time (its rate), not a key's: missing tokens / 40 per s.
            missing = cost - (TEAM_BURST - len(ok) * cost)
            exact_ms = -(-missing * 1000 // TEAM_RATE)
            assert exact_ms <= int(headers["retry-after-ms"]) <= min(60_000, exact_ms * 1.25 + 1)
        # Every token accounted for: the team's bucket holds its burst less what was admitted
        # (each request used all it reserved, so settles refund nothing), and each key's bucket
        # only its own share: the keys never bound.
        async def all_settled() -> bool:
            return int(await redis_client.zcard(store.keys.running)) == 0
        await eventually(all_settled)
        team = await redis_client.hget(store.keys.quota_key("crew"), "micro_tokens")
        assert team is not None and int(team) == (TEAM_BURST - len(ok) * cost) * 1_000_000
        per_member = collections.Counter(m for *_, m in ok)
        for member in MEMBERS:
            level = await redis_client.hget(store.keys.bucket_key(member), "micro_tokens")
            assert level is not None
            assert int(level) == (KEY_BURST - per_member[member] * cost) * 1_000_000
            assert int(level) >= cost * 1_000_000  # room left: the key did not bind
        corp = await redis_client.hget(store.keys.quota_key("corp"), "micro_tokens")
        assert corp is not None and int(corp) == (1_000_000 - len(ok) * cost) * 1_000_000
