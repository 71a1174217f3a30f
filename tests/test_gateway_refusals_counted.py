"""Requests refused before they name a pool still show in `kvgate_gateway_requests_total`
(pool "none", outcome "invalid"): a client whose every request is wrong (a bad priority or
timeout header, a body over the limit) must be visible on the requests panel, not only in its
own logs."""

from __future__ import annotations

from typing import Any

import aiohttp
import redis.asyncio as aioredis

from tests.gateway_harness import KEYS, running_gateway

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_refusals_before_the_pool_are_counted_as_invalid(
        redis_url: str, redis_client: aioredis.Redis) -> None:
    async with running_gateway(redis_url, max_body_bytes=2048) as gw:
        cases: list[tuple[dict[str, str], dict[str, Any], int, str, str]] = [
            ({"X-Priority": "urgent"}, {"model": "demo", "messages": MESSAGES}, 400,
             "invalid_priority", "vip"),
            ({"X-Priority": "batch", "X-Request-Timeout": "soon"},
             {"model": "demo", "messages": MESSAGES}, 400, "invalid_timeout", "batch"),
            ({}, {"model": "demo", "messages": [{"role": "user", "content": "x" * 4096}]}, 413,
             "request_too_large", "vip"),
        ]
        registry = gw.gateway.metrics.registry

        def invalid(tier: str) -> float:
            return registry.get_sample_value("kvgate_gateway_requests_total", {
                "pool": "none", "tier": tier, "outcome": "invalid"}) or 0

        for headers, body, status, code, tier in cases:
            before = invalid(tier)
            async with aiohttp.ClientSession() as http, http.post(
                    gw.url + "/v1/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {KEYS['vip']}", **headers}) as response:
                assert response.status == status
                assert (await response.json())["error"]["code"] == code
            # The tier asked for where it was valid, the tenant's own otherwise.
            assert invalid(tier) == before + 1, (code, tier)
