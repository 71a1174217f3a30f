"""Parsing the server's retry hints: `retry-after-ms`, `Retry-After`, `x-should-retry`.

Precedence follows the official OpenAI SDKs: `retry-after-ms` first (the precise value the
gateway computes), then `Retry-After` as seconds, then `Retry-After` as an HTTP date in one of
RFC 9110's three formats (`parse_http_date`).
"""

from __future__ import annotations

import math
import re
import time
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
    now = wall_clock()
    when = parse_http_date(raw, now=now)
    if when is None:
        return None
    return max(0.0, when - now)


def parse_retry_after_ms(
    headers: Mapping[str, str], *, wall_clock: Callable[[], float]
) -> float | None:
    """Milliseconds to wait per the headers, or None: `retry-after-ms` as sent (through
    seconds and back, 1011 would come out 1010.9999999999999), else `parse_retry_after`'s
    seconds in milliseconds."""
    raw_ms = header(headers, "retry-after-ms")
    if raw_ms is not None:
        ms = _parse_number(raw_ms)
        if ms is not None:
            return ms if math.isfinite(ms) else _FOREVER
    seconds = parse_retry_after(headers, wall_clock=wall_clock)
    return None if seconds is None else seconds * 1000.0


# The formats of RFC 9110's HTTP-date (section 5.6.7), case-sensitive as its grammar is: the
# IMF-fixdate senders use, and the obsolete RFC 850 and asctime dates a recipient must still
# accept. The Go SDK matches the same patterns (clients/go/hints.go). [0-9], not \d, which
# also matches other scripts' digits.
_DAY = "(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_DAY_LONG = "(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = f"(?P<month>{'|'.join(_MONTHS)})"
_TIME = "(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
_HTTP_DATE_FORMATS = (
    re.compile(f"{_DAY}, (?P<day>[0-9]{{2}}) {_MONTH} (?P<year>[0-9]{{4}}) {_TIME} GMT"),
    re.compile(f"{_DAY_LONG}, (?P<day>[0-9]{{2}})-{_MONTH}-(?P<yy>[0-9]{{2}}) {_TIME} GMT"),
    re.compile(f"{_DAY} {_MONTH} (?P<day>[0-9]{{2}}| [0-9]) {_TIME} (?P<year>[0-9]{{4}})"),
)
_DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def parse_http_date(raw: str, *, now: float) -> float | None:
    """The Unix time of an HTTP date in one of RFC 9110's formats, or None for anything else.

    No date without its weekday, no zone but GMT (none in asctime), no two-digit year but RFC
    850's: `email.utils.parsedate_tz` takes all of those, and the Go SDK refuses them. The
    weekday is not checked against the date (neither SDK does). An RFC 850 year is the year
    ending in its two digits that is at most 50 years after `now`'s and less than 50 before
    it, since RFC 9110 reads a date more than 50 years ahead as one in the past. The seconds
    may be 60, a leap second: the next minute's first.
    """
    text = raw.strip(" \t")  # the OWS around a field value
    for pattern in _HTTP_DATE_FORMATS:
        match = pattern.fullmatch(text)
        if match is not None:
            break
    else:
        return None
    fields = match.groupdict()
    month = _MONTHS.index(fields["month"]) + 1
    if fields.get("yy") is not None:
        current = time.gmtime(now).tm_year
        year = current + (int(fields["yy"]) - current) % 100
        if year > current + 50:
            year -= 100
    else:
        year = int(fields["year"])
    day, hour = int(fields["day"]), int(fields["hour"])
    minute, second = int(fields["minute"]), int(fields["second"])
    if not 1 <= day <= _days_in(year, month) or hour > 23 or minute > 59 or second > 60:
        return None
    return float(_days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second)


def _days_in(year: int, month: int) -> int:
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    return 29 if month == 2 and leap else _DAYS_IN_MONTH[month - 1]


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm), for
    any 4-digit year: datetime holds none before year 1."""
    if month <= 2:
        year -= 1
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * ((month + 9) % 12) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468


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
