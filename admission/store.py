"""Typed async API over one model pool's keys: the gateway's and the scheduler's only way to them.

One `PoolStore` per (client, pool). Every write is one script call, i.e. one round trip; the
reads between script calls are named operations (admission.reads), one round trip each;
nothing here reads a client clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from admission import reads
from admission.errors import FencedError, ScriptReplyError, is_transient
from admission.hints import QueueView, retry_hint_ms
from admission.keys import PoolKeys, abandoned_lease, check_name
from admission.outcomes import (
    AdmitResult,
    FinishResult,
    ForgetResult,
    ReapResult,
    Released,
    ReleasedTask,
    parse_admit,
    text_of,
    view_of,
)
from admission.scripts import Scripts
from admission.tiers import Tier, Zone

MICRO = 1_000_000
MIN_WEIGHT = 0.01
MAX_WEIGHT = 10_000.0
"""Tenant weights (fair release) within these bounds keep every charge at least one counter unit
per 10 tokens and the counters exact (below 2**53 units) for 9e10 tokens served at the
smallest weight."""


MAX_USAGE = 2**40
"""The most usage `finish` passes on, far above any request's: the script's counters (HINCRBY)
would fail past 2^63 after it has already returned the reservation, leaving a half-settled
task; the gateway bounds a node's report by the request itself before this."""


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    """Per-pool settings the scripts need on every call."""

    tier_queue_caps: tuple[int, int, int] = (10_000, 10_000, 100_000)
    lease_ttl_ms: int = 10_000
    stale_after_ms: int = 0
    default_retry_ms: int = 1_000
    """The shortest capacity hint, and the hint when nothing is known (admission.hints)."""
    retention_s: int = 600
    fair: bool = True
    """Release in weighted fair order across tenants within each tier (False: FIFO)."""
    fair_headroom: float = 0.0
    """Fair order: the fraction of each node's capacity a release of a tenant above its share
    leaves free while a lighter tenant is active (admission.fairconfig `headroom`; the services
    pass the configured value, whose default is not 0)."""
    fair_light_window_ms: int = 5_000
    """Fair order: how long a tenant counts as light (admission.fairconfig `light_window_ms`)."""


def _fair_arg(p: PoolPolicy) -> str:
    """admit.lua's ARGV[17]: FIFO, fair, or fair holding room back for light tenants."""
    if not p.fair:
        return "0"
    return "2" if p.fair_headroom > 0 else "1"


@dataclass(frozen=True, slots=True)
class QuotaLevel:
    """A level enclosing tenants (a team, an organisation): its own token bucket in each pool,
    and optional allowances, debited by every request of every tenant under it."""

    name: str
    rate: int
    """Bucket refill, tokens per second."""
    burst: int
    """Bucket size, tokens."""
    daily_tokens: int = 0
    """Tokens per UTC day (0: no allowance)."""
    monthly_tokens: int = 0
    """Tokens per UTC month (0: no allowance)."""

    def __post_init__(self) -> None:
        check_name("team", self.name)

    @property
    def scope(self) -> str:
        """How a 429 names it (`X-RateLimit-Scope`)."""
        return f"team:{self.name}"


@dataclass(frozen=True, slots=True)
class TenantQuota:
    name: str
    rate: int
    """Bucket refill, tokens per second."""
    burst: int
    """Bucket size, tokens: the largest single reservation the tenant can ever make."""
    max_queued: int
    weight: float = 1.0
    """The tenant's share within its tier relative to the others' (fair release)."""
    max_queued_tokens: int = 0
    """Most tokens (reservations) of its requests queued at once in the pool; 0: no cap."""
    max_inflight_tokens: int = 0
    """Most tokens reserved by its released, unfinished requests in the pool; 0: no cap."""
    daily_tokens: int = 0
    """The key's own allowance per UTC day (0: none)."""
    monthly_tokens: int = 0
    """The key's own allowance per UTC month (0: none)."""
    levels: tuple[QuotaLevel, ...] = ()
    """The levels enclosing the tenant, innermost first (its team, the team's parent, ...)."""
    level_args: tuple[str | int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    """The levels as the admit script takes them (built once)."""

    def __post_init__(self) -> None:
        check_name("tenant", self.name)
        if self.rate < 0 or self.burst < 0 or self.burst > 1_000_000_000:
            raise ValueError("tenant rate must be >= 0 and burst within 0..1e9 tokens")
        if not MIN_WEIGHT <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"tenant weight must be within {MIN_WEIGHT}..{MAX_WEIGHT}")
        args: list[str | int] = [repr(float(self.weight)), self.max_queued_tokens,
                                 self.max_inflight_tokens, self.daily_tokens,
                                 self.monthly_tokens, len(self.levels)]
        for lvl in self.levels:
            args += [lvl.name, lvl.rate, lvl.burst, lvl.daily_tokens, lvl.monthly_tokens]
        object.__setattr__(self, "level_args", tuple(args))


class PoolStore:
    def __init__(self, client: Any, scripts: Scripts, pool: str, policy: PoolPolicy) -> None:
        self.client = client
        self.scripts = scripts
        self.keys = k = PoolKeys(pool)
        self.policy = policy
        # Built once: the hot path's two scripts name the same pool keys on every call.
        self._admit_keys = {tier: (k.state, k.clock, k.tier_capacity(tier), k.node_reserved,
                                   *k.queues, k.deadlines, k.leases, k.tenant_queued, k.stats)
                            for tier in Tier}
        self._finish_keys_head = (k.clock, k.node_reserved, *k.queues, k.deadlines,
                                  k.tenant_queued, k.stats)
        self._finish_keys_tail = (k.state, k.node_vip_ttft)
        self._prefix = k.prefix

    @property
    def pool(self) -> str:
        return self.keys.pool

    def _finish_keys(self, task_id: str) -> list[str]:
        return [*self._finish_keys_head, self.keys.task_key(task_id), *self._finish_keys_tail]

    async def admit(
        self,
        *,
        task_id: str,
        tenant: TenantQuota,
        tier: Tier,
        prompt_tokens: int,
        max_tokens: int,
        gateway: str,
        queue_timeout_ms: int,
        tier_timeout_ms: int | None = None,
    ) -> AdmitResult:
        """`tier_timeout_ms`: the tier's configured queue timeout; a task queued with exactly
        that timeout expires in queue order and takes no deadlines entry (None: always one)."""
        check_name("task", task_id)
        k, p = self.keys, self.policy
        cost = prompt_tokens + max_tokens
        reply = await self.scripts.admit(
            keys=[
                *self._admit_keys[tier], k.task_key(task_id), k.bucket_key(tenant.name),
                k.gateway_tasks_key(gateway), k.running, k.node_guests, k.node_guest_pace,
                k.node_prefill, k.node_prefill_released,
            ],
            args=[
                task_id, tenant.name, int(tier), cost, prompt_tokens, max_tokens,
                tenant.rate, tenant.burst, tenant.max_queued, p.tier_queue_caps[tier],
                queue_timeout_ms, gateway, p.lease_ttl_ms, p.stale_after_ms,
                tier_timeout_ms or 0, self._prefix, _fair_arg(p), *tenant.level_args,
            ],
        )
        return parse_admit(reply, tier, p.default_retry_ms)

    async def queue_view(self, tier: Tier) -> QueueView:
        """What a capacity hint for a request of `tier` is computed from, now (one script
        call: the queues at `tier` or above, the state hash, its age by Redis TIME)."""
        k = self.keys
        reply = await self.scripts.hint(keys=[k.state, k.clock, *k.queues], args=[int(tier)])
        try:
            return view_of(Zone(text_of(reply[0])), int(reply[1]), reply[2:5])
        except (ValueError, IndexError) as exc:
            raise ScriptReplyError(f"unexpected hint reply {reply!r}") from exc

    def retry_hint_ms(self, view: QueueView, tier: Tier) -> int:
        """The capacity hint (ms, before jitter) of a request of `tier` in `view`."""
        return retry_hint_ms(view, tier, self.policy.default_retry_ms)

    async def finish(self, task_id: str, usage: int | None, *, cancelled: bool,
                     ttft_ms: int | None = None) -> FinishResult:
        """Settle (response done) or cancel (client gone) a task; `usage` None = unknown,
        bounded to `MAX_USAGE`.
        `ttft_ms`: ms from the dispatch to the node to the first token, counted for VIP tasks
        as the leader's release control signal (None: no first token)."""
        reply = await self.scripts.finish(
            keys=self._finish_keys(task_id),
            args=[
                self._prefix, task_id, -1 if usage is None else min(max(0, usage), MAX_USAGE),
                self.policy.retention_s, "cancelled" if cancelled else "settled",
                -1 if ttft_ms is None else max(0, ttft_ms),
            ],
        )
        return FinishResult(text_of(reply[0]), text_of(reply[1]), int(reply[2]))

    async def settle(self, task_id: str, usage: int) -> FinishResult:
        return await self.finish(task_id, usage, cancelled=False)

    async def cancel(self, task_id: str, usage: int | None = None) -> FinishResult:
        return await self.finish(task_id, usage, cancelled=True)

    async def renew(self, gateway: str) -> int:
        """Extend the lease of all of `gateway`'s tasks in this pool; returns how many it holds."""
        k = self.keys
        reply = await self.scripts.renew(
            keys=[k.clock, k.leases, k.gateway_tasks_key(gateway)],
            args=[gateway, self.policy.lease_ttl_ms],
        )
        return int(reply[1])

    async def abandon(self, gateway: str, task_id: str) -> bool:
        """Stop renewing one of `gateway`'s tasks: it is reaped (its whole reservation
        returned) once its lease expires, at most one lease TTL from now. False when the task
        was no longer in the gateway's set (it ended meanwhile)."""
        k = self.keys
        reply = await self.scripts.abandon(
            keys=[k.clock, k.leases, k.gateway_tasks_key(gateway),
                  k.abandoned_tasks_key(gateway)],
            args=[task_id, gateway, abandoned_lease(gateway)],
        )
        return bool(int(reply[0]))

    async def reap(self, max_tasks: int = 1000) -> ReapResult:
        k = self.keys
        reply = await self.scripts.reap(
            keys=[k.clock, k.node_reserved, *k.queues, k.deadlines, k.leases, k.tenant_queued,
                  k.stats],
            args=[k.prefix, max_tasks, self.policy.retention_s],
        )
        return ReapResult(int(reply[0]), int(reply[1]), int(reply[2]), bool(int(reply[3])))

    async def release(self, epoch: int, limits: tuple[int, int, int],
                      guests_only: Iterable[Tier] = (),
                      credit: tuple[int, int] | None = None, call_ms: int = 0,
                      record_held: bool = False) -> Released:
        """Pop up to `limits` tasks per tier (VIP, Normal, Batch); tasks of a tier in
        `guests_only` may go only to dedicated nodes, as guests. `credit`: (the Normal tasks
        light tenants' fast path may release in YELLOW until the next call, the credit the
        last call left): the credit is set to the first less what was taken of the second
        (`Released` says what the call found and set); None leaves the credit alone.

        `call_ms` > 0: in script calls of at most about that much Redis time each (Redis runs
        one script at a time: a call placing thousands of tasks on hundreds of nodes would hold
        every gateway's admits for seconds). A call that stopped on its bound is followed by
        another for what is left of `limits`, while each releases something; the credit goes
        with the first. A later call fenced, or failing on an error a retry can pass
        (`admission.errors.is_transient`), ends the release with what the earlier ones
        released, which must still be announced (a permanent error is raised). Raises
        FencedError.

        `record_held`: the calls also record why each tier's queue still waits (the pool's
        `held_by` hash, lua/release.lua), which only the tick's main release should: a call
        limited to one tier would report the others as held by the zone."""
        out = last = await self._release_call(epoch, limits, guests_only, credit, call_ms,
                                              record_held)
        left = list(limits)
        while last.more and last:
            for task in last:
                if task.node is not None:
                    left[task.tier] -= 1
            if not any(n > 0 for n in left):
                break
            try:
                last = await self._release_call(epoch, (left[0], left[1], left[2]),
                                                guests_only, None, call_ms, record_held)
            except Exception as exc:
                # What the earlier calls released must still be announced; the next tick
                # goes on where this one stopped.
                if isinstance(exc, FencedError) or is_transient(exc):
                    break
                raise
            out += last
            out.calls += 1
        out.more = last.more
        return out

    async def _release_call(self, epoch: int, limits: tuple[int, int, int],
                            guests_only: Iterable[Tier], credit: tuple[int, int] | None,
                            call_ms: int, record_held: bool = False) -> Released:
        k = self.keys
        extra = ["", ""] if credit is None else [int(credit[0]), int(credit[1])]
        reply = await self.scripts.release(
            keys=[k.state, k.clock, k.node_capacity, k.node_reserved, *k.queues, k.deadlines,
                  k.tenant_queued, k.stats, k.tier_capacity(Tier.NORMAL),
                  k.tier_capacity(Tier.BATCH), k.node_prefill, k.node_prefill_released,
                  k.held_by],
            args=[k.prefix, epoch, *limits, self.policy.retention_s,
                  sum(1 << int(t) for t in set(guests_only)), "1" if self.policy.fair else "0",
                  repr(float(self.policy.fair_headroom)), self.policy.fair_light_window_ms,
                  *extra, max(0, int(call_ms)) * 1000, "1" if record_held else ""],
        )
        if text_of(reply[0]) == "fenced":
            raise FencedError(self.pool, epoch, int(reply[1]))
        out = Released()
        out.more = text_of(reply[0]) == "more"
        out.credit_before, out.credit_after = int(reply[2]), int(reply[3])
        for i in range(4, len(reply), 5):
            node = text_of(reply[i + 2])
            out.append(ReleasedTask(text_of(reply[i]), text_of(reply[i + 1]), node or None,
                                    Tier(int(reply[i + 3])), int(reply[i + 4])))
        return out

    async def publish_state(
        self,
        epoch: int,
        zone: Zone,
        node_capacity: Mapping[str, int | tuple[int, int, int]],
        extra: Mapping[str, str | int | float] | None = None,
        prefill: Mapping[str, tuple[float, ...]] | None = None,
        refill_ms: int = 0,
    ) -> int:
        """Write the zone and node capacities (fenced); returns the Redis time written, µs.
        A node's capacity is the tokens each tier may reserve on it (VIP, Normal, Batch), or
        one number for all three. `prefill`: node -> (limit on the node's released Normal and
        Batch prompt tokens, window[, prefill rate in tokens/s[, the engine's running
        sequences[, the lane's cap: Normal and Batch tasks alive on it, -1 for a lane without
        a cap, -2 or absent for a node that is not a lane[, the node's count of VIP placements
        (`vip_placements`) read before the running sequences were: the chats placed since
        count as running there; -1 or absent: none counted]]]]), replacing the published prefill
        rooms (None: keep none, no node limited); each room refills at its node's rate for
        `refill_ms` after the publish (lua/_room.lua prefill_of, lane_takes)."""
        k = self.keys
        args: list[str | int | float] = [epoch, zone.value, len(node_capacity)]
        for node, capacity in sorted(node_capacity.items()):
            per_tier = (capacity,) * 3 if isinstance(capacity, int) else capacity
            args += [node, *(int(c) for c in per_tier)]
        rooms = prefill or {}
        args += [len(rooms), int(refill_ms)]
        for node, (limit, window, *more) in sorted(rooms.items()):
            rate = more[0] if more else 0
            running = more[1] if len(more) > 1 else -1
            lane = more[2] if len(more) > 2 else -2
            vips = more[3] if len(more) > 3 else -1
            args += [node, int(limit), int(window), int(rate), int(running), int(lane),
                     int(vips)]
        for field, value in (extra or {}).items():
            args += [field, value]
        reply = await self.scripts.state(
            keys=[k.state, k.clock, *k.tier_capacities, k.node_prefill], args=args)
        if text_of(reply[0]) == "fenced":
            raise FencedError(self.pool, epoch, int(reply[1]))
        return int(reply[2])

    async def notify(self, released: Sequence[ReleasedTask], *, sharded: bool = False) -> None:
        """Wake the gateways of released or expired tasks; the task record stays the truth."""
        if not released:
            return
        publish = "SPUBLISH" if sharded else "PUBLISH"
        async with self.client.pipeline(transaction=False) as pipe:
            for task in released:
                pipe.execute_command(publish, self.keys.wake_channel(task.gateway),
                                     f"{task.task_id} {task.node or ''}")
            await pipe.execute()

    def wake_channel(self, gateway: str) -> str:
        """The pub/sub channel on which `notify` wakes `gateway` (`parse_wake` reads it)."""
        return self.keys.wake_channel(gateway)

    async def task(self, task_id: str) -> dict[str, str] | None:
        """A task's record, or None when there is none (never was, or its retention ended)."""
        raw = await self.client.hgetall(self.keys.task_key(task_id))
        if not raw:
            return None
        return {text_of(f): text_of(v) for f, v in raw.items()}

    async def read_tick(self, *, control: bool, running: bool,
                        guests: bool = False) -> reads.TickReading:
        """What the leader plans a tick from (admission.reads.read_tick)."""
        return await reads.read_tick(self.client, self.keys, control=control, running=running,
                                     guests=guests)

    async def forget(self, kind: str, name: str, min_idle_us: int, apply: bool,
                     spent: bool = False) -> ForgetResult:
        """Delete a tenant's (`kind` 'tenant') or a quota level's ('level') keys in this pool if
        nothing alive needs them, they hold nothing fresh keys would not (a spent bucket or
        allowance; `spent` True deletes those too) and none was written in the last
        `min_idle_us`; with `apply` False, only judge (lua/forget.lua; `kvgate-prune` runs it
        for names the configuration no longer has)."""
        check_name("tenant" if kind == "tenant" else "team", name)
        k = self.keys
        reply = await self.scripts.forget(
            keys=[k.clock, k.tenant_queued, k.tenant_inflight, *(k.light(t) for t in Tier)],
            args=[self._prefix, kind, name, max(0, min_idle_us), "1" if apply else "0",
                  "1" if spent else "0"])
        idle = int(reply[2])
        return ForgetResult(text_of(reply[0]), text_of(reply[1]), None if idle < 0 else idle,
                            int(reply[3]))

    async def clear_held(self) -> None:
        """Forget why the queues waited (the `held_by` hash): the leader's tick found them empty,
        and no release ran to say so (tasks also leave a queue by expiry or cancellation)."""
        await self.client.delete(self.keys.held_by)

    async def vip_placements(self) -> dict[str, int]:
        """node -> VIP placements there so far (admission.reads.vip_placements)."""
        return await reads.vip_placements(self.client, self.keys)

    async def releases_older_than(self, age_us: int) -> tuple[int, list[tuple[str, int]]]:
        """The pool clock (µs) and the node and release (µs) of each task released `age_us`
        ago or more and not yet ended (admission.reads.releases_older_than)."""
        return await reads.releases_older_than(self.client, self.keys, age_us)

    async def nodes_out(self) -> dict[str, str]:
        """Node -> why the last leader took it out (admission.reads.nodes_out)."""
        return await reads.nodes_out(self.client, self.keys)

    async def published_state(self) -> dict[str, str]:
        """The state hash as the last leader published it (admission.reads.published_state)."""
        return await reads.published_state(self.client, self.keys)

    async def redis_time_us(self) -> int:
        """Redis TIME in µs, of the server that runs the pool's scripts
        (admission.reads.redis_time_us)."""
        return await reads.redis_time_us(self.client, self.keys.state)

    async def left_queue(self, tier: Tier, task_ids: Sequence[str]) -> list[str]:
        """Those of `task_ids` no longer queued in `tier`."""
        return await reads.left_queue(self.client, self.keys, tier, task_ids)

    async def task_states(self, task_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(state, node) of each task, '' for what its record lacks."""
        return await reads.task_states(self.client, self.keys, task_ids)

    async def read_fairness(self, levels: Sequence[str] = ()) -> reads.FairReading:
        """Backlogged flows, their tenants and the named quota levels' buckets
        (admission.reads.read_fairness)."""
        return await reads.read_fairness(self.client, self.keys, levels)

    async def gateway_tasks(self, gateway: str) -> set[str]:
        """Ids of the live tasks `gateway` holds in this pool."""
        return await reads.gateway_tasks(self.client, self.keys, gateway)
