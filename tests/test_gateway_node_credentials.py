"""The gateway's own credentials for its nodes (a vLLM server run with --api-key), on real
sockets: the pool's key reaches the node and the client's never does; a missing key stops the
gateway at start; a node that refuses the gateway (401, 403, 404) is a server-side 502 the
client can tell from its own mistakes, logged once per node and status and counted."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import openai
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from admission.config import ConfigError, parse_config
from admission.tiers import Zone
from bench.sim.cluster import serve_node
from bench.sim.config import SimConfig
from gateway.app import create_app
from gateway.state import METRICS
from tests.gateway_harness import BIG, KEYS, POOL, Harness, config_data, running_gateway, serve_app

NODE_KEY = "node-secret-5b1f"
VARIABLE = "KVGATE_TEST_NODE_KEY"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hi."}]


@asynccontextmanager
async def _node(require: str | None, *, refuse: int | None = None
                ) -> AsyncIterator[tuple[str, list[str | None]]]:
    """A node answering chat completions; with `require`, only to that bearer key (vLLM's
    401 otherwise); with `refuse`, always that status. Yields its URL and the Authorization
    header of every request it got."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        seen.append(request.headers.get("Authorization"))
        if refuse is not None:
            return web.json_response({"error": {"message": "refused", "type": "NotFoundError",
                                                "param": "model", "code": refuse}},
                                     status=refuse)
        if require is not None and request.headers.get("Authorization") != f"Bearer {require}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({
            "id": "cmpl-1", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with serve_app(app) as url:
        yield url, seen


def _pool_of(url: str, variable: str | None) -> Callable[[dict[str, Any]], None]:
    def adjust(data: dict[str, Any]) -> None:
        pool = data["pools"][0]
        pool["backends"] = [{"name": "node-0", "url": url}]
        if variable is not None:
            pool["backend_api_key_env"] = variable
    return adjust


@asynccontextmanager
async def _gateway(url: str, redis_url: str, variable: str | None) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url, adjust=_pool_of(url, variable)) as gw:
        await gw.publish(Zone.GREEN, BIG)
        yield gw


async def _chat(gw: Harness) -> Any:
    return await gw.openai("vip").chat.completions.create(
        model=POOL, messages=MESSAGES, max_tokens=3)


async def test_the_pools_key_reaches_the_node_and_the_clients_never_does(
    redis_url: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VARIABLE, NODE_KEY)
    async with _node(NODE_KEY) as (url, seen), _gateway(url, redis_url, VARIABLE) as gw:
        completion = await _chat(gw)
        assert completion.choices[0].message.content == "hi"
    assert seen == [f"Bearer {NODE_KEY}"]
    assert all(KEYS["vip"] not in (header or "") for header in seen)


async def test_without_a_pool_key_the_client_key_is_not_forwarded_and_the_refusal_is_a_502(
    redis_url: str, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvgate.gateway")
    async with _node(NODE_KEY) as (url, seen), _gateway(url, redis_url, None) as gw:
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as refused:
                await _chat(gw)
            assert refused.value.status_code == 502
            assert refused.value.code == "upstream_rejected"
            assert "not your API key" in refused.value.message
            # No retry can pass until the operator fixes the deployment: the SDKs are told so.
            assert refused.value.response.headers["x-should-retry"] == "false"
            assert "Retry-After" not in refused.value.response.headers
        counted = gw.app[METRICS].registry.get_sample_value(
            "kvgate_gateway_upstream_errors_total",
            {"pool": POOL, "node": "node-0", "kind": "rejected"})
    assert seen == [None, None]
    assert counted == 2
    logged = [r.getMessage() for r in caplog.records if "refused the gateway" in r.getMessage()]
    assert len(logged) == 1 and "HTTP 401" in logged[0] and "backend_api_key_env" in logged[0]
    assert NODE_KEY not in caplog.text and KEYS["vip"] not in caplog.text


@pytest.mark.parametrize("status", [403, 404])
async def test_a_node_refusing_the_model_or_the_gateway_is_a_502_not_the_clients_error(
    redis_url: str, redis_client: aioredis.Redis, status: int
) -> None:
    async with _node(None, refuse=status) as (url, _), _gateway(url, redis_url, None) as gw:
        with pytest.raises(openai.InternalServerError) as refused:
            await _chat(gw)
    assert refused.value.status_code == 502
    assert refused.value.code == "upstream_rejected"
    assert f"HTTP {status}" in refused.value.message


async def test_an_engine_refusing_the_priority_the_gateway_wrote_is_a_502_naming_pass_priority(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With `pass_priority` the gateway writes the tier as vLLM's `priority`; an engine
    without `--scheduling-policy priority` refuses it with a 400 (here the simulator, which
    answers as vLLM does), which blamed the client for the deployment's setting. VIP's
    priority is 0, which such an engine accepts: only the lower tiers were refused."""
    caplog.set_level(logging.ERROR, logger="kvgate.gateway")
    fcfs = SimConfig(model=POOL, num_gpu_blocks=2001, max_model_len=4096, time_scale=1000.0)

    def passing_priority(url: str) -> Callable[[dict[str, Any]], None]:
        def adjust(data: dict[str, Any]) -> None:
            _pool_of(url, None)(data)
            data["pools"][0]["pass_priority"] = True
        return adjust

    async with serve_node(fcfs) as node, running_gateway(
            redis_url, adjust=passing_priority(node.url)) as gw:
        await gw.publish(Zone.GREEN, BIG)
        assert (await _chat(gw)).choices  # VIP: priority 0
        with pytest.raises(openai.InternalServerError) as refused:
            await gw.openai("batch").chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": "Hi."}], max_tokens=4)
    assert refused.value.status_code == 502 and refused.value.code == "upstream_rejected"
    assert refused.value.response.headers["x-should-retry"] == "false"
    logged = [r.getMessage() for r in caplog.records if "refused the gateway" in r.getMessage()]
    assert len(logged) == 1 and "pass_priority" in logged[0], logged


@pytest.mark.parametrize("value", [None, "", "  "])
def test_a_pool_key_missing_from_the_environment_stops_the_gateway_at_start(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, value)
    data = config_data(redis_url, ["http://127.0.0.1:9"])
    _pool_of("http://127.0.0.1:9", VARIABLE)(data)
    with pytest.raises(ConfigError,
                       match=rf"^pools\[0\]\.backend_api_key_env: names {VARIABLE}, which is "
                             "not set"):
        create_app(parse_config(data, env={}), gateway_id="gw-test")


def test_the_pool_names_a_variable_not_a_key() -> None:
    data = config_data("redis://127.0.0.1:1/0", ["http://127.0.0.1:9"])
    _pool_of("http://127.0.0.1:9", "sk-live key")(data)
    with pytest.raises(ConfigError, match="backend_api_key_env: must be the name of an "
                                          "environment variable") as refused:
        parse_config(data, env={})
    assert "sk-live key" not in str(refused.value)
