"""Exceptions of the standalone client (the openai drop-in raises the SDK's own)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import httpx

from .hints import header, parse_retry_after_ms

REQUEST_ID_HEADER = "x-request-id"
BACKPRESSURE_LEVEL_HEADER = "x-ratelimit-backpressure-level"
QUEUE_DEPTH_HEADER = "x-queue-depth"
SCOPE_HEADER = "x-ratelimit-scope"


class KvgateError(Exception):
    """Base class of everything the standalone client raises."""


class APIConnectionError(KvgateError):
    """The server could not be reached (after the retries the policy allowed), or a stream
    broke off after it had begun (never retried: part of the answer has been delivered)."""


class IncompleteStreamError(APIConnectionError):
    """A stream whose body ended cleanly before its `data: [DONE]` event: the answer was cut
    short (a proxy's or load balancer's limit, a gateway stopping), not finished. Like a
    connection that breaks mid-stream, it is never retried: the chunks before it have been
    delivered. `request_id` is the stream's `X-Request-Id`."""

    def __init__(self, *, request_id: str | None = None) -> None:
        self.request_id = request_id
        about = f" (request {request_id})" if request_id else ""
        super().__init__(f"the stream ended without [DONE]{about}")


class APIStatusError(KvgateError):
    """An error response, with the OpenAI-shaped body's fields pulled out.

    `code`, `type` and `param` are the body's (None when absent); `request_id` is the
    gateway's `X-Request-Id`, which names the task in its logs (None when the request was
    refused before admission, as a 4xx for a malformed or impossible request is; every
    answer of the admission step, a 429 included, carries one). `retry_after_ms` is the wait
    the `retry-after-ms` / `Retry-After` headers ask for, else the body's `retry_after_ms`
    (a number >= 0), else None. A redirect (3xx: the client follows none) names its
    `Location` in `message`.
    """

    def __init__(self, status_code: int, body: Any, headers: Mapping[str, str]) -> None:
        err = _error_fields(body)
        self.status_code = status_code
        self.body = body
        # Case-insensitive, as the response's own headers: exc.headers.get("Retry-After").
        self.headers = httpx.Headers(headers)
        self.code: str | None = _str_or_none(err.get("code"))
        self.type: str | None = _str_or_none(err.get("type"))
        self.param: str | None = _str_or_none(err.get("param"))
        self.request_id: str | None = header(headers, REQUEST_ID_HEADER)
        message = err.get("message")
        location = header(headers, "location")
        if 300 <= status_code < 400 and location:
            # A POST cannot follow a redirect as it was sent (301 and 302 turn it into a GET):
            # the fix is the client's base URL, so the message says where to point it.
            self.message = (f"redirected to {location} (redirects are not followed: point "
                            "the client at the new address)")
        else:
            self.message = str(message) if message is not None else f"HTTP {status_code}"
        # Headers first: they are what the retry policy waited on, so the wait reported is
        # the one the policy honoured; the Go SDK reads them in the same order.
        self.retry_after_ms: float | None = _header_retry_ms(headers)
        if self.retry_after_ms is None:
            self.retry_after_ms = _body_retry_ms(err.get("retry_after_ms"))
        super().__init__(f"{status_code} {self.code or ''}: {self.message}".replace(" :", ":"))


class InvalidResponseError(KvgateError):
    """A success status whose body is not what the API answers with: a proxy's or portal's
    page, a body cut short, or, for a stream, a body that is no event stream (its
    Content-Type is not text/event-stream: a page, or a server that ignored `stream`).
    `body` is its text (the first 64 KiB of a stream's); `request_id` as in APIStatusError."""

    def __init__(self, status_code: int, body: str, headers: Mapping[str, str], *,
                 expected: str = "a JSON object") -> None:
        self.status_code = status_code
        self.body = body
        self.headers = httpx.Headers(headers)
        self.request_id: str | None = header(headers, REQUEST_ID_HEADER)
        super().__init__(f"{status_code}: the response is not {expected}: {body[:200]!r}")


class RateLimitError(APIStatusError):
    """429: `code` tells capacity_exceeded (the fleet is full) from rate_limit_exceeded (the
    key's quota, for now), rate_limit_exceeded_queued_tokens (the key's requests already
    queued hold its cap on queued tokens) and insufficient_quota (a quota that never refills,
    spent: no wait helps).

    `backpressure_level` is the pool's zone (`X-RateLimit-Backpressure-Level`: GREEN, YELLOW,
    RED, or UNKNOWN when the gateway could not read it, as when a queued request's deadline
    passes while Redis is unreachable); `queue_depth` the tasks queued at the request's tier
    or above (`X-Queue-Depth`); `scope` the limit that refused it (`X-RateLimit-Scope`: "key"
    for the key's own limits, else "team:<name>" for the enclosing quota level). Each is None when
    the header is absent (`queue_depth` also when it is no count).
    """

    def __init__(self, status_code: int, body: Any, headers: Mapping[str, str]) -> None:
        super().__init__(status_code, body, headers)
        self.backpressure_level: str | None = _stripped(header(headers, BACKPRESSURE_LEVEL_HEADER))
        self.scope: str | None = _stripped(header(headers, SCOPE_HEADER))
        depth = _stripped(header(headers, QUEUE_DEPTH_HEADER))
        self.queue_depth: int | None = (
            int(depth) if depth is not None and depth.isascii() and depth.isdigit() else None
        )


class StreamError(KvgateError):
    """The server reported an error inside an already started stream (never retried: part
    of the answer has been delivered).

    `payload` is the event's `error` member (OpenAI's shape: message, type, param, code), or
    the event's whole data when it is not a JSON object; an `error` member that is null is
    no error (OpenAI-compatible servers may send one in every chunk); `code`, `type`, `param`
    and `message` are pulled out of it (None when absent). The gateway ends a stream whose
    node broke off with `code` "upstream_broken_stream". `request_id` is the stream's
    `X-Request-Id`.
    """

    def __init__(self, payload: Any, *, request_id: str | None = None) -> None:
        err = payload if isinstance(payload, dict) else {}
        self.payload = payload
        self.code: str | None = _str_or_none(err.get("code"))
        self.type: str | None = _str_or_none(err.get("type"))
        self.param: str | None = _str_or_none(err.get("param"))
        message = err.get("message")
        self.message: str | None = None if message is None else str(message)
        self.request_id = request_id
        about = f" (request {request_id})" if request_id else ""
        super().__init__(f"error in stream{about}: {payload!r}")


def _error_fields(body: Any) -> dict[str, Any]:
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _stripped(value: str | None) -> str | None:
    return None if value is None else value.strip()


def _body_retry_ms(value: Any) -> float | None:
    # bool is an int to isinstance, and a negative or NaN wait is no wait: the hint parser
    # ignores such headers, and the Go SDK such bodies.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        ms = float(value)
    except OverflowError:  # an integer past any float: no usable wait
        return None
    return ms if ms >= 0 else None


def _header_retry_ms(headers: Mapping[str, str]) -> float | None:
    return parse_retry_after_ms(headers, wall_clock=time.time)


def status_error(status_code: int, body: Any, headers: Mapping[str, str]) -> APIStatusError:
    cls = RateLimitError if status_code == 429 else APIStatusError
    return cls(status_code, body, headers)
