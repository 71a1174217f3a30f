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
    day = now // DAY_US
    if lvl.daily > 0:
        used = bucket.day_used if bucket is not None and bucket.day == day else 0
        if used + cost > lvl.daily:
            w = math.ceil(((day + 1) * DAY_US - now) / 1000)
            if wait is None or (wait >= 0 and w > wait):
                wait, kind = w, "daily"
    if lvl.monthly > 0:
        month = month_of_day(day)
        used = bucket.month_used if bucket is not None and bucket.month == month else 0
        if used + cost > lvl.monthly:
            w = math.ceil((next_month_day(day) * DAY_US - now) / 1000)
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


def debit(buckets: dict[str, Bucket], levels: Sequence[Level], current: Sequence[int],
          now: int, cost: int) -> None:
    day = now // DAY_US
    month = month_of_day(day)
    for lvl, level in zip(levels, current, strict=True):
        old = buckets.get(lvl.key)
        bucket = Bucket(level - cost * MICRO, now, lvl.rate, lvl.burst)
        if old is not None:
            bucket.day, bucket.day_used = old.day, old.day_used
            bucket.month, bucket.month_used = old.month, old.month_used
        if lvl.daily > 0 or lvl.monthly > 0:
            day_used = bucket.day_used if bucket.day == day else 0
            month_used = bucket.month_used if bucket.month == month else 0
            bucket.day, bucket.day_used = day, day_used + cost
            bucket.month, bucket.month_used = month, month_used + cost
        buckets[lvl.key] = bucket


def credit(buckets: dict[str, Bucket], key: str, now: int, tokens: int,
           task_day: int | None) -> None:
    bucket = buckets[key]
    level = bucket.level_at(now) + tokens * MICRO
    bucket.level = max(0, min(level, bucket.burst * MICRO))
    bucket.updated_us = now
    if task_day is None:
        return
    day = now // DAY_US
    if task_day == day and bucket.day == day:
        bucket.day_used = max(0, bucket.day_used - tokens)
    month = month_of_day(day)
    if month_of_day(task_day) == month and bucket.month == month:
        bucket.month_used = max(0, bucket.month_used - tokens)
