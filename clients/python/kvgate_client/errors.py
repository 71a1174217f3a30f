"""Exceptions of the standalone client (the openai drop-in raises the SDK's own)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from .hints import header

REQUEST_ID_HEADER = "x-request-id"


class KvgateError(Exception):
    """Base class of everything the standalone client raises."""


class APIConnectionError(KvgateError):
    """The server could not be reached (after the retries the policy allowed)."""


class APIStatusError(KvgateError):
    """An error response, with the OpenAI-shaped body's fields pulled out.

    `code`, `type` and `param` are the body's (None when absent); `request_id` is the
    gateway's `X-Request-Id`, which names the task in its logs (None when the request was
    refused before admission, as a 4xx for a malformed or impossible request is).
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
        self.message = str(message) if message is not None else f"HTTP {status_code}"
        retry_ms = err.get("retry_after_ms")
        self.retry_after_ms: float | None = (
            float(retry_ms) if isinstance(retry_ms, int | float) else None
        )
        super().__init__(f"{status_code} {self.code or ''}: {self.message}".replace(" :", ":"))


class InvalidResponseError(KvgateError):
    """A success status whose body is not the JSON object the API answers with: a proxy's or
    portal's page, a body cut short. `body` is its text; `request_id` as in APIStatusError."""

    def __init__(self, status_code: int, body: str, headers: Mapping[str, str]) -> None:
        self.status_code = status_code
        self.body = body
        self.headers = httpx.Headers(headers)
        self.request_id: str | None = header(headers, REQUEST_ID_HEADER)
        super().__init__(f"{status_code}: the response is not a JSON object: {body[:200]!r}")


class RateLimitError(APIStatusError):
    """429: `code` tells capacity_exceeded (the fleet is full) from rate_limit_exceeded (the
    key's quota, for now) and insufficient_quota (a quota that never refills, spent: no wait
    helps)."""


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


def status_error(status_code: int, body: Any, headers: Mapping[str, str]) -> APIStatusError:
    cls = RateLimitError if status_code == 429 else APIStatusError
    return cls(status_code, body, headers)
