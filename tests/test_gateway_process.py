"""`python -m gateway --config FILE` as a real process, driven by the OpenAI SDK."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import openai
import redis.asyncio as aioredis

from admission.config import load_config
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore
from admission.tiers import Zone
from bench.common.instant_backend import InstantBackend
from tests.gateway_harness import (
    EPOCH,
    KEYS,
    ROOT,
    eventually,
    serve_backend,
    sha,
    start_gateway_process,
)


def _toml(backend_url: str) -> str:
    return f"""
[redis]
url = "redis://127.0.0.1:1/0"   # overridden by REDIS_URL

[gateway]
port = 8000
wake_fallback_ms = 100

[[pools]]
name = "demo"
stale_after_ms = 0
backends = [{{ name = "node-0", url = "{backend_url}" }}]

[[tenants]]
name = "vip"
tier = "vip"
key_sha256 = ["{sha(KEYS['vip'])}"]
"""


async def test_gateway_process_serves_settles_and_stops_on_sigterm(
    redis_url: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    backend = InstantBackend(model="demo")
    async with serve_backend(backend) as backend_url:
        config = tmp_path / "gateway.toml"
        config.write_text(_toml(backend_url))
        store = PoolStore(redis_client, register_scripts(redis_client), "demo",
                          _policy(config))
        await store.publish_state(EPOCH, Zone.GREEN, {"node-0": 1_000_000})
        process, url = await start_gateway_process(config, redis_url, "--log-level", "WARNING")
        try:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["vip"],
                                          max_retries=0) as client:
                raw = await client.chat.completions.with_raw_response.create(
                    model="demo", messages=[{"role": "user", "content": "hello"}],
                    max_tokens=5)
                completion = raw.parse()
                stream = await client.completions.create(
                    model="demo", prompt="hello", max_tokens=3, stream=True)
                text = "".join([c.choices[0].text async for c in stream if c.choices])
            assert completion.usage is not None and completion.usage.completion_tokens == 5
            assert text == " t0 t1 t2"
            task_id = raw.headers["x-request-id"]

            async def settled() -> bool:
                record = await store.task(task_id)
                return record is not None and record["state"] == "settled"

            await eventually(settled)
            record = await store.task(task_id)
            assert record is not None and int(record["usage"]) == completion.usage.total_tokens
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


def _policy(config: Path) -> PoolPolicy:
    return load_config(config, env={}).pool_policy("demo")


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[gateway]\nport = "eighty"\n[[pools]]\nname = "demo"\n')
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )
    assert result.returncode == 2
    assert "gateway.port" in result.stderr
