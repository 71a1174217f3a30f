"""A plain-Python reference model of fair release within a tier ("Fair release" in
lua/_tenant.lua), used by tests/model.py and the fairness property tests.

The scripts keep, per pool: each tenant's virtual counter per tier, the tier's virtual time,
the tenant's weight, queued and in-flight tokens, the backlogged flows (a mirror of the
counters of the tenants with work queued in the tier) and the index of the tenants in flight (a
mirror of their in-flight tokens). The model keeps the counters and the
rest in dicts and derives the flows from the tier's queue, which holds the same tasks in the
same order (FIFO within a tenant is FIFO within the tier restricted to that tenant).

Arithmetic mirrors the scripts' double-precision steps (`float(a) * b / c`, then floor), so
the counters agree to the unit, not only approximately.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from admission.keys import VT_SCALE, PoolKeys
from admission.tiers import Tier

TIE_SCAN = 8
"""Flows tied at the least counter compared by the age of their heads (lua/_tenant.lua)."""
LIGHT_SCAN = 8
"""Light tenants, and backlogged flows, in a release's view of shares (lua/_tenant.lua)."""
DRAIN_TAU_US = 5_000_000
DRAIN_WAIT_MAX_MS = 1_000_000_000


def weight_arg(weight: float) -> str:
    """The weight as the store passes it to the admit script."""
    return repr(float(weight))


def charge_of(cost: int, weight: float) -> int:
    """Counter units a task of `cost` tokens charges a tenant of `weight`."""
    return max(1, math.floor(cost * VT_SCALE / weight))


def settle_back(charge: int, cost: int, usage: int | None) -> int:
    """The part of a charge given back when the task ends (usage None: unknown, none used)."""
    if cost <= 0:
        return 0
    unused = cost if usage is None else cost - usage
    return math.floor(float(charge) * unused / cost)


@dataclass
class FairLedger:
    vt: dict[tuple[int, str], int] = field(default_factory=dict)
    """(tier, tenant) -> virtual counter (absent: 0)."""
    lifts: dict[tuple[int, str], int] = field(default_factory=dict)
    """(tier, tenant) -> lifts so far (`lifts_<tier>`): the epoch a charge records."""
    liftroom: dict[tuple[int, str], int] = field(default_factory=dict)
    """(tier, tenant) -> what the refunds of tasks charged before the latest lift may still
    take back (`liftroom_<tier>`)."""
    vtime: dict[int, int] = field(default_factory=dict)
    """tier -> the counter the last flow was served at."""
    weight: dict[str, str] = field(default_factory=dict)
    """tenant -> weight as stored by its last admit that queued or was charged."""
    queued_tokens: dict[str, int] = field(default_factory=dict)
    inflight_tokens: dict[str, int] = field(default_factory=dict)
    inflight_cap: dict[str, int] = field(default_factory=dict)
    """tenant -> cap on in-flight tokens as stored by its last admit that queued (0: none)."""
    drain: dict[str, tuple[float, int]] = field(default_factory=dict)
    """tenant -> (tokens released from its queue, decayed to the µs that follows)."""
    light: dict[int, dict[str, int]] = field(default_factory=dict)
    """tier -> tenant -> µs the fast path last admitted it beside a backlog (light:<tier>)."""

    def _books(self) -> tuple[dict[str, Any], ...]:
        return (self.weight, self.queued_tokens, self.inflight_tokens, self.inflight_cap,
                self.drain)

    def knows(self, tenant: str) -> bool:
        """Whether the tenant's hash exists: a field of it is stored."""
        return (any(t == tenant for book in (self.vt, self.lifts, self.liftroom)
                    for _, t in book)
                or any(tenant in book for book in self._books()))

    def forget(self, tenant: str) -> None:
        """Its hash and its light entries deleted (lua/forget.lua)."""
        for tiered in (self.vt, self.lifts, self.liftroom):
            for key in [k for k in tiered if k[1] == tenant]:
                del tiered[key]
        for book in self._books():
            book.pop(tenant, None)
        for light in self.light.values():
            light.pop(tenant, None)

    def drain_now(self, tenant: str, now: int) -> float | None:
        if tenant not in self.drain:
            return None
        total, at = self.drain[tenant]
        if now > at:
            total = total * math.exp(-(now - at) / DRAIN_TAU_US)
        return total

    def drain_add(self, tenant: str, now: int, tokens: int) -> None:
        self.drain[tenant] = ((self.drain_now(tenant, now) or 0.0) + tokens, now)

    def drain_wait_ms(self, tenant: str, now: int, excess: int) -> int:
        total = self.drain_now(tenant, now)
        if total is None:
            return -1
        rate = total * 1_000_000 / DRAIN_TAU_US
        if rate * DRAIN_WAIT_MAX_MS <= excess * 1000:
            return DRAIN_WAIT_MAX_MS
        return math.ceil(excess * 1000 / rate)

    def under_share(self, tier: int, tenant: str, weight: float,
                    flows: Mapping[str, int]) -> bool:
        """under_share() in lua/_tenant.lua: `tenant` (at the weight its request states) holds no
        more than its weighted share of the in-flight tokens of itself and up to LIGHT_SCAN
        backlogged flows (least counter first)."""
        own_weight = float(weight) if float(weight) > 0 else 1.0
        view = FairView(self, frozenset())
        view.members[tenant] = [float(self.inflight_tokens.get(tenant, 0)), own_weight]
        view.total, view.wsum = view.members[tenant][0], own_weight
        for other in sorted(flows, key=lambda t: (self.counter(tier, t), t))[:LIGHT_SCAN]:
            view.member(other)
        return view.within_share(tenant)

    def inflight_fits(self, tenant: str, cost: int, cap: int | None = None) -> bool:
        cap = self.inflight_cap.get(tenant, 0) if cap is None else cap
        return cap <= 0 or self.inflight_tokens.get(tenant, 0) + cost <= cap

    def counter(self, tier: int, tenant: str) -> int:
        return self.vt.get((tier, tenant), 0)

    def floor(self, tier: int, backlogged: Mapping[str, int]) -> tuple[int, bool]:
        """The least counter among `backlogged` tenants, or the tier's virtual time."""
        if backlogged:
            return min(self.counter(tier, t) for t in backlogged), True
        return self.vtime.get(tier, 0), False

    def lift(self, tier: int, tenant: str, backlogged: Mapping[str, int]) -> None:
        """`tenant`'s flow becomes backlogged (it is not among `backlogged`)."""
        floor, _ = self.floor(tier, backlogged)
        self.lifts[(tier, tenant)] = self.lifts.get((tier, tenant), 0) + 1
        self.liftroom[(tier, tenant)] = max(0, self.counter(tier, tenant) - floor)
        if self.counter(tier, tenant) < floor:
            self.vt[(tier, tenant)] = floor

    def charge(self, tier: int, tenant: str, cost: int) -> int:
        weight = float(self.weight.get(tenant, "1"))
        if weight <= 0:
            weight = 1.0
        charge = charge_of(cost, weight)
        served_at = self.counter(tier, tenant)
        if served_at > self.vtime.get(tier, 0):
            self.vtime[tier] = served_at
        self.vt[(tier, tenant)] = served_at + charge
        return charge

    def settle(self, tier: int, tenant: str, charge: int | None, cost: int,
               usage: int | None, epoch: int | None = None) -> None:
        """A charged task ends; `epoch`: the tenant's lifts when it was charged. One charged
        before the latest lift gets back no more than that lift's room, and takes it."""
        if charge is None:
            return
        back = settle_back(charge, cost, usage)
        if back > 0 and epoch is not None and epoch < self.lifts.get((tier, tenant), 0):
            room = self.liftroom.get((tier, tenant), 0)
            back = min(back, max(0, room))
            self.liftroom[(tier, tenant)] = room - back
        if back:
            self.vt[(tier, tenant)] = self.counter(tier, tenant) - back

    def add(self, book: dict[str, int], tenant: str, tokens: int) -> None:
        """Raise or lower a per-tenant count; at 0 or below the field is gone (HDEL)."""
        left = book.get(tenant, 0) + tokens
        if left <= 0:
            book.pop(tenant, None)
        else:
            book[tenant] = left

    def next_flow(self, tier: int, heads: Mapping[str, int],
                  skip: frozenset[str] | set[str] = frozenset()) -> str | None:
        """The tenant served next among `heads` (tenant -> its head's position in the tier's
        queue): least counter, then among up to TIE_SCAN tied the oldest head."""
        rows = sorted(heads, key=lambda t: (self.counter(tier, t), t))[:len(skip) + TIE_SCAN]
        best: str | None = None
        least: int | None = None
        ties = 0
        for tenant in rows:
            if tenant in skip:
                continue
            score = self.counter(tier, tenant)
            if least is None:
                least = score
            elif score > least:
                break
            if best is None or heads[tenant] < heads[best]:
                best = tenant
            ties += 1
            if ties >= TIE_SCAN:
                break
        return best


@dataclass
class FairView:
    """What one release call judges a tenant's share of the in-flight tokens by (fair_view()
    in lua/_tenant.lua): the light tenants (up to LIGHT_SCAN, most recent first), then up to
    LIGHT_SCAN backlogged flows (least counter first), each with its in-flight tokens and
    weight; sums accumulate in that order, as the script's do."""

    ledger: FairLedger
    light: frozenset[str]
    order: tuple[str, ...] = ()
    """The light tenants, most recent first (the script's ZREVRANGE)."""
    members: dict[str, list[float]] = field(default_factory=dict)
    total: float = 0
    wsum: float = 0

    @classmethod
    def of(cls, ledger: FairLedger, light: Mapping[str, int], flows: Mapping[str, int],
           tier: int) -> FairView:
        recent = sorted(light, key=lambda t: (light[t], t), reverse=True)[:LIGHT_SCAN]
        view = cls(ledger, frozenset(recent), tuple(recent))
        if not recent:
            return view
        for tenant in recent:
            view.member(tenant)
        for tenant in sorted(flows, key=lambda t: (ledger.counter(tier, t), t))[:LIGHT_SCAN]:
            view.member(tenant)
        return view

    def member(self, tenant: str) -> list[float]:
        if tenant not in self.members:
            weight = float(self.ledger.weight.get(tenant, "1"))
            if weight <= 0:
                weight = 1.0
            row = [float(self.ledger.inflight_tokens.get(tenant, 0)), weight]
            self.members[tenant] = row
            self.total += row[0]
            self.wsum += row[1]
        return self.members[tenant]

    def keep(self, tenant: str, headroom: float) -> float:
        """The room `tenant`'s release must leave: `headroom` when another tenant is light and
        it holds more than its weighted share of the view's in-flight tokens."""
        if not self.light or self.light == {tenant}:
            return 0.0
        return 0.0 if self.within_share(tenant) else headroom

    def light_first(self, heads: Mapping[str, int],
                    skip: frozenset[str] | set[str]) -> str | None:
        """light_flow() in lua/_tenant.lua: among the light tenants with a head in `heads`
        (tenant -> its position in the tier's queue), not skipped, holding no more than their
        weighted share of the view's in-flight tokens, the one whose head is oldest."""
        best: str | None = None
        for tenant in self.order:
            if tenant in skip or tenant not in heads:
                continue
            if self.within_share(tenant) and (best is None or heads[tenant] < heads[best]):
                best = tenant
        return best

    def within_share(self, tenant: str) -> bool:
        """within_share() in lua/_tenant.lua: no more than its weighted share of the view's
        in-flight tokens (the tenant joins the view if it is not in it yet)."""
        inflight, weight = self.member(tenant)
        return inflight * self.wsum <= weight * self.total

    def served(self, tenant: str, cost: int) -> None:
        if tenant in self.members:
            self.members[tenant][0] += cost
            self.total += cost


def heads_of(queue: Sequence[str], tenant_of: Mapping[str, Any]) -> dict[str, int]:
    """tenant -> position of its oldest task in `queue` (the backlogged flows of a tier)."""
    heads: dict[str, int] = {}
    for i, tid in enumerate(queue):
        heads.setdefault(tenant_of[tid].tenant, i)
    return heads


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_fair(client: Any, keys: PoolKeys, tenants: Sequence[str]) -> dict[str, Any]:
    """The fairness state in Redis, in the model's shapes (one MULTI)."""
    async with client.pipeline(transaction=True) as pipe:
        for tenant in tenants:
            pipe.hgetall(keys.tenant_key(tenant))
        for tier in Tier:
            pipe.zrange(keys.flows(tier), 0, -1, withscores=True)
        for tier in Tier:
            pipe.zrange(keys.light(tier), 0, -1, withscores=True)
        pipe.hgetall(keys.vtime)
        pipe.zrange(keys.tenant_inflight, 0, -1, withscores=True)
        reply = list(await pipe.execute())
    index = {_s(m): int(score) for m, score in reply.pop()}
    vt: dict[tuple[int, str], int] = {}
    weight: dict[str, str] = {}
    queued: dict[str, int] = {}
    inflight: dict[str, int] = {}
    caps: dict[str, int] = {}
    drain: dict[str, tuple[float, int]] = {}
    for tenant, raw in zip(tenants, reply, strict=False):
        h = {_s(k): _s(v) for k, v in raw.items()}
        for tier in Tier:
            if f"vt_{int(tier)}" in h and int(h[f"vt_{int(tier)}"]) != 0:
                vt[(int(tier), tenant)] = int(h[f"vt_{int(tier)}"])
        if "weight" in h:
            weight[tenant] = h["weight"]
        if "queued_tokens" in h:
            queued[tenant] = int(h["queued_tokens"])
        if "inflight_tokens" in h:
            inflight[tenant] = int(h["inflight_tokens"])
        if "inflight_cap" in h:
            caps[tenant] = int(h["inflight_cap"])
        if "drain" in h:
            drain[tenant] = (float(h["drain"]), int(h["drain_us"]))
    flows = [{_s(m): int(score) for m, score in rows}
             for rows in reply[len(tenants):len(tenants) + 3]]
    light = {tier: {_s(m): int(score) for m, score in rows}
             for tier, rows in enumerate(reply[len(tenants) + 3:len(tenants) + 6]) if rows}
    vtime = {int(Tier.parse(_s(k))): int(_s(v)) for k, v in reply[-1].items()}
    return {"vt": vt, "weight": weight, "queued_tokens": queued, "inflight_tokens": inflight,
            "inflight_cap": caps, "drain": drain, "flows": flows, "light": light, "vtime": vtime,
            "inflight_index": index}


def expected_fair(ledger: FairLedger, queues: Sequence[Sequence[str]],
                  tasks: Mapping[str, Any]) -> dict[str, Any]:
    """What `read_fair` must find, from the model."""
    flows = [{t: ledger.counter(tier, t) for t in heads_of(queue, tasks)}
             for tier, queue in enumerate(queues)]
    return {"vt": {k: v for k, v in ledger.vt.items() if v != 0},
            "weight": dict(ledger.weight), "queued_tokens": dict(ledger.queued_tokens),
            "inflight_tokens": dict(ledger.inflight_tokens),
            "inflight_cap": dict(ledger.inflight_cap), "drain": dict(ledger.drain), "flows": flows,
            "light": {t: dict(m) for t, m in ledger.light.items() if m},
            "vtime": {t: v for t, v in ledger.vtime.items()},
            # The pool's index of tenants in flight holds each one's in-flight tokens, and no
            # tenant with none (the metrics read it instead of scanning every tenant hash).
            "inflight_index": dict(ledger.inflight_tokens)}
