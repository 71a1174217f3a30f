"""What a node or a client can make a gateway hold, in bytes and in time, on real sockets (a
real redis-server, a real aiohttp node, raw-socket clients).

- A node's whole answer is held up to what the request can produce
  (`gateway.answersize.whole_answer_limit`): past it the client gets 502
  `upstream_oversized_answer`, the node's connection is closed, and the task is charged as any
  broken answer. A node's error answer is read up to `ERROR_BODY_BYTES`.
- A client's body must arrive within `gateway.request_read_timeout_ms` (else 408
  `request_timeout`), and a connection without a complete request head is closed after
  `gateway.keepalive_timeout_ms` (the runner `python -m gateway` serves with).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from admission.config import parse_config
from admission.tiers import Tier, Zone
from gateway.__main__ import make_runner
from gateway.answersize import (
    ANSWER_BASE_BYTES,
    LOGPROB_ENTRY_BYTES,
    MAX_LOGPROBS,
    TOKEN_BYTES,
    whole_answer_limit,
)
from gateway.app import create_app
from gateway.nodeerrors import NODE_TEXT_LIMIT
from gateway.parse import Inbound
from gateway.state import GATEWAY
from tests.gateway_harness import (
    BIG,
    KEYS,
    POOL,
    config_data,
    eventually,
    hostile_gateway,
    running_gateway,
)

MESSAGES = [{"role": "user", "content": "Say hi."}]
WAIT_S = 5.0
"""Most any step may take; a passing test takes a fraction of it."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Node:
    """A node answering every chat request with `answer`; `closed` is set once the gateway
    has dropped the connection of an answer in progress."""

    answer: Handler
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        try:
            return await self.answer(request)
        except (ConnectionResetError, asyncio.CancelledError):
            self.closed.set()
            raise


@dataclass
class Front:
    """A gateway in front of one `Node`."""

    url: str
    app: web.Application


@asynccontextmanager
async def gateway_over(redis_url: str, node: Node, **gateway: Any) -> AsyncIterator[Front]:
    """A gateway (test runner) whose one node is `node`, its pool GREEN with room;
    `gateway`: settings of its `[gateway]` table."""
    async with hostile_gateway(redis_url, node.handle, **gateway) as (url, app):
        yield Front(url, app)


def _auth(who: str = "normal") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


async def _chat(front: Front, **body: Any) -> tuple[int, bytes, Any]:
    payload = {"model": POOL, "messages": MESSAGES, "max_tokens": 8, **body}
    async with aiohttp.ClientSession() as http, http.post(
            front.url + "/v1/chat/completions", json=payload,
            headers=_auth()) as response:
        return response.status, await response.read(), response.headers


def _error(raw: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(raw)["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def _upstream_errors(front: Front, kind: str) -> float | None:
    return front.app[GATEWAY].metrics.registry.get_sample_value(
        "kvgate_gateway_upstream_errors_total", {"pool": POOL, "node": "node-0", "kind": kind})


def _completion(content: str) -> bytes:
    return orjson.dumps({
        "id": "c", "object": "chat.completion", "created": 0, "model": POOL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}})


async def _endless(request: web.Request, status: int) -> web.StreamResponse:
    """A chunked answer that outgrows every limit here (8 MiB), then never ends. Finite, so that
    a gateway without a limit holds 8 MiB while the test waits, not all the machine has."""
    response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(b'{"choices": [{"message": {"content": "')
    piece = b"x" * 65_536
    for _ in range(128):
        await response.write(piece)
    await asyncio.Event().wait()
    return response


# --- a node's whole answer ----------------------------------------------------------------


def test_the_limit_grows_with_what_the_request_asks_the_node_to_return() -> None:
    plain = whole_answer_limit({}, prompt_tokens=50, output_tokens=100)
    assert plain == ANSWER_BASE_BYTES + 100 * TOKEN_BYTES
    # `"logprobs": 0` (completions) still asks for each chosen token's logprob.
    for asks in ({"logprobs": True, "top_logprobs": 20}, {"logprobs": 0},
                 {"prompt_logprobs": 1}):
        per_token = TOKEN_BYTES + (MAX_LOGPROBS + 1) * LOGPROB_ENTRY_BYTES
        tokens = 100 + (50 if "prompt_logprobs" in asks else 0)
        assert whole_answer_limit(asks, prompt_tokens=50, output_tokens=100) == (
            ANSWER_BASE_BYTES + tokens * per_token)
    assert whole_answer_limit({"logprobs": False}, prompt_tokens=50, output_tokens=100) == plain
    # An echoed prompt comes back once per choice.
    assert whole_answer_limit({"echo": True, "n": 3}, prompt_tokens=50, output_tokens=300) == (
        ANSWER_BASE_BYTES + (300 + 3 * 50) * TOKEN_BYTES)


async def test_an_oversized_whole_answer_is_cut_off_and_charged_as_broken(
    redis_url: str, redis_client: Any,
) -> None:
    """A node that sends far more than an 8-token answer can hold: the gateway stops reading
    at the request's limit instead of buffering it, closes the node's connection (which aborts
    the generation), answers 502 and charges the prompt, as for any broken answer."""
    node = Node(lambda request: _endless(request, 200))
    async with gateway_over(redis_url, node) as front:
        status, raw, headers = await asyncio.wait_for(_chat(front), WAIT_S)
        assert status == 502
        error = _error(raw)
        assert (error["code"], error["type"]) == ("upstream_oversized_answer", "server_error")
        assert int(headers["Retry-After"]) >= 1
        await asyncio.wait_for(node.closed.wait(), WAIT_S)
        assert _upstream_errors(front, "oversized_answer") == 1
        gw = front.app[GATEWAY]
        await gw.settler.idle()
        store = gw.pools[POOL].store
        record = await store.task(headers["X-Request-Id"])
        prompt = gw.pools[POOL].counter.count_chat(MESSAGES)
        assert record is not None and record["state"] == "cancelled"
        assert int(record["usage"]) == prompt
        assert await redis_client.hget(store.keys.node_reserved, "node-0") is None


async def _declares_64_mib(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = 64 << 20
    await response.prepare(request)
    await response.write(b'{"choices": [')
    await asyncio.Event().wait()  # the rest never comes
    return response


async def test_a_declared_length_over_the_limit_fails_before_the_body(
    redis_url: str, redis_client: Any,
) -> None:
    node = Node(_declares_64_mib)
    async with gateway_over(redis_url, node) as front:
        status, raw, _ = await asyncio.wait_for(_chat(front), WAIT_S)
        assert status == 502 and _error(raw)["code"] == "upstream_oversized_answer"
        await asyncio.wait_for(node.closed.wait(), WAIT_S)


async def test_logprobs_make_room_for_a_larger_answer(redis_url: str, redis_client: Any) -> None:
    """The same 3 MiB answer to 100 output tokens: within the limit of a request that asked
    for 20 alternatives per token (4.4 MB), over that of one that did not (1.1 MB)."""
    big = _completion("x" * (3 << 20))

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(body=big, content_type="application/json")

    async with gateway_over(redis_url, Node(answer)) as front:
        status, raw, _ = await asyncio.wait_for(
            _chat(front, max_tokens=100, logprobs=True, top_logprobs=20), WAIT_S)
        assert status == 200 and len(raw) == len(big)
        status, raw, _ = await asyncio.wait_for(_chat(front, max_tokens=100), WAIT_S)
        assert status == 502 and _error(raw)["code"] == "upstream_oversized_answer"


async def _html_page(request: web.Request) -> web.StreamResponse:
    return web.Response(text="<html><body>Welcome to nginx!</body></html>",
                        content_type="text/html")


async def _ignores_stream(request: web.Request) -> web.StreamResponse:
    return web.Response(body=_completion("hi"), content_type="application/json")


@pytest.mark.parametrize(("answer", "stream"), [
    (_html_page, False), (_html_page, True), (_ignores_stream, True)])
async def test_a_200_that_is_not_an_openai_answer_is_a_502_refunded_and_logged_once(
    redis_url: str, redis_client: Any, caplog: pytest.LogCaptureFixture, answer: Handler,
    stream: bool,
) -> None:
    """A node URL that leads to another server's page, or a server that ignores `stream` (one
    JSON body, which framed as events is a stream without one): relayed as a 200, the SDKs
    would fail to parse a "success". The client gets a 502 in OpenAI's shape, the task is
    refunded (the gateway cannot tell what it cost), the error is counted each time and logged
    once per node."""
    caplog.set_level(logging.ERROR, logger="kvgate.gateway")
    async with gateway_over(redis_url, Node(answer)) as front:
        gw = front.app[GATEWAY]
        for attempt in (1, 2):
            status, raw, headers = await asyncio.wait_for(_chat(front, stream=stream), WAIT_S)
            assert status == 502, raw
            error = _error(raw)
            assert error["code"] == "upstream_malformed_answer"
            assert "not an OpenAI answer" in error["message"]
            assert _upstream_errors(front, "malformed_answer") == attempt
            await gw.settler.idle()
            record = await gw.pools[POOL].store.task(headers["X-Request-Id"])
            assert record is not None and record["state"] == "cancelled"
            assert int(record.get("usage", 0)) == 0
        assert await redis_client.hget(gw.pools[POOL].store.keys.node_reserved, "node-0") is None
    logged = [r for r in caplog.records if "node-0 sent" in r.getMessage()]
    assert len(logged) == 1 and "vLLM" in logged[0].getMessage()


@pytest.mark.parametrize(("node_status", "status", "code"), [
    (500, 502, "upstream_error"),  # the gateway's own error, the node's message in it
    (400, 400, None),  # the node's own, relayed with its text cut short
])
async def test_a_nodes_error_answer_is_read_only_up_to_its_cap(
    redis_url: str, redis_client: Any, node_status: int, status: int, code: str | None,
) -> None:
    """An error answer that never ends: the gateway answers from its first
    `ERROR_BODY_BYTES` and drops the node's connection."""
    node = Node(lambda request: _endless(request, node_status))
    async with gateway_over(redis_url, node) as front:
        got, raw, headers = await asyncio.wait_for(_chat(front), WAIT_S)
        error = _error(raw)
        assert (got, error["code"]) == (status, code)
        # A node's 5xx came before any work: another attempt can pass, and the SDKs are told
        # (kvgate's retries no 502 of its own accord); the node's 4xx is the request's fault.
        assert headers.get("x-should-retry") == ("true" if node_status == 500 else None)
        assert len(error["message"]) <= NODE_TEXT_LIMIT
        await asyncio.wait_for(node.closed.wait(), WAIT_S)
        assert _upstream_errors(front, "error") == (1 if node_status == 500 else 0)


# --- a client's request -------------------------------------------------------------------


async def test_a_queued_request_holds_neither_its_decoded_body_nor_its_raw_bytes(
    redis_url: str, redis_client: Any,
) -> None:
    """A body's decoded objects take some 25 times its bytes (`{}` is 2 bytes of JSON and a
    64-byte dict), and a request holds what it keeps through its whole wait in the queue and
    its answer. While this one waits, its `Inbound` refers to no decoded object (only the
    forwarded payload and numbers: the bound of its whole answer among them, still what the
    body asks for), and aiohttp keeps no copy of its raw bytes on the request."""
    body = {"model": POOL, "messages": MESSAGES, "max_tokens": 8, "logprobs": True,
            "top_logprobs": 5, "x": [{}] * 100_000}
    async with running_gateway(redis_url) as gw, aiohttp.ClientSession() as http:
        await gw.publish(Zone.YELLOW, BIG, extra={"drain_2": 0})  # Batch queues, none leaves
        answer = asyncio.ensure_future(http.post(gw.url + "/v1/chat/completions", json=body,
                                                 headers=gw.auth("batch")))

        async def queued() -> bool:
            return await gw.queued(int(Tier.BATCH)) == 1

        await eventually(queued)
        gc.collect()
        inbounds = [o for o in gc.get_objects() if isinstance(o, Inbound)]
        assert len(inbounds) == 1
        inbound = inbounds[0]
        assert [type(o).__name__ for o in gc.get_referents(inbound)
                if isinstance(o, (dict, list))] == []
        assert inbound.answer_limit == whole_answer_limit(
            {"logprobs": True}, prompt_tokens=inbound.prompt_tokens,
            output_tokens=inbound.max_tokens)
        assert orjson.loads(inbound.payload)["x"] == body["x"]  # forwarded as sent
        requests = [o for o in gc.get_objects() if isinstance(o, web.BaseRequest)]
        assert requests and all(r._read_bytes is None for r in requests)
        del inbounds, inbound, requests

        await gw.publish(Zone.GREEN, BIG)
        await gw.release()
        response = await asyncio.wait_for(answer, WAIT_S)
        assert response.status == 200, await response.text()
        response.release()


async def _drip(writer: asyncio.StreamWriter, byte: bytes) -> None:
    """One byte every 20 ms, for as long as the connection takes them (a slowloris client)."""
    with contextlib.suppress(ConnectionError):
        while not writer.is_closing():
            writer.write(byte)
            await writer.drain()
            await asyncio.sleep(0.02)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head.rstrip("\r\n").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


async def test_a_body_sent_byte_by_byte_gets_408_at_the_deadline(
    redis_url: str, redis_client: Any,
) -> None:
    """The client sends its headers, then its body one byte every 20 ms: at the body deadline
    (200 ms here) it gets 408 and the connection is not kept, though bytes were still coming;
    the request never reaches admission or the node."""
    async def unused(request: web.Request) -> web.StreamResponse:
        raise AssertionError("the node must not be reached")

    async with gateway_over(redis_url, Node(unused), request_read_timeout_ms=200) as front:
        url = front.url.removeprefix("http://")
        host, port = url.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        loop = asyncio.get_running_loop()
        started = loop.time()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEYS["normal"].encode()
            + b"\r\nContent-Length: 100000\r\n\r\n{")
        drip = asyncio.create_task(_drip(writer, b" "))
        try:
            status, headers, body = await asyncio.wait_for(_read_response(reader), WAIT_S)
            elapsed = loop.time() - started
        finally:
            drip.cancel()
            writer.close()
        assert status == 408 and headers["connection"] == "close"
        error = _error(body)
        assert (error["code"], error["type"]) == ("request_timeout", "timeout")
        assert 0.2 <= elapsed < WAIT_S
        registry = front.app[GATEWAY].metrics.registry
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "none", "tier": "normal", "outcome": "invalid"}) == 1


async def test_a_head_sent_byte_by_byte_is_cut_at_the_keepalive_timeout(
    redis_url: str, redis_client: Any,
) -> None:
    """On the runner `python -m gateway` serves with, a request head that never completes
    (one byte every 20 ms) is closed at `keepalive_timeout_ms` (200 ms here), before any
    handler or authentication; a complete request is served as usual."""
    config = parse_config(config_data(redis_url, ["http://127.0.0.1:9"],
                                      keepalive_timeout_ms=200), env={})
    app = create_app(config, gateway_id="gw-bounds-head", settle_drain_s=0.5)
    runner = make_runner(app, access_log=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{port}/healthz") as response:
            assert response.status == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
        drip = asyncio.create_task(_drip(writer, b"a"))
        try:
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed, no answer
        finally:
            drip.cancel()
            writer.close()
    finally:
        await runner.cleanup()


async def test_a_malformed_authorization_header_never_puts_the_key_in_the_log(
    redis_url: str, redis_client: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """A key read from a file with Windows line endings ends in a CR, which aiohttp's parser
    refuses before any handler, quoting the header line in its log record: on the runner
    `python -m gateway` serves with, that record is one WARNING line without the key."""
    config = parse_config(config_data(redis_url, ["http://127.0.0.1:9"]), env={})
    app = create_app(config, gateway_id="gw-bounds-badhead", settle_drain_s=0.5)
    runner = make_runner(app, access_log=True)
    await runner.setup()
    caplog.set_level(logging.DEBUG)
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                     + KEYS["vip"].encode() + b"\r\r\nContent-Length: 2\r\n\r\n{}")
        try:
            answer = await asyncio.wait_for(reader.read(), WAIT_S)
        finally:
            writer.close()
    finally:
        await runner.cleanup()
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"400"
    assert KEYS["vip"] not in caplog.text
    (record,) = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "after header value" in record.getMessage()  # what was wrong, not the bytes
