"""Parsing `retry-after-ms`, `Retry-After` (seconds or HTTP date) and `x-should-retry`."""

from __future__ import annotations

import email.utils
import math

import httpx
import pytest

from kvgate_client import parse_hints, parse_retry_after, parse_should_retry
from kvgate_client.errors import status_error
from kvgate_client.hints import parse_retry_after_ms

NOW = 1_700_000_000.0


def wall() -> float:
    return NOW


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "3500", "retry-after": "3"}, 3.5),  # ms wins, as in the OpenAI SDK
        ({"Retry-After": "3"}, 3.0),
        ({"retry-after": "0.25"}, 0.25),
        ({"retry-after-ms": "garbage", "retry-after": "2"}, 2.0),  # bad ms falls back
        ({"retry-after-ms": "-5"}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "nan"}, None),
        ({}, None),
    ],
)
def test_retry_after_values(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers, wall_clock=wall) == expected


def test_retry_after_http_date() -> None:
    date = email.utils.formatdate(NOW + 42, usegmt=True)
    assert parse_retry_after({"Retry-After": date}, wall_clock=wall) == pytest.approx(42.0)
    past = email.utils.formatdate(NOW - 42, usegmt=True)
    assert parse_retry_after({"Retry-After": past}, wall_clock=wall) == 0.0


# parsedate_tz accepts these, but the platform's time functions cannot hold them
# (ValueError or OverflowError): no usable date, as in the Go SDK, whose parser refuses them.
@pytest.mark.parametrize(
    "value",
    [
        "Fri, 31 Dec 99999 23:59:59 GMT",  # ValueError: year out of range
        "Fri, 31 Dec 99999999999999999999 23:59:59 GMT",  # OverflowError: too large for a C long
        "1 Jan 10000000000 00:00:00",  # OverflowError (local time: no zone given)
        "Feb -5 24:00:60 x -99999999999999",  # OverflowError: below the minimum
    ],
)
def test_retry_after_date_out_of_range_is_no_hint(value: str) -> None:
    assert parse_retry_after({"Retry-After": value}, wall_clock=wall) is None


def test_infinite_hint_is_too_long_not_forever() -> None:
    assert parse_retry_after({"retry-after-ms": "inf"}, wall_clock=wall) == math.inf


def test_works_on_httpx_headers_any_case() -> None:
    headers = httpx.Headers({"Retry-After-Ms": "1200", "X-Should-Retry": "FALSE"})
    hints = parse_hints(headers, wall_clock=wall)
    assert hints.retry_after_s == 1.2
    assert hints.should_retry is False


@pytest.mark.parametrize(
    ("value", "expected"), [("true", True), ("false", False), (" False ", False), ("maybe", None)]
)
def test_should_retry(value: str, expected: bool | None) -> None:
    assert parse_should_retry({"X-Should-Retry": value}) is expected


def test_should_retry_absent() -> None:
    assert parse_should_retry({"retry-after": "1"}) is None


@pytest.mark.parametrize("ms", ["1011", "1", "333", "4001", "987654"])
def test_the_millisecond_hint_is_kept_exactly(ms: str) -> None:
    """Not through seconds and back (1011 / 1000 * 1000 is 1010.9999999999999)."""
    assert parse_retry_after_ms({"retry-after-ms": ms}, wall_clock=lambda: 0.0) == float(ms)
    error = status_error(429, {"error": {"message": "m"}}, {"retry-after-ms": ms})
    assert error.retry_after_ms == float(ms)


def test_the_millisecond_hint_falls_back_on_retry_after() -> None:
    assert parse_retry_after_ms({"retry-after": "2"}, wall_clock=lambda: 0.0) == 2_000.0
    assert parse_retry_after_ms({}, wall_clock=lambda: 0.0) is None
