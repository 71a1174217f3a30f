"""What `kvgate-inspect` shows of fair release and quota levels, per pool.

Per tenant with a hash in the pool (`kvg:{pool}:tenant:<tenant>`): its weight, its share of
each tier it has work queued in (its weight over the weights of the tenants queued there: the
share of releases fair order gives it now), its virtual counter there and how far it is above
the tier's least (in tokens at weight 1; 0: served next), its queued and in-flight tokens
against its caps, and the tokens/s released from its queue (decayed over 5 s). Per quota level
(`kvg:{pool}:quota:<team>`): its bucket refilled to now, and its allowances used this day and
month. The tier's virtual time (`kvg:{pool}:vtime`) is shown too.

The same figures with redis-cli, for a tenant `acme` of pool `P` in Normal::

    redis-cli HGETALL 'kvg:{P}:tenant:acme'            vt_1, weight, queued_tokens, ...
    redis-cli ZRANGE 'kvg:{P}:flows:normal' 0 -1 WITHSCORES    backlogged, least first
    redis-cli ZRANGE 'kvg:{P}:flow:normal:acme' 0 -1   its queued tasks, oldest first
    redis-cli ZRANGE 'kvg:{P}:tenant_inflight' 0 -1 WITHSCORES   tenants in flight
    redis-cli HGETALL 'kvg:{P}:quota:research'          a team's bucket and allowances

Tenant and level keys are found with SCAN (never KEYS), as buckets are.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from admission.keys import VT_SCALE, PoolKeys
from admission.reads import finite_number as _num
from admission.reads import release_rate
from admission.tiers import Tier

SCAN_COUNT = 500
DAY_US = 86_400_000_000


@dataclass(frozen=True, slots=True)
class FairTenantView:
    tenant: str
    weight: float
    counters: list[int | None]
    """Virtual counter per tier (VIP, Normal, Batch), VT units; None: never charged there."""
    share: list[float | None]
    """Share of each tier's releases while it has work queued there; None: nothing queued."""
    lag_tokens: list[float | None]
    """Counter above the tier's least backlogged one, tokens at weight 1; None: not queued."""
    queued_tokens: int
    inflight_tokens: int
    inflight_cap: int | None
    release_rate: float
    """Tokens/s released from its queue (decayed over 5 s)."""


@dataclass(frozen=True, slots=True)
class LevelView:
    level: str
    tokens: float
    burst: int
    rate: int
    percent: float
    day_used: int | None
    """Tokens of the allowance used today (None: no daily or monthly allowance counted)."""
    month_used: int | None


@dataclass(frozen=True, slots=True)
class FairView:
    vtime: list[int]
    """Each tier's virtual time (VIP, Normal, Batch), VT units."""
    tenants: list[FairTenantView]
    levels: list[LevelView]


def as_text(value: Any) -> str:
    """A reply's bytes (or any value) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def wrong_type_reply(reply: Any) -> bool:
    # In the reply's text, not at its start: a cluster pipeline may prefix the command.
    return isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply)


def read_as_empty(read: Sequence[tuple[str, Any]], replies: list[Any],
                  wrong_type: list[str] | None) -> None:
    """Replies of a pipeline run with `raise_on_error=False`, in place: where a command's key
    (`read`: per command, its key and what it reads as when empty) holds another type (one
    written by hand with redis-cli), the empty value, the key added to `wrong_type`; any other
    error raised. kvgate-inspect is what an operator runs then: one such key must not fail
    the whole snapshot."""
    for i, ((key, empty), reply) in enumerate(zip(read, replies, strict=True)):
        if wrong_type_reply(reply):
            replies[i] = empty
            if wrong_type is not None and key not in wrong_type:
                wrong_type.append(key)
        elif isinstance(reply, BaseException):
            raise reply


async def scan_hashes(client: Any, prefix: str) -> dict[str, dict[str, str]]:
    """Every hash whose key starts with `prefix`, by the rest of its key: SCAN (never KEYS),
    then `read_hashes`."""
    names = [as_text(k) async for k in client.scan_iter(match=prefix + "*", count=SCAN_COUNT)]
    return {key[len(prefix):]: h for key, h in (await read_hashes(client, names)).items()}


async def read_hashes(client: Any, keys: Sequence[str]) -> dict[str, dict[str, str]]:
    """The hashes at `keys`, by key: HGETALL in pipelined chunks. A key of another type (one
    written by hand with redis-cli, `SET kvg:{p}:tenant:x 1`) is no record of kvgate's and is
    left out: its WRONGTYPE would fail the whole snapshot, and `kvgate-inspect` and the admin
    API would show no pool at all. Any other error still fails the read."""
    out: dict[str, dict[str, str]] = {}
    for start in range(0, len(keys), SCAN_COUNT):
        chunk = keys[start:start + SCAN_COUNT]
        async with client.pipeline(transaction=False) as pipe:
            for key in chunk:
                pipe.hgetall(key)
            replies = await pipe.execute(raise_on_error=False)
        for key, raw in zip(chunk, replies, strict=True):
            if wrong_type_reply(raw):
                continue
            if isinstance(raw, BaseException):
                raise raw
            if raw:  # it may vanish between SCAN and HGETALL
                out[key] = {as_text(k): as_text(v) for k, v in raw.items()}
    return out


def _period(h: Mapping[str, str], kind: str, index: int) -> int | None:
    if kind not in h:
        return None
    # The period the scripts count in: the clock's, or the next one when that is the one
    # stored (the clock stepped back across its start: period_of() in lua/_quota.lua).
    stored = int(_num(h.get(kind), -1))
    return int(_num(h.get(kind + "_used"))) if stored in (index, index + 1) else 0


def allowance_used(h: Mapping[str, str], now_us: int, month: int
                   ) -> tuple[int | None, int | None]:
    """Tokens of a bucket's daily and monthly allowances used in the current day and month
    (None: none was ever counted there), as the scripts count them (lua/_quota.lua)."""
    return _period(h, "day", now_us // DAY_US), _period(h, "month", month)


def level_view(name: str, h: Mapping[str, str], now_us: int, month: int) -> LevelView:
    level, at = _num(h.get("micro_tokens")), _num(h.get("updated_us"), now_us)
    rate, burst = int(_num(h.get("rate"))), int(_num(h.get("burst")))
    if now_us > at:
        level += rate * (now_us - at)
    tokens = min(level, burst * 1e6) / 1e6
    return LevelView(name, tokens, burst, rate,
                     round(100 * tokens / burst, 2) if burst else 0.0,
                     *allowance_used(h, now_us, month))


def tenant_view(name: str, h: Mapping[str, str], flows: Sequence[Mapping[str, int]],
                weights: Mapping[str, float], now_us: int) -> FairTenantView:
    counters: list[int | None] = []
    share: list[float | None] = []
    lag: list[float | None] = []
    for tier in Tier:
        raw = h.get(f"vt_{int(tier)}")
        counters.append(None if raw is None else int(_num(raw)))
        backlogged = flows[tier]
        if name in backlogged:
            total = sum(weights.get(t, 1.0) for t in backlogged) or 1.0
            share.append(weights.get(name, 1.0) / total)
            lag.append((backlogged[name] - min(backlogged.values())) / VT_SCALE)
        else:
            share.append(None)
            lag.append(None)
    cap = int(_num(h.get("inflight_cap")))
    return FairTenantView(name, _num(h.get("weight"), 1.0), counters, share, lag,
                          int(_num(h.get("queued_tokens"))), int(_num(h.get("inflight_tokens"))),
                          cap or None, release_rate(h, now_us))


async def read_fair(client: Any, keys: PoolKeys, now_us: int, month: int,
                    wrong_type: list[str] | None = None) -> FairView:
    """`month`: the current UTC month as the scripts count it (year x 12 + month - 1). A key
    of another type (written by hand) reads as empty and is added to `wrong_type`."""
    read: list[tuple[str, Any]] = [*((keys.flows(tier), []) for tier in Tier), (keys.vtime, {})]
    async with client.pipeline(transaction=False) as pipe:
        for tier in Tier:
            pipe.zrange(keys.flows(tier), 0, -1, withscores=True)
        pipe.hgetall(keys.vtime)
        reply = list(await pipe.execute(raise_on_error=False))
    read_as_empty(read, reply, wrong_type)
    # A score that is no finite number (by hand: ZADD ... +inf) reads as 0, not an OverflowError.
    flows = [{as_text(m): int(s) if math.isfinite(s) else 0 for m, s in rows}
             for rows in reply[:3]]
    vtime_raw = {as_text(k): as_text(v) for k, v in reply[3].items()}
    vtime = [int(_num(vtime_raw.get(t.label))) for t in Tier]
    tenants = await scan_hashes(client, keys.tenant_key(""))
    levels = await scan_hashes(client, keys.quota_key(""))
    weights = {n: _num(h.get("weight"), 1.0) for n, h in tenants.items()}
    return FairView(
        vtime,
        [tenant_view(n, tenants.get(n, {}), flows, weights, now_us)
         for n in sorted(set(tenants) | set().union(*flows))],
        [level_view(n, h, now_us, month) for n, h in sorted(levels.items())])


def _fmt(value: float | int | None, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def render_fair(view: FairView, table: Any) -> list[str]:
    """The fairness and quota tables (`table`: admission.inspect's table formatter)."""
    lines: list[str] = []
    if view.tenants:
        lines += table(
            ["tenant", "weight", "share v/n/b", "lag tokens v/n/b", "queued tok",
             "in flight tok", "cap", "released tok/s"],
            ([t.tenant, f"{t.weight:g}",
              "/".join(_fmt(s, "{:.0%}") for s in t.share),
              "/".join(_fmt(x, "{:.0f}") for x in t.lag_tokens),
              str(t.queued_tokens), str(t.inflight_tokens), _fmt(t.inflight_cap),
              f"{t.release_rate:.1f}"] for t in view.tenants))
        lines.append("  virtual time v/n/b: " + "/".join(str(v) for v in view.vtime)
                     + f" ({VT_SCALE} units per token at weight 1)")
    if view.levels:
        lines += table(["quota level", "tokens", "burst", "% of burst", "rate/s",
                        "used today", "used this month"],
                       ([lv.level, f"{lv.tokens:.1f}", str(lv.burst), f"{lv.percent:g}",
                         str(lv.rate), _fmt(lv.day_used), _fmt(lv.month_used)]
                        for lv in view.levels))
    return lines


def month_index(now_us: int) -> int:
    """The UTC month of `now_us` as the scripts count it (year x 12 + month - 1)."""
    date = datetime.datetime.fromtimestamp(now_us // 1_000_000, tz=datetime.UTC)
    return date.year * 12 + date.month - 1
