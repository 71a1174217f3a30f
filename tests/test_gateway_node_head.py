"""What a node's answer head (status line and header fields) can make a gateway hold, on raw
asyncio servers over loopback and the session's redis-server.

The head is read up to `MAX_HEAD_BYTES` and `MAX_HEADER_FIELDS`: a node that sends more fails
the request as soon as it goes past, with `HeadTooLarge`; its connection is dropped, and the
client gets the 502 of any node that answers something unreadable, refunded. In time a head is
bound by the silence limit, which its bytes one by one do not restart (only a head's end).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from admission.config import parse_config
from admission.tiers import Zone
from gateway.app import create_app
from gateway.nodeclient import (
    MAX_HEAD_BYTES,
    MAX_HEADER_FIELDS,
    HeadTooLarge,
    NodeClient,
    NodeResponse,
    NodeTimeout,
)
from gateway.state import GATEWAY
from tests.gateway_harness import BIG, KEYS, POOL, config_data, serve_app
from tests.rawnode import Handler, read_request

WAIT_S = 5.0
"""Most any request may take; a passing test takes a fraction of it. The gateway's own patience
with a quiet node is its default (minutes), so only the head's bound can end these in time."""
STATUS_LINE = b"HTTP/1.1 200 OK\r\n"
ENDLESS_CAP = 8 << 20
"""Where an "endless" node gives up and waits: finite, so that a gateway without a bound holds
8 MiB while the test fails, not all the machine has."""





def _head(*, size: int | None = None, fields: int | None = None) -> bytes:
    """A 200's head with a 2-byte body declared: `size` bytes in all, terminator included, or
    `fields` header fields (Content-Length among them)."""
    declared = b"Content-Length: 2\r\n"
    if fields is not None:
        return STATUS_LINE + declared + b"".join(
            b"X-Pad-%d: a\r\n" % i for i in range(fields - 1)) + b"\r\n"
    assert size is not None
    frame = len(STATUS_LINE + declared + b"X-Pad: \r\n\r\n")
    return STATUS_LINE + declared + b"X-Pad: " + b"a" * (size - frame) + b"\r\n\r\n"


async def _post(nodes: NodeClient, url: str) -> NodeResponse:
    """A chat request to the node at `url`, its head awaited at most `WAIT_S`."""
    return await asyncio.wait_for(nodes.post(url, "/v1/chat/completions", b"{}", {}), WAIT_S)


def _answering(answer: bytes) -> Handler:
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()
    return node


@pytest.mark.parametrize("bound", ["bytes", "fields"])
async def test_a_head_at_its_bounds_is_read_and_one_past_them_refused(
    raw_server: Callable[[Handler], Awaitable[str]], bound: str,
) -> None:
    """At the bound exactly the answer is read whole; one byte or one field more and the
    request fails, the rest of the head never held."""
    def head(extra: int) -> bytes:
        if bound == "bytes":
            return _head(size=MAX_HEAD_BYTES + extra)
        return _head(fields=MAX_HEADER_FIELDS + extra)

    if bound == "bytes":
        assert len(head(0)) == MAX_HEAD_BYTES
    else:  # the status line, the fields, the blank line
        assert head(0).count(b"\r\n") == 1 + MAX_HEADER_FIELDS + 1
    nodes = NodeClient(connect_timeout_s=1.0, read_timeout_s=WAIT_S)
    try:
        response = await _post(nodes, await raw_server(_answering(head(0) + b"ok")))
        assert (response.status, await response.read()) == (200, b"ok")
        response.release()
        with pytest.raises(HeadTooLarge):
            await _post(nodes, await raw_server(_answering(head(1) + b"ok")))
    finally:
        await nodes.close()


async def test_interim_answers_are_skipped_within_the_head_bound(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """A 100 Continue and a 103 Early Hints before the answer are skipped, as HTTP clients
    must, their fields dropped; the answer is the 200 after them. The heads count against one
    bound together: a stream of interim answers ends at it like one endless head."""
    hints = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
    nodes = NodeClient(connect_timeout_s=1.0, read_timeout_s=WAIT_S)
    try:
        answer = hints + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        response = await _post(nodes, await raw_server(_answering(answer)))
        assert (response.status, await response.read()) == (200, b"ok")
        assert "link" not in response.headers
        response.release()
        early = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
        endless = early * (MAX_HEAD_BYTES // len(early) + 1)
        with pytest.raises(HeadTooLarge):
            await _post(nodes, await raw_server(_answering(endless)))
    finally:
        await nodes.close()


async def test_a_head_sent_a_byte_at_a_time_is_bound_by_the_silence_limit(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """A node that sends its head a byte at a time, each a little sooner than the silence
    limit, never ending it: each byte restarted the limit, so the request was held until the
    head's byte bound, 64 Ki limits later. Only a head's end counts as the node answering; a
    head whose bytes come slowly but end in time is read."""
    limit_s = 1.5

    def trickling(head: bytes, pause_s: float) -> Handler:
        async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            try:
                for byte in head:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(pause_s)
                await reader.read()
            except ConnectionError:
                pass
            writer.close()
        return node

    nodes = NodeClient(connect_timeout_s=1.0, read_timeout_s=limit_s)
    try:
        endless = STATUS_LINE + b"X-Pad: " + b"a" * 10_000
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(NodeTimeout):
            await _post(nodes, await raw_server(trickling(endless, 0.05)))
        assert loop.time() - started < limit_s + 1.0
        whole = STATUS_LINE + b"Content-Length: 2\r\n\r\nok"  # 40 bytes within the limit
        response = await _post(nodes, await raw_server(trickling(whole, 0.005)))
        assert (response.status, await response.read()) == (200, b"ok")
        response.release()
    finally:
        await nodes.close()


@asynccontextmanager
async def _gateway_before(redis_url: str, node_url: str) -> AsyncIterator[tuple[str, Any]]:
    """A gateway whose one node is at `node_url`, its pool GREEN with room."""
    config = parse_config(config_data(redis_url, [node_url]), env={})
    app = create_app(config, gateway_id="gw-head", settle_drain_s=0.5)
    async with serve_app(app) as url:
        gw = app[GATEWAY]
        await gw.hub.subscribed.wait()
        await gw.pools[POOL].store.publish_state(1, Zone.GREEN, {"node-0": BIG})
        yield url, app


async def _chat(url: str) -> tuple[int, bytes, str]:
    """(status, body, X-Request-Id) of a chat request through the gateway at `url`."""
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['normal']}"},
            json={"model": POOL, "messages": [{"role": "user", "content": "Hi."}],
                  "max_tokens": 8}) as response:
        return response.status, await response.read(), response.headers["X-Request-Id"]


def _endless(line: Callable[[int], bytes], dropped: asyncio.Event) -> Handler:
    """A node that answers with a status line and then `line(i)` for i = 0, 1, ... up to
    `ENDLESS_CAP` bytes, never ending its head; `dropped` is set once the gateway closes."""
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STATUS_LINE)
        sent, i = 0, 0
        try:
            while sent < ENDLESS_CAP:
                batch = b"".join(line(i + k) for k in range(256))
                i += 256
                sent += len(batch)
                writer.write(batch)
                await writer.drain()
            await reader.read()
        except ConnectionError:
            pass
        dropped.set()
        writer.close()
    return node


def _past_the_bound_then_silent(dropped: asyncio.Event) -> Handler:
    """One byte of head past `MAX_HEAD_BYTES` (a field that never ends), then nothing: only a
    gateway that stops at the bound answers before its silence timeout."""
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STATUS_LINE + b"X-Pad: " + b"a" * (MAX_HEAD_BYTES - len(STATUS_LINE) - 6))
        await writer.drain()
        await reader.read()
        dropped.set()
        writer.close()
    return node


@pytest.mark.parametrize("node", [
    pytest.param(lambda dropped: _endless(lambda i: b"X-Pad-%d: %s\r\n" % (i, b"a" * 64),
                                          dropped), id="endless-fields"),
    pytest.param(lambda dropped: _endless(lambda i: b"a" * 1024, dropped), id="endless-field"),
    pytest.param(_past_the_bound_then_silent, id="one-byte-past-then-silent"),
])
async def test_a_node_whose_head_outgrows_its_bound_gets_a_502_refunded(
    redis_url: str, redis_client: Any, raw_server: Callable[[Handler], Awaitable[str]],
    node: Callable[[asyncio.Event], Handler],
) -> None:
    dropped = asyncio.Event()
    async with _gateway_before(redis_url, await raw_server(node(dropped))) as (url, app):
        gw = app[GATEWAY]
        status, raw, task_id = await asyncio.wait_for(_chat(url), WAIT_S)
        assert status == 502, raw
        error = orjson.loads(raw)["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert (error["code"], error["type"]) == ("upstream_error", "server_error")
        assert "HeadTooLarge" in error["message"]
        await asyncio.wait_for(dropped.wait(), WAIT_S)
        assert gw.metrics.registry.get_sample_value("kvgate_gateway_upstream_errors_total", {
            "pool": POOL, "node": "node-0", "kind": "error"}) == 1
        await gw.settler.idle()
        record = await gw.pools[POOL].store.task(task_id)
        assert record is not None and record["state"] == "cancelled"
        assert int(record.get("usage", 0)) == 0
        assert await redis_client.hget(gw.pools[POOL].store.keys.node_reserved, "node-0") is None
