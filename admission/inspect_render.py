"""The plain-text tables of ``python -m admission.inspect`` (``admission.inspect`` reads the
snapshot they render): one block per pool, the nodes with each tier's budget and headroom,
their reservations, release control and lane or dedicated role, the queues and why they wait,
the gateways' leases and the tenants' buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from admission.inspect_fair import render_fair
from admission.tiers import Tier

if TYPE_CHECKING:
    from admission.inspect_read import NodeView, PoolView, Snapshot
    from admission.reads import Held


def _duration(us: int | None) -> str:
    if us is None:
        return "-"
    sign, us = ("-" if us < 0 else ""), abs(us)
    if us < 1_000:
        return f"{sign}{us} µs"
    if us < 1_000_000:
        return f"{sign}{us / 1_000:.1f} ms"
    if us < 600_000_000:
        return f"{sign}{us / 1_000_000:.1f} s"
    return f"{sign}{us / 60_000_000:.1f} min"


def _num(value: float | int | None, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns, two spaces apart; the first column's header starts the block."""
    body = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in body) for i in range(len(headers))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in body]


def _per_tier(values: Sequence[int], vip: int) -> str:
    """VIP's, Normal's and Batch's figures ("9500/4000/1500"): each tier is placed against its
    own budget, so VIP's room alone says nothing of a Normal or Batch queue's."""
    return "/".join(str(v) for v in values) if values else str(vip)


def _dedicated(n: NodeView) -> str:
    """Whether the node is kept for VIP: dedicated (`[pools.dedicated]`), or a lane with the
    cap its Normal and Batch tasks (its guests) have now."""
    if n.dedicated:
        return "closed to guests" if n.guests_closed else "yes"
    cap = n.fields.get("lane_cap")
    if cap:
        return "lane" if cap == "-1" else f"lane, cap {cap}"
    return "-"


def _prefill(n: NodeView) -> str:
    """The release control's room / window and backlog, in prompt tokens, with the prefill rate
    and gain the window was sized by, the running limit ('-': not limited) and the decode step
    time now / at calm (the limit's signal)."""
    room, window = n.fields.get("prefill_room"), n.fields.get("prefill_window")
    if room is None or window is None:
        return "-"
    sized = "".join(f", {label}{n.fields[key]}{unit}" for key, label, unit in (
        ("prefill_rate", "", "/s"), ("prefill_gain", "gain ", ""),
        ("running_limit", "running limit ", "")) if n.fields.get(key))
    step, calm = n.fields.get("decode_step_ms"), n.fields.get("calm_step_ms")
    if step:
        sized += f", step {step}{f'/{calm}' if calm else ''} ms"
    return f"{room}/{window} (queued {n.fields.get('prefill_backlog', '?')}{sized})"


_POOL_REASONS = {
    "zone": "the zone's release policy",
    "tenant": "its tenants' in-flight caps or fair hold-back",
    "no_node": "no node has capacity for the tier",
}


def held_by(held: Held | None, now_us: int) -> str:
    """Why a queue waits, in words: the nodes that refused its head per reason (kv: the tier's
    KV ceiling; prefill: the release control's room; quiet: a long prompt kept off the nodes
    kept quiet for VIP; lane, dedicated: nodes kept for VIP), with the head's size, or a
    reason about the pool; and how long ago the leader's release recorded it."""
    if held is None:
        return "-"
    if held.reason.startswith("behind "):
        text = f"the {held.reason.split(' ', 1)[1]} queue's head"
    elif held.reason in _POOL_REASONS:
        text = _POOL_REASONS[held.reason]
    else:
        text = ", ".join(f"{reason} on {n} node{'s' if n != 1 else ''}"
                         for reason, n in held.kinds().items())
        if held.cost is not None:
            prompt = "" if held.prompt is None else f", prompt {held.prompt}"
            text += f" (head: {held.cost} tokens{prompt})"
    if held.at_us is not None:
        text += f", {_duration(now_us - held.at_us)} ago"
    return text


STALE_STATE_US = 2_000_000
"""A leader publishes every poll (well under a second), so an older state means none is leading
or it cannot reach Redis. Two seconds is the pools' default `stale_after_ms`, past which the
gateways stop the fast path and queue every request: the reader is told before that happens."""


def render_pool(p: PoolView) -> list[str]:
    drain = " ".join(f"{t.label} {_num(d, '{:g}')}/s" for t, d in zip(Tier, p.drain, strict=True))
    clock = "" if p.clock == "redis" else "  (clock frozen)"
    stale = ""
    if p.state_age_us is not None and p.state_age_us > STALE_STATE_US:
        stale = "  STALE: no leader has published for over 2 s (is a scheduler leading?)"
    lines = [
        f"pool {p.pool}  zone {p.zone or 'GREEN (no state published)'}  "
        f"epoch {_num(p.epoch)}  state age {_duration(p.state_age_us)}{clock}{stale}",
        f"  drain {drain}"
        + "".join(f"  {k} {v}" for k, v in sorted(p.state.items()) if v != ""),
    ]
    if p.wrong_type_keys:
        lines.append("  WARNING keys of another type than kvgate writes, read as empty: "
                     + ", ".join(p.wrong_type_keys))
    lines += table(
        ["node", "capacity v/n/b", "reserved", "headroom v/n/b", "usage", "projected",
         "prefill room", "dedicated", "guests", "out"],
        ([n.node, _per_tier(n.tier_capacity, n.capacity), str(n.reserved),
          _per_tier(n.tier_headroom, n.headroom),
          _num(n.usage, "{:.4f}"), _num(n.projected, "{:.4f}"), _prefill(n), _dedicated(n),
          str(n.guests), n.out or ""]
         for n in p.nodes),
    ) if p.nodes else ["  no nodes (no capacity published)"]
    lines += table(["tier", "depth", "oldest wait", "oldest task", "held by"],
                   ([q.tier, str(q.depth), _duration(q.oldest_wait_us), q.oldest_task or "-",
                     held_by(q.held, p.now_us)]
                    for q in p.queues))
    lines.append(f"  in flight: {p.in_flight_tasks} tasks, {p.in_flight_tokens} tokens "
                 f"reserved; queued: {p.queued}")
    if "normal_credit" in p.stats:
        lines.append(f"  light tenants' YELLOW credit: {p.stats['normal_credit']} Normal tasks "
                     f"({p.stats.get('credit_used', 0)} taken on the fast path so far)")
    if p.gateways:
        lines += table(["gateway", "live tasks", "lease left"],
                       ([g.gateway, str(g.live_tasks),
                         _duration(g.lease_left_us) + (
                             " EXPIRED" if g.lease_left_us is not None and g.lease_left_us < 0
                             else "")]
                        for g in p.gateways))
    else:
        lines.append("  no gateway holds a lease (a gateway holds one only while it has requests)")
    if p.tenants:
        lines += table(["tenant", "tokens", "burst", "% of burst", "rate/s", "queued",
                        "used today", "used this month"],
                       ([t.tenant + (" *" if t.configured is False else ""),
                         _num(t.tokens, "{:.1f}"), _num(t.burst), _num(t.percent),
                         _num(t.rate), str(t.queued), _num(t.day_used), _num(t.month_used)]
                        for t in p.tenants))
        if any(t.configured is False for t in p.tenants):
            lines.append("  * not in the configuration read: its keys stay until kvgate-prune "
                         "deletes them")
    if p.fairness is not None:
        lines += render_fair(p.fairness, table)
    return lines


def render(s: Snapshot, redis: str | None = None) -> str:
    """The tables; `redis`: the address read, shown first (kept on screen by --watch)."""
    left = s.scheduler.lease_left_ms
    lease = "" if left is None else f"  lease left {left} ms"
    lines = [] if redis is None else [f"redis {redis}"]
    lines += [f"scheduler leader {s.scheduler.leader or 'NONE'}  epoch {s.scheduler.epoch}{lease}"]
    for pool in s.pools:
        lines += ["", *render_pool(pool)]
    return "\n".join(lines) + "\n"
