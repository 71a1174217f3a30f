"""The openai drop-in and the standalone client over real loopback HTTP.

An aiohttp server (in its own thread, so the sync SDK can block on it) speaks the gateway's 429
protocol N times, then answers like vLLM: JSON, or SSE chunks ending with `data: [DONE]`.
Sleeps are injected, so the test never waits for the hints it receives.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from aiohttp import web

import kvgate_client
from kvgate_client import (
    RETRY_COUNT_HEADER,
    AsyncKvgateClient,
    AsyncRetryTransport,
    KvgateClient,
    RateLimitError,
    RetryBudget,
    RetryPolicy,
    RetryTransport,
)

HINT_MS = 1500


@dataclass
class Script:
    rejects: int = 0  # answer this many requests with 429 before serving
    should_retry: str | None = None  # x-should-retry on the 429s
    hint_ms: int = HINT_MS
    attempts: list[str | None] = field(default_factory=list)  # retry-count header per attempt
    sdk_retry_counts: list[str | None] = field(default_factory=list)


def reject(script: Script) -> web.Response:
    headers = {
        "Retry-After": str(-(-script.hint_ms // 1000)),
        "retry-after-ms": str(script.hint_ms),
        "X-RateLimit-Backpressure-Level": "RED",
        "X-Queue-Depth": "142",
    }
    if script.should_retry is not None:
        headers["x-should-retry"] = script.should_retry
    body = {
        "error": {
            "code": "capacity_exceeded",
            "message": "Cluster KV-Cache is currently saturated. Please backoff.",
            "type": "capacity_error",
            "retry_after_ms": script.hint_ms,
        }
    }
    return web.json_response(body, status=429, headers=headers)


WORDS = ["Hello", ",", " world", "!"]


async def serve(request: web.Request, script: Script, chat: bool) -> web.StreamResponse:
    script.attempts.append(request.headers.get(RETRY_COUNT_HEADER))
    script.sdk_retry_counts.append(request.headers.get("x-stainless-retry-count"))
    body = await request.json()
    if script.rejects > 0:
        script.rejects -= 1
        return reject(script)
    obj = "chat.completion" if chat else "text_completion"
    if not body.get("stream"):
        choice: dict[str, object] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(WORDS)}
        else:
            choice["text"] = "".join(WORDS)
        return web.json_response(
            {
                "id": "x1",
                "object": obj,
                "created": 1,
                "model": body["model"],
                "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            }
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i, word in enumerate(WORDS):
        delta: dict[str, object] = {"index": 0, "finish_reason": None, "logprobs": None}
        if chat:
            delta["delta"] = {"role": "assistant", "content": word} if i == 0 else {"content": word}
        else:
            delta["text"] = word
        chunk = {
            "id": "x1",
            "object": f"{obj}.chunk",
            "created": 1,
            "model": body["model"],
            "choices": [delta],
        }
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@dataclass
class Server:
    base_url: str
    script: Script


@pytest.fixture
def server() -> Iterator[Server]:
    script = Script()
    app = web.Application()

    async def chat(request: web.Request) -> web.StreamResponse:
        return await serve(request, script, chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, script, chat=False)

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{port}/v1", script)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


class Sleeps:
    def __init__(self) -> None:
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    async def asleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def sync_client(server: Server, sleeps: Sleeps) -> openai.OpenAI:
    transport = RetryTransport(httpx.HTTPTransport(), sleep=sleeps.sleep)
    return kvgate_client.openai(base_url=server.base_url, api_key="k", retry_transport=transport)


MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_openai_succeeds_after_429s(server: Server) -> None:
    server.script.rejects = 2
    sleeps = Sleeps()
    client = sync_client(server, sleeps)
    assert client.max_retries == 0
    result = client.chat.completions.create(model="m", messages=MESSAGES)
    assert result.choices[0].message.content == "Hello, world!"
    # 3 attempts = MAX_ATTEMPTS: the first and two retries, each after at least the hint.
    assert server.script.attempts == [None, "1", "2"]
    assert server.script.sdk_retry_counts == ["0", "0", "0"]  # the SDK itself never retried
    assert len(sleeps.slept) == 2 and min(sleeps.slept) >= HINT_MS / 1000


def test_openai_gives_up_with_rate_limit_error(server: Server) -> None:
    server.script.rejects = 10
    sleeps = Sleeps()
    client = sync_client(server, sleeps)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="m", prompt="hi")
    assert info.value.code == "capacity_exceeded"
    assert info.value.response.headers["x-ratelimit-backpressure-level"] == "RED"
    assert len(server.script.attempts) == kvgate_client.MAX_ATTEMPTS


def test_openai_obeys_x_should_retry_false(server: Server) -> None:
    server.script.rejects = 1
    server.script.should_retry = "false"
    sleeps = Sleeps()
    with pytest.raises(openai.RateLimitError):
        sync_client(server, sleeps).chat.completions.create(model="m", messages=MESSAGES)
    assert len(server.script.attempts) == 1 and sleeps.slept == []


def test_openai_streaming_after_a_429(server: Server) -> None:
    server.script.rejects = 1
    sleeps = Sleeps()
    client = sync_client(server, sleeps)
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "Hello, world!"
    assert len(server.script.attempts) == 2


async def test_async_openai_streaming_after_429s(server: Server) -> None:
    server.script.rejects = 2
    sleeps = Sleeps()
    budget = RetryBudget()
    transport = AsyncRetryTransport(httpx.AsyncHTTPTransport(), budget=budget, sleep=sleeps.asleep)
    client = kvgate_client.async_openai(
        base_url=server.base_url, api_key="k", retry_transport=transport
    )
    stream = await client.completions.create(model="m", prompt="hi", stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream])
    await client.close()
    assert text == "Hello, world!"
    assert len(server.script.attempts) == 3
    assert (budget.first_attempts, budget.retries) == (1, 2)


def test_default_factory_with_real_sleeps(server: Server) -> None:
    # No injected transport: the factory builds its own and really sleeps, so the server's
    # hint and the policy's windows are shrunk to milliseconds.
    server.script.rejects = 2
    server.script.hint_ms = 2
    budget = RetryBudget()
    policy = RetryPolicy(base_delay_s=0.001, max_delay_s=0.004)
    client = kvgate_client.openai(
        base_url=server.base_url, api_key="k", budget=budget, policy=policy
    )
    result = client.completions.create(model="m", prompt="hi")
    assert result.choices[0].text == "Hello, world!"
    assert (budget.first_attempts, budget.retries) == (1, 2)
    assert server.script.attempts == [None, "1", "2"]


def test_wrap_refuses_sdk_retries_and_foreign_http_client() -> None:
    with pytest.raises(TypeError):
        kvgate_client.wrap(openai.OpenAI, api_key="k", max_retries=2)
    with pytest.raises(TypeError):
        kvgate_client.wrap(openai.OpenAI, api_key="k", http_client=httpx.Client())
    with pytest.raises(TypeError):
        kvgate_client.wrap(openai.AsyncOpenAI, api_key="k", retry_transport=RetryTransport())
    client = kvgate_client.wrap(openai.AsyncOpenAI, api_key="k")
    assert isinstance(client, openai.AsyncOpenAI) and client.max_retries == 0


def test_copies_refuse_sdk_retries_too(server: Server) -> None:
    """`with_options(max_retries=N)`, the SDK's way to retry a few calls harder, shares the
    transport: the SDK's retries would run on top of kvgate's. Refused like the factory's, on
    copies of copies too; other options still change."""
    server.script.rejects = 10
    client = sync_client(server, Sleeps())
    for make in (client.with_options, client.copy):
        with pytest.raises(TypeError, match="max_retries must stay 0"):
            make(max_retries=2)
    patient = client.with_options(timeout=5.0)
    assert patient.timeout == 5.0 and patient.max_retries == 0
    with pytest.raises(TypeError, match="max_retries must stay 0"):
        patient.with_options(max_retries=1)
    with pytest.raises(openai.RateLimitError):
        patient.with_options(max_retries=0).chat.completions.create(model="m", messages=MESSAGES)
    assert len(server.script.attempts) == kvgate_client.MAX_ATTEMPTS  # kvgate's alone


def test_standalone_client_chat_stream_and_errors(server: Server) -> None:
    sleeps = Sleeps()
    transport = RetryTransport(httpx.HTTPTransport(), sleep=sleeps.sleep)
    with KvgateClient(server.base_url, "k", retry_transport=transport) as client:
        server.script.rejects = 1
        reply = client.chat("m", [{"role": "user", "content": "hi"}], max_tokens=5)
        assert reply["choices"][0]["message"]["content"] == "Hello, world!"
        server.script.rejects = 2
        with client.stream_completions("m", "hi") as stream:
            assert "".join(c["choices"][0]["text"] for c in stream) == "Hello, world!"
        server.script.rejects = 10
        with pytest.raises(RateLimitError) as info:
            client.stream_chat("m", [{"role": "user", "content": "hi"}])
        assert info.value.code == "capacity_exceeded" and info.value.retry_after_ms == HINT_MS
        # Headers as the server spelled them, read in any case (as a response's are).
        headers = info.value.headers
        assert headers.get("Retry-After") == headers.get("retry-after") == str(
            -(-HINT_MS // 1000))
        assert headers["X-Queue-Depth"] == "142"
        assert client.stats().attempts == 2 + 3 + 3
    assert server.script.attempts.count(None) == 3  # three logical requests


async def test_async_standalone_client_stream(server: Server) -> None:
    sleeps = Sleeps()
    transport = AsyncRetryTransport(httpx.AsyncHTTPTransport(), sleep=sleeps.asleep)
    async with AsyncKvgateClient(server.base_url, "k", retry_transport=transport) as client:
        server.script.rejects = 1
        stream = await client.stream_chat("m", [{"role": "user", "content": "hi"}])
        parts = [c["choices"][0]["delta"].get("content", "") async for c in stream]
        assert "".join(parts) == "Hello, world!"
        reply = await client.completions("m", "hi")
        assert reply["choices"][0]["text"] == "Hello, world!"
    assert len(server.script.attempts) == 3 and len(sleeps.slept) == 1
