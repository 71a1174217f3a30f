"""The HTTP/1.1 client for the hop from the gateway to its inference nodes.

aiohttp's client was a third of the gateway's CPU per request (session, request and response
objects, header multidicts, timers and a stream reader per call), for a hop that only ever
POSTs a JSON body to a known node and reads back either one JSON body or an SSE stream. This
client keeps the part that matters: kept-alive connections per node, llhttp (via httptools) to
parse the answer and undo chunked framing, flow control on a slow reader, a connect timeout,
and a read timeout that fires when the node has sent nothing for that long (as aiohttp's
`sock_read`).

Errors: `NodeUnreachable` when no connection could be made (nothing was sent), `NodeTimeout`
when the node went quiet, `AnswerTooLarge` when a body read whole outgrows the reader's limit,
`HeadTooLarge` when the status line and headers outgrow theirs, `NodeStuck` (a `NodeTimeout`)
when the gateway ended the exchange because the pool's leader judged the node stuck
(`NodeClient.cut`), `NodeError` for any other failure (connection lost, malformed answer).
A request that finds its reused connection closed by the node before any byte of an answer, within
`STALE_CLOSE_S` of its sending, is sent again once on a new connection: servers close idle
keep-alive connections on their own schedule (vLLM's uvicorn after 5 s), and such a connection
never reached the app. A later close is the node failing while it worked on the request (a
whole answer sends no byte before its end): sent again, it would be generated twice.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.nodefailures import (
    AnswerTooLarge,
    HeadTooLarge,
    NodeError,
    NodeStuck,
    NodeTimeout,
    NodeUnreachable,
)

__all__ = ["AnswerTooLarge", "HeadTooLarge", "NodeClient", "NodeError", "NodeResponse",
           "NodeStuck", "NodeTimeout", "NodeUnreachable"]

PAUSE_READING_BYTES = 256 * 1024
"""A stream whose reader (the gateway's client) lags this far behind stops reading the node
until it catches up, so a slow client costs the gateway bounded memory."""
MAX_HEAD_BYTES = 64 << 10
"""The most bytes of an answer's status line and headers the client takes before their end.
vLLM's head is a few hundred bytes, a proxy's in front of it a few kilobytes; nothing else
bounds it (llhttp parses a head of any length, httptools joins a field's pieces until its
end), so a node could grow the gateway without end before any body. In time, a head is bound
by the silence limit: only a head's end restarts it, not its bytes one by one (a node sending
a byte a little more often than the limit would otherwise hold the request for 64 Ki limits)."""
STALE_CLOSE_S = 0.5
"""How soon after a request is written on a reused connection the node's close of it still
means it closed the connection as idle, before reading the request: the close is then already
on its way, and is seen within the event loop's lag. Later, the node had the request."""
MAX_HEADER_FIELDS = 128
"""The most header fields an answer may carry: vLLM sends about five. Each is a dict entry,
and a head of tiny fields under `MAX_HEAD_BYTES` would be thousands of them."""


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    tls: bool
    base_path: str
    host_header: bytes


@functools.lru_cache(maxsize=1024)
def _origin(base_url: str) -> _Origin:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NodeUnreachable(f"not an http(s) node URL: {base_url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return _Origin(host, port, tls, parts.path.rstrip("/"), f"{shown}:{port}".encode("idna"))


def _declared_length(headers: Mapping[str, str]) -> int:
    """The body length a `Content-Length` header declares; -1 when there is none."""
    try:
        return int(headers.get("content-length", "-1"))
    except ValueError:  # llhttp refuses a malformed one before the headers are complete
        return -1


class _Connection(asyncio.Protocol):
    """One kept-alive connection; carries one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: _Origin) -> None:
        self.loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.idle_in: list[_Connection] | None = None
        """The pool list holding this connection while it waits for a request."""
        self.busy_in: set[_Connection] | None = None
        """The client's set of connections carrying a request to this origin, while it
        carries one (`NodeClient.cut` looks there)."""
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_bytes = 0
        self.heads = 0
        """Heads ended so far, interim ones included."""
        self.header_fields = 0
        self.interim = False
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.received_any = False
        self.error: NodeError | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.last_data = 0.0
        self.sent_at = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport; they quack like one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self.headers_done:
            self.last_data = self.loop.time()
            self._feed(data)
            return
        heads = self.heads
        room = MAX_HEAD_BYTES - self.head_bytes
        if len(data) > room:
            # The head must end within the room left; what follows it is body.
            self._feed(data[:room])
            if self.error is not None:
                return
            if not self.headers_done:
                self.fail(HeadTooLarge(f"the node's answer head is over {MAX_HEAD_BYTES} "
                                        "bytes"))
                return
            data = data[room:]
        else:
            self.head_bytes += len(data)
        self._feed(data)
        if self.heads != heads:
            self.last_data = self.loop.time()  # a head ended: the node is answering

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail(NodeError("the node switched protocols"))
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what a callback of ours raised, if one did
            self.fail(cause if isinstance(cause, NodeError) else NodeError(
                f"malformed answer from the node: {exc}"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idle_in is not None:
            # Nodes close idle connections on their own schedule (uvicorn: 5 s); drop it now
            # rather than hold it until the pool digs down to it.
            self.idle_in.remove(self)
            self.idle_in = None
        if self.headers_done and not self.complete and self._unframed():
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        elif not self.complete:
            self.fail(NodeError("the node closed the connection"))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_fields += 1
        if self.header_fields > MAX_HEADER_FIELDS:
            raise HeadTooLarge(f"the node's answer has over {MAX_HEADER_FIELDS} header fields")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.heads += 1
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints) before the real one, which an
            # HTTP client skips: its fields are dropped, and the head bound keeps counting, so
            # that the heads together, however many, stay within it.
            self.interim = True
            self.headers = {}
            self.header_fields = 0
            return
        self.status = status
        # Asked now: llhttp's answer is not kept once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > PAUSE_READING_BYTES and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    # -- for the client ---------------------------------------------------------------------

    def _unframed(self) -> bool:
        h = self.headers
        return "content-length" not in h and "chunked" not in h.get("transfer-encoding", "")

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: NodeError) -> None:
        """End the exchange with `error`: the reader raises it, the connection is closed."""
        if self.error is None:
            self.error = error
        self.abort()
        self._wake()

    def abort(self) -> None:
        self.closed = True
        self._cancel_timer()
        self.leave_busy()
        if self.transport is not None:
            self.transport.abort()

    def start(self, request: bytes, read_timeout_s: float) -> None:
        self._reset()
        assert self.transport is not None
        self.last_data = self.sent_at = self.loop.time()
        self.transport.write(request)
        self._timer = self.loop.call_later(read_timeout_s, self._check_quiet, read_timeout_s)

    def _check_quiet(self, read_timeout_s: float) -> None:
        quiet_for = self.loop.time() - self.last_data
        if self.complete:
            self._timer = None
        elif quiet_for >= read_timeout_s:
            self._timer = None
            self.fail(NodeTimeout(f"the node sent nothing for {read_timeout_s:g} s"))
        else:
            self._timer = self.loop.call_later(
                read_timeout_s - quiet_for, self._check_quiet, read_timeout_s)

    def leave_busy(self) -> None:
        if self.busy_in is not None:
            self.busy_in.discard(self)
            self.busy_in = None

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait(self) -> None:
        """Until something new arrives (headers, body, end) or the exchange fails."""
        if self.error is not None:
            raise self.error
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.error is None and not self.closed


class NodeResponse:
    """A node's answer: status and headers at hand, the body read whole or as it arrives.

    End every response with `release()` (keeps the connection when the answer was read to
    its end) or `close()` (drops it, which also tells the node to stop generating)."""

    __slots__ = ("_client", "_conn", "headers", "status")

    def __init__(self, client: NodeClient, conn: _Connection) -> None:
        self._client = client
        self._conn = conn
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers
        """Lower-case names."""

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body. A body over `limit` bytes (None: no limit) raises `AnswerTooLarge`
        as soon as that shows (a `Content-Length` over it: before any byte is taken), with
        the connection closed: a node's answer is otherwise held whole, however large."""
        conn = self._conn
        if limit is not None and _declared_length(self.headers) > limit:
            raise self._too_large(limit)
        parts: list[bytes] = []
        size = 0
        while True:
            if conn.chunks:
                data = conn.take()  # may resume reading: a large body must not stall
                size += len(data)
                if limit is not None and size > limit:
                    raise self._too_large(limit)
                parts.append(data)
            elif conn.complete:
                return b"".join(parts)
            else:
                await conn.wait()

    async def read_prefix(self, limit: int) -> bytes:
        """The body's first `limit` bytes (all of it when shorter); a longer rest is left
        unread, so that `release()` then closes the connection."""
        conn = self._conn
        parts: list[bytes] = []
        size = 0
        while size < limit:
            if conn.chunks:
                data = conn.take()
                size += len(data)
                parts.append(data)
            elif conn.complete:
                break
            else:
                await conn.wait()
        return b"".join(parts)[:limit]

    def _too_large(self, limit: int) -> AnswerTooLarge:
        self._conn.abort()
        return AnswerTooLarge(limit)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, in pieces of whatever size came."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            else:
                await conn.wait()

    def close(self) -> None:
        self._conn.abort()

    def release(self) -> None:
        conn = self._conn
        if conn.reusable():
            conn._cancel_timer()
            self._client._keep(conn)
        else:
            conn.abort()


class NodeClient:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_s: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._ssl_context = ssl_context
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._busy: dict[_Origin, set[_Connection]] = {}
        self.connects = 0

    def busy(self, base_url: str) -> int:
        """Requests in flight to the node at `base_url`."""
        return len(self._busy.get(_origin(base_url), ()))

    def cut(self, base_url: str, quiet_s: float, why: str) -> int:
        """End every exchange with the node at `base_url` that has received nothing for
        `quiet_s` or longer (counted from its sending, or from its last byte): each reader
        raises `NodeStuck(why)` as it would a timeout, and the connection is closed, which
        tells the node to drop the request. One that is receiving is left to finish: the
        verdict may be a moment older than the node's recovery. Returns how many were ended."""
        busy = self._busy.get(_origin(base_url))
        if not busy:
            return 0
        now = asyncio.get_running_loop().time()
        ended = [c for c in busy if not c.complete and now - c.last_data >= quiet_s]
        for conn in ended:
            conn.fail(NodeStuck(why))
        return len(ended)

    def _keep(self, conn: _Connection) -> None:
        conn.leave_busy()
        conn.idle_since = conn.loop.time()
        conn.idle_in = self._idle.setdefault(conn.origin, [])
        conn.idle_in.append(conn)

    def _idle_connection(self, origin: _Origin, now: float) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            conn.idle_in = None
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(loop, origin)
        context: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            context = self._ssl_context
        self.connects += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: conn, origin.host, origin.port, ssl=context)
        except (OSError, TimeoutError) as exc:
            raise NodeUnreachable(f"cannot connect to the node: {type(exc).__name__}") from exc
        return conn

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str],
        *, read_timeout_s: float | None = None,
        on_sent: Callable[[bool], None] | None = None,
    ) -> NodeResponse:
        """POST `body` to the node at `base_url` + `path`; returns once the headers are in.
        `read_timeout_s` replaces the client's own silence limit for this request; `on_sent` is
        told True once the request is handed to a connection (the node may be working on it),
        and False when that connection turns out closed and a new one is opened for it."""
        origin = _origin(base_url)
        head = [b"POST ", origin.base_path.encode(), path.encode(), b" HTTP/1.1\r\nHost: ",
                origin.host_header, b"\r\nContent-Length: %d\r\n" % len(body)]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            head.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
        head.append(b"\r\n")
        request = b"".join(head) + body
        quiet_s = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        conn = self._idle_connection(origin, asyncio.get_running_loop().time())
        if conn is not None:
            try:
                return await self._exchange(conn, request, quiet_s, on_sent)
            except NodeError as exc:
                if (conn.received_any or isinstance(exc, NodeTimeout)
                        or conn.loop.time() - conn.sent_at > STALE_CLOSE_S):
                    raise
                # Closed by the node while idle, before it read the request: send it anew.
                if on_sent is not None:
                    on_sent(False)
        return await self._exchange(await self._connect(origin), request, quiet_s, on_sent)

    async def _exchange(self, conn: _Connection, request: bytes, read_timeout_s: float,
                        on_sent: Callable[[bool], None] | None = None) -> NodeResponse:
        conn.start(request, read_timeout_s)
        busy = conn.busy_in = self._busy.setdefault(conn.origin, set())
        busy.add(conn)
        if on_sent is not None:
            on_sent(True)
        try:
            while not conn.headers_done:
                await conn.wait()
        except BaseException:
            conn.abort()
            raise
        return NodeResponse(self, conn)

    async def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                conn = idle.pop()
                conn.idle_in = None
                conn.abort()
        self._idle.clear()
