"""The node client's count of exchanges in flight per node (`busy`) and its ending of the
silent ones on a node judged stuck (`cut`), against raw servers over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.nodeclient import STALE_CLOSE_S, NodeClient, NodeError, NodeStuck, NodeTimeout
from tests.gateway_harness import eventually
from tests.rawnode import OK, Handler, answer_ok, read_request

JSON = {"Content-Type": "application/json"}
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def until(check: Callable[[], bool]) -> None:
    async def holds() -> bool:
        return check()

    await eventually(holds, interval_s=0.005)


async def test_busy_counts_each_exchange_until_it_is_released_closed_failed_or_cancelled(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    answer = asyncio.Event()

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = (await read_request(reader)).rsplit(b"\r\n\r\n", 1)[1]
            if body == b"hang":
                await reader.read()  # until the client leaves
                return
            if body == b"break":
                writer.close()
                return
            await answer.wait()
            writer.write(OK)
            await writer.drain()

    url = await raw_server(node)
    nodes = NodeClient(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        assert nodes.busy(url) == 0
        pending = asyncio.ensure_future(nodes.post(url, "/v1/completions", b"ok", JSON))
        await until(lambda: nodes.busy(url) == 1)
        answer.set()
        response = await pending
        assert nodes.busy(url) == 1  # its body is still to read
        assert await response.read() == b"ok"
        response.release()
        assert nodes.busy(url) == 0
        closed = await nodes.post(url, "/v1/completions", b"ok", JSON)
        closed.close()
        assert nodes.busy(url) == 0
        with pytest.raises(NodeError):
            await nodes.post(url, "/v1/completions", b"break", JSON)
        assert nodes.busy(url) == 0
        waiting = asyncio.ensure_future(nodes.post(url, "/v1/completions", b"hang", JSON))
        await until(lambda: nodes.busy(url) == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert nodes.busy(url) == 0
    finally:
        await nodes.close()


async def test_cut_ends_the_silent_exchanges_and_leaves_those_that_receive(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    stop = asyncio.Event()

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = (await read_request(reader)).rsplit(b"\r\n\r\n", 1)[1]
        writer.write(STREAM_HEAD + chunk(b"data: t0\n\n"))
        await writer.drain()
        while body == b"trickle" and not stop.is_set():
            await asyncio.sleep(0.02)
            writer.write(chunk(b"data: t\n\n"))
            await writer.drain()
        await reader.read()

    url = await raw_server(node)
    nodes = NodeClient(connect_timeout_s=1.0, read_timeout_s=30.0)
    try:
        silent = await nodes.post(url, "/v1/completions", b"silent", JSON)
        trickling = await nodes.post(url, "/v1/completions", b"trickle", JSON)
        assert nodes.busy(url) == 2
        async for first in silent.iter_any():  # the head and first event arrived
            assert first.startswith(b"data: t0")
            break
        assert nodes.cut(url, 0.2, "judged stuck") == 0  # silent for less than 0.2 s
        await asyncio.sleep(0.3)
        assert nodes.cut(url, 0.2, "judged stuck") == 1
        with pytest.raises(NodeStuck, match="judged stuck") as info:
            async for _ in silent.iter_any():
                pass
        assert isinstance(info.value, NodeTimeout)
        assert nodes.busy(url) == 1
        got = b""
        async for data in trickling.iter_any():
            got += data
            if got.count(b"data: t") >= 5:
                break
        assert nodes.cut(url, 0.2, "judged stuck") == 0  # receiving: left alone
        stop.set()
        trickling.close()
        assert nodes.busy(url) == 0
        assert nodes.cut(url, 0.0, "judged stuck") == 0
    finally:
        await nodes.close()


async def test_an_exchange_cut_on_a_reused_connection_is_not_sent_again(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """Ended before any byte of answer and within STALE_CLOSE_S of its sending, as a node's
    close of an idle connection would be, it is still not sent again: the node had it."""
    received: list[bytes] = []

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await answer_ok(reader, writer))
        received.append(await read_request(reader))
        await reader.read()

    url = await raw_server(node)
    nodes = NodeClient(connect_timeout_s=1.0, read_timeout_s=30.0)
    try:
        first = await nodes.post(url, "/v1/completions", b"1", JSON)
        assert await first.read() == b"ok"
        first.release()
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        second = asyncio.ensure_future(nodes.post(url, "/v1/completions", b"2", JSON))
        await until(lambda: len(received) == 2)
        assert nodes.cut(url, 0.0, "judged stuck") == 1
        with pytest.raises(NodeStuck):
            await second
        assert loop.time() - sent_at < STALE_CLOSE_S
    finally:
        await nodes.close()
    assert nodes.connects == 1
    assert [r.rsplit(b"\r\n\r\n", 1)[1] for r in received] == [b"1", b"2"]
