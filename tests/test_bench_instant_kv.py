"""The instant backend's settable KV usage (`--kv-usage`, `--settable-kv`): what /metrics
reports follows ``PUT /lab/kv_usage`` and the scheduler's own parser reads it back; bad values
get a 400 and change nothing; without the option there is no /lab route at all."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from bench import instant_backend
from bench.instant_backend import InstantBackend
from scheduler.scrape import parse_vllm_metrics
from tests.gateway_harness import serve_backend


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def kv_usage(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as response:
        return parse_vllm_metrics(await response.text()).kv_usage


async def test_kv_usage_is_set_at_run_time(http: aiohttp.ClientSession) -> None:
    backend = InstantBackend(kv_usage=0.25, settable_kv=True, record=False)
    async with serve_backend(backend) as url:
        assert await kv_usage(http, url) == 0.25
        async with http.put(url + "/lab/kv_usage", json={"kv_usage": 0.84}) as response:
            assert response.status == 200
            assert await response.json() == {"kv_usage": 0.84}
        assert await kv_usage(http, url) == 0.84
        for bad in ({"kv_usage": 1.5}, {"kv_usage": -0.1}, {"kv_usage": "0.5"},
                    {"kv_usage": True}, {"usage": 0.5}, [0.5]):
            async with http.put(url + "/lab/kv_usage", json=bad) as response:
                assert response.status == 400, bad
                assert (await response.json())["error"]["param"] == "kv_usage"
        async with http.put(url + "/lab/kv_usage", data=b"{not json") as response:
            assert response.status == 400
        assert await kv_usage(http, url) == 0.84


async def test_no_lab_route_unless_asked(http: aiohttp.ClientSession) -> None:
    async with serve_backend(InstantBackend(record=False)) as url:
        async with http.put(url + "/lab/kv_usage", json={"kv_usage": 0.5}) as response:
            assert response.status in (404, 405)
        assert await kv_usage(http, url) == 0.0


def test_kv_usage_option_is_a_fraction() -> None:
    for bad in ("1.5", "-0.1"):
        with pytest.raises(SystemExit):
            instant_backend.main(["--kv-usage", bad])
