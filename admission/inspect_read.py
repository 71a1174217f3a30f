"""What Redis says about a model pool, read as one consistent snapshot: `kvgate-inspect`'s and
the gateway admin API's reading (admission.inspect is the command line around it).

Per pool: the zone the leader published and how old that is, the nodes with each tier's budget,
their reservations, headroom and measured usage, queue depth and oldest wait per tier, the
reservations in flight, the gateways' leases, and every tenant's token bucket; plus who leads
the schedulers. "Now" is the clock the Lua scripts use (Redis ``TIME``; in a test process, the
pool clock's ``frozen_us`` when set), so waits, ages and bucket refills are the ones the next
admit would compute. Bucket keys are found with SCAN (never KEYS, which blocks a busy server).
A pool's reads are one MULTI (its keys share one hash tag, so this holds on Redis Cluster too).
A field that is no finite number (written by hand with redis-cli) reads as unknown.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.asyncio.cluster import RedisCluster

from admission.config import TenantSettings
from admission.inspect_fair import (
    FairView,
    allowance_used,
    as_text,
    month_index,
    read_as_empty,
    read_fair,
    scan_hashes,
)
from admission.keys import PoolKeys, SchedulerKeys
from admission.reads import Held, held_map, parse_nodes_out, redis_time_us
from admission.scripts import frozen_clock_allowed
from admission.store import MICRO
from admission.tiers import Tier

CORE_STATE_FIELDS = ("zone", "epoch", "updated_us", "nodes_out")
DRAIN_FIELDS = tuple(f"drain_{t.value}" for t in Tier)


@dataclass(frozen=True, slots=True)
class NodeView:
    node: str
    capacity: int
    """Tokens the leader lets VIP reserve on the node (0 once it is taken out): VIP's budget,
    the highest of the tiers' (`tier_capacity` has the others')."""
    reserved: int
    headroom: int
    """VIP's: `capacity` less `reserved` (`tier_headroom` has every tier's)."""
    usage: float | None
    """Measured KV-cache usage (0..1) the leader last published, if any."""
    projected: float | None
    out: str | None
    """Why the leader took the node out (stale, ejected, ...), from the state's nodes_out."""
    guests: int
    """Tasks of other tiers alive on a dedicated node as guests ([pools.dedicated]), or Normal
    and Batch tasks alive on a lane ([pools.control] lane_nodes)."""
    dedicated: bool
    """A dedicated node: its tiers first, other tiers only as bounded guests."""
    guests_closed: bool
    """A dedicated node the leader closed to new guests (it runs above `guest_max_running`)."""
    fields: dict[str, str]
    """Any other per-node state field (`name:node` in the state hash)."""
    tier_capacity: list[int] = field(default_factory=list)
    """Tokens each tier (VIP, Normal, Batch) may reserve on the node: `node_capacity`,
    `node_capacity:normal`, `node_capacity:batch`. A task is placed against its own tier's
    budget (lua/_place.lua), and Normal's and Batch's are lower than VIP's."""
    tier_headroom: list[int] = field(default_factory=list)
    """Each tier's budget less `reserved`: the largest task of that tier the node's KV budget
    takes now (the release control's prefill room, the dedicated and lane rules and fair
    hold-back can leave it less)."""


@dataclass(frozen=True, slots=True)
class QueueView:
    tier: str
    depth: int
    oldest_task: str | None
    oldest_wait_us: int | None
    held: Held | None = None
    """Why it waits, as the leader's last release recorded it (None: it did not wait)."""


@dataclass(frozen=True, slots=True)
class GatewayView:
    gateway: str
    lease_expiry_us: int | None
    """None: the lease's score is no finite number (written by hand)."""
    lease_left_us: int | None
    """Negative: the lease expired and the reaper has not returned its tasks yet."""
    live_tasks: int
    """Queued or released tasks the gateway holds in this pool."""


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: str
    bucket: bool
    """False: no bucket key in this pool yet; the first admit finds it full."""
    micro_tokens: int | None
    """Level after the lazy refill up to now, in micro-tokens (exact)."""
    tokens: float | None
    burst: int | None
    rate: int | None
    percent: float | None
    """Level as a percentage of the burst, two decimals."""
    queued: int
    day_used: int | None = None
    """Tokens of its own daily allowance used today (None: no allowance counted in the pool):
    a tenant refused by its allowance may have a full bucket."""
    month_used: int | None = None
    configured: bool | None = None
    """Whether the configuration read names the tenant (None: none was read): keys of one it
    does not name stay until `kvgate-prune` deletes them."""


@dataclass(frozen=True, slots=True)
class PoolView:
    pool: str
    now_us: int
    clock: str
    """'redis' (TIME) or 'frozen' (the pool clock's frozen_us, tests only)."""
    zone: str | None
    """None: no leader has published this pool's state yet (admits treat it as GREEN)."""
    epoch: int | None
    updated_us: int | None
    state_age_us: int | None
    drain: list[float | None]
    """Release rate per tier (tasks/s) the leader measured, VIP first."""
    state: dict[str, str]
    """The state hash's other fields (pool_usage, usage_ratio, leader, ...)."""
    nodes: list[NodeView]
    queues: list[QueueView]
    queued: int
    in_flight_tasks: int
    """Released, unsettled tasks: what the gateways hold minus what is queued."""
    in_flight_tokens: int
    """Tokens those tasks hold (the sum of node_reserved)."""
    gateways: list[GatewayView]
    tenants: list[TenantView]
    stats: dict[str, int]
    fairness: FairView | None = None
    """Fair release and quota levels (admission.inspect_fair)."""
    wrong_type_keys: list[str] = field(default_factory=list)
    """The pool's keys that hold another type than kvgate writes (by hand, with redis-cli),
    read as empty."""


@dataclass(frozen=True, slots=True)
class SchedulerView:
    leader: str | None
    epoch: int
    lease_left_ms: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    scheduler: SchedulerView
    pools: list[PoolView]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _hash(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {as_text(k): as_text(v) for k, v in raw.items()}


def _int(value: str | None) -> int | None:
    """A field as an integer; None when it is missing or no finite number (operators can
    write anything with redis-cli: "1e999" must not end the read with an OverflowError)."""
    if value is None or value == "":
        return None
    try:
        return int(float(value)) if "." in value or "e" in value.lower() else int(value)
    except (ValueError, OverflowError):
        return None


def _float(value: str | None) -> float | None:
    """A field as a finite float, else None: "nan" or "inf" would make `--json` and the admin
    API print NaN or Infinity, which JSON parsers (jq, JSON.parse) refuse."""
    try:
        number = None if value is None or value == "" else float(value)
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def bucket_level(raw: Mapping[str, str], now_us: int) -> tuple[int, int, int] | None:
    """(micro-tokens at `now_us`, rate, burst) the way `_lib.lua`'s bucket_level computes it."""
    level, ts = _int(raw.get("micro_tokens")), _int(raw.get("updated_us"))
    rate, burst = _int(raw.get("rate")), _int(raw.get("burst"))
    if rate is None or burst is None:
        return None
    cap = burst * MICRO
    if level is None or ts is None:
        return cap, rate, burst
    if now_us > ts:
        level += rate * (now_us - ts)
    return min(level, cap), rate, burst


def _tenant_view(name: str, level: tuple[int, int, int] | None, queued: int,
                 bucket: bool, used: tuple[int | None, int | None] = (None, None)
                 ) -> TenantView:
    if level is None:
        return TenantView(name, bucket, None, None, None, None, None, queued, *used)
    micro, rate, burst = level
    percent = round(100 * micro / (burst * MICRO), 2) if burst else None
    return TenantView(name, bucket, micro, micro / MICRO, burst, rate, percent, queued, *used)


async def read_scheduler(client: Any) -> SchedulerView:
    k = SchedulerKeys()
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(k.leader)
        pipe.pttl(k.leader)
        pipe.get(k.epoch)
        leader, pttl, epoch = await pipe.execute()
    return SchedulerView(
        leader=None if leader is None else as_text(leader),
        epoch=(None if epoch is None else _int(as_text(epoch))) or 0,
        lease_left_ms=int(pttl) if leader is not None and int(pttl) >= 0 else None,
    )


async def _buckets(client: Any, keys: PoolKeys) -> dict[str, dict[str, str]]:
    # A bucket may vanish between SCAN and HGETALL (flush, manual DEL): it is then left out.
    return await scan_hashes(client, keys.bucket_key(""))


def _nodes(state: dict[str, str], capacity: Mapping[str, str],
           reserved: Mapping[str, str], guests: Mapping[str, str],
           lower: Sequence[Mapping[str, str]] = ({}, {})) -> list[NodeView]:
    """`lower`: Normal's and Batch's budgets per node (node_capacity:normal, :batch)."""
    per_node: dict[str, dict[str, str]] = {}
    for name in [f for f in state if ":" in f]:
        kind, node = name.split(":", 1)
        per_node.setdefault(node, {})[kind] = state.pop(name)
    out_reasons = parse_nodes_out(state.get("nodes_out", ""))
    dedicated = set(state.get("dedicated_nodes", "").split())
    closed = set(state.get("dedicated_guests_closed", "").split())
    views = []
    for node in sorted(set(capacity) | set(reserved) | set(per_node) | set(out_reasons)):
        extra = per_node.get(node, {})
        cap, res = _int(capacity.get(node)) or 0, _int(reserved.get(node)) or 0
        tier_caps = [cap, *(_int(budgets.get(node)) or 0 for budgets in lower)]
        views.append(NodeView(
            node=node, capacity=cap, reserved=res, headroom=cap - res,
            usage=_float(extra.pop("usage", None)),
            projected=_float(extra.pop("projected", None)),
            out=out_reasons.get(node), guests=_int(guests.get(node)) or 0,
            dedicated=node in dedicated, guests_closed=node in closed, fields=extra,
            tier_capacity=tier_caps, tier_headroom=[c - res for c in tier_caps],
        ))
    return views


async def read_pool(client: Any, pool: str,
                    tenants: Sequence[TenantSettings] = ()) -> PoolView:
    keys = PoolKeys(pool)
    cluster = isinstance(client, RedisCluster)
    # MULTI makes one consistent snapshot; every key here shares the pool's hash tag.
    read: list[tuple[str, Any]] = []
    """Per command: its key, and what it reads as when the key holds another type."""
    async with client.pipeline(transaction=True) as pipe:
        if not cluster:  # a keyless TIME cannot join a cluster transaction
            pipe.time()
            read.append(("", None))
        for key in (keys.state, keys.node_capacity, keys.node_reserved, keys.node_guests):
            pipe.hgetall(key)
            read.append((key, {}))
        for queue in keys.queues:
            pipe.zcard(queue)
            pipe.zrange(queue, 0, 0, withscores=True)
            read += [(queue, 0), (queue, [])]
        pipe.zrange(keys.leases, 0, -1, withscores=True)
        read.append((keys.leases, []))
        for key in (keys.tenant_queued, keys.stats, keys.held_by,
                    keys.tier_capacity(Tier.NORMAL), keys.tier_capacity(Tier.BATCH)):
            pipe.hgetall(key)
            read.append((key, {}))
        if frozen_clock_allowed():
            pipe.hget(keys.clock, "frozen_us")
            read.append((keys.clock, None))
        replies = list(await pipe.execute(raise_on_error=False))
    wrong_type: list[str] = []
    read_as_empty(read, replies, wrong_type)
    redis_now = (await redis_time_us(client, keys.state) if cluster
                 else _time_us(replies.pop(0)))
    state_raw, cap_raw, res_raw, guests_raw = replies[:4]
    queue_replies = replies[4:10]
    leases_raw, queued_raw, stats_raw, held_raw = replies[10:14]
    lower_caps = [_hash(raw) for raw in replies[14:16]]
    frozen = replies[16] if len(replies) > 16 else None
    held = held_map(held_raw)

    now = int(frozen) if frozen is not None else redis_now
    state = _hash(state_raw)
    capacity, reserved = _hash(cap_raw), _hash(res_raw)
    updated = _int(state.get("updated_us"))
    drain = [_float(state.get(f)) for f in DRAIN_FIELDS]
    nodes = _nodes(state, capacity, reserved, _hash(guests_raw), lower_caps)

    queues = []
    for tier in Tier:
        depth = int(queue_replies[2 * tier])
        head = queue_replies[2 * tier + 1]
        oldest, wait = None, None
        if head:
            score = _score(head[0][1])
            oldest, wait = as_text(head[0][0]), None if score is None else now - score
        queues.append(QueueView(tier.label, depth, oldest, wait,
                                held.get(tier.label) if depth else None))
    queued = sum(q.depth for q in queues)

    leases = [(as_text(g), _score(score)) for g, score in leases_raw]
    live: list[int] = []
    if leases:
        async with client.pipeline(transaction=False) as pipe:
            for gateway, _ in leases:
                pipe.scard(keys.gateway_tasks_key(gateway))
            counts = list(await pipe.execute(raise_on_error=False))
        read_as_empty([(keys.gateway_tasks_key(g), 0) for g, _ in leases], counts, wrong_type)
        live = [int(n) for n in counts]
    gateways = [GatewayView(g, expiry, None if expiry is None else expiry - now, n)
                for (g, expiry), n in zip(leases, live, strict=True)]

    queued_by_tenant = {k: _int(v) or 0 for k, v in _hash(queued_raw).items()}
    buckets = await _buckets(client, keys)
    configured = {t.name: t for t in tenants}
    views = []
    for name in sorted(set(buckets) | set(configured) | set(queued_by_tenant)):
        queued_n = queued_by_tenant.get(name, 0)
        if name in buckets:
            views.append(_tenant_view(name, bucket_level(buckets[name], now), queued_n, True,
                                      allowance_used(buckets[name], now, month_index(now))))
        elif name in configured:
            t = configured[name]
            views.append(_tenant_view(name, (t.burst * MICRO, t.rate, t.burst), queued_n, False))
        else:
            views.append(_tenant_view(name, None, queued_n, False))
    if configured:
        views = [dataclasses.replace(v, configured=v.tenant in configured) for v in views]

    fairness = await read_fair(client, keys, now, month_index(now), wrong_type)
    return PoolView(
        pool=pool, now_us=now, clock="redis" if frozen is None else "frozen",
        zone=state.get("zone"), epoch=_int(state.get("epoch")), updated_us=updated,
        state_age_us=None if updated is None else now - updated, drain=drain,
        state={k: v for k, v in state.items()
               if k not in CORE_STATE_FIELDS and k not in DRAIN_FIELDS},
        nodes=nodes, queues=queues, queued=queued,
        in_flight_tasks=max(0, sum(live) - queued),
        in_flight_tokens=sum(n.reserved for n in nodes),
        gateways=gateways, tenants=views,
        stats={k: v for k, v in ((k, _int(v)) for k, v in _hash(stats_raw).items())
               if v is not None},
        fairness=fairness,
        wrong_type_keys=wrong_type,
    )


def _score(value: Any) -> int | None:
    """A sorted set's score as µs; None when it is no finite number (`ZADD key +inf x` by
    hand: int() of it would end the read with an OverflowError)."""
    number = float(value)
    return int(number) if math.isfinite(number) else None


def _time_us(reply: Any) -> int:
    sec, usec = reply
    return int(sec) * 1_000_000 + int(usec)


async def snapshot(client: Any, pools: Sequence[str],
                   tenants: Sequence[TenantSettings] = ()) -> Snapshot:
    views = [await read_pool(client, pool, tenants) for pool in pools]
    return Snapshot(await read_scheduler(client), views)


# --- Command line -----------------------------------------------------------------------
