"""Exceptions of the standalone client (the openai drop-in raises the SDK's own)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class KvgateError(Exception):
    """Base class of everything the standalone client raises."""


class APIConnectionError(KvgateError):
    """The server could not be reached (after the retries the policy allowed)."""


class APIStatusError(KvgateError):
    """An error response, with the OpenAI-shaped body's fields pulled out."""

    def __init__(self, status_code: int, body: Any, headers: Mapping[str, str]) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        err: dict[str, Any] = error if isinstance(error, dict) else {}
        self.status_code = status_code
        self.body = body
        self.headers = dict(headers)
        self.code: str | None = _str_or_none(err.get("code"))
        self.type: str | None = _str_or_none(err.get("type"))
        message = err.get("message")
        self.message = str(message) if message is not None else f"HTTP {status_code}"
        retry_ms = err.get("retry_after_ms")
        self.retry_after_ms: float | None = (
            float(retry_ms) if isinstance(retry_ms, int | float) else None
        )
        super().__init__(f"{status_code} {self.code or ''}: {self.message}".replace(" :", ":"))


class RateLimitError(APIStatusError):
    """429: `code` tells capacity_exceeded (the fleet is full) from rate_limit_exceeded (quota)."""


class StreamError(KvgateError):
    """The server reported an error inside an already started stream (never retried)."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        super().__init__(f"error in stream: {payload!r}")


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def status_error(status_code: int, body: Any, headers: Mapping[str, str]) -> APIStatusError:
    cls = RateLimitError if status_code == 429 else APIStatusError
    return cls(status_code, body, headers)
