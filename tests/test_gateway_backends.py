"""The gateway facing its nodes, on real sockets: what it forwards of a client's request, how a
node's own 4xx reaches the client (OpenAI's error shape, the node's status, message and param;
401, 403 and 404 refuse the gateway itself: tests/test_gateway_node_credentials.py),
and the warning at start for a pool whose prompts are counted with the bundled tokenizer.

Nodes are bench.sim's simulated vLLM (its validation answers like vLLM's: an exception class
as the type, the status as an integer code) or, for bodies it never sends, a scripted server.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from admission.tiers import Zone
from bench.sim.cluster import serve_node
from bench.sim.config import SimConfig
from tests.gateway_harness import BIG, POOL, ROOT, Harness, running_gateway, serve_app

MESSAGES: list[Any] = [{"role": "user", "content": "Say hi."}]
# 1000 simulated seconds per wall second: answers come at once.
SIM = SimConfig(model=POOL, num_gpu_blocks=2001, max_model_len=4096, time_scale=1000.0)
BUNDLED_TOKENIZER = ROOT / "gateway" / "assets" / "qwen2-tokenizer.json.gz"


def _only_node(url: str) -> Callable[[dict[str, Any]], None]:
    def adjust(data: dict[str, Any]) -> None:
        data["pools"][0]["backends"] = [{"name": "node-0", "url": url}]
    return adjust


@asynccontextmanager
async def _gateway_before(url: str, redis_url: str) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url, adjust=_only_node(url)) as gw:
        await gw.publish(Zone.GREEN, BIG)
        yield gw


async def _post(gw: Harness, path: str, data: bytes,
                headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    sent = {**gw.auth("vip"), "Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + path, data=data, headers=sent) as response:
        return response.status, await response.read(), response.headers


async def test_a_gzip_request_reaches_the_node_decoded(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with serve_node(SIM) as node, _gateway_before(node.url, redis_url) as gw:
        body = orjson.dumps({"model": POOL, "messages": MESSAGES, "max_tokens": 3})
        status, answer, _ = await _post(gw, "/v1/chat/completions", gzip.compress(body),
                                        {"Content-Encoding": "gzip"})
        assert status == 200, answer
        completion = orjson.loads(answer)
        assert completion["choices"][0]["message"]["content"]
        assert completion["usage"]["completion_tokens"] == 3
        # A streamed answer takes the same path out.
        body = orjson.dumps({"model": POOL, "prompt": "hi", "max_tokens": 2, "stream": True})
        status, answer, _ = await _post(gw, "/v1/completions", gzip.compress(body),
                                        {"Content-Encoding": "gzip"})
        assert status == 200 and answer.endswith(b"data: [DONE]\n\n"), answer


async def test_a_simulated_nodes_400_is_relayed_in_openai_shape(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with serve_node(SIM) as node, _gateway_before(node.url, redis_url) as gw:
        # The gateway allows n up to 128; the simulator serves n=1 only and says so like vLLM.
        body = orjson.dumps({"model": POOL, "messages": MESSAGES, "max_tokens": 3, "n": 2})
        status, answer, headers = await _post(gw, "/v1/chat/completions", body)
        assert status == 400
        assert orjson.loads(answer) == {"error": {
            "message": "The simulator supports n=1 only.", "type": "invalid_request_error",
            "param": "n", "code": None}}
        assert headers["Content-Type"].startswith("application/json")
        await gw.settled()
        record = await gw.task(headers["X-Request-Id"])
        assert record["state"] == "cancelled" and "usage" not in record  # nothing charged


# (a node's status, content type and body; the error the client then reads, same status)
NODE_ANSWERS: list[tuple[int, str, bytes, dict[str, Any]]] = [
    (400, "application/json",
     orjson.dumps({"object": "error", "message": "max_tokens is too large",
                   "type": "BadRequestError", "param": "max_tokens", "code": 400}),
     {"message": "max_tokens is too large", "type": "invalid_request_error",
      "param": "max_tokens", "code": None}),
    (422, "application/json",
     orjson.dumps({"error": {"message": "bad field", "type": "ValidationError",
                             "param": ["body", 0], "code": 422}}),
     {"message": "bad field", "type": "invalid_request_error", "param": None, "code": None}),
    (400, "application/json",
     orjson.dumps({"error": {"message": "too long", "type": "invalid_request_error",
                             "param": "messages", "code": "context_length_exceeded"}}),
     {"message": "too long", "type": "invalid_request_error", "param": "messages",
      "code": "context_length_exceeded"}),
    (422, "application/json",
     orjson.dumps({"error": {"message": "The prompt is empty.",
                             "type": "BadRequestError", "param": "prompt", "code": 422}}),
     {"message": "The prompt is empty.", "type": "invalid_request_error",
      "param": "prompt", "code": None}),
    (409, "application/json", orjson.dumps({"detail": "Conflict"}),
     {"message": "Conflict", "type": "invalid_request_error", "param": None, "code": None}),
    (413, "text/html", b"<html><body>413 Request Entity Too Large</body></html>\n",
     {"message": "<html><body>413 Request Entity Too Large</body></html>",
      "type": "invalid_request_error", "param": None, "code": None}),
    (400, "text/plain", b"",
     {"message": "The inference node answered HTTP 400.", "type": "invalid_request_error",
      "param": None, "code": None}),
]


@asynccontextmanager
async def _scripted_node(status: int, content_type: str, body: bytes) -> AsyncIterator[str]:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with serve_app(app) as url:
        yield url


@pytest.mark.parametrize(("status", "content_type", "node_body", "expected"), NODE_ANSWERS)
async def test_a_nodes_4xx_keeps_its_status_message_and_param(
    redis_url: str, redis_client: aioredis.Redis, status: int, content_type: str,
    node_body: bytes, expected: dict[str, Any],
) -> None:
    async with _scripted_node(status, content_type, node_body) as url, \
            _gateway_before(url, redis_url) as gw:
        body = orjson.dumps({"model": POOL, "messages": MESSAGES, "max_tokens": 3})
        answered, answer, headers = await _post(gw, "/v1/chat/completions", body)
        assert answered == status
        assert orjson.loads(answer) == {"error": expected}
        assert headers["X-Request-Id"]


async def test_a_pool_without_tokenizer_is_warned_about_once_at_start(
    redis_url: str, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    def three_pools(data: dict[str, Any]) -> None:
        demo = data["pools"][0]
        data["pools"] += [{**demo, "name": "llama"},
                          {**demo, "name": "qwen", "tokenizer": str(BUNDLED_TOKENIZER)}]

    caplog.set_level(logging.WARNING, logger="kvgate.gateway")
    async with running_gateway(redis_url, adjust=three_pools) as gw:
        assert sorted(gw.gateway.pools) == ["demo", "llama", "qwen"]
        warned = [r for r in caplog.records if "tokenizer" in r.getMessage()]
    messages = [r.getMessage() for r in warned]
    assert len(messages) == 2 and {r.levelno for r in warned} == {logging.WARNING}, messages
    for name in ("demo", "llama"):
        assert sum(m.startswith(f"pool {name} ") for m in messages) == 1, messages
    assert not any(m.startswith("pool qwen ") for m in messages)
    for message in messages:
        assert "bundled Qwen2 tokenizer" in message and "tokenizer.json" in message
