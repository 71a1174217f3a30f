"""RetryTransport / AsyncRetryTransport over httpx.MockTransport, with a fake clock and sleep."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvgate_client import (
    READ_TIMEOUT_HEADER,
    REQUEST_TIMEOUT_HEADER,
    RETRY_COUNT_HEADER,
    APIStatusError,
    AsyncRetryTransport,
    InvalidResponseError,
    KvgateClient,
    KvgateError,
    RetryBudget,
    RetryPolicy,
    RetryTransport,
    StreamError,
)
from kvgate_client.retrying import BUDGET, DEADLINE, NOT_RETRYABLE, SERVER_SAID_NO

Handler = Callable[[httpx.Request], httpx.Response]


class FakeTime:
    """A monotonic clock that only moves when someone sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


class Seen:
    """What one attempt looked like on the wire (the Request object itself is reused)."""

    def __init__(self, request: httpx.Request) -> None:
        self.content = request.content
        self.retry_count = request.headers.get(RETRY_COUNT_HEADER)
        self.declared = (request.headers.get(READ_TIMEOUT_HEADER),
                         request.headers.get(REQUEST_TIMEOUT_HEADER))


def rejecting(
    statuses: list[int], headers: dict[str, str] | None = None
) -> tuple[Handler, list[Seen]]:
    """Answers the given statuses in turn, then 200 for ever; records every attempt."""
    seen: list[Seen] = []
    script: Iterator[int] = iter(statuses)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(Seen(request))
        status = next(script, 200)
        if status == 200:
            return httpx.Response(200, json={"ok": True})
        body = {"error": {"code": "capacity_exceeded", "message": "full", "retry_after_ms": 1}}
        return httpx.Response(status, headers=headers or {}, json=body)

    return handler, seen


def make_client(
    handler: Handler,
    t: FakeTime,
    policy: RetryPolicy | None = None,
    budget: RetryBudget | None = None,
) -> tuple[httpx.Client, RetryTransport]:
    transport = RetryTransport(
        httpx.MockTransport(handler),
        policy=policy,
        budget=budget,
        clock=t.clock,
        sleep=t.sleep,
        rand=random.Random(3).random,
    )
    return httpx.Client(transport=transport, base_url="http://gw"), transport


@pytest.mark.parametrize("status", [429, 503])
def test_retryable_statuses_are_retried(status: int) -> None:
    t = FakeTime()
    handler, seen = rejecting([status, status])
    client, transport = make_client(handler, t)
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 200
    assert len(seen) == 3 and len(t.sleeps) == 2
    # The body is replayed unchanged and retries are marked.
    assert {r.content for r in seen} == {b'{"prompt":"hi"}'}
    assert [r.retry_count for r in seen] == [None, "1", "2"]
    stats = transport.stats()
    assert (stats.requests, stats.attempts, stats.retries) == (1, 3, 2)


# 504 is a proxy's timeout (the gateway never sends one): the generation may still be running.
@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422, 500, 501, 502, 504])
def test_other_statuses_are_not_retried(status: int) -> None:
    t = FakeTime()
    handler, seen = rejecting([status])
    client, transport = make_client(handler, t)
    assert client.get("/").status_code == status
    assert len(seen) == 1 and t.sleeps == []
    assert transport.stats().outcomes == {NOT_RETRYABLE: 1}


def test_server_hint_is_a_floor() -> None:
    t = FakeTime()
    handler, seen = rejecting([429, 429], {"retry-after-ms": "2500", "retry-after": "3"})
    client, _ = make_client(handler, t)
    assert client.get("/").status_code == 200 and len(seen) == 3
    assert len(t.sleeps) == 2 and all(s >= 2.5 for s in t.sleeps)


def test_x_should_retry_false_is_obeyed() -> None:
    t = FakeTime()
    handler, seen = rejecting([429], {"x-should-retry": "false", "retry-after-ms": "10"})
    client, transport = make_client(handler, t)
    response = client.get("/")
    assert response.status_code == 429 and len(seen) == 1
    assert response.json()["error"]["code"] == "capacity_exceeded"  # body left for the caller
    assert transport.stats().outcomes == {SERVER_SAID_NO: 1}


def test_x_should_retry_true_overrides_the_status_table() -> None:
    t = FakeTime()
    handler, seen = rejecting([500], {"x-should-retry": "true"})
    client, _ = make_client(handler, t)
    assert client.get("/").status_code == 200 and len(seen) == 2


def test_gives_up_after_max_attempts_and_returns_last_response() -> None:
    t = FakeTime()
    handler, seen = rejecting([429] * 10)
    client, _ = make_client(handler, t, RetryPolicy(max_attempts=4))
    assert client.get("/").status_code == 429
    assert len(seen) == 4 and len(t.sleeps) == 3


def test_deadline_respected() -> None:
    t = FakeTime()
    handler, seen = rejecting([429] * 100, {"retry-after-ms": "2000"})
    policy = RetryPolicy(max_attempts=100, deadline_s=9.0)
    client, transport = make_client(handler, t, policy)
    assert client.get("/").status_code == 429
    assert t.now <= 9.0  # never slept past the deadline
    assert len(seen) >= 2  # but did use the time it had
    assert transport.stats().outcomes == {DEADLINE: 1}


def test_connection_errors_are_retried_timeouts_are_not() -> None:
    t = FakeTime()
    calls: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) <= 2:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200)

    client, _ = make_client(flaky, t)
    assert client.get("/").status_code == 200 and len(calls) == 3

    def slow(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ReadTimeout("slow", request=request)

    calls.clear()
    client, _ = make_client(slow, t)
    with pytest.raises(httpx.ReadTimeout):
        client.get("/")
    assert len(calls) == 1


def test_connection_errors_exhausted_raise_the_last_error() -> None:
    t = FakeTime()

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client, transport = make_client(down, t)
    with pytest.raises(httpx.ConnectError):
        client.get("/")
    assert transport.stats().attempts == 3


def test_empty_budget_means_no_retry() -> None:
    t = FakeTime()
    handler, seen = rejecting([429])
    budget = RetryBudget(initial_tokens=0.0)
    client, transport = make_client(handler, t, budget=budget)
    assert client.get("/").status_code == 429 and len(seen) == 1
    assert transport.stats().outcomes == {BUDGET: 1}
    assert budget.retries_denied == 1


async def test_async_transport_retries_and_honours_hints() -> None:
    t = FakeTime()
    handler, seen = rejecting([429, 503], {"retry-after": "1"})
    transport = AsyncRetryTransport(
        httpx.MockTransport(handler), clock=t.clock, sleep=t.asleep, rand=lambda: 0.5
    )
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post("http://gw/v1/chat/completions", content=b"{}")
    assert response.status_code == 200 and len(seen) == 3
    # hint 1 s + half of max(window, hint): attempt 0 -> 1 + 0.5 * 1, attempt 1 -> 1 + 0.5 * 2
    assert t.sleeps == [1.5, 2.0]


def test_the_async_transport_retries_under_trio() -> None:
    """httpx and the openai SDK run under trio as well as asyncio; so does the backoff, with
    its default sleep (asyncio.sleep raised there: no running event loop)."""
    import trio

    handler, seen = rejecting([429], {"retry-after-ms": "1"})
    transport = AsyncRetryTransport(httpx.MockTransport(handler), rand=lambda: 0.0)

    async def main() -> int:
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.post("http://gw/v1/chat/completions", content=b"{}")).status_code

    assert trio.run(main) == 200 and len(seen) == 2
    assert dict(transport.stats().outcomes) == {"ok": 1}


async def test_async_transport_does_not_retry_400() -> None:
    t = FakeTime()
    handler, seen = rejecting([400])
    transport = AsyncRetryTransport(httpx.MockTransport(handler), clock=t.clock, sleep=t.asleep)
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.get("http://gw/")).status_code == 400
    assert len(seen) == 1 and t.sleeps == []


def test_every_attempt_declares_the_clients_read_timeout() -> None:
    """The raw read timeout, to the millisecond, rounded down (the gateway takes its own
    margin off it); a request's own timeout counts, and a caller's header is kept."""
    t = FakeTime()
    handler, seen = rejecting([429])
    client, _ = make_client(handler, t)
    client.timeout = httpx.Timeout(5.0, read=12.3456)
    assert client.post("/v1/completions", json={}).status_code == 200
    assert [r.declared for r in seen] == [("12.345", None)] * 2  # retries included
    seen.clear()
    client.post("/v1/completions", json={}, timeout=httpx.Timeout(5.0, read=None))
    client.post("/v1/completions", json={}, timeout=0.0005)
    client.post("/v1/completions", json={}, timeout=1e308)  # no overflow
    client.post("/v1/completions", json={}, headers={"X-Stainless-Read-Timeout": "30"})
    assert [r.declared for r in seen] == [
        (None, None), ("0.001", None), ("10000000000.000", None), ("30", None)]


def test_retrier_and_policy_are_exclusive() -> None:
    with pytest.raises(TypeError):
        RetryTransport(
            httpx.MockTransport(lambda r: httpx.Response(200)),
            policy=RetryPolicy(),
            retrier=RetryTransport().retrier,
        )


# --- the standalone client raises its own errors, and only those -------------------------


def one_answer(response: Callable[[], httpx.Response]) -> KvgateClient:
    transport = RetryTransport(httpx.MockTransport(lambda request: response()),
                               policy=RetryPolicy(max_attempts=1))
    return KvgateClient("http://gw/v1", "k", retry_transport=transport)


def test_a_success_status_without_the_apis_json_is_an_invalid_response() -> None:
    """A portal's page or a cut body behind a 200 is a KvgateError that carries the status
    and the text, not a JSONDecodeError from deep inside the client."""
    for body in ("<html>captive portal</html>", '{"choices": [', "[1, 2]", "null"):
        with one_answer(lambda body=body: httpx.Response(200, text=body, headers={  # type: ignore[misc]
                "x-request-id": "task-7"})) as client, \
                pytest.raises(InvalidResponseError) as info:
            client.chat("m", [{"role": "user", "content": "hi"}])
        assert isinstance(info.value, KvgateError)
        assert (info.value.status_code, info.value.body, info.value.request_id) == (
            200, body, "task-7")


def test_a_redirect_is_an_error_status_not_a_success() -> None:
    with one_answer(lambda: httpx.Response(308, headers={
            "location": "https://gw/v1/chat/completions"})) as client, \
            pytest.raises(APIStatusError) as info:
        client.chat("m", [{"role": "user", "content": "hi"}])
    assert info.value.status_code == 308
    assert info.value.message.startswith("redirected to https://gw/v1/chat/completions")


def test_a_body_that_cannot_be_decoded_is_a_kvgate_error() -> None:
    def junk() -> httpx.Response:
        return httpx.Response(200, content=b"not gzip at all",
                              headers={"content-encoding": "gzip"})

    with one_answer(junk) as client:
        with pytest.raises(KvgateError):
            client.chat("m", [{"role": "user", "content": "hi"}])
        with pytest.raises(KvgateError), client.stream_chat(
                "m", [{"role": "user", "content": "hi"}]) as stream:
            list(stream)


def test_a_leading_bom_is_no_part_of_the_first_event_and_a_null_event_is_an_error() -> None:
    """The SSE grammar allows a BOM before the first line; an event that is JSON but no object
    is no chunk. The Go SDK draws the same lines."""
    body = ('\ufeffdata: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            "data: null\n\ndata: [DONE]\n\n")
    with one_answer(lambda: httpx.Response(200, content=body.encode(), headers={
            "content-type": "text/event-stream", "x-request-id": "t-9"})) as client, \
            client.stream_chat("m", [{"role": "user", "content": "hi"}]) as stream:
        chunks = iter(stream)
        assert next(chunks)["choices"][0]["delta"]["content"] == "a"
        with pytest.raises(StreamError) as info:
            next(chunks)
    assert info.value.payload is None and info.value.request_id == "t-9"
