"""The Python SDK as an application developer meets it: against the real gateway (the session's
redis-server, the gateway and a node on loopback sockets), and against bare loopback servers
for the byte-level cases the gateway never produces on purpose.

Covered here: events whose text holds Unicode line separators (legal unescaped in JSON, and
neither vLLM's serializer nor the gateway's orjson escapes them), SSE framing by bare CR, the
fields that error types carry (param, request id, a stream's error event; an `"error": null`
that is none), cancelled requests in the counters (a retry cut short in its backoff sleep
neither counted nor charged), and the README's examples run as written.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

import kvgate_client
from admission.tiers import Zone
from kvgate_client import (
    APIStatusError,
    AsyncKvgateClient,
    AsyncRetryTransport,
    KvgateClient,
    KvgateError,
    RetryPolicy,
    RetryStats,
    RetryTransport,
    StreamError,
)
from kvgate_client._sse import LineSplitter
from kvgate_client.budget import MAX_TOKENS
from tests.gateway_harness import KEYS, POOL, Harness, running_gateway, serve_app

ROOT = Path(__file__).resolve().parent.parent
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
# Each is a line break to str.splitlines(), none is one to SSE (CR, LF and CRLF only).
TRICKY = ["a\u2028b", "c\u2029d", "e\x85f", "g\u2028"]


def chunk(content: str) -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": POOL,
             "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


Handler = Callable[[web.Request, web.StreamResponse], Awaitable[None]]


def node_app(body: Handler) -> web.Application:
    """A node (or, directly, a gateway) whose streamed answer `body` writes."""
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Request-Id": "req-direct"})
        await response.prepare(request)
        await body(request, response)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@asynccontextmanager
async def gateway_over(redis_url: str, body: Handler) -> AsyncIterator[Harness]:
    """The real gateway in GREEN, its one node answering with `body`."""
    async with serve_app(node_app(body)) as node_url:
        def adjust(data: dict[str, Any]) -> None:
            data["pools"][0]["backends"] = [{"name": "node-0", "url": node_url}]

        async with running_gateway(redis_url, adjust=adjust) as gw:
            await gw.publish(Zone.GREEN)
            yield gw


async def tricky_tokens(request: web.Request, response: web.StreamResponse) -> None:
    for text in TRICKY:
        await response.write(chunk(text))
    await response.write(b"data: [DONE]\n\n")


async def broken_stream(request: web.Request, response: web.StreamResponse) -> None:
    await response.write(chunk("t0"))
    assert request.transport is not None
    request.transport.abort()  # the node dies mid-answer


async def until_error(stream: AsyncIterable[dict[str, Any]]
                      ) -> tuple[list[dict[str, Any]], StreamError]:
    """The chunks a stream yields before it raises `StreamError`, and the error."""
    got: list[dict[str, Any]] = []
    with pytest.raises(StreamError) as info:
        async for c in stream:
            got.append(c)
    return got, info.value


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


# --- streams: the SSE grammar, not str.splitlines ---------------------------------------------


async def test_unicode_line_separators_inside_tokens_survive_the_stream(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with gateway_over(redis_url, tricky_tokens) as gw:
        async with AsyncKvgateClient(gw.url + "/v1", api_key=KEYS["vip"]) as aclient:
            stream = await aclient.stream_chat(POOL, MESSAGES, max_tokens=8)
            got = [c async for c in stream]
        assert text_of(got) == "".join(TRICKY)

        def sync_read() -> list[dict[str, Any]]:
            with KvgateClient(gw.url + "/v1", api_key=KEYS["vip"]) as client, \
                    client.stream_chat(POOL, MESSAGES, max_tokens=8) as stream:
                return list(stream)

        assert text_of(await asyncio.to_thread(sync_read)) == "".join(TRICKY)


async def test_bare_cr_framing_at_every_split_and_without_waiting_for_more_bytes() -> None:
    """SSE allows CR alone as a line end. An event whose blank line is a CR at the end of a
    write is complete: it must reach the caller before the server writes anything else."""
    multiline = b'data: {"id": "1",\rdata: "choices": [{"delta": {"content": "y"}}]}\r\r'
    wire = (b"\xef\xbb\xbf: keep-alive\r\r" + chunk("x").replace(b"\n\n", b"\r\n\r\n")
            + multiline)
    gate = asyncio.Event()

    async def pieces(request: web.Request, response: web.StreamResponse) -> None:
        for i in range(len(wire)):  # one byte per write: every split point
            await response.write(wire[i:i + 1])
        await gate.wait()  # nothing more until the client has the last event
        await response.write(b"data: [DONE]\r\r")

    async with serve_app(node_app(pieces)) as url, \
            AsyncKvgateClient(url + "/v1", api_key="k") as aclient:
        stream = await aclient.stream_chat(POOL, MESSAGES)
        events = aiter(stream)
        got = [await asyncio.wait_for(anext(events), 5) for _ in range(2)]
        gate.set()
        got += [c async for c in events]
    assert text_of(got) == "xy"


def test_an_empty_piece_between_a_cr_and_its_lf_is_no_line_end() -> None:
    """Transports may hand over an empty piece; between the CR and the LF of one CRLF it
    made the LF a second line end, a blank line that ended the event early."""
    splitter = LineSplitter()
    lines = [*splitter.feed(b"data: x\r"), *splitter.feed(b""), *splitter.feed(b"\ndata: y\n")]
    assert lines == ["data: x", "data: y"]


async def test_an_event_that_is_not_json_is_a_stream_error() -> None:
    async def garbage(request: web.Request, response: web.StreamResponse) -> None:
        await response.write(chunk("ok") + b"data: <html>proxy error</html>\n\n")

    async with serve_app(node_app(garbage)) as url, \
            AsyncKvgateClient(url + "/v1", api_key="k") as aclient:
        got, error = await until_error(await aclient.stream_chat(POOL, MESSAGES))
    assert text_of(got) == "ok"
    assert isinstance(error, KvgateError)
    assert error.payload == "<html>proxy error</html>"
    assert error.request_id == "req-direct"


async def test_an_error_member_that_is_null_is_no_error() -> None:
    """OpenAI-compatible servers may put `"error": null` in every normal chunk; only a value
    there ends the stream."""
    def with_null_error(content: str) -> bytes:
        return chunk(content).replace(b'{"id"', b'{"error":null,"id"', 1)

    async def nulls_then_error(request: web.Request, response: web.StreamResponse) -> None:
        await response.write(with_null_error("a") + with_null_error("b")
                             + b'data: {"error": {"message": "engine died", "code": "x"}}\n\n')

    def sync_read(url: str) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        with KvgateClient(url + "/v1", api_key="k") as client, \
                client.stream_chat(POOL, MESSAGES) as stream, pytest.raises(StreamError):
            got.extend(stream)
        return got

    async with serve_app(node_app(nulls_then_error)) as url, \
            AsyncKvgateClient(url + "/v1", api_key="k") as aclient:
        got, error = await until_error(await aclient.stream_chat(POOL, MESSAGES))
        assert text_of(got) == "ab"
        assert (error.code, error.message) == ("x", "engine died")
        assert text_of(await asyncio.to_thread(sync_read, url)) == "ab"


# --- what the errors carry ---------------------------------------------------------------------


async def test_errors_carry_param_and_request_id_from_the_gateway(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with gateway_over(redis_url, broken_stream) as gw:
        async with AsyncKvgateClient(gw.url + "/v1", api_key=KEYS["vip"]) as aclient:
            with pytest.raises(APIStatusError) as refused:
                await aclient.chat(POOL, MESSAGES, max_tokens=9000)
            assert (refused.value.status_code, refused.value.code, refused.value.param) == (
                400, "max_tokens_too_large", "max_tokens")
            assert refused.value.request_id is None  # refused before admission: no task

            stream = await aclient.stream_chat(POOL, MESSAGES, max_tokens=8)
            got, error = await until_error(stream)
        assert text_of(got) == "t0"
        assert error.code == "upstream_broken_stream"
        assert error.type == "server_error"
        assert error.message == "The inference node broke off the stream."
        assert error.param is None
        assert error.request_id == stream.response.headers["x-request-id"]
        assert error.request_id and error.request_id in str(error)


async def test_a_502_carries_the_request_id(redis_url: str, redis_client: aioredis.Redis) -> None:
    async with running_gateway(redis_url, backend_options={"fail_status": 500}) as gw:
        await gw.publish(Zone.GREEN)
        async with AsyncKvgateClient(gw.url + "/v1", api_key=KEYS["vip"]) as aclient:
            with pytest.raises(APIStatusError) as info:
                await aclient.chat(POOL, MESSAGES, max_tokens=8)
    error = info.value
    assert (error.status_code, error.code, error.param) == (502, "upstream_error", None)
    assert error.request_id is not None and error.request_id == error.headers["x-request-id"]


# --- hints a server may send -------------------------------------------------------------------


async def test_a_retry_after_date_beyond_year_9999_is_no_hint() -> None:
    """An HTTP date the platform's time functions cannot hold is no usable hint: the 429 is
    retried on the backoff alone (as the Go SDK does), not turned into an exception."""
    answers = iter([429])

    async def handle(request: web.Request) -> web.Response:
        if next(answers, 200) == 429:
            return web.json_response(
                {"error": {"code": "capacity_exceeded", "message": "full"}}, status=429,
                headers={"Retry-After": "Fri, 31 Dec 99999 23:59:59 GMT"})
        return web.json_response({"choices": [{"message": {"content": "hi"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    transport = AsyncRetryTransport(sleep=sleep)
    async with serve_app(app) as url, \
            AsyncKvgateClient(url + "/v1", api_key="k", retry_transport=transport) as aclient:
        reply = await aclient.chat(POOL, MESSAGES)
    assert reply["choices"][0]["message"]["content"] == "hi"
    assert len(slept) == 1 and 0 <= slept[0] < 1.0  # full jitter, the first window
    stats = transport.stats()
    assert (stats.attempts, dict(stats.outcomes)) == (2, {"ok": 1})


# --- cancelled requests are counted ----------------------------------------------------------


class Rejecting:
    """A loopback server answering 429 with a 30 s hint; `hold` makes it never answer."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.arrived = asyncio.Event()
        self.attempts = 0

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            self.attempts += 1
            self.arrived.set()
            if self.hold:
                await asyncio.Event().wait()
            return web.json_response({"error": {"code": "capacity_exceeded"}}, status=429,
                                     headers={"retry-after-ms": "30000"})

        app = web.Application()
        app.router.add_post("/", handle)
        return app


@pytest.mark.parametrize(("hold", "outcome"), [(False, "canceled"), (True, "error")],
                         ids=["during-backoff", "during-attempt"])
async def test_a_cancelled_async_request_is_counted(hold: bool, outcome: str) -> None:
    server = Rejecting(hold)
    sleeping = asyncio.Event()
    during_sleep: list[RetryStats] = []

    async def sleep(seconds: float) -> None:
        during_sleep.append(transport.stats())
        sleeping.set()
        await asyncio.Event().wait()

    transport = AsyncRetryTransport(sleep=sleep)
    async with serve_app(server.app()) as url, httpx.AsyncClient(transport=transport) as http:
        task = asyncio.create_task(http.post(url + "/", json={}))
        await (server.arrived if hold else sleeping).wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    stats = transport.stats()
    assert (stats.requests, dict(stats.outcomes)) == (1, {outcome: 1})
    assert server.attempts == 1
    assert_only_the_first_attempt_counted(stats, *during_sleep)


def assert_only_the_first_attempt_counted(final: RetryStats, *during_sleep: RetryStats) -> None:
    """A retry that was decided but never sent (its backoff sleep cut short) is neither an
    attempt nor a retry, during the sleep or after, and its token is back in the budget once
    the request has ended (it is held during the sleep)."""
    for stats in (final, *during_sleep):
        assert (stats.requests, stats.attempts, stats.retries) == (1, 1, 0)
    assert final.budget is not None
    assert (final.budget.retries, final.budget.tokens) == (0, MAX_TOKENS)


def test_an_interrupted_sync_backoff_is_counted() -> None:
    class Interrupt(BaseException):
        pass

    during_sleep: list[RetryStats] = []

    def sleep(seconds: float) -> None:
        during_sleep.append(transport.stats())
        raise Interrupt  # what KeyboardInterrupt or a thread's shutdown does mid-sleep

    server = Rejecting(hold=False)
    with ThreadServer(server.app()) as url:
        transport = RetryTransport(sleep=sleep)
        with httpx.Client(transport=transport) as http, pytest.raises(Interrupt):
            http.post(url + "/", json={})
    assert dict(transport.stats().outcomes) == {"canceled": 1}
    assert server.attempts == 1
    assert_only_the_first_attempt_counted(transport.stats(), *during_sleep)


async def test_a_request_cancelled_while_its_rejection_is_read_is_counted() -> None:
    """The 429 decided a retry (its token taken); the task is cancelled while the rejection's
    body is still arriving, before the backoff: the request ends canceled and the token is
    back, as when the cancel comes in the backoff."""
    responded = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=429, headers={
            "retry-after-ms": "30000", "content-type": "application/json",
            "content-length": "1000"})
        await response.prepare(request)
        await response.write(b'{"error": {"code": "capacity_exceeded"')
        await asyncio.Event().wait()  # the rest of the body never comes
        return response

    class Signalling(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await super().handle_async_request(request)
            responded.set()  # the retry transport decides and starts reading the body now
            return response

    app = web.Application()
    app.router.add_post("/", handle)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    transport = AsyncRetryTransport(Signalling(), sleep=sleep)
    async with serve_app(app) as url, httpx.AsyncClient(transport=transport) as http:
        task = asyncio.create_task(http.post(url + "/", json={}))
        await responded.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert slept == []  # cancelled in the body's read, not in the backoff
    assert dict(transport.stats().outcomes) == {"canceled": 1}
    assert_only_the_first_attempt_counted(transport.stats())


def test_a_sync_request_interrupted_while_its_rejection_is_read_is_counted() -> None:
    class Interrupt(BaseException):
        pass

    class CutBody(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b'{"error": '
            raise Interrupt  # what KeyboardInterrupt does in the middle of the read

    def reject(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={"retry-after-ms": "30000"}, stream=CutBody())

    transport = RetryTransport(httpx.MockTransport(reject), sleep=lambda s: None)
    with httpx.Client(transport=transport) as http, pytest.raises(Interrupt):
        http.post("http://gw/", json={})
    assert dict(transport.stats().outcomes) == {"canceled": 1}
    assert_only_the_first_attempt_counted(transport.stats())


class ThreadServer:
    """`app` on a loopback port, served by its own event loop in a thread (for sync clients);
    entering yields its base URL."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        async with serve_app(self._app) as url:
            self._url = url
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> str:
        self._thread.start()
        assert self._ready.wait(10)
        return self._url

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()


# --- the README's examples ---------------------------------------------------------------------

README = ROOT / "clients" / "python" / "README.md"


def readme_blocks() -> Iterator[str]:
    yield from re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_every_readme_example_compiles() -> None:
    for i, block in enumerate(readme_blocks()):
        compile(block, f"README.md, python block {i}", "exec")


async def test_readme_examples_run_against_the_gateway(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    """Every block in order, in one namespace, as a reader pastes them into one script; only
    the gateway's address, the model name and `KEY` are filled in. Blocks with placeholder
    arguments (`=...`, such as an Azure endpoint) are compiled above, not run."""
    runnable = [b for b in readme_blocks() if "=..." not in b]
    assert len(runnable) >= 3
    async with running_gateway(redis_url) as gw:
        await gw.publish(Zone.GREEN)
        script = "\n".join(
            f"exec(compile({b!r}, 'README block {i}', 'exec'))" for i, b in enumerate(runnable))
        script = script.replace("http://gateway:8080/v1", gw.url + "/v1")
        script = script.replace("llama-3-8b", POOL)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", f"KEY = {KEYS['vip']!r}\n{script}", cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()[-3000:]
    assert out.decode().count(" t0 t1 t2") >= 3  # every streamed example printed its tokens


# --- the environment's proxy ------------------------------------------------------------------




class RecordingProxy:
    """A forward proxy that answers itself: it records each request's target (absolute form,
    as a client sends it to a proxy), rejects the first with a 429, then answers."""

    def __init__(self) -> None:
        self.targets: list[str] = []

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            self.targets.append(f"{request.method} {request.raw_path}")
            if len(self.targets) == 1:
                return web.json_response({"error": {"code": "capacity_exceeded"}}, status=429,
                                         headers={"retry-after-ms": "1"})
            return web.json_response({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": "via the proxy"}, "finish_reason": "stop"}]})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app


def test_the_clients_go_through_the_environments_proxy(
        no_proxy_environment: pytest.MonkeyPatch) -> None:
    """Behind an egress proxy only the constructor line changes, as with the official SDK:
    both clients send every attempt, retries too, through the proxy HTTP_PROXY names, to the
    gateway it cannot reach itself."""
    quick = RetryPolicy(base_delay_s=0.001, max_delay_s=0.001)
    target = "POST http://gateway.invalid/v1/chat/completions"
    for build in (
        lambda: KvgateClient("http://gateway.invalid/v1", "k", policy=quick).chat(
            "m", MESSAGES)["choices"][0]["message"]["content"],
        lambda: kvgate_client.openai(base_url="http://gateway.invalid/v1", api_key="k",
                                     policy=quick).chat.completions.create(
            model="m", messages=MESSAGES).choices[0].message.content,
    ):
        proxy = RecordingProxy()
        with ThreadServer(proxy.app()) as url:
            no_proxy_environment.setenv("HTTP_PROXY", url)
            assert build() == "via the proxy"
        assert proxy.targets == [target, target]


async def test_the_async_client_goes_through_the_proxy_but_to_exempt_hosts(
        no_proxy_environment: pytest.MonkeyPatch) -> None:
    proxy = RecordingProxy()
    quick = RetryPolicy(base_delay_s=0.001, max_delay_s=0.001)
    async with serve_app(proxy.app()) as url:
        no_proxy_environment.setenv("ALL_PROXY", url)
        async with AsyncKvgateClient("http://gateway.invalid/v1", "k", policy=quick) as client:
            reply = await client.chat("m", MESSAGES)
        assert reply["choices"][0]["message"]["content"] == "via the proxy"
        assert proxy.targets == ["POST http://gateway.invalid/v1/chat/completions"] * 2
        # NO_PROXY exempts the host, named alone or with the port: the request goes straight
        # to it (here, the same server, reached directly: its request line holds the path).
        port = url.rsplit(":", 1)[1]
        for exempt in ("127.0.0.1", f"127.0.0.1:{port}"):
            no_proxy_environment.setenv("NO_PROXY", exempt)
            async with AsyncKvgateClient(url + "/v1", "k", policy=quick) as client:
                await client.chat("m", MESSAGES)
        assert proxy.targets[2:] == ["POST /v1/chat/completions"] * 2
        # A proxy written without a scheme is an http:// one, as httpx and curl read it.
        no_proxy_environment.delenv("NO_PROXY")
        no_proxy_environment.setenv("ALL_PROXY", url.removeprefix("http://"))
        async with AsyncKvgateClient("http://gateway.invalid/v1", "k", policy=quick) as client:
            await client.chat("m", MESSAGES)
        assert proxy.targets[4:] == ["POST http://gateway.invalid/v1/chat/completions"]
