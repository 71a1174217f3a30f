"""A gateway process's SIGTERM is bounded by ``--shutdown-timeout``: streams that would outlast
it are cut there, their reservations settled, and the process exits.

A real gateway process, a real Redis (the `redis_url` fixture), and a node that streams one
token every 100 ms (`InstantBackend`); the client reads the bytes itself to see where the
stream ends. The requests still on their way to the queue when the queued ones are answered
(step 3) are timed by hand: an in-process gateway, its `answer_queued` called by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from admission.config import load_config
from admission.scripts import register_scripts
from admission.store import PoolStore
from admission.tiers import Tier, Zone
from bench.common.instant_backend import InstantBackend
from bench.common.localredis import LocalRedis
from gateway.shutdown import (
    BACKGROUND_STOP_S,
    CANCEL_GRACE_S,
    EXIT_RESERVE_S,
    QUEUED_ANSWER_S,
    SETTLE_DRAIN_S,
    SETTLE_MARGIN_S,
)
from gateway.state import IN_FLIGHT
from tests.gateway_harness import (
    BIG,
    EPOCH,
    KEYS,
    Harness,
    eventually,
    running_gateway,
    serve_backend,
    start_gateway_process,
)
from tests.test_gateway_process import _toml

TIMEOUT_S = 3.0
TOKEN_MS = 100
LONG_TOKENS = 200
"""A 20 s stream: far beyond the timeout, and beyond twice it."""
SHORT_TOKENS = 10
"""A 1 s stream: it ends inside the timeout and must reach the client whole."""
AUTH = {"Authorization": f"Bearer {KEYS['vip']}"}
HEALTHY_EXIT_S = 2.0
"""With Redis up the settle takes milliseconds; this leaves room for a loaded machine and the
interpreter's exit, well under `SETTLE_MARGIN_S` (the bound when Redis is down)."""


@contextlib.asynccontextmanager
async def gateway_process(config: Path, redis_url: str) -> AsyncIterator[
        tuple[asyncio.subprocess.Process, str]]:
    """`python -m gateway` with `--shutdown-timeout` TIMEOUT_S; (process, base URL)."""
    process, url = await start_gateway_process(
        config, redis_url, "--log-level", "WARNING", "--shutdown-timeout", str(TIMEOUT_S))
    try:
        yield process, url
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _pool(tmp_path: Path, backend_url: str, client: aioredis.Redis, *, room: int
                ) -> tuple[Path, PoolStore]:
    """The gateway's config file for `backend_url`, and its pool's store with `room` tokens
    published on the one node (0: every request queues)."""
    config = tmp_path / "gateway.toml"
    config.write_text(_toml(backend_url))
    store = PoolStore(client, register_scripts(client), "demo",
                      load_config(config, env={}).pool_policy("demo"))
    await store.publish_state(EPOCH, Zone.GREEN, {"node-0": room})
    return config, store


async def _stderr(process: asyncio.subprocess.Process) -> str:
    assert process.stderr is not None
    return (await process.stderr.read()).decode()


class Stream:
    """One streamed completion, read to its end (clean or not) by a background task."""

    def __init__(self, http: aiohttp.ClientSession, url: str, tokens: int) -> None:
        self.flowing = asyncio.Event()
        """Set once the first token reached the client."""
        self.task_id = ""
        self.body = b""
        self._task = asyncio.create_task(self._read(http, url, tokens))

    async def _read(self, http: aiohttp.ClientSession, url: str, tokens: int) -> None:
        response = await http.post(url + "/v1/completions", json={
            "model": "demo", "prompt": "hello", "max_tokens": tokens, "stream": True})
        assert response.status == 200, await response.text()
        self.task_id = response.headers["X-Request-Id"]
        with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            async for line in response.content:
                self.body += line
                if b'"text"' in line:
                    self.flowing.set()

    async def started(self) -> None:
        await asyncio.wait_for(self.flowing.wait(), 30)

    async def ended(self) -> bytes:
        await self._task
        return self.body


async def test_sigterm_cuts_streams_at_the_timeout_settles_and_exits(
    redis_url: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    backend = InstantBackend(model="demo", token_interval_ms=TOKEN_MS,
                             whole_answer_delay_ms=LONG_TOKENS * TOKEN_MS)
    async with serve_backend(backend) as backend_url:
        config, store = await _pool(tmp_path, backend_url, redis_client, room=1_000_000)
        async with gateway_process(config, redis_url) as (process, url), \
                aiohttp.ClientSession(headers=AUTH) as http:
            long = Stream(http, url, LONG_TOKENS)
            await long.started()
            short = Stream(http, url, SHORT_TOKENS)
            await short.started()
            # A whole answer the node works on for 20 s: silent until its end.
            whole_answer = asyncio.create_task(http.post(url + "/v1/completions", json={
                "model": "demo", "prompt": "hello", "max_tokens": LONG_TOKENS}))
            async def at_the_node() -> bool:
                return len(backend.received) == 3

            await eventually(at_the_node)
            sent_at = time.monotonic()
            process.send_signal(signal.SIGTERM)

            async def refused() -> bool:
                try:
                    async with aiohttp.ClientSession() as fresh:
                        await fresh.get(url + "/healthz")
                except aiohttp.ClientConnectionError:
                    return True
                return False

            # New connections are refused at once, while the streams still run.
            await eventually(refused, within_s=TIMEOUT_S / 2)
            assert process.returncode is None

            short_body, long_body = await short.ended(), await long.ended()
            cut_at = time.monotonic() - sent_at
            code = await asyncio.wait_for(process.wait(), TIMEOUT_S + SETTLE_MARGIN_S + 5)
            took = time.monotonic() - sent_at
            stderr = await _stderr(process)
        print(f"SIGTERM to stream cut {cut_at:.2f} s, to exit {took:.2f} s")
        assert code == 0, stderr
        assert "Traceback" not in stderr, stderr

        # The short stream ended inside the timeout: whole, with its [DONE].
        assert short_body.endswith(b"data: [DONE]\n\n")
        assert short_body.count(b'"text"') == SHORT_TOKENS
        # The long one was cut at the timeout: no [DONE], a fraction of its tokens.
        assert b"[DONE]" not in long_body
        assert 0 < long_body.count(b'"text"') < LONG_TOKENS / 2
        assert TIMEOUT_S - 0.2 <= cut_at < TIMEOUT_S + HEALTHY_EXIT_S, cut_at
        assert TIMEOUT_S - 0.2 <= took < TIMEOUT_S + HEALTHY_EXIT_S, took
        # The node's generation was aborted, not left running.
        await asyncio.wait_for(backend.aborted.wait(), 5)
        # The whole answer, cut with no byte of it sent, gets an answer it can retry on,
        # not a connection closed without one.
        response = await whole_answer
        error = (await response.json())["error"]
        assert (response.status, error["code"]) == (503, "gateway_shutting_down"), error
        assert int(response.headers["retry-after-ms"]) >= 1000
        assert response.headers["Connection"].lower() == "close"

    # Nothing is left reserved: both tasks ended in Redis before the process exited.
    whole, cut = await store.task(short.task_id), await store.task(long.task_id)
    assert whole is not None and whole["state"] == "settled"
    assert cut is not None and cut["state"] == "cancelled"
    # Charged for what was generated before the cut (prompt + tokens sent), not refunded.
    assert int(cut["usage"]) > 0
    reserved = await redis_client.hgetall(store.keys.node_reserved)
    assert all(int(v) == 0 for v in reserved.values()), reserved
    for raw in await redis_client.zrange(store.keys.leases, 0, -1):
        gateway = raw.decode() if isinstance(raw, bytes) else str(raw)
        assert await redis_client.scard(store.keys.gateway_tasks_key(gateway)) == 0


async def test_with_redis_down_the_settle_margin_still_bounds_the_exit(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path
) -> None:
    """Finishes that cannot reach Redis are retried for a bounded time, then left to the
    lease reaper: the process still exits within the timeout plus the settle margin."""
    server = redis_factory()
    client = aioredis.Redis.from_url(server.url)
    backend = InstantBackend(model="demo", token_interval_ms=TOKEN_MS)
    try:
        async with serve_backend(backend) as backend_url:
            config, _ = await _pool(tmp_path, backend_url, client, room=1_000_000)
            async with gateway_process(config, server.url) as (process, url), \
                    aiohttp.ClientSession(headers=AUTH) as http:
                long = Stream(http, url, LONG_TOKENS)
                await long.started()
                server.kill()
                sent_at = time.monotonic()
                process.send_signal(signal.SIGTERM)
                body = await long.ended()
                code = await asyncio.wait_for(process.wait(), TIMEOUT_S + SETTLE_MARGIN_S + 5)
                took = time.monotonic() - sent_at
                stderr = await _stderr(process)
    finally:
        await client.aclose()
    print(f"Redis down: SIGTERM to exit {took:.2f} s")
    assert code == 0, stderr
    assert b"[DONE]" not in body
    assert TIMEOUT_S - 0.2 <= took < TIMEOUT_S + SETTLE_MARGIN_S + 1.0, took
    assert f"1 of 1 requests still running after {TIMEOUT_S:.1f} s: cancelling them" in stderr
    assert "Traceback" not in stderr, stderr


def test_the_margin_covers_its_parts() -> None:
    """Each step after the timeout has its own bound; the deadline over them is the margin,
    so a step that takes its whole bound is never the one cut short."""
    assert (QUEUED_ANSWER_S + CANCEL_GRACE_S + SETTLE_DRAIN_S + BACKGROUND_STOP_S
            + EXIT_RESERVE_S) <= SETTLE_MARGIN_S


async def test_a_request_still_queued_at_the_timeout_gets_a_503_it_can_retry(
    redis_url: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """The pool has no room, so the request waits in the queue past the shutdown timeout: it is
    answered 503 with a retry hint (another gateway can take it) and leaves the queue, instead
    of having its connection cut."""
    backend = InstantBackend(model="demo", token_interval_ms=TOKEN_MS)
    async with serve_backend(backend) as backend_url:
        config, store = await _pool(tmp_path, backend_url, redis_client, room=0)
        async with gateway_process(config, redis_url) as (process, url), \
                aiohttp.ClientSession(headers=AUTH) as http:
            answer = asyncio.create_task(http.post(url + "/v1/completions", json={
                "model": "demo", "prompt": "hello", "max_tokens": 4}))

            async def waiting() -> bool:
                return bool(await redis_client.zcard(store.keys.queue(Tier.VIP)))

            await eventually(waiting)
            sent_at = time.monotonic()
            process.send_signal(signal.SIGTERM)
            response = await answer
            answered_at = time.monotonic() - sent_at
            body = await response.json()
            code = await asyncio.wait_for(process.wait(), TIMEOUT_S + SETTLE_MARGIN_S + 5)
            stderr = await _stderr(process)
        assert code == 0, stderr
        assert response.status == 503, body
        assert body["error"]["code"] == "gateway_shutting_down"
        assert int(response.headers["Retry-After"]) >= 1
        assert response.headers.get("x-should-retry") != "false"
        assert TIMEOUT_S - 0.2 <= answered_at < TIMEOUT_S + HEALTHY_EXIT_S, answered_at
        assert "1 queued requests answered 503" in stderr
    assert await redis_client.zcard(store.keys.queue(Tier.VIP)) == 0
    task = await store.task(response.headers["X-Request-Id"]) if (
        "X-Request-Id" in response.headers) else None
    assert task is None or task["state"] == "cancelled"
    assert await redis_client.hgetall(store.keys.tenant_queued) == {}


# --- requests on their way to the queue when the queued ones are answered -----------------


async def _late_chat(http: aiohttp.ClientSession, gw: Harness, rest: asyncio.Event
                     ) -> aiohttp.ClientResponse:
    """A Batch chat whose body's second half is sent once `rest` is set."""
    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "demo", "messages": [{"role": "user", "content": "late"}], '
        await rest.wait()
        yield b'"max_tokens": 4}'

    return await http.post(gw.url + "/v1/chat/completions", data=body(),
                           headers={**gw.auth("batch"), "Content-Type": "application/json"})


async def _handled(gw: Harness) -> None:
    in_flight = gw.app[IN_FLIGHT]

    async def started() -> bool:
        return len(in_flight) == 1

    await eventually(started)


async def _told_to_retry_elsewhere(response: aiohttp.ClientResponse) -> None:
    body = await response.json()
    assert response.status == 503, body
    assert body["error"]["code"] == "gateway_shutting_down"
    assert int(response.headers["Retry-After"]) >= 1
    assert response.headers.get("x-should-retry") != "false"


async def test_a_request_whose_body_arrives_after_the_queued_were_answered_gets_the_503(
    redis_url: str, redis_client: aioredis.Redis,
) -> None:
    """Its handler was reading the body when `answer_queued` ran: it reaches admission
    afterwards and is answered as the queued were, without a task."""
    async with running_gateway(redis_url) as gw, aiohttp.ClientSession() as http:
        await gw.publish(Zone.YELLOW, BIG, extra={"drain_2": 0})  # Batch would queue
        rest = asyncio.Event()
        answer = asyncio.ensure_future(_late_chat(http, gw, rest))
        await _handled(gw)
        assert gw.gateway.admitter.answer_queued() == 0
        rest.set()
        response = await asyncio.wait_for(answer, 5)
        await _told_to_retry_elsewhere(response)
        assert "X-Request-Id" not in response.headers  # no task was written
        assert await gw.queued(int(Tier.BATCH)) == 0
        assert await redis_client.hgetall(gw.store.keys.tenant_queued) == {}


@pytest.mark.parametrize("zone", [Zone.YELLOW, Zone.GREEN])
async def test_a_request_whose_admit_was_in_flight_when_the_queued_were_answered_gets_the_503(
    redis_factory: Callable[..., LocalRedis], zone: Zone,
) -> None:
    """Redis is paused (SIGSTOP) while the request's admit is on its way: `answer_queued` runs
    before the reply comes. Queued (YELLOW) or released (GREEN) by that reply, the request is
    answered 503 with a retry hint, its task cancelled at once: out of the queue, nothing left
    reserved, the node never asked (what still runs is cut within `QUEUED_ANSWER_S`)."""
    server = redis_factory()
    async with running_gateway(server.url) as gw, aiohttp.ClientSession() as http:
        await gw.publish(zone, BIG, extra={"drain_2": 0})
        rest = asyncio.Event()
        answer = asyncio.ensure_future(_late_chat(http, gw, rest))
        await _handled(gw)
        live = gw.gateway.settler.live

        async def admitting() -> bool:
            return len(live) == 1

        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            rest.set()
            await eventually(admitting)
            assert gw.gateway.admitter.answer_queued() == 0
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        response = await asyncio.wait_for(answer, 5)
        await _told_to_retry_elsewhere(response)
        await gw.settled()
        record = await gw.task(response.headers["X-Request-Id"])
        assert record["state"] == "cancelled"
        assert await gw.queued(int(Tier.BATCH)) == 0
        assert await gw.redis.hgetall(gw.store.keys.tenant_queued) == {}
        reserved = await gw.redis.hgetall(gw.store.keys.node_reserved)
        assert all(int(v) == 0 for v in reserved.values()), reserved
        assert gw.backends[0].received == []
