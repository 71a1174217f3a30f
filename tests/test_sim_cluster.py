"""Simulated nodes as child processes: start on free ports, serve, crash, stop."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.cluster import start_cluster
from bench.sim.config import SimConfig

FAST: dict[str, Any] = {"num_gpu_blocks": 2001, "max_model_len": 4096, "time_scale": 1000.0}


async def test_cluster_starts_serves_and_stops() -> None:
    configs = [
        SimConfig(model="pool-a", **FAST),
        SimConfig(model="pool-a", engine_index=1, v0_metrics=True, **FAST),
    ]
    cluster = await start_cluster(configs)
    async with cluster, aiohttp.ClientSession() as session:
        assert len({n.port for n in cluster.nodes}) == 2
        for node in cluster.nodes:
            async with session.post(node.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            }) as resp:
                body = await resp.json()
            assert body["usage"]["completion_tokens"] == 4
        async with session.get(cluster.urls[1] + "/metrics") as resp:
            names = {f.name for f in text_string_to_metric_families(await resp.text())}
        assert "vllm:gpu_cache_usage_perc" in names

        cluster.kill(0)
        assert cluster.nodes[0].process.returncode == -9
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(cluster.urls[0] + "/health"):
                pass
    assert all(n.process.poll() is not None for n in cluster.nodes)


async def test_crash_exit_ends_the_process_like_an_oom_kill() -> None:
    config = SimConfig(model="m", num_gpu_blocks=11, max_model_len=160, time_scale=1000.0,
                       crash_after_full_s=0.0, crash_usage_threshold=0.5)
    cluster = await start_cluster([config], crash_exit=True)
    async with cluster, aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(cluster.urls[0] + "/v1/completions",
                                    json={"prompt": "z" * 400, "stream": True}) as resp:
                await resp.read()
        code = await asyncio.to_thread(cluster.nodes[0].process.wait, 10)
        assert code == 137
