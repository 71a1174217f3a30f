"""The hot path's Redis client: many concurrent script calls multiplexed over one connection.

Every request makes two script calls (admit, then settle). Through redis-py each takes a
connection from the pool, packs, sends, waits and gives the connection back, about 90 µs of
CPU per call on the reference machine, a third of the gateway's budget. RESP answers commands
on a connection in the order they were sent, so one connection can carry every call at once:
write the command, queue a future, and resolve futures in order as replies are parsed (hiredis).
Calls overlap on the connection (pipelining) with no pool to size or exhaust.

Failure semantics match a redis-py connection with socket timeouts: a reply that does not come
within `socket_timeout_ms`, or a lost connection, fails every call in flight on it with
`redis.exceptions.TimeoutError` / `ConnectionError` and the next call reconnects. After a
failed connect, calls fail at once for a while (a circuit breaker) with an error of the class
the connect failed with: refused credentials stay an `AuthenticationError`. A NOSCRIPT
reply is raised as `NoScriptError`, on which admission's one script runner
(`admission.scripts.Script`) loads the script and retries once, as it does over redis-py.

This is a transport only: it names no key and builds no command of its own beyond the
connection's handshake. Only the script calls of admission go through it (`mux_scripts`, i.e.
`Scripts.via_connection`); pub/sub, record reads, readiness and the scheduler's operations use
the regular redis-py client. Redis Cluster is not
multiplexed (the gateway keeps redis-py's scripts there). With Sentinel, each connect asks
where the primary is (`locate`, which authenticates to the Sentinels as redis-py's client
does), and a READONLY reply (the server was demoted to a replica by a failover) drops the
connection, so the next call reconnects to the new primary.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
from redis.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from admission.config import RedisSettings, tls_context
from admission.connection import PrimaryLocator
from admission.errors import TRANSIENT_REPLY_CODES, describe, reply_code
from admission.scripts import Scripts

MIN_DOWN_S = 0.1
MAX_DOWN_S = 2.0
LOCATED_MAX_DOWN_S = 0.5
"""With Sentinel: a new primary is usually promoted while the circuit is open; trying again
(one Sentinel query and a connect) at least twice a second finds it soon after."""
MAX_CLIENTS_REPLY = "ERR max number of clients"
"""How Redis refuses a connection past `maxclients` (the error it writes before closing it;
"... reached", or "... + cluster connections reached" on a cluster node)."""


def _lost_connection(message: str) -> ConnectionError | None:
    """The ConnectionError for an error reply that condemns the connection, else None: every
    later call on it would fail alike, so it is dropped and the next call opens another.

    READONLY: a failover made this server a replica; the next connection finds the primary.
    Max clients: Redis at `maxclients` answers a new connection with this and closes it, a
    refusal that passes once clients leave (redis-py raises it as a ConnectionError too), not
    an ERR reply to the command, which is_transient takes for a failing script."""
    if message.startswith("READONLY"):
        return ConnectionError(f"Redis is a replica now: {message}")
    if message.startswith(MAX_CLIENTS_REPLY):
        return ConnectionError("Redis refused the connection: max number of clients")
    return None


def pack(args: Sequence[bytes | str | int | float]) -> bytes:
    """One RESP command."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = repr(arg).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class _Protocol(asyncio.Protocol):
    def __init__(self, on_lost: Callable[[_Protocol], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.closed = False
        self._on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport; they quack like one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending = self.pending
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(ConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if not pending:  # a reply nobody waits for: the stream is out of step
                self.fail(ConnectionError("unexpected reply from Redis"))
                return
            future = pending.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                message = str(reply)
                lost = _lost_connection(message)
                if lost is not None:
                    future.set_exception(lost)
                    self.fail(lost)
                    return
                error = NoScriptError(message) if message.startswith("NOSCRIPT") else (
                    ResponseError(message))
                future.set_exception(error)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError("Connection to Redis lost"))

    def fail(self, error: Exception) -> None:
        if not self.closed:
            self.closed = True
            self._on_lost(self)
            if self.transport is not None:
                self.transport.abort()
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)


class RedisMux:
    def __init__(self, settings: RedisSettings, *, locate: PrimaryLocator | None = None) -> None:
        """`locate`: where the primary is now (Sentinel); None: the URL's host and port."""
        if settings.cluster:
            raise ValueError("RedisMux does not speak Redis Cluster")
        self.settings = settings
        self.locate = locate
        self.params: dict[str, Any] = parse_url(settings.url)  # type: ignore[no-untyped-call, unused-ignore]
        # Built once, from the URL's TLS parameters as the client library reads them: a
        # certificate this connection alone rejected would pass /readyz (the library's) and
        # fail every admit.
        self._tls = tls_context(settings)
        self.timeout_s = settings.socket_timeout_ms / 1000
        self.connect_timeout_s = settings.connect_timeout_ms / 1000
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        self._closed = False
        # Circuit breaker: after a failed connect, calls fail at once until `_down_until`
        # (backing off to MAX_DOWN_S, LOCATED_MAX_DOWN_S with Sentinel), instead of each
        # waiting for its own connect timeout.
        self._down_until = 0.0
        self._down_s = MIN_DOWN_S
        self._down_error: ConnectionError = ConnectionError("Redis unreachable")
        """What the connect that opened the circuit failed with (`_circuit_open`)."""
        self._max_down_s = MAX_DOWN_S if locate is None else LOCATED_MAX_DOWN_S
        self.connects = 0

    def _lost(self, conn: _Protocol) -> None:
        if self._conn is conn:
            self._conn = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        params = self.params
        conn = _Protocol(self._lost)
        host, port = params.get("host", "localhost"), params.get("port", 6379)
        if self.locate is not None:
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    host, port = await self.locate()
            except AuthenticationError:
                # The Sentinels refused their credentials (admission.connection's
                # SentinelAuthenticationError): kept as is, permanent and named, where "No
                # primary found" would read as an outage.
                raise
            except (RedisError, OSError, TimeoutError) as exc:
                raise ConnectionError(f"No primary found: {type(exc).__name__}") from exc
        if "path" in params:
            connect = loop.create_unix_connection(lambda: conn, params["path"])
        else:
            connect = loop.create_connection(lambda: conn, host, port, ssl=self._tls)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await connect
        except (OSError, TimeoutError) as exc:
            raise ConnectionError(f"Error connecting to Redis: {type(exc).__name__}") from exc
        try:
            if params.get("password"):
                auth = ["AUTH", params["password"]]
                if params.get("username"):
                    auth.insert(1, params["username"])
                await self._call(conn, auth)
            if params.get("db"):
                await self._call(conn, ["SELECT", params["db"]])
        except ResponseError as exc:
            conn.fail(ConnectionError("Redis handshake failed"))
            if reply_code(exc) in TRANSIENT_REPLY_CODES:
                # BUSY (a script runs past its time limit: SELECT is refused, AUTH is not) or
                # LOADING: nothing wrong with the credentials, and a retry passes. As an
                # AuthenticationError is_transient took it for refused credentials, and every
                # settle in flight was given up as permanent.
                raise ConnectionError(f"Redis handshake refused ({describe(exc)})") from None
            raise AuthenticationError(str(exc)) from None
        return conn

    async def _connection(self) -> _Protocol:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise ConnectionError("client closed")
        loop = asyncio.get_running_loop()
        if self._connecting is None:
            if loop.time() < self._down_until:
                raise self._circuit_open() from self._down_error
            self.connects += 1
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            conn = await asyncio.shield(connecting)
        except ConnectionError as exc:
            if self._connecting is connecting:
                self._down_until = loop.time() + self._down_s
                self._down_s = min(self._down_s * 2, self._max_down_s)
                self._down_error = exc
            raise
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None
        self._down_s = MIN_DOWN_S
        self._conn = conn
        return conn

    def _circuit_open(self) -> ConnectionError:
        """The error of a call refused while the circuit is open, raised from the failure that
        opened it: of its class. A plain ConnectionError here turned refused
        credentials (AuthenticationError, permanent for `is_transient`) into an outage for
        as long as the circuit stayed open: fail-open tiers went to the nodes unadmitted,
        settles retried for their whole deadline, and the logs named a ConnectionError."""
        cause = self._down_error
        return type(cause)(f"circuit open since a connect failed ({describe(cause)})")

    async def _call(self, conn: _Protocol, args: Sequence[bytes | str | int | float]) -> Any:
        if conn.closed or conn.transport is None:
            raise ConnectionError("Connection to Redis lost")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        conn.pending.append(future)
        conn.transport.write(pack(args))
        timer = loop.call_later(self.timeout_s, _expire, conn, future)
        try:
            return await future
        finally:
            timer.cancel()

    async def execute(self, *args: bytes | str | int | float) -> Any:
        return await self._call(await self._connection(), args)

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.fail(ConnectionError("client closed"))
            self._conn = None


def _expire(conn: _Protocol, future: asyncio.Future[Any]) -> None:
    if not future.done():
        # Replies come in order: the connection cannot be trusted for later calls either.
        conn.fail(RedisTimeoutError("Timeout reading from Redis"))


def mux_scripts(scripts: Scripts, mux: RedisMux) -> Scripts:
    """The same scripts, called through `mux` (admission's runner, this connection)."""
    return scripts.via_connection(mux)
