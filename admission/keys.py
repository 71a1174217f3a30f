"""Every Redis key this project uses, in one place.

Only admission/ uses this schema: the gateway and the scheduler reach the keys through
`admission.store.PoolStore` (script calls and named reads), `admission.pubsub` and
`admission.leadership`, and name none themselves (tests/test_layering.py).

All keys of one model pool share the hash tag ``{pool}`` so that each script touches one slot
and the code runs unchanged on Redis Cluster; the scheduler's leadership keys share ``{sched}``.
Key names are plain words so operators can read them with redis-cli, for example::

    kvg:{llama-8b}:queue:vip        ZSET  task id -> enqueue time (µs, Redis TIME)
    kvg:{llama-8b}:task:4f1c2a...   HASH  tenant, tier, cost, state, node, gateway, ...

The Lua scripts build the names of keys they discover at run time (a task id popped from a
queue) from the same ``prefix`` the Python side passes in; `lua/_lib.lua` mirrors the suffixes
of `task_key`, `bucket_key`, `gateway_tasks_key`, `running`, `node_guests`,
`node_guest_pace`, `tenant_key`, `flows`, `flow`, `light`, `vtime`, `tenant_inflight` and
`quota_key`, and a test checks that they agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from admission.tiers import Tier

ROOT = "kvg"
VT_SCALE = 1000
"""Virtual counter units per token served at weight 1 (`lua/_tenant.lua` VT_SCALE): a task of
cost W charges its tenant's counter floor(W x VT_SCALE / weight)."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}\Z")
"""A pool's, tenant's, team's, node's or gateway's name, anchored at the very end of the text:
`$` also matches before a final newline, and a name ending in one would pass."""


def check_name(kind: str, value: str) -> str:
    """Names end up inside keys and hash tags: no braces, colons, spaces or line breaks."""
    if not NAME_PATTERN.fullmatch(value):
        raise ValueError(
            f"{kind} name {value!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            " and start with a letter or digit"
        )
    return value


ABANDONED_SUFFIX = ":abandoned"


def abandoned_lease(gateway: str) -> str:
    """The entry in `leases` of a gateway's abandoned tasks. No gateway id contains ':'
    (`check_name`), so it never names a real gateway; the reaper treats it like one whose
    lease is never renewed."""
    return gateway + ABANDONED_SUFFIX


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """The keys of one model pool."""

    pool: str

    def __post_init__(self) -> None:
        check_name("pool", self.pool)

    @property
    def prefix(self) -> str:
        return f"{ROOT}:{{{self.pool}}}:"

    @property
    def state(self) -> str:
        """HASH written by the scheduler: zone, epoch, updated_us, drain rates, red_clear_s
        (while RED), usage."""
        return self.prefix + "state"

    @property
    def clock(self) -> str:
        """HASH: last_us (queue clock); frozen_us (a test's frozen time, honoured only by a
        process that called `admission.scripts.allow_frozen_clock`)."""
        return self.prefix + "clock"

    @property
    def node_capacity(self) -> str:
        """HASH node -> tokens of KV the scheduler lets VIP reserve on that node (VIP's
        ceiling, the highest of the tiers': every node with a budget is listed here)."""
        return self.prefix + "node_capacity"

    def tier_capacity(self, tier: Tier) -> str:
        """HASH node -> tokens that work of `tier` may reserve on that node, up to the tier's
        own ceiling on projected KV: `node_capacity` for VIP, `node_capacity:normal` and
        `node_capacity:batch` for the others (lower ceilings, so never more room)."""
        if tier is Tier.VIP:
            return self.node_capacity
        return f"{self.node_capacity}:{tier.label}"

    @property
    def tier_capacities(self) -> tuple[str, str, str]:
        return (self.tier_capacity(Tier.VIP), self.tier_capacity(Tier.NORMAL),
                self.tier_capacity(Tier.BATCH))

    @property
    def node_reserved(self) -> str:
        """HASH node -> tokens reserved by released, unsettled tasks."""
        return self.prefix + "node_reserved"

    def queue(self, tier: Tier) -> str:
        """ZSET task id -> enqueue time in µs of Redis TIME (FIFO within the tier)."""
        return f"{self.prefix}queue:{tier.label}"

    @property
    def queues(self) -> tuple[str, str, str]:
        return (self.queue(Tier.VIP), self.queue(Tier.NORMAL), self.queue(Tier.BATCH))

    @property
    def deadlines(self) -> str:
        """ZSET queued task id -> deadline in µs."""
        return self.prefix + "deadlines"

    @property
    def leases(self) -> str:
        """ZSET gateway id -> lease expiry in µs; one entry per live gateway, not per task."""
        return self.prefix + "leases"

    @property
    def tenant_queued(self) -> str:
        """HASH tenant -> number of its tasks queued in this pool."""
        return self.prefix + "tenant_queued"

    @property
    def stats(self) -> str:
        """HASH of monotonic counters (released per tier, settled, cost and usage sums)."""
        return self.prefix + "stats"

    @property
    def held_by(self) -> str:
        """HASH tier -> why its queue waits as of the leader's last release, with the waiting
        head's id and size (lua/release.lua, KEYS[15]); for operators."""
        return self.prefix + "held_by"

    @property
    def running(self) -> str:
        """ZSET 'node prompt_tokens max_tokens task_id' -> released µs, one member per released
        task until it ends: what the scheduler projects each node's KV growth from."""
        return self.prefix + "running"

    @property
    def node_guests(self) -> str:
        """HASH dedicated node or lane -> tasks of other tiers alive on it as guests (released
        and not ended: `[pools.dedicated]` caps them per dedicated node, the leader's lane cap
        per lane, `[pools.control] lane_nodes`)."""
        return self.prefix + "node_guests"

    @property
    def node_guest_pace(self) -> str:
        """HASH dedicated node -> µs (Redis TIME) before which it takes no other guest: set
        when guests are paced by their prompt tokens (`[pools.dedicated]`)."""
        return self.prefix + "node_guest_pace"

    @property
    def node_prefill(self) -> str:
        """HASH node -> limit on `node_prefill_released` (prompt tokens) and node:window ->
        tokens: the prefill room of Normal and Batch work per node, written by the leader every
        poll (scheduler/control.py; absent node: no limit)."""
        return self.prefix + "node_prefill"

    @property
    def node_prefill_released(self) -> str:
        """HASH node -> prompt tokens of Normal and Batch work released there so far (a
        monotonic count the scripts raise with each such release)."""
        return self.prefix + "node_prefill_released"

    @property
    def node_vip_ttft(self) -> str:
        """HASH node:n, node:over -> VIP first tokens seen per node and those later than the
        objective (monotonic counts, raised by the finish script)."""
        return self.prefix + "node_vip_ttft"

    def flows(self, tier: Tier) -> str:
        """ZSET tenant -> virtual counter: the tenants with work queued in `tier` (backlogged
        flows). Fair release serves the least counter first (`lua/_tenant.lua`, "Fair release");
        the counter itself lives in the tenant's hash (`tenant_key`), mirrored here."""
        return f"{self.prefix}flows:{tier.label}"

    def flow(self, tier: Tier, tenant: str) -> str:
        """ZSET task id -> enqueue µs: one tenant's queued tasks in `tier` (FIFO within the
        tenant), the same entries as the tier's queue; gone when empty."""
        return f"{self.prefix}flow:{tier.label}:{tenant}"

    def light(self, tier: Tier) -> str:
        """ZSET tenant -> µs: the tenants the fast path admitted in `tier` while it had
        backlogged flows, each at its last such admit. For a window after it, fair release of a
        tenant above its share leaves room for them (`lua/_tenant.lua`, fair_keep()); the release
        drops entries older than the window."""
        return f"{self.prefix}light:{tier.label}"

    @property
    def vtime(self) -> str:
        """HASH tier label -> virtual time: the counter of the last flow served in that tier,
        what a tenant's counter is lifted to when it becomes backlogged in an idle tier."""
        return self.prefix + "vtime"

    @property
    def tenant_inflight(self) -> str:
        """ZSET tenant -> tokens reserved by its released, unfinished tasks (`inflight_tokens`
        in its hash): the tenants with tokens in flight, whose figures the leader's metrics
        read beside the backlogged flows without a SCAN of every tenant hash. The scripts
        write each change's result (`lua/_tenant.lua`, inflight_index()) and remove a tenant
        at 0."""
        return self.prefix + "tenant_inflight"

    def tenant_key(self, tenant: str) -> str:
        """HASH of one tenant in this pool: vt_0..vt_2 (virtual counters per tier, in
        `VT_SCALE` units per token at weight 1), weight, inflight_cap, queued_tokens,
        inflight_tokens, drain and drain_us (tokens released from its queue, decayed)."""
        return f"{self.prefix}tenant:{tenant}"

    def quota_key(self, level: str) -> str:
        """HASH of an enclosing quota level (a team, an organisation) in this pool: its bucket
        (micro_tokens, updated_us, rate, burst, as `bucket_key`'s) and its allowances' periods
        (day, day_used, month, month_used)."""
        return f"{self.prefix}quota:{level}"

    def task_key(self, task_id: str) -> str:
        return f"{self.prefix}task:{task_id}"

    def bucket_key(self, tenant: str) -> str:
        """HASH micro_tokens, updated_us, rate, burst: the tenant's token bucket in this pool
        (and day, day_used, month, month_used when it has allowances)."""
        return f"{self.prefix}bucket:{tenant}"

    def gateway_tasks_key(self, gateway: str) -> str:
        """SET of the live (queued or released) task ids a gateway holds in this pool."""
        return f"{self.prefix}gateway:{gateway}"

    def abandoned_tasks_key(self, gateway: str) -> str:
        """SET of the task ids a gateway gave up ending (`lua/abandon.lua`): never renewed, so
        the reaper returns them once the lease named `abandoned_lease(gateway)` expires."""
        return self.gateway_tasks_key(abandoned_lease(gateway))

    def wake_channel(self, gateway: str) -> str:
        """Pub/sub channel on which a gateway hears about its released tasks."""
        return f"{self.prefix}wake:{gateway}"


@dataclass(frozen=True, slots=True)
class SchedulerKeys:
    """Leadership keys, shared by all scheduler replicas."""

    @property
    def leader(self) -> str:
        """STRING holding the leader's id, with a TTL: the lease."""
        return f"{ROOT}:{{sched}}:leader"

    @property
    def epoch(self) -> str:
        """STRING counter: the fencing epoch, raised by each new leader."""
        return f"{ROOT}:{{sched}}:epoch"

    @property
    def handover(self) -> str:
        """Pub/sub channel: a resigning leader says so, and standbys try to lead at once."""
        return f"{ROOT}:{{sched}}:handover"
