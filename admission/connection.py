"""Redis clients built the same way by every service: bounded pools, timeouts, TLS, cluster."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from admission.config import RedisSettings


def connect(settings: RedisSettings) -> Any:
    """A redis.asyncio client (or RedisCluster) for `settings`; no I/O until first use.

    A blocking pool caps connections at `max_connections` and makes callers wait up to
    `pool_timeout_ms` for one, instead of failing with MaxConnectionsError under load.
    Socket timeouts keep a stuck Redis from hanging requests forever.
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
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.max_connections,
        timeout=settings.pool_timeout_ms / 1000,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        health_check_interval=30,
        **ssl,
    )
    return aioredis.Redis(connection_pool=pool)
