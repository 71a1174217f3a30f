"""A plain-Python reference model of quota levels ("Quota levels" in lua/_quota.lua), used by
tests/model.py: the key's bucket and every enclosing level's, each with optional daily and
monthly allowances of UTC days and months.

Calendar months come from `datetime` here, independently of the scripts' own arithmetic on
days, so that the two are checked against each other.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from admission.store import QuotaLevel

MICRO = 1_000_000
DAY_US = 86_400_000_000
EPOCH = datetime.date(1970, 1, 1)


@dataclass
class Bucket:
    level: int  # micro-tokens
    updated_us: int
    rate: int
    burst: int
    day: int | None = None
    day_used: int = 0
    month: int | None = None
    month_used: int = 0

    def level_at(self, now: int) -> int:
        level = self.level + self.rate * max(0, now - self.updated_us)
        return min(level, self.burst * MICRO)


def month_of_day(day: int) -> int:
    date = EPOCH + datetime.timedelta(days=day)
    return date.year * 12 + date.month - 1


def next_month_day(day: int) -> int:
    date = EPOCH + datetime.timedelta(days=day)
    year, month = (date.year + 1, 1) if date.month == 12 else (date.year, date.month + 1)
    return (datetime.date(year, month, 1) - EPOCH).days


def period_of(stored: int | None, index: int) -> int:
    """The period an allowance counts in (period_of() in lua/_quota.lua): the clock's, or the
    next one when that is the one stored (the clock stepped back across its start)."""
    return stored if stored is not None and stored == index + 1 else index


@dataclass(frozen=True)
class Level:
    """One level a request pays at: its bucket's name in the model (the tenant's name, or
    'team:<name>'), and its limits."""

    key: str
    rate: int
    burst: int
    daily: int
    monthly: int


def levels_of(tenant: str, rate: int, burst: int, daily: int, monthly: int,
              enclosing: Sequence[QuotaLevel]) -> list[Level]:
    return [Level(tenant, rate, burst, daily, monthly)] + [
        Level(lvl.scope, lvl.rate, lvl.burst, lvl.daily_tokens, lvl.monthly_tokens)
        for lvl in enclosing]


def short(buckets: dict[str, Bucket], lvl: Level, now: int, cost: int, held: int = 0
          ) -> tuple[int | None, str | None, int]:
    """(ms until it can pay or -1 never, what ran out, its level in micro-tokens) of one
    level; (None, None, level) when it can pay now. `held`: the tokens the level's live tasks
    reserved there; a bucket that never refills but would pay with them back is short by
    0 ms, 'held' (the wait is theirs, unknown)."""
    bucket = buckets.get(lvl.key)
    level = lvl.burst * MICRO if bucket is None else min(
        bucket.level + lvl.rate * max(0, now - bucket.updated_us), lvl.burst * MICRO)
    need = cost * MICRO
    wait: int | None = None
    kind: str | None = None
    if level < need:
        wait, kind = -1, "bucket"
        if lvl.rate > 0:
            wait = math.ceil((need - level) / lvl.rate / 1000)
        elif level + held * MICRO >= need:
            wait, kind = 0, "held"
    day = period_of(bucket.day if bucket is not None else None, now // DAY_US)
    if lvl.daily > 0:
        used = bucket.day_used if bucket is not None and bucket.day == day else 0
        if used + cost > lvl.daily:
            w = math.ceil(((day + 1) * DAY_US - now) / 1000)
            if wait is None or (wait >= 0 and w > wait):
                wait, kind = w, "daily"
    if lvl.monthly > 0:
        month = period_of(bucket.month if bucket is not None else None, month_of_day(now // DAY_US))
        used = bucket.month_used if bucket is not None and bucket.month == month else 0
        if used + cost > lvl.monthly:
            year, m = divmod(month, 12)
            first = (datetime.date(year, m + 1, 1) - EPOCH).days
            w = math.ceil((next_month_day(first) * DAY_US - now) / 1000)
            if wait is None or (wait >= 0 and w > wait):
                wait, kind = w, "monthly"
    return wait, kind, level


def binding(buckets: dict[str, Bucket], levels: Sequence[Level], now: int, cost: int,
            held: Mapping[str, int] | None = None
            ) -> tuple[Level | None, int, str, list[int]]:
    """The level that can pay last (innermost among equals; never first of all), its wait
    and kind, and every level's current level. `held`: level key -> tokens reserved there by
    its live tasks."""
    found: Level | None = None
    found_wait, found_kind = 0, ""
    current = []
    for lvl in levels:
        wait, kind, level = short(buckets, lvl, now, cost, (held or {}).get(lvl.key, 0))
        current.append(level)
        if wait is not None and (found is None or (
                found_wait >= 0 and (wait < 0 or wait > found_wait))):
            found, found_wait, found_kind = lvl, wait, kind or ""
    return found, found_wait, found_kind, current


Periods = tuple[int | None, int | None]
"""The day and month a level's allowances counted a task in; (None, None): it has none."""


def debit(buckets: dict[str, Bucket], levels: Sequence[Level], current: Sequence[int],
          now: int, cost: int) -> list[Periods]:
    """Every level pays; the periods each counted the task in (what the task records as
    quota_day and quota_month, one per level)."""
    periods: list[Periods] = []
    for lvl, level in zip(levels, current, strict=True):
        old = buckets.get(lvl.key)
        bucket = Bucket(level - cost * MICRO, now, lvl.rate, lvl.burst)
        if old is not None:
            bucket.day, bucket.day_used = old.day, old.day_used
            bucket.month, bucket.month_used = old.month, old.month_used
        if lvl.daily > 0 or lvl.monthly > 0:
            day = period_of(bucket.day, now // DAY_US)
            month = period_of(bucket.month, month_of_day(now // DAY_US))
            day_used = bucket.day_used if bucket.day == day else 0
            month_used = bucket.month_used if bucket.month == month else 0
            bucket.day, bucket.day_used = day, day_used + cost
            bucket.month, bucket.month_used = month, month_used + cost
            periods.append((day, month))
        else:
            periods.append((None, None))
        buckets[lvl.key] = bucket
    return periods


def credit(buckets: dict[str, Bucket], key: str, now: int, tokens: int,
           periods: Periods) -> None:
    """A task ends: `tokens` back to the level's bucket, and to each allowance whose period
    the task counted in there (`periods`) is still the one the level counts in."""
    bucket = buckets[key]
    level = bucket.level_at(now) + tokens * MICRO
    bucket.level = max(0, min(level, bucket.burst * MICRO))
    bucket.updated_us = now
    day, month = periods
    if day is not None and bucket.day == day and period_of(bucket.day, now // DAY_US) == day:
        bucket.day_used = max(0, bucket.day_used - tokens)
    if month is not None and bucket.month == month and period_of(
            bucket.month, month_of_day(now // DAY_US)) == month:
        bucket.month_used = max(0, bucket.month_used - tokens)


def spent(bucket: Bucket, now: int) -> bool:
    """Whether a bucket holds what a fresh one would not (lua/forget.lua): a level below its
    burst at `now`, or an allowance used in the period it counts in now."""
    today = now // DAY_US
    day = period_of(bucket.day, today)
    month = period_of(bucket.month, month_of_day(today))
    return (bucket.level_at(now) < bucket.burst * MICRO
            or (bucket.day == day and bucket.day_used > 0)
            or (bucket.month == month and bucket.month_used > 0))
