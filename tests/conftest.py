"""Shared fixtures: a real redis-server per test session, a clean database per test.

Every server these fixtures empty (FLUSHDB, FLUSHALL, SCRIPT FLUSH) is one the suite started
itself: a private redis-server child process on a free loopback port by default, or a
testcontainers Redis when KVGATE_TEST_DOCKER=1 and a Docker engine answers. `REDIS_URL` is
removed from the environment for the whole session, so neither a fixture, nor `parse_config`
(which reads it), nor a child process can reach the server a developer's shell points at.

KVGATE_TEST_EXTERNAL_REDIS_URL=redis://host:port/db opts in to running the tests that take the
`pool_redis` fixture against an existing server (to check another Redis version or a managed
service). Such a test works only under a pool name unique to it, so all its keys fall under
``kvg:{<pool>}:``; afterwards the fixture deletes the keys under that prefix (SCAN + UNLINK) and
nothing else. The external server is never flushed and never sent SCRIPT FLUSH, and a test that
also asks for `redis_client` or `redis_url` (it flushes, touches the scheduler's global keys or
needs the whole server) gets the private server instead.

KVGATE_TEST_NO_SKIP=1 (set by `make test`, which installs everything the suite needs) turns any
skipped test into a failure, so a missing tool cannot hide a test in CI.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from redis.asyncio.cluster import RedisCluster

from admission.keys import PoolKeys
from admission.scripts import allow_frozen_clock
from bench.common.localredis import LocalCluster, LocalRedis, start_cluster, start_redis
from tests.live import Processes
from tests.properties import PROFILE
from tests.rawnode import Handler

# Tests stop and move time by writing the pool clock's frozen_us; only a process that says so
# honours it (services never do), so the suite says so before any script is registered.
allow_frozen_clock()

# Hypothesis' defaults (an example database under .hypothesis/, a 200 ms deadline) make a
# property's result depend on the checkout and on the machine's load; see tests/properties.py.
settings.load_profile(PROFILE)

EXTERNAL_REDIS_ENV = "KVGATE_TEST_EXTERNAL_REDIS_URL"
NO_SKIP_ENV = "KVGATE_TEST_NO_SKIP"
# A test that asks for one of these needs a server it may empty: never the external one.
PRIVATE_REDIS_FIXTURES = frozenset({"redis_client", "redis_url"})


def pytest_configure(config: pytest.Config) -> None:
    # The gateway's and scheduler's config loaders give REDIS_URL precedence over the file, and
    # child processes inherit it: with it gone, no test can reach a server it did not start.
    os.environ.pop("REDIS_URL", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `make test` runs the suite on two workers (pytest-xdist, --dist loadgroup). The slow
    # tests each run a whole stack of processes (simulated nodes, gateways, schedulers) against
    # wall-clock bounds: they go to one worker, one after another, so that no two of them share
    # the machine's cores while the other worker takes the quick tests.
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("slow"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and os.environ.get(NO_SKIP_ENV) == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, and {NO_SKIP_ENV}=1 forbids skips (make test installs what the suite "
            f"needs; install the missing piece in the Makefile): {reason}"
        )
    return report


def _docker_reachable() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A server this session started (and so may empty), never one from the environment."""
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


@dataclass(frozen=True)
class PoolRedis:
    """A client and a pool name no other test uses; `external` tells which server it is."""

    client: aioredis.Redis
    pool: str
    external: bool

    @property
    def keys(self) -> PoolKeys:
        return PoolKeys(self.pool)


async def delete_prefix(client: aioredis.Redis, prefix: str) -> int:
    """UNLINK every key under `prefix` (SCAN, so a large database is not blocked); the count."""
    pattern = prefix.replace("\\", "\\\\")
    for special in "*?[]":
        pattern = pattern.replace(special, "\\" + special)
    deleted = 0
    batch: list[bytes] = []
    async for key in client.scan_iter(match=pattern + "*", count=500):
        batch.append(key)
        if len(batch) == 500:
            deleted += await client.unlink(*batch)
            batch.clear()
    if batch:
        deleted += await client.unlink(*batch)
    return deleted


@pytest.fixture
async def pool_redis(request: pytest.FixtureRequest) -> AsyncIterator[PoolRedis]:
    """A pool of its own: on the opted-in external server when the test can run there."""
    pool = f"kvgate-test-{uuid.uuid4().hex[:16]}"
    external_url = os.environ.get(EXTERNAL_REDIS_ENV, "")
    external = bool(external_url) and not PRIVATE_REDIS_FIXTURES & set(request.fixturenames)
    if external:
        client = aioredis.Redis.from_url(external_url)
    else:
        # The session's own server, emptied as `redis_client` empties it (the test may ask for
        # both: FLUSHDB on the same server twice is harmless).
        client = aioredis.Redis.from_url(request.getfixturevalue("redis_url"))
        await client.flushdb()
        await client.script_flush()
    try:
        yield PoolRedis(client, pool, external=external)
    finally:
        try:
            if external:
                await delete_prefix(client, PoolKeys(pool).prefix)
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


@pytest.fixture
async def procs() -> AsyncIterator[Processes]:
    """Service processes (gateways, schedulers, vLLM stand-ins) the test starts; all are
    stopped, and their files removed, afterwards."""
    processes = Processes()
    try:
        yield processes
    finally:
        await asyncio.to_thread(processes.cleanup)


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


PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
"""The environment's proxy settings, which httpx and Go's net/http read."""


@pytest.fixture
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment without proxy settings (either case), for a test to set its own."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """Starts a raw asyncio server running a handler per connection (a misbehaving node:
    tests.rawnode) and returns its base URL; all are closed after the test."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
