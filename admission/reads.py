"""Named reads of one pool's keys, for the gateway and the scheduler.

The scripts (admission.store) write; these read what the services need between script calls,
each in one round trip, so that no service names a key or sends a command of its own:

- `read_tick`: what the leader plans a tick from (reservations, counters, queue depths, why
  each queue waited at the last release (`Held`), and
  when asked the prefill counts, the VIP first-token reports and the running index, whose
  members `running_member` parses: the services never see a member's format);
- `left_queue` and `task_states`: the gateway's fallback check of its queued requests;
- `gateway_tasks`: the tasks a gateway holds in the pool (its orphan sweep);
- `read_fairness`: the backlogged flows, the tenants with tokens in flight, their hashes and
  the quota levels, for the leader's metrics (three round trips, about once a second, off
  every request's path).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from redis.asyncio.cluster import RedisCluster

from admission.keys import VT_SCALE, PoolKeys
from admission.scripts import frozen_clock_allowed
from admission.tiers import Tier


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def int_map(raw: Mapping[Any, Any]) -> dict[str, int]:
    """A hash of counters as read (bytes or str fields and values), fields that are not
    integers left out."""
    out: dict[str, int] = {}
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else str(k)
        try:
            out[key] = int(v)
        except (TypeError, ValueError):
            continue
    return out


class RunningMember(NamedTuple):
    """A released task as the running index records it: the member lua/_lib.lua's
    running_member writes ("node prompt_tokens max_tokens task_id"; names never contain
    spaces, admission.keys.check_name) and its score."""

    node: str
    prompt_tokens: int
    max_tokens: int
    released_us: int
    """When the task was released (the pool clock, µs): the member's score."""


def running_member(raw: Any, score: Any) -> RunningMember | None:
    """One (member, score) pair of `TickReading.running`, parsed; None for a member in a
    format this version does not write (its reservation then counts at full size)."""
    try:
        node, prompt_tokens, max_tokens, _ = _text(raw).split(" ", 3)
        return RunningMember(node, int(prompt_tokens), int(max_tokens), int(float(score)))
    except ValueError:
        return None


def vip_counts(counts: Mapping[str, int]) -> tuple[dict[str, tuple[int, int]], dict[int, int]]:
    """The fields the finish script counts in node_vip_ttft, in one pass: node -> (VIP first
    tokens, those over the objective), from the `<node>:n` and `<node>:over` fields; and
    bucket k -> VIP first tokens of the whole pool whose ms lie in [1.1^k, 1.1^(k+1)), from
    the `h<k>` fields, plus the per-node `<node>:h<k>` fields that earlier versions of the
    script wrote (a pool upgraded while running keeps them; all are monotonic)."""
    reports: dict[str, tuple[int, int]] = {}
    histogram: dict[int, int] = {}
    for field_name, value in counts.items():
        node, _, kind = field_name.rpartition(":")
        if kind in ("n", "over") and node:
            n, over = reports.get(node, (0, 0))
            reports[node] = (value, over) if kind == "n" else (n, value)
        elif kind.startswith("h") and kind[1:].isdigit():
            bucket = int(kind[1:])
            histogram[bucket] = histogram.get(bucket, 0) + value
    return reports, histogram


NODE_REASONS = ("kv", "prefill", "quiet", "lane", "dedicated")
"""What stopped a waiting head on a node (place()'s `why` in lua/_place.lua)."""
HELD_REASONS = (*NODE_REASONS, "zone", "tenant", "behind", "no_node")
"""Every reason a tier's queue waits for (Held.kinds())."""


@dataclass(frozen=True, slots=True)
class Held:
    """Why a tier's queue waits, as the leader's last release recorded it (the pool's `held`
    hash, lua/release.lua): the nodes that refused its head, counted per reason, or a reason
    about the pool ('zone', 'tenant', 'behind <tier>', 'no_node')."""

    reason: str
    at_us: int | None = None
    task: str | None = None
    """The head that fits no node (node reasons only)."""
    cost: int | None = None
    """Its tokens: prompt and the output it may generate."""
    prompt: int | None = None

    def kinds(self) -> dict[str, int]:
        """reason -> nodes that gave it, or {'zone' | 'tenant' | 'behind' | 'no_node': 1}."""
        if "=" not in self.reason:
            return {"behind" if self.reason.startswith("behind ") else self.reason: 1}
        out: dict[str, int] = {}
        for part in self.reason.split(","):
            name, _, count = part.partition("=")
            if count.isdigit():
                out[name] = int(count)
        return out


def held_map(raw: Mapping[Any, Any]) -> dict[str, Held]:
    """The `held_by` hash as read: tier label -> Held."""
    fields = {_text(k): _text(v) for k, v in raw.items()}

    def number(name: str) -> int | None:
        value = fields.get(name, "")
        return int(value) if value.lstrip("-").isdigit() else None

    out = {}
    for tier in Tier:
        reason = fields.get(tier.label)
        if reason:
            t = tier.label
            out[t] = Held(reason, number(f"{t}:us"), fields.get(f"{t}:task") or None,
                          number(f"{t}:cost"), number(f"{t}:prompt"))
    return out


@dataclass(frozen=True, slots=True)
class TickReading:
    """One pool as the leader reads it at the start of a tick."""

    reserved: dict[str, int]
    """node_reserved: node -> tokens reserved by released, unsettled tasks."""
    stats: dict[str, int]
    """The pool's monotonic counters (released_<tier>, settled_cost, settled_usage, ...)."""
    depths: tuple[int, int, int]
    """Tasks queued per tier (VIP, Normal, Batch)."""
    prefill_released: dict[str, int] = field(default_factory=dict)
    """node -> prompt tokens of Normal and Batch work released there so far (read with
    `control`, before the running index)."""
    prefill_overdrawn: dict[str, int] = field(default_factory=dict)
    """node -> prompt tokens light tenants released there beyond the room so far (the same
    hash's `<node>:light` fields)."""
    vip_reports: dict[str, tuple[int, int]] = field(default_factory=dict)
    """node -> (VIP first tokens seen, those over the objective), monotonic counts (with
    `control`)."""
    vip_histogram: dict[int, int] = field(default_factory=dict)
    """The pool's VIP first tokens per 10% bucket of ms (`vip_histogram`), monotonic counts
    (with `control`)."""
    guests: dict[str, int] = field(default_factory=dict)
    """node_guests: node -> tasks alive there as guests of a dedicated node or a lane (with
    `guests`)."""
    running: Sequence[tuple[Any, Any]] | None = None
    """The running index's (member, score) pairs as Redis returns them, for `running_member`
    to parse (the leader parses each member once and keeps it while its task runs, keyed by
    the raw member); None when not read."""
    frozen_us: Any = None
    """The pool clock's frozen_us, read with the index only in a process that enabled the test
    clock (`admission.scripts.allow_frozen_clock`); None in every service."""
    held: dict[str, Held] = field(default_factory=dict)
    """Why each tier's queue waited at the last main release (tier label -> Held)."""


async def read_tick(client: Any, keys: PoolKeys, *, control: bool, running: bool,
                    guests: bool = False) -> TickReading:
    """One pipelined read (no TIME: Redis Cluster refuses it in a pipeline). `control`: also
    the prefill counts; `guests`: also the guests count per node (a lane's cap is sized from
    it); `running`: also the whole running index, the largest reply of a tick with thousands
    of tasks in flight, so it is read only when it is used."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.node_reserved)
        pipe.hgetall(keys.stats)
        for queue in keys.queues:
            pipe.zcard(queue)
        pipe.hgetall(keys.held_by)
        if control:
            # Before the running index: a release in between is then counted in the backlog
            # and in this count, so the room it took is not given back.
            pipe.hgetall(keys.node_prefill_released)
            pipe.hgetall(keys.node_vip_ttft)
        if guests:
            pipe.hgetall(keys.node_guests)
        if running:
            # Raw: redis-py's own score conversion would double this read's cost.
            pipe.execute_command("ZRANGE", keys.running, 0, -1, "WITHSCORES")
            if frozen_clock_allowed():
                pipe.hget(keys.clock, "frozen_us")
        reply = list(await pipe.execute())
    depths = (int(reply[2]), int(reply[3]), int(reply[4]))
    held = held_map(reply[5])
    rest = reply[6:]
    prefill_released: dict[str, int] = {}
    overdrawn: dict[str, int] = {}
    reports: dict[str, tuple[int, int]] = {}
    histogram: dict[int, int] = {}
    guest_counts: dict[str, int] = {}
    if control:
        for name, count in int_map(rest[0]).items():
            node, _, kind = name.partition(":")
            if not kind:
                prefill_released[node] = count
            elif kind == "light":
                overdrawn[node] = count
        reports, histogram = vip_counts(int_map(rest[1]))
        rest = rest[2:]
    if guests:
        guest_counts, rest = int_map(rest[0]), rest[1:]
    if not running:
        return TickReading(int_map(reply[0]), int_map(reply[1]), depths, prefill_released,
                           overdrawn, reports, histogram, guest_counts, held=held)
    frozen = rest[1] if len(rest) > 1 else None
    return TickReading(int_map(reply[0]), int_map(reply[1]), depths, prefill_released,
                       overdrawn, reports, histogram, guest_counts, rest[0], frozen, held=held)


async def left_queue(client: Any, keys: PoolKeys, tier: Tier,
                     task_ids: Sequence[str]) -> list[str]:
    """Those of `task_ids` no longer in the queue of `tier` (one ZMSCORE)."""
    if not task_ids:
        return []
    scores = await client.execute_command("ZMSCORE", keys.queue(tier), *task_ids)
    return [task_id for task_id, score in zip(task_ids, scores, strict=True) if score is None]


async def task_states(client: Any, keys: PoolKeys,
                      task_ids: Sequence[str]) -> list[tuple[str, str]]:
    """(state, node) of each task's record, '' for what it lacks (one pipelined read)."""
    async with client.pipeline(transaction=False) as pipe:
        for task_id in task_ids:
            pipe.hmget(keys.task_key(task_id), "state", "node")
        records = await pipe.execute()
    return [(_text(state), _text(node)) for state, node in records]


async def gateway_tasks(client: Any, keys: PoolKeys, gateway: str) -> set[str]:
    """Ids of the live tasks `gateway` holds in the pool (its renewed set)."""
    return {_text(raw) for raw in await client.smembers(keys.gateway_tasks_key(gateway))}


@dataclass(frozen=True, slots=True)
class FairReading:
    """Fair release and quota levels of one pool, as the leader reads them for its metrics."""

    now_us: int
    """The scripts' clock (Redis TIME, or the pool clock's frozen_us in tests)."""
    backlogged: tuple[dict[str, float], dict[str, float], dict[str, float]]
    """Per tier: the backlogged tenants and their virtual counters, in tokens at weight 1."""
    tenants: dict[str, dict[str, str]]
    """The hashes of those tenants and of the tenants with tokens in flight (the pool's
    `tenant_inflight` index), queued or not (weight, queued_tokens, inflight_tokens, drain, ...)."""
    levels: dict[str, dict[str, str]]
    """The quota levels asked for, by name: their bucket hashes (empty: never debited)."""


def _str_map(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in raw.items()}


async def vip_placements(client: Any, keys: PoolKeys) -> dict[str, int]:
    """node -> VIP placements there so far (`<node>:vips` in node_prefill_released): what the
    leader reads before its poll, so that the chats placed after it count as running beside
    the reading (lua/_room.lua prefill_room)."""
    return {name[:-len(":vips")]: count
            for name, count in int_map(await client.hgetall(keys.node_prefill_released)).items()
            if name.endswith(":vips")}


NODE_STUCK = "stuck"
"""The `nodes_out` reason of a node whose engine the leader judged stuck (its /metrics answers,
it holds requests, its page does not change): the gateways end the requests it holds."""


def parse_nodes_out(raw: str) -> dict[str, str]:
    """The state's `nodes_out` field ("node:reason,node:reason") as node -> reason."""
    return dict(item.split(":", 1) for item in raw.split(",") if ":" in item)


async def nodes_out(client: Any, keys: PoolKeys) -> dict[str, str]:
    """The nodes the last leader took out of the pool, and why (one field of the state)."""
    return parse_nodes_out(_text(await client.hget(keys.state, "nodes_out")))


async def releases_older_than(client: Any, keys: PoolKeys, age_us: int
                              ) -> tuple[int, list[tuple[str, int]]]:
    """The pool clock now (Redis TIME, or the frozen_us of a test that froze it), µs, and the
    node and release (µs) of each task in the running index released `age_us` ago or more:
    tasks kvgate released there that have not ended."""
    now_us = await redis_time_us(client, keys.state)
    if frozen_clock_allowed() and (frozen := await client.hget(keys.clock, "frozen_us")):
        now_us = int(frozen)
    members = await client.zrangebyscore(keys.running, "-inf", now_us - age_us, withscores=True)
    return now_us, [(entry.node, entry.released_us) for raw, score in members
                    if (entry := running_member(raw, score)) is not None]


async def published_state(client: Any, keys: PoolKeys) -> dict[str, str]:
    """The pool's state hash, as the last leader published it (empty: none yet)."""
    return _str_map(await client.hgetall(keys.state))


async def redis_time_us(client: Any, key: str) -> int:
    """TIME in µs of the server that holds `key`. The scripts stamp a pool's records with the
    clock of the server that runs them, the one that owns the pool's slot; TIME names no key,
    so on Redis Cluster it would go to any node, whose clock may differ from that one's by
    their skew. It is sent to the owner of `key`'s slot instead."""
    if isinstance(client, RedisCluster):
        owner = client.get_node_from_key(key)
        seconds, micros = await client.execute_command("TIME", target_nodes=owner)
    else:
        seconds, micros = await client.time()
    return int(seconds) * 1_000_000 + int(micros)


async def read_fairness(client: Any, keys: PoolKeys, levels: Sequence[str]) -> FairReading:
    """Two pipelined reads: the backlogged flows of every tier, the tenants in flight, the
    levels' buckets (and the pool clock's frozen_us in a process that enabled the test clock);
    then the hashes of the tenants found in the flows or in flight. A tenant with tokens in
    flight and none queued is in no flow: without the index its tokens would be in no series,
    not even `_other`'s."""
    server_now = await redis_time_us(client, keys.state)
    frozen_read = frozen_clock_allowed()
    async with client.pipeline(transaction=False) as pipe:
        for tier in Tier:
            pipe.zrange(keys.flows(tier), 0, -1, withscores=True)
        pipe.zrange(keys.tenant_inflight, 0, -1)
        for level in levels:
            pipe.hgetall(keys.quota_key(level))
        if frozen_read:
            pipe.hget(keys.clock, "frozen_us")
        reply = list(await pipe.execute())
    flows = tuple({_text(m): float(s) / VT_SCALE for m, s in rows} for rows in reply[:3])
    frozen = reply.pop() if frozen_read else None
    now = int(frozen) if frozen is not None else server_now
    names = sorted(set().union(*flows, (_text(m) for m in reply[3])))
    tenants: dict[str, dict[str, str]] = {}
    if names:
        async with client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(keys.tenant_key(name))
            tenants = {n: _str_map(raw) for n, raw in zip(names, await pipe.execute(),
                                                          strict=True)}
    return FairReading(now, (flows[0], flows[1], flows[2]), tenants,
                       {lvl: _str_map(raw) for lvl, raw in zip(levels, reply[4:], strict=True)})


def finite_number(raw: str | None, default: float = 0.0) -> float:
    """A hash field as a finite float; `default` when it is missing, not a number, or not
    finite (operators can write anything with redis-cli)."""
    try:
        value = float(raw) if raw is not None else default
    except ValueError:
        return default
    return value if math.isfinite(value) else default


DRAIN_TAU_S = 5.0
"""The time constant of a tenant's decayed drain in the scripts (lua/_tenant.lua DRAIN_TAU_US)."""


def release_rate(h: Mapping[str, str], now_us: int) -> float:
    """Tokens/s released from a tenant's queue, from its decayed drain (`drain`, `drain_us`
    of its hash) as of `now_us`."""
    total, at = finite_number(h.get("drain")), finite_number(h.get("drain_us"), now_us)
    if now_us > at:
        total *= math.exp(-(now_us - at) / (DRAIN_TAU_S * 1e6))
    return total / DRAIN_TAU_S
