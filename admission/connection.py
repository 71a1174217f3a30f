"""Redis clients built the same way by every service: bounded pools, timeouts, TLS, cluster,
Sentinel."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import (
    BlockingConnectionPool,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    NoPermissionError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from admission.config import RedisSettings
from admission.errors import REDIS_ERRORS

PrimaryLocator = Callable[[], Awaitable[tuple[str, int]]]


def connect(settings: RedisSettings) -> Any:
    """A redis.asyncio client (or RedisCluster) for `settings`; no I/O until first use.

    A blocking pool caps connections at `max_connections` and makes callers wait up to
    `pool_timeout_ms` for one, instead of failing with MaxConnectionsError under load.
    Socket timeouts keep a stuck Redis from hanging requests forever.

    With `sentinel_master` the client asks the Sentinels where the primary is whenever it
    opens a connection, so after a failover its next connections go to the new primary; the
    URL gives only the scheme (TLS or not), the credentials and the database. Without it, a
    connection whose server was demoted answers READONLY once and is dropped (`_PrimaryOnly`),
    so that the next one finds whatever the URL's name points at then.
    """
    timeout = settings.socket_timeout_ms / 1000
    connect_timeout = settings.connect_timeout_ms / 1000
    ssl: dict[str, Any] = {}
    if settings.url.startswith("rediss://") and settings.ssl_ca_file:
        ssl["ssl_ca_certs"] = settings.ssl_ca_file
    if settings.cluster:
        return RedisCluster.from_url(
            settings.url,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
            max_connections=settings.max_connections,
            **ssl,
        )
    if settings.sentinel_master is not None:
        return _sentinel_primary(settings, timeout, connect_timeout, ssl)
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        connection_class=_primary_class(settings.url),
        max_connections=settings.max_connections,
        timeout=settings.pool_timeout_ms / 1000,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        health_check_interval=30,
        **ssl,
    )
    # The client owns its pool, so closing the client closes the pool's connections (a client
    # handed a pool leaves them open, to be found unclosed at exit).
    return aioredis.Redis.from_pool(pool)


class _PrimaryOnly:
    """A connection whose server answers READONLY is dropped, and the call fails with a
    ConnectionError. The server was the primary when the connection was opened and a failover
    demoted it to a replica; Redis keeps such clients connected, and redis-py keeps the
    connection in its pool after an error reply, so every script call on it (the scheduler's
    every write, leadership included) was refused READONLY for as long as the process lived,
    even once `redis.url`'s DNS name or Service moved to the new primary (a managed Redis's
    failover; docs/runbook.md, "Redis failover"). Its next connection resolves the name anew.
    What redis-py does for Sentinel pools, and gateway/redismux.py for its own connection; the
    command was refused, so nothing ran twice."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ReadOnlyError:
            await self.disconnect()  # type: ignore[attr-defined]
            raise ConnectionError("Redis is a replica now (READONLY): reconnecting") from None


class _PrimaryConnection(_PrimaryOnly, Connection):
    pass


class _PrimarySSLConnection(_PrimaryOnly, SSLConnection):
    pass


class _PrimaryUnixConnection(_PrimaryOnly, UnixDomainSocketConnection):
    pass


def _primary_class(url: str) -> type[Any]:
    """The `_PrimaryOnly` connection class for `url`'s scheme (TCP, TLS, unix socket)."""
    scheme = parse_url(url).get("connection_class", Connection)
    if scheme is SSLConnection:
        return _PrimarySSLConnection
    if scheme is UnixDomainSocketConnection:
        return _PrimaryUnixConnection
    return _PrimaryConnection


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (connections to the current primary) with the blocking pool's bound."""


class SentinelAuthenticationError(AuthenticationError):
    """The Sentinels refused kvgate's credentials for them (`redis.sentinel_username`,
    `redis.sentinel_password_env`), or wanted some and got none. Not the primary's refusal:
    those credentials are `redis.url`'s, and the primary was not asked. An AuthenticationError,
    so permanent for `admission.errors.is_transient`; its class names the Sentinels in logs
    that show an error's class alone (`admission.errors.describe`)."""


def _address(client: Any) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host')}:{kwargs.get('port')}"


class _Sentinels(Sentinel):
    """redis-py's Sentinel client, but Sentinels that refuse its credentials fail the lookup
    with one SentinelAuthenticationError. redis-py counts a refusal as it counts a Sentinel it
    cannot reach and raises MasterNotFoundError, a plain ConnectionError, which `is_transient`
    takes for an outage: a wrong password would send fail-open tiers to the nodes unadmitted
    and have settles retried, under a message that says only "No master found"."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        """Where the primary is, asking the Sentinels in turn, as redis-py does. No Sentinel
        answered and at least one refused the credentials: SentinelAuthenticationError (one
        that is down says nothing about them; one that answered accepted them)."""
        refused: list[str] = []
        failed: list[str] = []
        answered = False
        for i, sentinel in enumerate(self.sentinels):
            try:
                # A dict by master name: redis-py parses the reply so in RESP2 and RESP3.
                masters = cast(dict[str, Any], await sentinel.sentinel_masters())
            except (AuthenticationError, NoPermissionError) as exc:
                # The server's reply (WRONGPASS "invalid username-password pair ...", NOAUTH
                # "HELLO must be called with the client already authenticated ..."), which
                # never holds the password.
                refused.append(f"{_address(sentinel)}: {exc}")
                continue
            except (ConnectionError, ResponseError, RedisTimeoutError) as exc:
                failed.append(f"{_address(sentinel)}: {type(exc).__name__} {exc}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                # The Sentinel that knew is asked first next time, as in redis-py.
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                return state["ip"], state["port"]
            answered = True
            failed.append(f"{_address(sentinel)}: no primary {service_name!r} up")
        if refused and not answered:
            raise SentinelAuthenticationError(
                "the Sentinels refused kvgate's credentials for them (redis.sentinel_username, "
                "redis.sentinel_password_env; the primary's own are redis.url's): "
                + "; ".join(refused))
        raise MasterNotFoundError(f"No master found for {service_name!r}: {'; '.join(failed)}")


class _SentinelPrimary(aioredis.Redis):
    """The primary's client; closing it closes the connections to the Sentinels too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            await pool.sentinel_manager.aclose()


def _sentinel_primary(
    settings: RedisSettings, timeout: float, connect_timeout: float, ssl: dict[str, Any]
) -> aioredis.Redis:
    assert settings.sentinel_master is not None
    params: dict[str, Any] = dict(parse_url(settings.url))
    for key in ("host", "port", "connection_class"):  # the Sentinels name the primary
        params.pop(key, None)
    tls = settings.url.startswith("rediss://")
    sockets = {"socket_timeout": timeout, "socket_connect_timeout": connect_timeout}
    # The URL's TLS parameters win over `ssl_ca_file` (as redis-py's from_url has them), and
    # given twice to master_for they were a TypeError at start.
    tls_params = {**ssl, **{k: v for k, v in params.items() if k.startswith("ssl_")}}
    params = {k: v for k, v in params.items() if not k.startswith("ssl_")}
    # The Sentinels are reached like the primary (TLS with the same settings, or not), with
    # credentials of their own: Sentinels keep a password apart from the primary's (their own
    # `requirepass`), and many have none.
    auth = {k: v for k, v in (("username", settings.sentinel_username),
                              ("password", settings.sentinel_password)) if v is not None}
    sentinel_kwargs: dict[str, Any] = {
        **sockets, **auth, **({"ssl": True, **tls_params} if tls else {})}
    sentinel = _Sentinels(  # type: ignore[no-untyped-call, unused-ignore]
        settings.sentinel_addresses(), sentinel_kwargs=sentinel_kwargs)
    client: aioredis.Redis = sentinel.master_for(
        settings.sentinel_master,
        redis_class=_SentinelPrimary,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=settings.max_connections,
        timeout=settings.pool_timeout_ms / 1000,
        health_check_interval=30,
        ssl=tls,
        **sockets,
        **tls_params,
        **params,
    )
    return client


def primary_locator(client: Any) -> PrimaryLocator | None:
    """How to find the current primary of a client built by `connect` with Sentinel (asks the
    Sentinels, with the client's credentials for them; refused: SentinelAuthenticationError);
    None for other clients, whose address is fixed."""
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        locate: PrimaryLocator = pool.get_master_address
        return locate
    return None


def redis_address(settings: RedisSettings) -> str:
    """Where `settings` lead, for people: a URL without user name or password. The services
    name it when they start and `kvgate-inspect` before it reads, so a reader sees at once
    which server a process uses (a laptop's own Redis on the default port is easy to reach by
    mistake)."""
    params: dict[str, Any] = dict(parse_url(settings.url))
    db = int(params.get("db") or 0)
    if "path" in params:
        return f"unix://{params['path']}?db={db}"
    scheme = settings.url.split("://", 1)[0]
    if settings.sentinel_master is not None:
        return (f"Sentinel master {settings.sentinel_master} via "
                f"{', '.join(settings.sentinels)} ({scheme}, db {db})")
    host = str(params.get("host") or "localhost")
    if ":" in host:
        host = f"[{host}]"
    address = f"{scheme}://{host}:{int(params.get('port') or 6379)}"
    return f"Redis Cluster via {address}" if settings.cluster else f"{address}/{db}"


SAFE_EVICTION = "noeviction"


async def eviction_warning(client: Any) -> str | None:
    """A warning for people when the server may evict kvgate's keys, else None.

    Budgets, queues and leases are Redis keys: a server under memory pressure with an eviction
    policy other than ``noeviction`` drops some of them silently (a node's budget, a queued
    task), where ``noeviction`` refuses writes and every caller sees the error. Managed
    services often forbid CONFIG; then nothing can be said and nothing is."""
    try:
        reply = await client.config_get("maxmemory-policy")
    except REDIS_ERRORS:  # a Redis Cluster none of whose nodes answers included
        return None
    if isinstance(reply, dict):
        policy = next(iter(reply.values()), None)
        if isinstance(policy, bytes):
            policy = policy.decode()
        if isinstance(policy, str) and policy != SAFE_EVICTION:
            return (f"Redis maxmemory-policy is {policy}: under memory pressure it may evict "
                    f"kvgate's budgets, queues and leases; set it to {SAFE_EVICTION}")
    return None


MIN_VERSION = (6, 2)
"""The oldest Redis whose commands every script uses (`ZADD ... LT`, 6.2)."""
MIN_VERSION_SHARDED = (7, 0)
"""The oldest with `SPUBLISH`/`SSUBSCRIBE` (`redis.sharded_pubsub`)."""


def version_problem(version: str, *, sharded_pubsub: bool) -> str | None:
    """What a server of `version` (INFO's `redis_version`) cannot do for kvgate, or None."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # a fork's own numbering: nothing can be said
    if found < MIN_VERSION:
        return (f"Redis {version} is older than {MIN_VERSION[0]}.{MIN_VERSION[1]}, which "
                "kvgate's scripts need (ZADD ... LT): some of them will fail with a syntax "
                "error; upgrade Redis")
    if sharded_pubsub and found < MIN_VERSION_SHARDED:
        return (f"Redis {version} has no sharded pub/sub ({MIN_VERSION_SHARDED[0]}.0): with "
                "redis.sharded_pubsub no release wake-up is sent or received; upgrade Redis or "
                "turn sharded_pubsub off")
    return None


async def version_error(client: Any, settings: RedisSettings) -> str | None:
    """`version_problem` of the server (on a cluster, of its oldest node), or None when it
    cannot be read (Redis not up yet: the services start anyway and retry)."""
    try:
        reply = await client.info("server")
    except REDIS_ERRORS:
        return None
    replies = [reply] if "redis_version" in reply else [
        r for r in reply.values() if isinstance(r, dict)]
    problems = (version_problem(str(r.get("redis_version", "")),
                                sharded_pubsub=settings.sharded_pubsub) for r in replies)
    return next((p for p in problems if p is not None), None)

