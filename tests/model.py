"""A plain-Python reference model of the admission core (lua/*.lua), for property tests.

It keeps the same state as Redis in dicts and lists and applies the same rules, written the
obvious way; the stateful test runs both side by side and compares them after every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from admission.hints import drain_hint_ms, tenant_drain_hint_ms
from admission.keys import abandoned_lease
from admission.outcomes import TaskState
from admission.store import QuotaLevel
from tests import quotamodel
from tests.fairmodel import FairLedger, FairView, heads_of, weight_arg
from tests.quotamodel import Bucket

MICRO = 1_000_000
TIERS = (0, 1, 2)
TIE_SHARE = 32
"""Headroom within 1/TIE_SHARE of the best node's ties with it (lua/_place.lua)."""


@dataclass
class ModelTask:
    tenant: str
    tier: int
    cost: int
    gateway: str
    state: TaskState
    deadline_us: int = 0
    node: str | None = None
    releases: int = 0
    finishes: int = 0
    prompt: int = 0
    guest: bool = False
    abandoned: bool = False
    """Moved by its gateway to the gateway's abandoned set (`lua/abandon.lua`)."""
    charge: int | None = None
    """Counter units charged at its release (fair release); None: not charged."""
    epoch: int | None = None
    """Its tenant's lifts in its tier when it was charged (`lift_epoch`)."""
    levels: tuple[str, ...] = ()
    """The buckets of the enclosing quota levels it paid at ('team:<name>')."""
    quota_periods: tuple[quotamodel.Periods, ...] = ()
    """The day and month each level it paid at (its tenant's first) counted it in, when an
    allowance applied (`quota_day`, `quota_month`); empty: none did."""


@dataclass
class Model:
    now: int
    tier_caps: tuple[int, int, int]
    lease_ttl_ms: int
    stale_after_ms: int
    default_retry_ms: int
    zone: str = "GREEN"
    epoch: int = 0
    state_updated_us: int | None = None
    drain: tuple[int, int, int] = (0, 0, 0)
    capacity: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Node -> tokens VIP, Normal and Batch may each reserve on it (each tier's ceiling)."""
    reserved: dict[str, int] = field(default_factory=dict)
    queues: tuple[list[str], list[str], list[str]] = field(default_factory=lambda: ([], [], []))
    tasks: dict[str, ModelTask] = field(default_factory=dict)
    buckets: dict[str, Bucket] = field(default_factory=dict)
    """Tenant name or 'team:<name>' -> its bucket in this pool."""
    last_scope: tuple[str, str] | None = None
    """The (scope, kind) of the last admit refused by a quota level."""
    leases: dict[str, int] = field(default_factory=dict)
    dedicated_nodes: frozenset[str] = frozenset()
    dedicated_tiers: int = 0
    """Bit 2^tier set for each tier the dedicated nodes serve."""
    guest_prompt: int = 0
    guest_cap: int = 0
    guest_rate: int = 0
    """Guests' prompt tokens per second a dedicated node takes (0: unpaced)."""
    guest_output: int = 0
    """Guests' output tokens at most (0: no bound)."""
    guest_paced_until: dict[str, int] = field(default_factory=dict)
    """Dedicated node -> µs before which it takes no guest (paced guests)."""
    guests_closed: frozenset[str] = frozenset()
    """Dedicated nodes that take no guests now (their engines run too many sequences)."""
    released_count: int = 0
    """Tasks released so far (the scripts' stats released_0..2): whose turn a tie is."""
    fair: bool = True
    """Release in weighted fair order within a tier (False: FIFO)."""
    ledger: FairLedger = field(default_factory=FairLedger)
    fair_headroom: float = 0.0
    """Fair order: the room a release of a tenant above its share leaves free (a fraction)."""
    fair_light_window_ms: int = 5_000

    # --- derived views -------------------------------------------------------------------
    def tenant_queued(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for queue in self.queues:
            for tid in queue:
                tenant = self.tasks[tid].tenant
                counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    def live_tasks_of(self, gateway: str) -> set[str]:
        """Live tasks held under the lease `gateway` (a gateway, or its abandoned set)."""
        return {
            tid for tid, t in self.tasks.items()
            if _lease_of(t) == gateway and not t.state.terminal
        }

    def guests(self) -> dict[str, int]:
        """Guests alive per node: released as guests and not ended."""
        counts: dict[str, int] = {}
        for t in self.tasks.values():
            if t.guest and t.state is TaskState.RELEASED and t.node is not None:
                counts[t.node] = counts.get(t.node, 0) + 1
        return counts

    def place(self, tier: int, cost: int, prompt: int, guests_only: bool = False,
              keep: float = 0.0) -> tuple[str | None, bool]:
        """The most headroom among the nodes the task may use, dedicated ones first for the
        tiers they serve and for guests (other tiers' short work, below the per-node cap);
        (None, False) when the best has no room for `cost` under the tier's own capacity. Nodes
        less than `cost` or 1/TIE_SHARE of the best's headroom below the best tie: the least
        reserved, then the one whose turn it is (`released_count` modulo their number, in name
        order). With
        `guests_only`, only a dedicated node taking the task as a guest will do. With `keep`, a
        node's headroom counts keep x its capacity less (room held back for light tenants)."""
        owns = bool(self.dedicated_tiers >> tier & 1)
        guests = self.guests()
        may_guest = (not owns and self.guest_cap > 0 and prompt <= self.guest_prompt
                     and (not self.guest_output or cost - prompt <= self.guest_output))
        dedicated = sorted(n for n in self.capacity if n in self.dedicated_nodes
                           and (owns or (may_guest and n not in self.guests_closed
                                         and guests.get(n, 0) < self.guest_cap
                                         and (not self.guest_rate
                                              or self.guest_paced_until.get(n, 0) <= self.now))))
        groups = [dedicated, sorted(n for n in self.capacity if n not in self.dedicated_nodes)]
        if guests_only:
            groups = [[] if owns else dedicated, []]
        for group, nodes in enumerate(groups):
            rooms = {n: self.capacity[n][tier] - self.reserved.get(n, 0) for n in nodes}
            if keep > 0:
                rooms = {n: r - (math.floor(keep * self.capacity[n][tier])
                                 if self.capacity[n][tier] > 0 else 0) for n, r in rooms.items()}
            if not rooms or max(rooms.values()) < cost:
                continue
            best = max(rooms.values())
            # Less than the task's cost or a 32nd of the best's headroom below it: a tie, to
            # the least reserved, then in name order by turn (the count of releases so far).
            margin = max(cost, best // TIE_SHARE, 1)
            tied = [n for n, r in rooms.items() if r >= cost and best - r < margin]
            least = min(self.reserved.get(n, 0) for n in tied)
            tied = sorted(n for n in tied if self.reserved.get(n, 0) == least)
            return tied[self.released_count % len(tied)], group == 0 and not owns
        return None, False

    def _guest_joined(self, node: str, prompt: int) -> None:
        if self.guest_rate:
            start = max(self.now, self.guest_paced_until.get(node, 0))
            self.guest_paced_until[node] = start + prompt * 1_000_000 // self.guest_rate

    # --- bucket helpers --------------------------------------------------------------------
    def held(self) -> dict[str, int]:
        """Level key (tenant, or 'team:<name>') -> tokens reserved there by live tasks."""
        out: dict[str, int] = {}
        for t in self.tasks.values():
            if t.state in (TaskState.QUEUED, TaskState.RELEASED):
                for key in (t.tenant, *t.levels):
                    out[key] = out.get(key, 0) + t.cost
        return out

    def credit(self, task: ModelTask, tokens: int) -> None:
        for i, key in enumerate((task.tenant, *task.levels)):
            periods = task.quota_periods[i] if task.quota_periods else (None, None)
            quotamodel.credit(self.buckets, key, self.now, tokens, periods)

    def _unreserve(self, node: str, cost: int) -> None:
        left = self.reserved.get(node, 0) - cost
        if left <= 0:
            self.reserved.pop(node, None)
        else:
            self.reserved[node] = left

    def flows(self, tier: int) -> dict[str, int]:
        """The backlogged flows of `tier`: tenant -> position of its head in the queue."""
        return heads_of(self.queues[tier], self.tasks)

    def _drop_queued(self, tid: str, state: TaskState) -> None:
        t = self.tasks[tid]
        self.queues[t.tier].remove(tid)
        self.ledger.add(self.ledger.queued_tokens, t.tenant, -t.cost)
        self.credit(t, t.cost)
        t.state = state
        t.finishes += 1

    def _drop_released(self, tid: str, state: TaskState, usage: int | None) -> int:
        t = self.tasks[tid]
        assert t.node is not None
        self._unreserve(t.node, t.cost)
        refund = t.cost if usage is None else t.cost - usage
        self.ledger.add(self.ledger.inflight_tokens, t.tenant, -t.cost)
        self.ledger.settle(t.tier, t.tenant, t.charge, t.cost, usage, t.epoch)
        self.credit(t, refund)
        t.state = state
        t.finishes += 1
        return refund

    # --- operations, mirroring the scripts --------------------------------------------------
    def admit(
        self, tid: str, tenant: str, tier: int, cost: int, rate: int, burst: int,
        tenant_cap: int, timeout_ms: int, gateway: str, prompt: int = 0,
        weight: float = 1.0, queued_cap: int = 0, inflight_cap: int = 0,
        daily: int = 0, monthly: int = 0, enclosing: tuple[QuotaLevel, ...] = (),
    ) -> tuple[str, str, int, int]:
        """Returns (outcome, detail, retry_after_ms, depth) as the script does."""
        if tid in self.tasks:
            return ("duplicate", self.tasks[tid].state.value, 0, 0)
        ahead = sum(len(self.queues[t]) for t in range(tier + 1))
        drain = sum(self.drain[t] for t in range(tier + 1))

        def drain_hint() -> int:
            # The rule itself is admission.hints' (its properties: tests/test_hints.py); the
            # model checks what the script feeds it.
            return drain_hint_ms(ahead, drain, self.default_retry_ms)

        if cost > burst:
            return ("rejected", "exceeds_burst", -1, ahead)
        if self.zone == "RED" and tier > 0:
            return ("rejected", "zone_red", drain_hint(), ahead)
        levels = quotamodel.levels_of(tenant, rate, burst, daily, monthly, enclosing)
        binding, wait, kind, current = quotamodel.binding(self.buckets, levels, self.now, cost,
                                                          self.held())
        if binding is not None:
            self.last_scope = ("key" if binding.key == tenant else binding.key, kind)
            if kind == "held":  # no one knows when the live tasks end: the floor
                wait = self.default_retry_ms
            return ("rejected", "quota", wait, ahead)
        fresh = self.stale_after_ms == 0 or (
            self.state_updated_us is not None
            and self.now - self.state_updated_us <= self.stale_after_ms * 1000
        )
        node, guest = None, False
        ledger = self.ledger
        flows = self.flows(tier)
        first, busy = ahead == 0, False
        if self.fair:
            # Nothing queued above, nothing of its own queued here, and no backlogged flow
            # with a lower counter: it would be served next. Busy: it arrives beside others'
            # backlog with none of its own (it is light, released or queued).
            busy = tenant not in flows and bool(flows)
            first = ahead == len(self.queues[tier]) and tenant not in flows
            if first and busy:
                first = (ledger.counter(tier, tenant) <= ledger.floor(tier, flows)[0]
                         or (self.fair_headroom > 0
                             and ledger.under_share(tier, tenant, weight, flows)))
        if (first and fresh and (self.zone == "GREEN" or tier == 0)
                and ledger.inflight_fits(tenant, cost, inflight_cap)):
            node, guest = self.place(tier, cost, prompt)
        if node is None:
            if len(self.queues[tier]) >= self.tier_caps[tier]:
                return ("rejected", "queue_full", drain_hint(), ahead)
            own = self.tenant_queued().get(tenant, 0)
            if own >= tenant_cap:
                # The tokens of its requests over the cap, and one more, at their average
                # cost, drained at the tenant's own rate (-1: nothing queued, unknown).
                wait = -1 if own == 0 else ledger.drain_wait_ms(
                    tenant, self.now,
                    math.ceil(ledger.queued_tokens.get(tenant, 0) * (own - tenant_cap + 1) / own))
                return ("rejected", "tenant_queue_full",
                        tenant_drain_hint_ms(wait, self.default_retry_ms), ahead)
            excess = ledger.queued_tokens.get(tenant, 0) + cost - queued_cap
            if queued_cap > 0 and excess > 0:
                wait = ledger.drain_wait_ms(tenant, self.now, excess)
                return ("rejected", "tenant_queued_tokens",
                        tenant_drain_hint_ms(wait, self.default_retry_ms), ahead)
        periods = quotamodel.debit(self.buckets, levels, current, self.now, cost)
        self.leases[gateway] = self.now + self.lease_ttl_ms * 1000
        task = ModelTask(tenant, tier, cost, gateway, TaskState.QUEUED, prompt=prompt,
                         levels=tuple(lvl.key for lvl in levels[1:]))
        if any(lvl.daily or lvl.monthly for lvl in levels):
            task.quota_periods = tuple(periods)
        self.tasks[tid] = task
        if node is not None:
            task.state, task.node, task.releases = TaskState.RELEASED, node, 1
            self.released_count += 1
            task.guest = guest
            if guest:
                self._guest_joined(node, prompt)
            self.reserved[node] = self.reserved.get(node, 0) + cost
            ledger.add(ledger.inflight_tokens, tenant, cost)
            if busy:
                ledger.weight[tenant] = weight_arg(weight)
                ledger.lift(tier, tenant, flows)
                task.charge = ledger.charge(tier, tenant, cost)
                task.epoch = ledger.lifts.get((tier, tenant), 0)
                ledger.light.setdefault(tier, {})[tenant] = self.now
            return ("released", node, 0, 0)
        task.deadline_us = self.now + timeout_ms * 1000
        self.queues[tier].append(tid)
        ledger.weight[tenant] = weight_arg(weight)
        ledger.inflight_cap[tenant] = inflight_cap
        ledger.add(ledger.queued_tokens, tenant, cost)
        if tenant not in flows:
            ledger.lift(tier, tenant, flows)
        if busy:
            ledger.light.setdefault(tier, {})[tenant] = self.now
        return ("queued", "", 0, ahead + 1)

    def fair_view(self, tier: int) -> FairView:
        """The view a release call judges shares by in `tier` (fair_view() in lua/_tenant.lua);
        light entries older than the window are dropped first."""
        window = self.fair_light_window_ms * 1000
        light = {t: at for t, at in self.ledger.light.get(tier, {}).items()
                 if at >= self.now - window}
        self.ledger.light[tier] = light
        return FairView.of(self.ledger, light, self.flows(tier), tier)

    def release(
        self, epoch: int, limits: tuple[int, int, int], guests_only: frozenset[int] = frozenset()
    ) -> list[tuple[str, str, str | None, int]] | None:
        """None = fenced; else (task, gateway, node or None if expired, tier) in order."""
        if epoch < self.epoch:
            return None
        self.epoch = epoch
        out: list[tuple[str, str, str | None, int]] = []
        for tier in TIERS:
            released = 0
            blocked = False
            queue = self.queues[tier]
            skip: set[str] = set()
            view = self.fair_view(tier) if self.fair and self.fair_headroom > 0 else None
            while released < limits[tier] and queue:
                tid = queue[0]
                if self.fair:
                    heads = self.flows(tier)
                    first = view.light_first(heads, skip) if view is not None else None
                    if first is None:
                        first = self.ledger.next_flow(tier, heads, skip)
                    if first is None:
                        break
                    tid = queue[heads[first]]
                t = self.tasks[tid]
                if t.deadline_us <= self.now:
                    self._drop_queued(tid, TaskState.EXPIRED)
                    out.append((tid, t.gateway, None, tier))
                    continue
                capped = not self.ledger.inflight_fits(t.tenant, t.cost)
                node, guest = None, False
                keep = 0.0
                if not capped:
                    if view is not None:
                        keep = view.keep(t.tenant, self.fair_headroom)
                    node, guest = self.place(tier, t.cost, t.prompt, tier in guests_only, keep)
                    if node is None and keep > 0 and self.place(
                            tier, t.cost, t.prompt, tier in guests_only)[0] is None:
                        keep = 0.0  # it fits nowhere even without the hold-back: it holds
                if self.fair and (capped or (node is None and keep > 0)):
                    skip.add(t.tenant)  # its own cap, or room it must leave: the others go on
                    continue
                if node is None:
                    blocked = True
                    break
                queue.remove(tid)
                self.ledger.add(self.ledger.queued_tokens, t.tenant, -t.cost)
                t.charge = self.ledger.charge(tier, t.tenant, t.cost)
                t.epoch = self.ledger.lifts.get((tier, t.tenant), 0)
                self.ledger.add(self.ledger.inflight_tokens, t.tenant, t.cost)
                if view is not None:
                    view.served(t.tenant, t.cost)
                self.ledger.drain_add(t.tenant, self.now, t.cost)
                self.reserved[node] = self.reserved.get(node, 0) + t.cost
                t.state, t.node, t.guest = TaskState.RELEASED, node, guest
                if guest:
                    self._guest_joined(node, t.prompt)
                t.releases += 1
                self.released_count += 1
                released += 1
                out.append((tid, t.gateway, node, tier))
            if blocked:
                break
        return out

    def finish(self, tid: str, usage: int | None, cancelled: bool) -> tuple[str, str, int]:
        t = self.tasks.get(tid)
        if t is None:
            return ("noop", "unknown", 0)
        if t.state is TaskState.RELEASED:
            final = TaskState.CANCELLED if cancelled else TaskState.SETTLED
            return (final.value, "released", self._drop_released(tid, final, usage))
        if t.state is TaskState.QUEUED:
            self._drop_queued(tid, TaskState.CANCELLED)
            return ("cancelled", "queued", t.cost)
        return ("noop", t.state.value, 0)

    def abandon(self, gateway: str, tid: str) -> bool:
        """The task leaves the gateway's renewed set; the abandoned set's lease is the earlier
        of its own and the gateway's (now when the gateway holds none)."""
        t = self.tasks.get(tid)
        if t is None or t.state.terminal or _lease_of(t) != gateway:
            return False
        t.abandoned = True
        name = abandoned_lease(gateway)
        expiry = self.leases.get(gateway, self.now)
        self.leases[name] = min(self.leases.get(name, expiry), expiry)
        return True

    def renew(self, gateway: str) -> int:
        live = len(self.live_tasks_of(gateway))
        if live == 0:
            self.leases.pop(gateway, None)
        else:
            self.leases[gateway] = self.now + self.lease_ttl_ms * 1000
        return live

    def reap(self) -> tuple[int, int, int]:
        """With a budget larger than everything, so the order of SPOP does not matter."""
        reaped = expired = returned = 0
        for gateway in sorted(g for g, exp in self.leases.items() if exp <= self.now):
            for tid in sorted(self.live_tasks_of(gateway)):
                t = self.tasks[tid]
                if t.state is TaskState.QUEUED:
                    self._drop_queued(tid, TaskState.REAPED)
                else:
                    self._drop_released(tid, TaskState.REAPED, None)
                    returned += t.cost
                reaped += 1
            del self.leases[gateway]
        for queue in self.queues:
            for tid in list(queue):
                if self.tasks[tid].deadline_us <= self.now:
                    self._drop_queued(tid, TaskState.EXPIRED)
                    expired += 1
        return reaped, expired, returned

    def forget(self, kind: str, name: str, min_idle_us: int, apply: bool,
               spent: bool = False) -> tuple[str, str, int, int]:
        """lua/forget.lua: (verdict, reason, idle µs or -1, keys) for a tenant's keys or a
        quota level's ('level'); with `apply`, a name with nothing alive, nothing spent (unless
        `spent`) and idle long enough loses its bucket (and a tenant its fairness record), as
        if it had never been seen."""
        key = name if kind == "tenant" else "team:" + name
        if kind == "tenant":
            if self.tenant_queued().get(name):
                return "kept", "queued", -1, 0
            if self.ledger.inflight_tokens.get(name, 0) > 0:
                return "kept", "in_flight", -1, 0
        bucket = self.buckets.get(key)
        times = [] if bucket is None else [bucket.updated_us]
        record = kind == "tenant" and self.ledger.knows(name)
        if kind == "tenant" and name in self.ledger.drain:
            times.append(self.ledger.drain[name][1])
        idle = max(0, self.now - max(times)) if times else -1
        keys = int(bucket is not None) + int(record)
        if keys == 0:
            return "kept", "absent", idle, 0
        if self.held().get(key, 0) > 0:
            return "kept", "held", idle, 0
        if not spent and bucket is not None and quotamodel.spent(bucket, self.now):
            return "kept", "spent", idle, 0
        if times and self.now - max(times) < min_idle_us:
            return "kept", "recent", idle, 0
        if not apply:
            return "forgettable", "", idle, keys
        self.buckets.pop(key, None)
        if kind == "tenant":
            self.ledger.forget(name)
        return "forgotten", "", idle, keys

    def publish_state(
        self, epoch: int, zone: str, capacity: Mapping[str, int | tuple[int, int, int]],
        drain: tuple[int, int, int],
        dedicated: tuple[frozenset[str], int] = (frozenset(), 0),
        guests: tuple[int, int] = (0, 0),
        guest_rate: int = 0,
        guest_output: int = 0,
        guests_closed: frozenset[str] = frozenset(),
    ) -> bool:
        """`guests`: (guest prompt limit, guest cap per dedicated node), (0, 0) for none;
        `guests_closed`: dedicated nodes that take no guests now;
        `guest_rate`: their prompt tokens per second on each dedicated node (0: unpaced);
        `guest_output`: their output tokens at most (0: no bound);
        `capacity`: per node, what each tier may reserve (one number: the same for all)."""
        if epoch < self.epoch:
            return False
        self.dedicated_nodes, self.dedicated_tiers = dedicated
        self.guest_prompt, self.guest_cap = guests
        self.guest_rate = guest_rate
        self.guest_output = guest_output
        self.guests_closed = guests_closed
        self.epoch = epoch
        self.zone = zone
        self.capacity = {n: (c, c, c) if isinstance(c, int) else c for n, c in capacity.items()}
        self.drain = drain
        self.state_updated_us = self.now
        return True


def _lease_of(task: ModelTask) -> str:
    return abandoned_lease(task.gateway) if task.abandoned else task.gateway
