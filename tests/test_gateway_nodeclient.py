"""The gateway's HTTP client for its nodes, against real servers on loopback.

aiohttp servers stand in for well-behaved nodes; raw asyncio servers play the misbehaving
ones (a node that closes a kept-alive connection, breaks off, goes quiet or answers garbage).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from admission.config import ConfigError, parse_config
from bench.common.localredis import free_port
from gateway.app import _node_client
from gateway.nodeclient import (
    PAUSE_READING_BYTES,
    STALE_CLOSE_S,
    NodeClient,
    NodeError,
    NodeTimeout,
    NodeUnreachable,
)
from tests.rawnode import Handler, answer_ok, read_request

JSON = {"Content-Type": "application/json"}


def client(read_timeout_s: float = 5.0) -> NodeClient:
    return NodeClient(connect_timeout_s=1.0, read_timeout_s=read_timeout_s)





@pytest.fixture
async def app_server() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_requests_reuse_one_kept_alive_connection(
    app_server: Callable[[web.Application], Awaitable[str]],
) -> None:
    seen: list[tuple[str, bytes, str | None]] = []

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.path, body, request.headers.get("X-Request-Id")))
        return web.json_response({"n": len(seen)}, headers={"X-Node": "a"})

    app = web.Application()
    app.router.add_post("/base/v1/chat/completions", echo)
    url = await app_server(app)
    nodes = client()
    try:
        for i in range(5):
            response = await nodes.post(url + "/base/", "/v1/chat/completions",
                                        b'{"i": %d}' % i, {**JSON, "X-Request-Id": f"t{i}"})
            assert response.status == 200
            assert response.headers["x-node"] == "a"
            assert await response.read() == b'{"n": %d}' % (i + 1)
            response.release()
    finally:
        await nodes.close()
    assert nodes.connects == 1
    assert seen == [("/base/v1/chat/completions", b'{"i": %d}' % i, f"t{i}") for i in range(5)]


async def test_a_chunked_stream_arrives_piece_by_piece(
    app_server: Callable[[web.Application], Awaitable[str]],
) -> None:
    go_on = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await go_on.wait()
        await response.write(b"data: 2\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    url = await app_server(app)
    nodes = client()
    try:
        response = await nodes.post(url, "/v1/completions", b"{}", JSON)
        assert response.headers["transfer-encoding"] == "chunked"
        pieces = response.iter_any()
        assert await anext(pieces) == b"data: 1\n\n"  # before the node sends the rest
        go_on.set()
        assert b"".join([piece async for piece in pieces]) == b"data: 2\n\n"
        response.release()
        again = await nodes.post(url, "/v1/completions", b"{}", JSON)
        assert await again.read() == b"data: 1\n\ndata: 2\n\n"
        again.release()
    finally:
        await nodes.close()
    assert nodes.connects == 1


async def test_a_node_nobody_listens_on_is_unreachable() -> None:
    nodes = client()
    sent: list[bool] = []
    with pytest.raises(NodeUnreachable):
        await nodes.post(f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}", JSON,
                         on_sent=sent.append)
    # Never handed to a connection: the gateway charges its client nothing for it.
    assert sent == []


async def test_on_sent_is_told_once_the_request_is_on_a_connection(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """The gateway marks a request as one the node may be working on (charged if its client
    leaves) only from here; before, from before the connection opened, so a client that left
    while it was being opened paid for its prompt."""
    answered = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await answered.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    url = await raw_server(answer)
    nodes = client()
    sent: list[bool] = []
    told = asyncio.Event()

    def on_sent(on_a_connection: bool) -> None:
        sent.append(on_a_connection)
        told.set()

    try:
        pending = asyncio.ensure_future(nodes.post(url, "/v1/completions", b"{}", JSON,
                                                   on_sent=on_sent))
        await told.wait()
        assert not pending.done()  # told before the node answered
        answered.set()
        response = await pending
        assert await response.read() == b"{}" and sent == [True]
        response.release()
    finally:
        await nodes.close()


async def test_a_quiet_node_times_out(raw_server: Callable[[Handler], Awaitable[str]]) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers; returns when the client gives up

    url = await raw_server(silent)
    nodes = client(read_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NodeTimeout) as info:
        await nodes.post(url, "/v1/completions", b"{}", JSON)
    assert isinstance(info.value, TimeoutError)
    assert loop.time() - started >= 0.19


async def test_a_kept_alive_connection_closed_by_the_node_is_replaced(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """The node reads nothing more on the kept connection: the request goes out again on a
    new one, and the node sees it exactly once."""
    answered: list[bytes] = []
    connections = 0

    async def once_per_connection(reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        answered.append(await answer_ok(reader, writer))
        await read_request(reader)  # the next request on this connection: dropped unanswered
        writer.close()

    url = await raw_server(once_per_connection)
    nodes = client()
    try:
        first = await nodes.post(url, "/v1/completions", b"1", JSON)
        assert await first.read() == b"ok"
        first.release()
        told: list[bool] = []
        second = await nodes.post(url, "/v1/completions", b"2", JSON, on_sent=told.append)
        assert (second.status, await second.read()) == (200, b"ok")
        second.release()
        # Sent, then unsent while the new connection opened (a client leaving then pays
        # nothing), then sent on it.
        assert told == [True, False, True]
    finally:
        await nodes.close()
    assert nodes.connects == connections == 2
    assert [request.rsplit(b"\r\n\r\n", 1)[1] for request in answered] == [b"1", b"2"]


async def test_a_kept_alive_connection_closed_while_the_node_works_is_not_sent_again(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """A node that reads the request on a kept connection and fails later, before any byte
    of its answer (a whole answer sends none until its end), had the request: the close is a
    node error, and the request is not generated a second time elsewhere on the node."""
    received: list[bytes] = []
    hang_up = asyncio.Event()

    async def fails_while_working(reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter) -> None:
        received.append(await answer_ok(reader, writer))
        received.append(await read_request(reader))
        await hang_up.wait()  # working on it, then the node dies
        writer.close()

    url = await raw_server(fails_while_working)
    nodes = client()
    try:
        first = await nodes.post(url, "/v1/completions", b"1", JSON)
        assert await first.read() == b"ok"
        first.release()
        asyncio.get_running_loop().call_later(STALE_CLOSE_S * 2, hang_up.set)
        told: list[bool] = []
        with pytest.raises(NodeError, match="closed the connection"):
            await nodes.post(url, "/v1/completions", b"2", JSON, on_sent=told.append)
        assert told == [True]
    finally:
        await nodes.close()
    assert nodes.connects == 1
    assert [request.rsplit(b"\r\n\r\n", 1)[1] for request in received] == [b"1", b"2"]


async def test_a_node_breaking_off_an_answer_fails_it_without_retry(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    requests = 0

    async def breaks_off(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    url = await raw_server(breaks_off)
    nodes = client()
    response = await nodes.post(url, "/v1/completions", b"{}", JSON)
    with pytest.raises(NodeError, match="closed the connection"):
        await response.read()
    response.release()
    assert requests == 1


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", b"until the end"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 4\r\n\r\nfour", b"four"),
    ],
)
async def test_connection_close_answers_are_read_whole_and_not_kept(
    raw_server: Callable[[Handler], Awaitable[str]], answer: bytes, body: bytes,
) -> None:
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    url = await raw_server(closes)
    nodes = client()
    for _ in range(2):
        response = await nodes.post(url, "/v1/completions", b"{}", JSON)
        assert await response.read() == body
        response.release()
    assert nodes.connects == 2


async def test_a_malformed_answer_is_a_node_error(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()

    url = await raw_server(garbage)
    with pytest.raises(NodeError, match="malformed"):
        await client().post(url, "/v1/completions", b"{}", JSON)


async def test_close_drops_the_connection_so_the_node_stops(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    node_saw_eof = asyncio.Event()

    async def streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if await reader.read() == b"":
            node_saw_eof.set()

    url = await raw_server(streams)
    nodes = client()
    response = await nodes.post(url, "/v1/completions", b"{}", JSON)
    assert await anext(response.iter_any()) == b"hello"
    response.close()
    await asyncio.wait_for(node_saw_eof.wait(), 5)
    response.release()  # after close: nothing to keep
    assert nodes._idle_connection(response._conn.origin, 0.0) is None


async def test_a_reader_that_lags_pauses_the_node_and_loses_nothing(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    piece = 64 * 1024
    total = 512 * piece  # far more than the kernel's socket buffers hold
    sent_all = asyncio.Event()

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for i in range(total // piece):
            writer.write(bytes([i % 251]) * piece)
            await writer.drain()
        sent_all.set()
        await reader.read()

    url = await raw_server(floods)
    nodes = client()
    response = await nodes.post(url, "/v1/completions", b"{}", JSON)
    conn = response._conn
    while not conn.paused:
        await conn.wait()
    assert not sent_all.is_set()  # the node is held back by the paused reading
    assert conn.buffered < 2 * PAUSE_READING_BYTES
    body = await response.read()
    assert body == b"".join(bytes([i % 251]) * piece for i in range(total // piece))
    response.release()
    await nodes.close()


async def test_line_breaks_in_headers_are_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        await client().post("http://127.0.0.1:1", "/v1/completions", b"{}",
                            {"X-Evil": "a\r\nHost: elsewhere"})


async def test_https_nodes_are_verified_against_the_given_ca(
    tmp_path: Path, app_server: Callable[[web.Application], Awaitable[str]],
) -> None:
    from tests.test_security import make_tls_dir

    certs = make_tls_dir(tmp_path / "tls")
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(certs / "server.crt", certs / "server.key")

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"tls": request.secure})

    app = web.Application()
    app.router.add_post("/v1/completions", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_side).start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}"
    try:
        trusted = NodeClient(connect_timeout_s=2, read_timeout_s=5,
                             ssl_context=ssl.create_default_context(cafile=str(certs / "ca.crt")))
        response = await trusted.post(url, "/v1/completions", b"{}", JSON)
        assert await response.read() == b'{"tls": true}'
        response.release()
        await trusted.close()
        with pytest.raises(NodeUnreachable, match="SSL"):  # the system store lacks our CA
            await client().post(url, "/v1/completions", b"{}", JSON)
        # The gateway's own client trusts a pool's backend_ca_file.
        config = parse_config({"pools": [{
            "name": "p", "backend_ca_file": str(certs / "ca.crt"),
            "backends": [{"name": "n1", "url": url}]}]}, env={})
        gateway_client = _node_client(config)
        response = await gateway_client.post(url, "/v1/completions", b"{}", JSON)
        assert await response.read() == b'{"tls": true}'
        response.release()
        await gateway_client.close()
        missing = parse_config({"pools": [{
            "name": "p", "backend_ca_file": str(tmp_path / "nowhere.pem"),
            "backends": [{"name": "n1", "url": url}]}]}, env={})
        with pytest.raises(ConfigError, match=r"nowhere\.pem"):
            missing.backend_ssl_context()
    finally:
        await runner.cleanup()


async def test_an_idle_connection_the_node_closes_leaves_the_pool_at_once(
    raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    hang_up = asyncio.Event()

    async def answers_then_hangs_up(reader: asyncio.StreamReader,
                                    writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await hang_up.wait()  # as uvicorn does after its keep-alive timeout
        writer.close()

    url = await raw_server(answers_then_hangs_up)
    nodes = client()
    responses = [await nodes.post(url, "/v1/completions", b"{}", JSON) for _ in range(3)]
    lost: list[asyncio.Future[None]] = []
    for response in responses:
        assert await response.read() == b"ok"
        conn = response._conn
        gone = asyncio.get_running_loop().create_future()
        lost.append(gone)
        original = conn.connection_lost

        def noting(exc: Exception | None, original: Any = original, gone: Any = gone) -> None:
            original(exc)
            gone.set_result(None)

        conn.connection_lost = noting  # type: ignore[method-assign]
        response.release()
    assert sum(len(idle) for idle in nodes._idle.values()) == 3
    hang_up.set()
    await asyncio.wait_for(asyncio.gather(*lost), 5)
    assert all(not idle for idle in nodes._idle.values())
    await nodes.close()
