"""The SDK against the real gateway: the session's redis-server, the gateway (aiohttp, serving
in this event loop) and an instant vLLM-like backend, all on real sockets. The test plays the
scheduler: it holds the pool in RED (or GREEN, or YELLOW with a queue that never drains) by
publishing its state.

Sleeps are injected and only recorded (one may also change the zone, standing for the time
that passes), and the retry loop's clock is frozen: nothing waits for the hints received.
Attempts are counted at the gateway, by its own metrics: in RED every attempt of the `normal`
tenant is one `zone_red` rejection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

import kvgate_client
from admission.tiers import Zone
from gateway.handlers import client_deadline_ms
from gateway.parse import whole_answer_s
from kvgate_client import (
    RETRY_COUNT_HEADER,
    AsyncKvgateClient,
    AsyncRetryTransport,
    KvgateClient,
    RateLimitError,
    RetryBudget,
    RetryPolicy,
    RetryTransport,
    retrying,
)
from kvgate_client.budget import EARN_PER_REQUEST, MAX_TOKENS
from kvgate_client.transport import read_timeout
from tests.gateway_harness import (
    BIG,
    KEYS,
    POOL,
    Harness,
    eventually,
    queued_tokens_tenant,
    running_gateway,
)

MESSAGES: list[Any] = [{"role": "user", "content": "Summarise the plot of Hamlet."}]

# RED with the normal tier draining at 0.5 tasks/s and nothing queued: the gateway's hint is
# (0 + 1) / 0.5 = 2 s, spread upward by its retry_jitter (25%). Longer than the SDK's first
# backoff window (1 s), so a delay of at least 2 s can only come from the hint.
RED_HINT_MS = 2000
GATEWAY_JITTER = 1.25


def frozen_clock() -> float:
    return 0.0


class AsyncSleeps:
    """Records the delays asked for; `then` runs in place of the time passing."""

    def __init__(self, then: Callable[[], Awaitable[None]] | None = None) -> None:
        self.slept: list[float] = []
        self._then = then

    async def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        if self._then is not None:
            await self._then()


class Recording(httpx.AsyncBaseTransport):
    """The real HTTP transport, noting each attempt's retry-count header and answer."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.seen: list[tuple[str | None, int, httpx.Headers]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        retry = request.headers.get(RETRY_COUNT_HEADER)
        self.seen.append((retry, response.status_code, response.headers))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url) as harness:
        yield harness


async def hold_red(gw: Harness) -> None:
    await gw.publish(Zone.RED, capacity=0, extra={"drain_0": 0, "drain_1": 0.5, "drain_2": 0})


def drop_in(gw: Harness, transport: AsyncRetryTransport, who: str = "normal") -> openai.AsyncOpenAI:
    client = kvgate_client.async_openai(
        base_url=gw.url + "/v1", api_key=KEYS[who], retry_transport=transport
    )
    gw.clients.append(client)  # closed by the harness
    return client


def rejections(gw: Harness, reason: str, tier: str = "normal") -> int:
    value = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_rejections_total", {"pool": POOL, "tier": tier, "reason": reason}
    )
    return int(value or 0)


# --- (a) the retry budget bounds the load under sustained 429s ---------------------------------

REQUESTS = 1000
WORKERS = 6


@pytest.mark.parametrize("initial_tokens", [0.0, MAX_TOKENS], ids=["empty", "default-full"])
async def test_sustained_429s_cost_at_most_ten_percent_more_attempts(
    gw: Harness, initial_tokens: float
) -> None:
    await hold_red(gw)
    budget = RetryBudget(initial_tokens=initial_tokens)
    sleeps = AsyncSleeps()
    transport = AsyncRetryTransport(budget=budget, sleep=sleeps, clock=frozen_clock)
    client = drop_in(gw, transport)
    queue = list(range(REQUESTS))

    async def worker() -> None:
        while queue:
            queue.pop()
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8)

    await asyncio.gather(*(worker() for _ in range(WORKERS)))

    attempts = rejections(gw, "zone_red")  # counted by the gateway: every attempt was refused
    assert attempts == transport.stats().attempts  # and the SDK's own counter agrees
    # The budget's bound: each request earns 0.1 retry, plus what the bucket held at the start.
    # Empty at the start: the property, exactly. Full (the default, so that a one-shot
    # script can retry): 1.1x plus at most MAX_TOKENS attempts in all, 1.11x over 1,000 requests.
    assert attempts <= 1.1 * REQUESTS + initial_tokens
    # Retries did happen (the bucket was spent), and the budget is what stopped the others: the
    # policy alone would have made MAX_ATTEMPTS (3) attempts of every request.
    assert attempts >= REQUESTS * (1 + EARN_PER_REQUEST) - 1
    outcomes = transport.stats().outcomes
    assert set(outcomes) <= {retrying.BUDGET, retrying.MAX_ATTEMPTS}
    assert outcomes[retrying.BUDGET] >= REQUESTS - (attempts - REQUESTS)
    assert len(sleeps.slept) == attempts - REQUESTS


# --- (b) streaming through the openai drop-in -------------------------------------------------


def tokens(n: int) -> str:
    """What the instant backend generates: ' t0 t1 ...'."""
    return "".join(f" t{i}" for i in range(n))


async def test_async_drop_in_streams_chat_end_to_end(gw: Harness) -> None:
    await gw.publish(Zone.GREEN)
    sleeps = AsyncSleeps()
    client = drop_in(gw, AsyncRetryTransport(sleep=sleeps, clock=frozen_clock))
    raw = await client.chat.completions.with_raw_response.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in raw.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokens(6)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    assert sleeps.slept == []
    # Through the gateway, not around it: admitted, forwarded, settled at the streamed usage.
    await gw.settled()
    record = await gw.task(raw.headers["x-request-id"])
    assert record["state"] == "settled" and int(record["usage"]) == usage.total_tokens
    assert gw.backends[0].received[-1].body["stream"] is True


async def test_sync_drop_in_streams_completions_end_to_end(gw: Harness) -> None:
    await gw.publish(Zone.GREEN)
    slept: list[float] = []

    def run() -> str:
        # The blocking SDK in a worker thread; the gateway keeps serving in this loop.
        transport = RetryTransport(sleep=slept.append, clock=frozen_clock)
        client = kvgate_client.openai(
            base_url=gw.url + "/v1", api_key=KEYS["normal"], retry_transport=transport
        )
        with client:
            assert client.max_retries == 0
            stream = client.completions.create(
                model="demo", prompt="Once upon a time", max_tokens=5, stream=True
            )
            return "".join(chunk.choices[0].text for chunk in stream)

    assert await asyncio.to_thread(run) == tokens(5)
    assert slept == []
    assert gw.backends[0].received[-1].path == "/v1/completions"


async def test_stream_refused_in_red_is_retried_and_streams_once_green(gw: Harness) -> None:
    await hold_red(gw)

    async def scheduler_turns_green() -> None:
        await gw.publish(Zone.GREEN)

    sleeps = AsyncSleeps(then=scheduler_turns_green)
    recording = Recording()
    client = drop_in(gw, AsyncRetryTransport(recording, sleep=sleeps, clock=frozen_clock))
    stream = await client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=4, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == tokens(4)
    assert [(retry, status) for retry, status, _ in recording.seen] == [(None, 429), ("1", 200)]
    assert len(sleeps.slept) == 1 and sleeps.slept[0] >= RED_HINT_MS / 1000
    assert rejections(gw, "zone_red") == 1
    # Only the retry reached the backend, and the gateway passed the SDK's retry count on.
    [forwarded] = gw.backends[0].received
    headers = {k.lower(): v for k, v in forwarded.headers.items()}
    assert headers[RETRY_COUNT_HEADER] == "1"


# --- (c) the gateway's retry-after-ms is honoured ---------------------------------------------


async def test_every_delay_honours_the_gateways_retry_after_ms(gw: Harness) -> None:
    await hold_red(gw)
    policy = RetryPolicy()
    sleeps = AsyncSleeps()
    recording = Recording()
    # A budget large enough that every request makes all its attempts.
    budget = RetryBudget(max_tokens=100.0)
    client = drop_in(
        gw,
        AsyncRetryTransport(
            recording, policy=policy, budget=budget, sleep=sleeps, clock=frozen_clock
        ),
    )
    requests = 8
    for _ in range(requests):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8)
    assert len(recording.seen) == requests * policy.max_attempts
    assert all(status == 429 for _, status, _ in recording.seen)
    # Each sleep follows the 429 of the attempt before it (requests run one after another).
    caused = [
        (int(retry or 0), int(headers["retry-after-ms"]))
        for retry, _, headers in recording.seen
        if int(retry or 0) < policy.max_attempts - 1
    ]
    assert len(sleeps.slept) == len(caused) == requests * (policy.max_attempts - 1)
    hints = [hint_ms for _, hint_ms in caused]
    assert min(hints) >= RED_HINT_MS and max(hints) <= RED_HINT_MS * GATEWAY_JITTER
    assert len(set(hints)) > 1  # the gateway jitters its hints: each delay has its own
    for delay, (n, hint_ms) in zip(sleeps.slept, caused, strict=True):
        hint_s = hint_ms / 1000
        assert delay >= hint_s  # never sooner than the gateway asked
        # ... and within the policy's window above the hint.
        assert delay <= policy.delay(n, hint_s, lambda: 1.0)


# --- (d) x-should-retry: false ----------------------------------------------------------------

# A policy that would retry a 400: only the gateway's header can stop it.
RETRIES_400 = RetryPolicy(retryable_statuses=frozenset({400, 429, 503, 504}))


@pytest.mark.parametrize("policy", [RetryPolicy(), RETRIES_400], ids=["default", "retries-400"])
async def test_request_beyond_the_tenants_burst_is_not_retried(
    gw: Harness, policy: RetryPolicy
) -> None:
    await hold_red(gw)
    sleeps = AsyncSleeps()
    recording = Recording()
    transport = AsyncRetryTransport(recording, policy=policy, sleep=sleeps, clock=frozen_clock)
    client = drop_in(gw, transport, who="small")  # a burst of 1,000 tokens
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1024)
    assert info.value.code == "exceeds_burst"
    assert info.value.response.headers["x-should-retry"] == "false"
    assert len(recording.seen) == 1 and sleeps.slept == []
    assert rejections(gw, "exceeds_burst") == 1
    # Stopped by the header, not by the status table.
    assert transport.stats().outcomes == {retrying.SERVER_SAID_NO: 1}


# --- (e) the client's own timeout, declared to the gateway ------------------------------------

CLIENT_TIMEOUT_S = 3.0
# The harness's Batch tier waits 20 s in the queue; the client, 3 s. It declares that wait, and
# the gateway ends the request's wait in the queue early enough for its 429 to reach the
# client: 0.5 s (or a tenth) before, and for a whole answer earlier still by the time the
# answer may take (`upstream_ms_per_output_token` per decode step).
DECLARED = read_timeout(CLIENT_TIMEOUT_S)
MAX_TOKENS_ASKED = 8
# The 429 itself, not a retry of it: a retry would queue again.
ONE_ATTEMPT = RetryPolicy(max_attempts=1)


def queue_timeouts(gw: Harness) -> int:
    value = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_requests_total",
        {"pool": POOL, "tier": "batch", "outcome": "queue_timeout"})
    return int(value or 0)


def queue_deadline_s(gw: Harness, declared: str, *, stream: bool, max_tokens: int) -> float:
    """The queue deadline the gateway computes for a request that declares `declared`."""
    generation_s = whole_answer_s(stream, max_tokens,
                                  gw.config.gateway.upstream_ms_per_output_token / 1000)
    deadline_ms = client_deadline_ms(None, declared, generation_s=generation_s)
    assert deadline_ms is not None
    return deadline_ms / 1000


@pytest.mark.parametrize("mode", ["async-stream", "sync-whole"])
async def test_a_queued_request_gets_its_429_and_hint_before_the_client_gives_up(
    gw: Harness, mode: str
) -> None:
    """Without the client's declared timeout the gateway would keep the request queued for
    its tier's 20 s, and the client would time out at 3 s with no hint to wait for. A whole
    answer's 429 comes earlier than a stream's: had the request been released at its
    deadline, its answer would have had the time to be generated before the client's read
    timeout."""
    await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})  # Batch queues for ever
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=5.0)
    # Timed from the call itself: building the client (and starting a thread) is not the wait.
    if mode == "async-stream":
        async with AsyncKvgateClient(gw.url + "/v1", KEYS["batch"], policy=ONE_ATTEMPT,
                                     timeout=timeout) as aclient:
            started = time.monotonic()
            with pytest.raises(RateLimitError) as info:
                await aclient.stream_chat(POOL, MESSAGES, max_tokens=MAX_TOKENS_ASKED)
            answered_s = time.monotonic() - started
        error = info.value
    else:
        def run() -> tuple[RateLimitError, float]:
            with KvgateClient(gw.url + "/v1", KEYS["batch"], policy=ONE_ATTEMPT,
                              timeout=timeout) as client:
                started = time.monotonic()
                with pytest.raises(RateLimitError) as raised:
                    client.chat(POOL, MESSAGES, max_tokens=MAX_TOKENS_ASKED)
                return raised.value, time.monotonic() - started

        error, answered_s = await asyncio.to_thread(run)
    deadline_s = queue_deadline_s(gw, DECLARED, stream=mode == "async-stream",
                                  max_tokens=MAX_TOKENS_ASKED)
    if mode == "sync-whole":
        # 3 s less the margin and the time 8 tokens may take: sooner than a stream's 2.5 s.
        assert deadline_s < queue_deadline_s(gw, DECLARED, stream=True,
                                             max_tokens=MAX_TOKENS_ASKED)
    assert deadline_s <= answered_s < min(CLIENT_TIMEOUT_S, deadline_s + 0.5), answered_s
    assert error.code == "capacity_exceeded" and "waited" in error.message
    assert error.retry_after_ms is not None and error.retry_after_ms >= 1
    assert error.retry_after_ms == float(error.headers["retry-after-ms"])
    assert error.request_id is not None
    assert queue_timeouts(gw) == 1


async def test_a_whole_answer_through_the_sdk_leaves_its_generation_time_in_the_queue(
    gw: Harness,
) -> None:
    """The SDK declares the client's raw read timeout: the gateway keeps back, from a
    non-streamed request's queue deadline, the time its answer may take to generate, and
    none from a stream's. Read from the tasks' deadlines in Redis, against its clock."""
    await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})  # Batch queues for ever
    wait_s, max_tokens = 10.0, 30  # below the tier's 20 s: the client's deadline binds
    live = gw.gateway.settler.live
    pending: list[asyncio.Future[Any]] = []
    async with AsyncKvgateClient(gw.url + "/v1", KEYS["batch"], policy=ONE_ATTEMPT,
                                 timeout=httpx.Timeout(wait_s, connect=5.0)) as aclient:

        async def deadline_left_s(request: Awaitable[Any]) -> float:
            before = live.snapshot()
            pending.append(asyncio.ensure_future(request))
            return await gw.new_task_deadline_s(before)

        try:
            stream_left = await deadline_left_s(
                aclient.stream_chat(POOL, MESSAGES, max_tokens=max_tokens))
            whole_left = await deadline_left_s(
                aclient.chat(POOL, MESSAGES, max_tokens=max_tokens))
        finally:
            for request in pending:
                request.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    declared = read_timeout(wait_s)
    stream_s = queue_deadline_s(gw, declared, stream=True, max_tokens=max_tokens)
    whole_s = queue_deadline_s(gw, declared, stream=False, max_tokens=max_tokens)
    assert whole_s < stream_s - 1  # the generation allowance, beyond the tolerance below
    assert stream_s - 1 < stream_left <= stream_s, stream_left
    assert whole_s - 1 < whole_left <= whole_s, whole_left


# --- (f) the 429 protocol's scope and the tenant's cap on queued tokens -----------------------


async def test_a_tenants_cap_on_queued_tokens_is_a_rate_limit_error_with_its_scope(
    redis_url: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    adjust = queued_tokens_tenant(monkeypatch)

    async with running_gateway(redis_url, adjust=adjust) as gw, \
            AsyncKvgateClient(gw.url + "/v1", KEYS["flood"], policy=ONE_ATTEMPT) as aclient:
        await gw.publish(Zone.YELLOW)  # Normal never takes the fast path: everything queues
        queued = [asyncio.create_task(aclient.chat(POOL, MESSAGES, max_tokens=300))
                  for _ in range(3)]  # ~3 x 310 tokens of the 1,000

        async def three_queued() -> bool:
            return await gw.queued(1) == 3

        await eventually(three_queued)
        with pytest.raises(RateLimitError) as info:
            await aclient.chat(POOL, MESSAGES, max_tokens=300)
        error = info.value
        assert error.code == "rate_limit_exceeded_queued_tokens"
        assert (error.scope, error.backpressure_level, error.queue_depth) == ("key", "YELLOW", 3)
        assert error.retry_after_ms == float(error.headers["retry-after-ms"]) >= 1_000
        await gw.release((0, 10, 0))
        replies = await asyncio.gather(*queued)
    assert all(reply["choices"] for reply in replies)
