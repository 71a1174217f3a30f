"""The Python SDK at the edges of HTTP, over real loopback servers (aiohttp, or a bare socket
server where aiohttp cannot play the part): the timeout each attempt declares, a certificate
that fails verification, proxies that cannot be reached or refuse the tunnel, a connection
closed without a reply and replies that break HTTP, redirects,
streams that are no event stream or end before `data: [DONE]`, and what a 429's headers say
when its body says nothing, or something else.

Sync clients run in a worker thread while the servers keep serving in the test's event loop.
Backoff sleeps are injected and only recorded: nothing waits for a hint.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

import kvgate_client
from kvgate_client import (
    READ_TIMEOUT_HEADER,
    REQUEST_TIMEOUT_HEADER,
    APIConnectionError,
    APIStatusError,
    AsyncKvgateClient,
    AsyncRetryTransport,
    IncompleteStreamError,
    InvalidResponseError,
    KvgateClient,
    RateLimitError,
    RetryPolicy,
    RetryTransport,
)
from kvgate_client.client import DEFAULT_LIMITS, NOT_A_STREAM_PREFIX
from kvgate_client.proxies import async_transport
from tests.gateway_harness import serve_app
from tests.test_client_openai import Sleeps
from tests.test_security import make_tls_dir

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def chunk(content: str) -> bytes:
    return (b'data: {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, '
            b'"delta": {"content": "' + content.encode() + b'"}}]}\n\n')


def chat_app(handler: Callable[[web.Request], Any]) -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


# --- every attempt declares the client's timeout ---------------------------------------------


def declared(request: httpx.Request) -> tuple[str | None, str | None]:
    """What an attempt declared: the client's read timeout, and the queue's own wait."""
    return request.headers.get(READ_TIMEOUT_HEADER), request.headers.get(REQUEST_TIMEOUT_HEADER)


def test_every_attempt_declares_the_read_timeout() -> None:
    seen: list[tuple[str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(declared(request))
        if len(seen) < 3:
            return httpx.Response(429, headers={"retry-after-ms": "1"}, json={"error": {}})
        return httpx.Response(200, json={"choices": []})

    sleeps = Sleeps()
    transport = RetryTransport(httpx.MockTransport(handler), sleep=sleeps.sleep)
    with KvgateClient("http://gw/v1", "k", retry_transport=transport,
                      timeout=httpx.Timeout(7.5, connect=1.0)) as client:
        client.chat("m", MESSAGES)
    # The raw wait, as the OpenAI SDKs declare theirs: the gateway takes its margin off it,
    # and for a whole answer the time its generation may take.
    assert seen == [("7.500", None)] * 3
    seen.clear()
    with KvgateClient("http://gw/v1", "k", retry_transport=RetryTransport(
            httpx.MockTransport(handler), sleep=sleeps.sleep)) as client:
        client.chat("m", MESSAGES)
    assert seen == [("600.000", None)] * 3  # the default timeouts


@pytest.mark.parametrize(("timeout", "expected"), [
    (1.005, "1.005"), (2.01, "2.010"), (0.1, "0.100"), (2.675, "2.675"), (59.999, "59.999")])
def test_a_decimal_read_timeout_is_declared_to_its_last_millisecond(
        timeout: float, expected: str) -> None:
    """1.005 * 1000 is 1004.9999999999999 in binary: a bare floor would declare 1.004, a
    millisecond less than the client waits (and than the Go SDK declares for 1005 ms)."""
    seen: list[tuple[str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(declared(request))
        return httpx.Response(200, json={"choices": []})

    with KvgateClient("http://gw/v1", "k", timeout=timeout,
                      retry_transport=RetryTransport(httpx.MockTransport(handler))) as client:
        client.chat("m", MESSAGES)
    assert seen == [(expected, None)]


async def test_no_read_timeout_declares_nothing_and_a_callers_value_is_kept() -> None:
    seen: list[tuple[str | None, str | None]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(declared(request))
        return httpx.Response(200, json={"choices": []})

    transport = AsyncRetryTransport(httpx.MockTransport(handler))
    async with AsyncKvgateClient("http://gw/v1", "k", retry_transport=transport,
                                 timeout=httpx.Timeout(None)) as aclient:
        await aclient.chat("m", MESSAGES)
    async with AsyncKvgateClient("http://gw/v1", "k", retry_transport=transport,
                                 headers={"X-Stainless-Read-Timeout": "12"}) as aclient:
        await aclient.chat("m", MESSAGES)
    # The queue's own wait, set by the caller, is sent as it is, next to the client's wait.
    async with AsyncKvgateClient("http://gw/v1", "k", retry_transport=transport,
                                 headers={"X-Request-Timeout": "12"}) as aclient:
        await aclient.chat("m", MESSAGES)
    assert seen == [(None, None), ("12", None), ("600.000", "12")]


async def test_the_drop_in_sends_the_openai_sdks_own_read_timeout() -> None:
    seen: list[tuple[str | None, str | None]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(declared(request))
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hello"}}]})

    client = kvgate_client.async_openai(
        base_url="http://gw/v1", api_key="k", timeout=7.5,
        retry_transport=AsyncRetryTransport(httpx.MockTransport(handler)))
    async with client:
        await client.chat.completions.create(model="m", messages=MESSAGES)
    assert seen == [("7.5", None)]  # the SDK's header, unchanged: one declaration, not two


# --- failures that repeat on every attempt are not retried -----------------------------------


@asynccontextmanager
async def tls_server(where: Path) -> AsyncIterator[str]:
    """A TLS server on loopback whose certificate no system store trusts."""
    tls = make_tls_dir(where)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls / "server.crt", tls / "server.key")

    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    runner = web.AppRunner(chat_app(handle), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    try:
        yield f"https://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_a_certificate_that_fails_verification_is_not_retried(tmp_path: Path) -> None:
    sleeps = Sleeps()
    async with tls_server(tmp_path) as url:
        atransport = AsyncRetryTransport(sleep=sleeps.asleep)
        async with AsyncKvgateClient(url + "/v1", "k", retry_transport=atransport) as aclient:
            with pytest.raises(APIConnectionError) as info:
                await aclient.chat("m", MESSAGES)
        assert isinstance(info.value.__cause__, httpx.ConnectError)

        def run() -> RetryTransport:
            transport = RetryTransport(sleep=sleeps.sleep)
            with KvgateClient(url + "/v1", "k", retry_transport=transport) as client, \
                    pytest.raises(APIConnectionError):
                client.chat("m", MESSAGES)
            return transport

        transport = await asyncio.to_thread(run)
    for stats in (atransport.stats(), transport.stats()):
        assert (stats.attempts, dict(stats.outcomes)) == (1, {"error": 1})
    assert sleeps.slept == []


@asynccontextmanager
async def _listening(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                      Awaitable[None]]) -> AsyncIterator[str]:
    """A raw server on loopback running `handle` per connection; yields its base URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def refusing_proxy() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A forward proxy that answers every CONNECT with 407; yields its URL and the request
    lines it received."""
    lines: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines.append(head.split(b"\r\n", 1)[0])
        writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async with _listening(handle) as url:
        yield url, lines


async def test_a_proxy_that_refuses_the_tunnel_is_not_retried(
        no_proxy_environment: pytest.MonkeyPatch) -> None:
    """A CONNECT answered 407 (or 403, 502) comes back the same on every attempt."""
    sleeps = Sleeps()
    async with refusing_proxy() as (url, lines):
        no_proxy_environment.setenv("HTTPS_PROXY", url)
        atransport = AsyncRetryTransport(async_transport(DEFAULT_LIMITS), sleep=sleeps.asleep)
        async with AsyncKvgateClient("https://gateway.invalid/v1", "k",
                                     retry_transport=atransport) as aclient:
            with pytest.raises(APIConnectionError) as info:
                await aclient.chat("m", MESSAGES)
    assert isinstance(info.value.__cause__, httpx.ProxyError)
    assert lines == [b"CONNECT gateway.invalid:443 HTTP/1.1"]
    assert atransport.stats().attempts == 1 and sleeps.slept == []


async def test_a_proxy_that_cannot_be_reached_is_retried(
        no_proxy_environment: pytest.MonkeyPatch) -> None:
    """The request reached no one: a connection error like any other."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens there any more: every dial is refused
    no_proxy_environment.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    sleeps = Sleeps()
    atransport = AsyncRetryTransport(async_transport(DEFAULT_LIMITS), sleep=sleeps.asleep)
    async with AsyncKvgateClient("https://gateway.invalid/v1", "k",
                                 retry_transport=atransport) as aclient:
        with pytest.raises(APIConnectionError) as info:
            await aclient.chat("m", MESSAGES)
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    stats = atransport.stats()
    assert (stats.attempts, dict(stats.outcomes)) == (3, {"max_attempts": 1})
    assert len(sleeps.slept) == 2


# --- only a connection closed without a reply is retried --------------------------------------


OK_REPLY = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n"
            b"Connection: close\r\n\r\n{\"choices\": []}")


@asynccontextmanager
async def raw_server(replies: list[bytes]) -> AsyncIterator[tuple[str, list[bytes]]]:
    """Answers the n-th connection with replies[n] (the last one after them) once it has read
    the request, then closes it; yields its URL and the replies sent."""
    sent: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = replies[min(len(sent), len(replies) - 1)]
        sent.append(reply)
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                await reader.readexactly(int(value))
        writer.write(reply)
        await writer.drain()
        writer.close()

    async with _listening(handle) as url:
        yield url + "/v1", sent


async def test_a_connection_closed_without_a_reply_is_retried() -> None:
    """The server read the request and closed before any status line (httpx's "Server
    disconnected without sending a response"): as a kept-alive connection closed under it."""
    sleeps = Sleeps()
    async with raw_server([b"", b"", OK_REPLY]) as (url, sent):
        transport = AsyncRetryTransport(sleep=sleeps.asleep)
        async with AsyncKvgateClient(url, "k", retry_transport=transport) as aclient:
            assert await aclient.chat("m", MESSAGES) == {"choices": []}
    assert len(sent) == 3 and len(sleeps.slept) == 2


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 abc Weird\r\nfoo\r\n\r\n",  # a status code that is no number
    b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
])
async def test_a_reply_that_breaks_http_is_not_retried(reply: bytes) -> None:
    """A reply came, so the request may have run: sending it again could run it twice. The Go
    SDK does not retry these either."""
    sleeps = Sleeps()
    async with raw_server([reply, OK_REPLY]) as (url, sent):
        transport = AsyncRetryTransport(sleep=sleeps.asleep)
        async with AsyncKvgateClient(url, "k", retry_transport=transport) as aclient:
            with pytest.raises(APIConnectionError) as info:
                await aclient.chat("m", MESSAGES)
    assert isinstance(info.value.__cause__, httpx.RemoteProtocolError)
    assert sent == [reply]
    async with raw_server([reply, OK_REPLY]) as (url, sent):

        def run() -> RetryTransport:
            sync_transport = RetryTransport(sleep=sleeps.sleep)
            with KvgateClient(url, "k", retry_transport=sync_transport) as client, \
                    pytest.raises(APIConnectionError):
                client.chat("m", MESSAGES)
            return sync_transport

        sync_transport = await asyncio.to_thread(run)
    assert sent == [reply]
    for stats in (transport.stats(), sync_transport.stats()):
        assert (stats.attempts, dict(stats.outcomes)) == (1, {"error": 1})
    assert sleeps.slept == []


# --- redirects are not followed --------------------------------------------------------------


class Moved:
    """POSTs to /v1/... are answered 301 to /v2/...; every request is recorded."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(f"{request.method} {request.path}")
        if request.path.startswith("/v1/"):
            raise web.HTTPMovedPermanently(self.url + "/v2/" + request.path[len("/v1/"):])
        if request.method != "POST":
            return web.json_response({"error": {"message": "Method not allowed"}}, status=405)
        return web.json_response({"choices": []})


async def test_the_drop_in_does_not_turn_a_redirected_post_into_a_get() -> None:
    moved = Moved()
    async with serve_app(chat_app(moved.handle)) as url:
        moved.url = url
        client = kvgate_client.async_openai(base_url=url + "/v1", api_key="k")
        async with client:
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 301
    assert info.value.response.headers["location"] == url + "/v2/chat/completions"
    assert moved.seen == ["POST /v1/chat/completions"]


async def test_the_standalone_clients_redirect_error_names_the_location() -> None:
    moved = Moved()
    async with serve_app(chat_app(moved.handle)) as url:
        moved.url = url
        async with AsyncKvgateClient(url + "/v1", "k") as aclient:
            with pytest.raises(APIStatusError) as info:
                await aclient.chat("m", MESSAGES)
    assert info.value.status_code == 301
    assert f"redirected to {url}/v2/chat/completions" in str(info.value)
    assert info.value.message.startswith(f"redirected to {url}/v2/chat/completions")
    assert moved.seen == ["POST /v1/chat/completions"]


# --- a stream is an event stream that ends with [DONE] ----------------------------------------


async def test_a_success_that_is_no_event_stream_is_an_invalid_response() -> None:
    """A proxy's page, or a server that ignored `stream` (a whole answer, bigger than the part
    read), behind a 200: not a stream of no events."""
    page = "<html>Please sign in to the network</html>"
    whole = b'{"choices": [{"message": {"content": "' + b"x" * (NOT_A_STREAM_PREFIX * 4) + b'"}}]}'

    async def handle(request: web.Request) -> web.Response:
        if request.path.endswith("/completions") and "chat" not in request.path:
            return web.Response(body=whole, content_type="application/json")
        return web.Response(text=page, content_type="text/html", headers={"X-Request-Id": "t-1"})

    async with serve_app(chat_app(handle)) as url:
        async with AsyncKvgateClient(url + "/v1", "k") as aclient:
            with pytest.raises(InvalidResponseError) as info:
                await aclient.stream_chat("m", MESSAGES)
            assert (info.value.status_code, info.value.body, info.value.request_id) == (
                200, page, "t-1")
            assert "not an event stream (Content-Type 'text/html; charset=utf-8')" in str(
                info.value)
            with pytest.raises(InvalidResponseError) as whole_info:
                await aclient.stream_completions("m", "hi")
            assert whole_info.value.body.encode() == whole[:NOT_A_STREAM_PREFIX]

        def run() -> InvalidResponseError:
            with KvgateClient(url + "/v1", "k") as client, \
                    pytest.raises(InvalidResponseError) as raised:
                client.stream_chat("m", MESSAGES)
            return raised.value

        assert (await asyncio.to_thread(run)).body == page


async def test_a_stream_that_ends_before_done_is_an_incomplete_stream() -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Request-Id": "t-2"})
        await response.prepare(request)
        await response.write(chunk("a") + chunk("b"))
        await response.write_eof()  # cleanly, and without data: [DONE]
        return response

    def text(chunks: list[dict[str, Any]]) -> str:
        return "".join(c["choices"][0]["delta"]["content"] for c in chunks)

    async with serve_app(chat_app(handle)) as url:
        got: list[dict[str, Any]] = []
        async with AsyncKvgateClient(url + "/v1", "k") as aclient:
            stream = await aclient.stream_chat("m", MESSAGES)
            with pytest.raises(IncompleteStreamError) as info:
                async for c in stream:
                    got.append(c)
        assert text(got) == "ab"
        assert isinstance(info.value, APIConnectionError)  # as a connection that broke
        assert info.value.request_id == "t-2" and "without [DONE]" in str(info.value)
        assert aclient.stats().attempts == 1  # delivered chunks: never retried

        def run() -> list[dict[str, Any]]:
            read: list[dict[str, Any]] = []
            with KvgateClient(url + "/v1", "k") as client, \
                    client.stream_chat("m", MESSAGES) as sync_stream, \
                    pytest.raises(IncompleteStreamError):
                read.extend(sync_stream)
            return read

        assert text(await asyncio.to_thread(run)) == "ab"


# --- what a 429's headers say ------------------------------------------------------------------


def answering(response: httpx.Response) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: response)


def test_a_429s_headers_fill_what_its_body_leaves_out() -> None:
    answers = [
        httpx.Response(429, headers={"retry-after-ms": "1500", "X-RateLimit-Scope": "team-a",
                                     "X-RateLimit-Backpressure-Level": "UNKNOWN",
                                     "X-Queue-Depth": "7"},
                       json={"error": {"code": "rate_limit_exceeded"}}),
        httpx.Response(429, headers={"Retry-After": "2"}, text="busy"),
        httpx.Response(429, headers={"retry-after-ms": "1500"},
                       json={"error": {"code": "capacity_exceeded", "retry_after_ms": 900}}),
        httpx.Response(503, headers={"Retry-After": "3"}, json={"error": {}}),
    ]
    errors: list[APIStatusError] = []
    for answer in answers:
        transport = RetryTransport(answering(answer), policy=RetryPolicy(max_attempts=1))
        with KvgateClient("http://gw/v1", "k", retry_transport=transport) as client, \
                pytest.raises(APIStatusError) as info:
            client.chat("m", MESSAGES)
        errors.append(info.value)
    scoped, bare, both, unavailable = errors
    assert isinstance(scoped, RateLimitError)
    assert (scoped.retry_after_ms, scoped.scope, scoped.backpressure_level, scoped.queue_depth) == (
        1500.0, "team-a", "UNKNOWN", 7)
    assert isinstance(bare, RateLimitError)
    assert (bare.retry_after_ms, bare.scope, bare.backpressure_level, bare.queue_depth) == (
        2000.0, None, None, None)
    assert both.retry_after_ms == 1500.0  # the headers first, as the retry policy reads them
    assert not isinstance(unavailable, RateLimitError) and unavailable.retry_after_ms == 3000.0


@pytest.mark.parametrize(("headers", "expected"), [
    ({"retry-after-ms": "1200"}, 1200.0),
    ({"Retry-After": "2"}, 2000.0),
    ({"retry-after-ms": "soon"}, 3000.0),  # no hint in the headers: the body's
    ({}, 3000.0),
])
def test_the_reported_wait_reads_the_headers_first(
        headers: dict[str, str], expected: float) -> None:
    """The wait the error reports is the one the retry policy read; the Go SDK's RetryAfter
    takes the same order."""
    answer = httpx.Response(429, headers=headers, json={
        "error": {"code": "capacity_exceeded", "retry_after_ms": 3000}})
    transport = RetryTransport(answering(answer), policy=RetryPolicy(max_attempts=1))
    with KvgateClient("http://gw/v1", "k", retry_transport=transport) as client, \
            pytest.raises(RateLimitError) as info:
        client.chat("m", MESSAGES)
    assert info.value.retry_after_ms == expected


@pytest.mark.parametrize("retry_after_ms", [-5, True, "3000", None])
def test_a_body_wait_that_is_no_wait_is_none(retry_after_ms: Any) -> None:
    """As the Go SDK, which reads only a number, and a negative one as none."""
    answer = httpx.Response(429, json={"error": {"retry_after_ms": retry_after_ms}})
    transport = RetryTransport(answering(answer), policy=RetryPolicy(max_attempts=1))
    with KvgateClient("http://gw/v1", "k", retry_transport=transport) as client, \
            pytest.raises(RateLimitError) as info:
        client.chat("m", MESSAGES)
    assert info.value.retry_after_ms is None
