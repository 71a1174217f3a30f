"""Shared fixtures: a real redis-server per test session, a clean database per test.

`REDIS_URL` in the environment points the tests at an existing server instead (it is flushed
between tests, so never point it at one that holds anything you care about). testcontainers is
used only when KVGATE_TEST_DOCKER=1 and a Docker engine answers; the default is a private
redis-server child process on a free port.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from admission.localredis import LocalCluster, LocalRedis, start_cluster, start_redis


def _docker_reachable() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    env_url = os.environ.get("REDIS_URL")
    if env_url:
        yield env_url
        return
    if os.environ.get("KVGATE_TEST_DOCKER") == "1" and _docker_reachable():
        from testcontainers.redis import RedisContainer

        with RedisContainer() as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
        return
    server = start_redis()
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    await client.script_flush()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., LocalRedis]]:
    """Start extra, private redis-servers (AUTH, TLS, restarts); all are stopped afterwards."""
    started: list[LocalRedis] = []

    def factory(**kwargs: object) -> LocalRedis:
        server = start_redis(**kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A real 3-master Redis Cluster on loopback, one per test module."""
    c = start_cluster(3)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
async def cluster_client(cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    """A RedisCluster client on `cluster`, emptied before the test."""
    c = RedisCluster.from_url(cluster.url)
    await c.initialize()
    await c.flushall()
    try:
        yield c
    finally:
        await c.aclose()
