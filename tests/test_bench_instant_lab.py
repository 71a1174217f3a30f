"""The instant backend's settable engine state (`--kv-usage`, `--settable-metrics`): what
/metrics reports follows ``PUT /lab/metrics`` and the scheduler's own parser reads it back; bad
values get a 400 and change nothing; without the option there is no /lab route at all."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from bench.common import instant_backend
from bench.common.instant_backend import InstantBackend
from scheduler.scrape import NodeMetrics, parse_vllm_metrics
from tests.gateway_harness import serve_backend


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def scrape(http: aiohttp.ClientSession, url: str) -> NodeMetrics:
    async with http.get(url + "/metrics") as response:
        return parse_vllm_metrics(await response.text())


async def test_engine_state_is_set_at_run_time(http: aiohttp.ClientSession) -> None:
    backend = InstantBackend(kv_usage=0.25, settable_metrics=True, record=False)
    async with serve_backend(backend) as url:
        m = await scrape(http, url)
        assert (m.kv_usage, m.running, m.waiting) == (0.25, 0, 0)
        async with http.put(url + "/lab/metrics", json={"kv_usage": 0.84}) as response:
            assert response.status == 200
            assert await response.json() == {"kv_usage": 0.84, "running": 0, "waiting": 0}
        async with http.put(url + "/lab/metrics", json={"running": 300, "waiting": 2}) as r:
            assert r.status == 200
        m = await scrape(http, url)
        assert (m.kv_usage, m.running, m.waiting) == (0.84, 300, 2)
        bad: list[tuple[Any, str | None]] = [
            ({"kv_usage": 1.5}, "kv_usage"), ({"kv_usage": -0.1}, "kv_usage"),
            ({"kv_usage": "0.5"}, "kv_usage"), ({"kv_usage": True}, "kv_usage"),
            ({"running": 1.5}, "running"), ({"waiting": -1}, "waiting"),
            ({"kv_usage": 0.5, "running": -1}, "running"),  # nothing of it applies
            ({"usage": 0.5}, None), ({}, None), ([0.5], None)]
        for body, param in bad:
            async with http.put(url + "/lab/metrics", json=body) as response:
                assert response.status == 400, body
                assert (await response.json())["error"]["param"] == param, body
        async with http.put(url + "/lab/metrics", data=b"{not json") as response:
            assert response.status == 400
        m = await scrape(http, url)
        assert (m.kv_usage, m.running, m.waiting) == (0.84, 300, 2)


async def test_no_lab_route_unless_asked(http: aiohttp.ClientSession) -> None:
    async with serve_backend(InstantBackend(record=False)) as url:
        async with http.put(url + "/lab/metrics", json={"kv_usage": 0.5}) as response:
            assert response.status in (404, 405)
        assert (await scrape(http, url)).kv_usage == 0.0


def test_kv_usage_option_is_a_fraction() -> None:
    for bad in ("1.5", "-0.1"):
        with pytest.raises(SystemExit):
            instant_backend.main(["--kv-usage", bad])
