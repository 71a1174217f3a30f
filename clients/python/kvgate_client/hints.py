"""Parsing the server's retry hints: `retry-after-ms`, `Retry-After`, `x-should-retry`.

Precedence follows the official OpenAI SDKs: `retry-after-ms` first (the precise value the
gateway computes), then `Retry-After` as seconds, then `Retry-After` as an HTTP date.
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# A hint that parses to +inf (e.g. "inf") must not turn into an endless wait; it counts as
# "longer than anyone will wait", which the policy's MAX_RETRY_AFTER_S then rejects.
_FOREVER = math.inf


@dataclass(frozen=True, slots=True)
class RetryHints:
    """What a response says about retrying it."""

    # Seconds the server asks the client to wait; None when absent or unparseable.
    retry_after_s: float | None
    # The server's explicit verdict from `x-should-retry`, or None when it said nothing.
    should_retry: bool | None


def header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive lookup that also works on a plain dict."""
    value = headers.get(name)
    if value is not None:
        return value
    lname = name.lower()
    for key, val in headers.items():
        if key.lower() == lname:
            return val
    return None


def _parse_number(raw: str) -> float | None:
    text = raw.strip()
    # float() also reads digit underscores and other scripts' digits, which no HTTP number
    # spells; the Go SDK refuses them too (clients/vectors/retry_policy.json).
    if not text.isascii() or "_" in text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    if math.isnan(value) or value < 0:
        return None
    return value


def parse_retry_after(
    headers: Mapping[str, str], *, wall_clock: Callable[[], float]
) -> float | None:
    """Seconds to wait per the headers, or None. `wall_clock` is `time.time` outside tests."""
    raw_ms = header(headers, "retry-after-ms")
    if raw_ms is not None:
        ms = _parse_number(raw_ms)
        if ms is not None:
            return ms / 1000.0 if math.isfinite(ms) else _FOREVER
    raw = header(headers, "retry-after")
    if raw is None:
        return None
    seconds = _parse_number(raw)
    if seconds is not None:
        return seconds if math.isfinite(seconds) else _FOREVER
    # RFC 9110 also allows an HTTP date; a date in the past means "now".
    try:
        parsed = email.utils.parsedate_tz(raw)
        if parsed is None:
            return None
        when = float(email.utils.mktime_tz(parsed))
    except (ValueError, OverflowError):
        # parsedate_tz accepts any digits, but the time functions hold only years up to 9999
        # and a C long of seconds: such a date is no usable hint (the Go SDK's parser refuses
        # it too). Raised from here, it would escape the transport with the response unclosed.
        return None
    return max(0.0, when - wall_clock())


def parse_should_retry(headers: Mapping[str, str]) -> bool | None:
    raw = header(headers, "x-should-retry")
    if raw is None:
        return None
    value = raw.strip().lower()
    if value == "true":
        return True
    if value == "false":
        return False
    return None


def parse_hints(headers: Mapping[str, str], *, wall_clock: Callable[[], float]) -> RetryHints:
    return RetryHints(
        retry_after_s=parse_retry_after(headers, wall_clock=wall_clock),
        should_retry=parse_should_retry(headers),
    )
