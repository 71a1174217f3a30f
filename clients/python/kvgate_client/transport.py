"""httpx transports that apply the retry policy below any httpx client (and so below the
official OpenAI SDK, which takes an `http_client`).

Working at the transport level means a retry happens only before a response is handed up:
once a status line below 400 (or a final error) has been returned, its body, streamed or not,
belongs to the caller and is never replayed.

Every attempt tells the gateway how long its client will wait (`X-Stainless-Read-Timeout`, the
request's read timeout, the header the OpenAI SDKs send): a request still queued when that time
nears gets its 429 and retry hint while the client listens, instead of the client timing out
first with no hint at all.
"""

from __future__ import annotations

import math
import random
import ssl
import time
from collections.abc import Awaitable, Callable

import anyio
import httpx

from .budget import RetryBudget
from .policy import RetryPolicy
from .retrying import CANCELED, Retrier, RetryStats

# Sent on every retry so that access logs, proxies and the node (the gateway forwards it
# unread) can tell retries from first attempts.
RETRY_COUNT_HEADER = "x-kvgate-retry-count"

# The client's read timeout in seconds, as the OpenAI SDKs declare it: how long the client waits
# for the first byte of the answer. The gateway ends the request's wait in its queue early
# enough for its 429 and retry hint to reach the client in that time (0.5 s or a tenth of it
# before), and for a whole, non-streamed answer, whose first byte comes only once all of it is
# generated, earlier still by the time the generation may take. A request that already carries
# the header keeps its own value.
READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
# The gateway's header for the longest wait in its queue alone, in seconds (it keeps nothing
# back). The transports do not send it; a caller may.
REQUEST_TIMEOUT_HEADER = "x-request-timeout"

# Failures where the request either never reached the server or the connection died before a
# status line came back. Read and write *timeouts* are not here: the request may be running on
# a GPU, and a second copy doubles the load exactly when the fleet is slow. A proxy that cannot
# be reached is a ConnectError (retried: the request reached no one); one that refuses the
# tunnel (a CONNECT answered 407, 403, 502) is an httpx.ProxyError, not retried, as a TLS
# certificate the client does not trust is not (see `retryable`): each fails the same way
# every time, so a retry only delays the error. A RemoteProtocolError is retried only when the
# server closed the connection without answering (see `retryable`).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)

# httpcore's message (HTTP/1.1) for a connection the server closed before any response: a
# kept-alive connection it closed as the request went out, or a server that died reading it.
# httpcore has no type of its own for it; every other RemoteProtocolError is a reply that came
# but broke the protocol (a malformed status line or header), so the request may have run.
# (httpcore parses nothing before a head is whole, so a close after part of one reads the same
# and is retried; the Go SDK, which parses the status line as it comes, may refuse those.)
NO_RESPONSE = "Server disconnected without sending a response"


def retryable(exc: BaseException) -> bool:
    """Whether a connection error is worth another attempt: not when the server's (or the
    proxy's) certificate failed verification, which httpx reports as a ConnectError caused by
    ssl.SSLCertVerificationError, nor when the server answered something that is not HTTP (a
    RemoteProtocolError other than a connection closed without a response). The Go SDK draws
    the same lines (IsConnectionError)."""
    if isinstance(exc, httpx.RemoteProtocolError) and not str(exc).startswith(NO_RESPONSE):
        return False
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return False
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return True


# Longer waits are declared as this: past the gateway's own cap (1e9 s) and any Go
# time.Duration, and their milliseconds stay finite.
MAX_DECLARED_S = 1e10


def read_timeout(wait_s: float) -> str:
    """The `X-Stainless-Read-Timeout` value for a client that waits `wait_s` for an answer: the
    seconds, to the millisecond, rounded down; at least 1 ms (at most `MAX_DECLARED_S`)."""
    # A decimal wait is seldom exact in binary (1.005 * 1000 is 1004.9999999999999): rounding
    # to the nanosecond, the Go SDK's resolution, before the floor keeps 1.005 s at 1005 ms.
    ms = max(1, math.floor(round(min(wait_s, MAX_DECLARED_S) * 1000, 6)))
    return f"{ms / 1000:.3f}"


def _declare_timeout(request: httpx.Request) -> None:
    if READ_TIMEOUT_HEADER in request.headers:
        return
    timeouts = request.extensions.get("timeout")
    read = timeouts.get("read") if isinstance(timeouts, dict) else None
    # No read timeout (None) means no deadline of the client's own: the tier's applies.
    if isinstance(read, int | float) and math.isfinite(read) and read > 0:
        request.headers[READ_TIMEOUT_HEADER] = read_timeout(float(read))


def _make_retrier(
    retrier: Retrier | None,
    policy: RetryPolicy | None,
    budget: RetryBudget | None,
    clock: Callable[[], float],
    wall_clock: Callable[[], float],
    rand: Callable[[], float],
) -> Retrier:
    if retrier is not None:
        if policy is not None or budget is not None:
            raise TypeError("pass either retrier or policy/budget, not both")
        return retrier
    return Retrier(policy, budget, clock=clock, wall_clock=wall_clock, rand=rand)


class RetryTransport(httpx.BaseTransport):
    """Wraps a sync transport (an `httpx.HTTPTransport` by default) with the retry policy."""

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        retrier: Retrier | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inner = transport if transport is not None else httpx.HTTPTransport()
        self.retrier = _make_retrier(retrier, policy, budget, clock, wall_clock, rand)
        self._sleep = sleep

    @property
    def budget(self) -> RetryBudget:
        return self.retrier.budget

    def stats(self) -> RetryStats:
        return self.retrier.stats()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        # Buffer the body once so every attempt can send it again (a generator body could not).
        request.read()
        # The read timeout is the same for every attempt, and each attempt sends this request.
        _declare_timeout(request)
        state = self.retrier.begin()
        rejected: httpx.Response | None = None
        while True:
            try:
                response = self.inner.handle_request(request)
            except CONNECTION_ERRORS as exc:
                decision = state.after_error(exc, retryable=retryable(exc))
                if not decision.retry:
                    raise
            except BaseException as exc:  # a KeyboardInterrupt too: every request ends counted
                state.after_error(exc, retryable=False)
                raise
            else:
                decision = state.after_response(response.status_code, response.headers)
                if not decision.retry:
                    return response
                rejected = response
            try:
                # The retry is counted (its budget token taken) from here: whatever ends it
                # before it is sent, in the body's read as in the backoff, refunds the token.
                if rejected is not None:
                    _discard(rejected)
                    rejected = None
                self._sleep(decision.delay_s)
            except BaseException:
                state.stop(CANCELED)
                raise
            request.headers[RETRY_COUNT_HEADER] = str(state.start_retry())

    def close(self) -> None:
        self.inner.close()


class AsyncRetryTransport(httpx.AsyncBaseTransport):
    """Wraps an async transport (an `httpx.AsyncHTTPTransport` by default) with the policy."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        retrier: Retrier | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
        # anyio's, not asyncio's: httpx and the openai SDK also run under trio.
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self.inner = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.retrier = _make_retrier(retrier, policy, budget, clock, wall_clock, rand)
        self._sleep = sleep

    @property
    def budget(self) -> RetryBudget:
        return self.retrier.budget

    def stats(self) -> RetryStats:
        return self.retrier.stats()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        _declare_timeout(request)
        state = self.retrier.begin()
        rejected: httpx.Response | None = None
        while True:
            try:
                response = await self.inner.handle_async_request(request)
            except CONNECTION_ERRORS as exc:
                decision = state.after_error(exc, retryable=retryable(exc))
                if not decision.retry:
                    raise
            except BaseException as exc:  # asyncio.CancelledError too
                state.after_error(exc, retryable=False)
                raise
            else:
                decision = state.after_response(response.status_code, response.headers)
                if not decision.retry:
                    return response
                rejected = response
            try:
                if rejected is not None:  # as in RetryTransport: a cancel here refunds
                    await _adiscard(rejected)
                    rejected = None
                await self._sleep(decision.delay_s)
            except BaseException:
                state.stop(CANCELED)
                raise
            request.headers[RETRY_COUNT_HEADER] = str(state.start_retry())

    async def aclose(self) -> None:
        await self.inner.aclose()


def _discard(response: httpx.Response) -> None:
    # Reading the (small) error body first lets the connection go back to the pool.
    try:
        response.read()
    except httpx.HTTPError:
        pass
    finally:
        response.close()


async def _adiscard(response: httpx.Response) -> None:
    try:
        await response.aread()
    except httpx.HTTPError:
        pass
    finally:
        await response.aclose()
