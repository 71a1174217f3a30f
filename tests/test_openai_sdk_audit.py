"""The gateway as the official OpenAI SDK sees it, where it once answered wrongly: a node's error
event mid-stream, a client that leaves before a whole answer has begun, the field named by an
`exceeds_burst` refusal, and an empty `tools` list. A real gateway, the session's redis-server
and vLLM-speaking nodes, all on loopback sockets; budgets are checked in Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from admission.tiers import Zone
from tests.gateway_harness import BIG, Harness, eventually, running_gateway, serve_app

MESSAGES: list[Any] = [{"role": "user", "content": "Write a haiku about the sea."}]
TOKENS = [" a", " b"]

# vLLM >= 0.10 nests its error; earlier versions put the same fields at the top of the event,
# where the SDKs do not look for one.
NESTED = {"error": {"message": "Guided decoding failed.", "type": "BadRequestError",
                    "param": "response_format", "code": 400}}
FLAT = {"object": "error", "message": "Engine loop has died.", "type": "InternalServerError",
        "param": None, "code": 500}


def _chunk_event(model: str, delta: dict[str, Any]) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
             "model": model, "choices": [
                 {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class StreamingNode:
    """A vLLM-speaking node whose streams carry a role chunk and `TOKENS`, then end as `end`
    says."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delta in [{"role": "assistant", "content": ""}, *({"content": t} for t in TOKENS)]:
            await response.write(_chunk_event(body["model"], delta))
        await self.end(request, response)
        return response

    async def end(self, request: web.Request, response: web.StreamResponse) -> None:
        raise NotImplementedError


class ErrorStreamNode(StreamingNode):
    """Ends with the error event `error` and `[DONE]`, as vLLM ends a generation that fails
    mid-stream."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error

    async def end(self, request: web.Request, response: web.StreamResponse) -> None:
        await response.write(b"data: " + orjson.dumps(self.error) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


class DiesInsideAnEventNode(StreamingNode):
    """Begins one more event (`tail`, which no blank line ends) and dies: the engine killed,
    or the network cut, in the middle of a write."""

    def __init__(self, tail: bytes) -> None:
        self.tail = tail

    async def end(self, request: web.Request, response: web.StreamResponse) -> None:
        await response.write(self.tail)
        assert request.transport is not None
        request.transport.abort()


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url) as harness:
        await harness.freeze_clock()
        await harness.publish(Zone.GREEN, BIG)
        yield harness


async def _released_no_more(gw: Harness, task_id: str) -> bool:
    record = await gw.store.task(task_id)
    return record is not None and record["state"] != "released"


@pytest.mark.parametrize(("event", "message", "error_type"), [
    (NESTED, "Guided decoding failed.", "invalid_request_error"),
    (FLAT, "Engine loop has died.", "server_error"),
], ids=["vllm-nested", "vllm-flat"])
async def test_a_nodes_error_event_mid_stream_is_raised_by_the_sdk_in_openai_shape(
    redis_url: str, redis_client: aioredis.Redis, event: dict[str, Any], message: str,
    error_type: str,
) -> None:
    async with serve_app(ErrorStreamNode(event).app()) as node_url:
        def adjust(data: dict[str, Any]) -> None:
            data["pools"][0]["backends"] = [{"name": "node-0", "url": node_url}]

        async with running_gateway(redis_url, adjust=adjust) as gw:
            await gw.freeze_clock()
            await gw.publish(Zone.GREEN, BIG)
            raw = await gw.openai("vip").chat.completions.with_raw_response.create(
                model="demo", messages=MESSAGES, max_tokens=50, stream=True)
            text: list[str] = []
            with pytest.raises(openai.APIError) as info:
                async for chunk in raw.parse():
                    text.extend(c.delta.content or "" for c in chunk.choices)
            assert "".join(text) == "".join(TOKENS)  # what came before the error reached it
            assert (info.value.message, info.value.type) == (message, error_type)
            assert info.value.code is None  # vLLM's integer status is no OpenAI code
            await gw.settled()
            # A generation that ended on an error is cancelled, charged what it produced.
            record = await gw.task(raw.headers["x-request-id"])
            prompt = gw.gateway.pools["demo"].counter.count_chat(MESSAGES)
            assert record["state"] == "cancelled"
            assert int(record["usage"]) == prompt + len(TOKENS)
            assert await gw.bucket("vip") == 1_000_000 - (prompt + len(TOKENS))
            assert await gw.redis.hget(gw.store.keys.node_reserved, "node-0") is None


@pytest.mark.parametrize("tail", [
    b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choi',
    _chunk_event("demo", {"content": " c"}).removesuffix(b"\n"),
], ids=["inside-the-json", "before-the-blank-line"])
async def test_a_node_that_dies_inside_an_event_ends_the_stream_with_an_error_the_sdk_raises(
    redis_url: str, redis_client: aioredis.Redis, tail: bytes,
) -> None:
    """The event the node had begun was sent on ahead of the gateway's error event and ran
    into it: one event whose data was not JSON (`{"id": ... "choidata: {"error": ...}`, or a
    chunk and the error on two data lines), and the SDK raised json.JSONDecodeError, no
    openai.APIError. The unfinished event is dropped now: the tokens before it, then the
    error the SDK raises."""
    async with serve_app(DiesInsideAnEventNode(tail).app()) as node_url:
        def adjust(data: dict[str, Any]) -> None:
            data["pools"][0]["backends"] = [{"name": "node-0", "url": node_url}]

        async with running_gateway(redis_url, adjust=adjust) as gw:
            await gw.publish(Zone.GREEN, BIG)
            stream = await gw.openai("vip").chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=50, stream=True)
            text: list[str] = []
            with pytest.raises(openai.APIError) as info:
                async for chunk in stream:
                    text.extend(c.delta.content or "" for c in chunk.choices)
            assert "".join(text) == "".join(TOKENS)
            assert info.value.message == "The inference node broke off the stream."
            assert (info.value.code, info.value.type) == ("upstream_broken_stream",
                                                          "server_error")


async def test_a_client_that_leaves_before_a_whole_answer_began_is_charged_its_prompt(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    # The node answers a whole body only at its end (as vLLM does): until then the gateway has
    # no response headers, yet the node is working on the request.
    async with running_gateway(redis_url,
                               backend_options={"whole_answer_delay_ms": 600_000}) as gw:
        await gw.freeze_clock()
        await gw.publish(Zone.GREEN, BIG)
        node = gw.backends[0]
        call = asyncio.create_task(gw.openai("normal").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=200))

        async def reached_the_node() -> bool:
            return len(node.received) == 1

        await eventually(reached_the_node)
        task_id = node.received[0].headers["X-Request-ID"]
        call.cancel()  # the SDK's caller gives up (a timeout, a cancelled job)
        with pytest.raises(asyncio.CancelledError):
            await call
        await eventually(lambda: _released_no_more(gw, task_id))
        await gw.settled()
        record = await gw.task(task_id)
        prompt = gw.gateway.pools["demo"].counter.count_chat(MESSAGES)
        assert record["state"] == "cancelled"
        assert int(record["usage"]) == prompt < int(record["cost"]) == prompt + 200
        assert await gw.bucket("normal") == 1_000_000 - prompt
        assert await gw.redis.hget(gw.store.keys.node_reserved, "node-0") is None
        assert await gw.redis.scard(gw.store.keys.gateway_tasks_key("gw-test")) == 0


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
async def test_exceeds_burst_names_the_field_the_client_sent(gw: Harness, field: str) -> None:
    # The "small" key's burst is 1,000 tokens: no request of 1,000 output tokens fits it.
    with pytest.raises(openai.BadRequestError) as info:
        await gw.openai("small").chat.completions.create(
            model="demo", messages=MESSAGES, extra_body={field: 1000})
    assert info.value.code == "exceeds_burst"
    assert info.value.param == field
    assert f"Lower {field} " in info.value.message
    assert info.value.response.headers["x-should-retry"] == "false"
    assert gw.backends[0].received == []


async def test_an_empty_tools_list_adds_no_tokens(gw: Harness) -> None:
    counter = gw.gateway.pools["demo"].counter
    limit, max_tokens = gw.config.pools["demo"].context_length, 50
    # A prompt that fits with its max_tokens, but not with the tools template's allowance too.
    words = limit - max_tokens
    while counter.count_chat([{"role": "user", "content": "word " * words}]) + max_tokens > limit:
        words -= 1
    messages: list[Any] = [{"role": "user", "content": "word " * words}]
    prompt = counter.count_chat(messages)
    assert prompt + max_tokens + counter.chat_format.tools_overhead_tokens > limit
    raw = await gw.openai("vip").chat.completions.with_raw_response.create(
        model="demo", messages=messages, max_tokens=max_tokens, tools=[])
    assert raw.parse().choices
    assert gw.backends[0].received[-1].body["tools"] == []
    record = await gw.task(raw.headers["x-request-id"])
    assert int(record["cost"]) == prompt + max_tokens
    # A list that does hold tools still pays the allowance; one of the wrong type is refused.
    assert counter.count_chat(messages, [{"type": "function", "function": {"name": "f"}}]) > (
        prompt + counter.chat_format.tools_overhead_tokens)
    with pytest.raises(openai.BadRequestError) as info:
        await gw.openai("vip").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=1, extra_body={"tools": "none"})
    assert info.value.param == "tools"
