"""One model pool's tick on the leader: poll, plan budgets, publish, release, notify.

Every tick costs the pool four Redis round trips whatever the queue length: one pipelined read
(reservations, counters, queue depths, why the queues waited: `PoolStore.read_tick`), the
fenced state write, one release script call for a whole batch, and one pipeline of wake-ups
(and, on a tick that finds the queues emptied without a release, the delete of their held
record). Before each write the replica checks that it still holds its lease by its own clock;
the epoch it passes is the second line of defence.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from admission.config import PoolSettings, SchedulerSettings
from admission.reads import NODE_STUCK
from admission.store import PoolStore
from admission.tiers import Tier, Zone
from scheduler.budget import (
    NodePlan,
    RunningTask,
    UsageLearner,
    budgets,
    plan_node,
    pool_usage,
    published_ratio,
)
from scheduler.calm import CalmBaseline
from scheduler.control import REFILL_POLLS, ReleaseControl
from scheduler.metrics import ZONE_LEVEL, SchedulerMetrics
from scheduler.nodestate import NodeRoom, learned_control
from scheduler.policy import DrainRates, ReleasePolicy
from scheduler.probe import Prober
from scheduler.running import Indexed, prefill_tasks, tasks_by_node
from scheduler.scrape import NodeView, Poller
from scheduler.stuck import ClockMatch, latest_by_node
from scheduler.tick import Snapshot, TickResult
from scheduler.transitions import TransitionLog
from scheduler.zones import RedClearance, ZoneTracker, published_zone

log = logging.getLogger("kvgate.scheduler.pool")

AGED_READ_S = 1.0
"""Without the running index read by the tick, how often the nodes holding old tasks are read
while a node is a candidate for stuck (scheduler.stuck)."""


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.2f}"


def _hung_if_leading(prober: Prober, leading: Callable[[], bool], view: NodeView,
                     since: float) -> bool | None:
    return prober.hung(view, since) if leading() else None


class PoolScheduler:
    def __init__(
        self,
        store: PoolStore,
        pool: PoolSettings,
        settings: SchedulerSettings,
        poller: Poller,
        metrics: SchedulerMetrics,
        *,
        me: str,
        sharded_pubsub: bool = False,
        clock: Callable[[], float] = time.monotonic,
        may_judge_stuck: Callable[[], bool] = lambda: True,
        prober: Prober | None = None,
    ) -> None:
        self.store = store
        self.may_judge_stuck = may_judge_stuck
        """False while a dead gateway's tasks may still be in the running index (the reaper held
        back after Redis failures, or not yet run since): no node is judged stuck then
        (scheduler.stuck)."""
        self.prober = prober
        """Probes the nodes whose page stands still (scheduler.probe); None: off."""
        self._inherit = True
        """The next tick reads which nodes the last leader published stuck (once per term)."""
        self._index_now_us: int | None = None
        """The pool clock when this tick read the running index (None: not read)."""
        self._aged: tuple[float, int, list[tuple[str, int]]] | None = None
        """The last read of old tasks (`_aged_nodes`): when (monotonic), the pool clock then
        (µs), and each task's node and release (µs)."""
        self.clock_match = ClockMatch()
        """The pool clock on ours, for judging a frozen page (scheduler.stuck)."""
        self.pool = pool
        self.settings = settings
        self.poller = poller
        self.metrics = metrics
        self.me = me
        self.sharded = sharded_pubsub
        self.clock = clock
        zones = pool.zones
        self.tracker = ZoneTracker(zones)
        self.ceilings = zones.ceilings()
        self.clearance = RedClearance(zones.red - zones.hysteresis)
        self.transitions = TransitionLog(pool.name, settings.eject_after_failures, zones.red)
        self.learner = UsageLearner(settings.usage_halflife_s, zones.usage_margin,
                                    zones.max_overcommit)
        self.policy = ReleasePolicy(zones, settings.release_batch, clock(), self._dedicated_guests,
                                    self._holds_room)
        self.drains = DrainRates()
        self.control = ReleaseControl(pool.control) if pool.control.enabled else None
        self.calm = CalmBaseline(pool.control.vip_slowdown, pool.control.vip_ttft_objective_ms,
                                 pool.control.signal_stale_ms / 1000)
        self.wait_s = min(settings.scrape_timeout_ms, settings.poll_interval_ms / 2) / 1000
        self.refill_ms = REFILL_POLLS * settings.poll_interval_ms
        self.first_wait_s = settings.scrape_timeout_ms / 1000
        """The first poll of a term waits for a whole scrape: there is no earlier reading to use."""
        self._preemptions: dict[str, float] = {}
        self._cooldown_until: dict[str, float] = {}
        self._first_poll = True
        self._resume = True
        """The release control and the usage ratio start from what the last leader published
        (`new_term`)."""
        self._indexed: dict[Any, Indexed] = {}
        """The running index as parsed on the last tick."""
        self._redis_at: tuple[int, float] | None = None
        """A Redis time (µs) and the local clock then: what our last publish wrote, or TIME
        read before this replica's first publish (`_redis_now_us`)."""

    @property
    def name(self) -> str:
        return self.pool.name

    def _guests_closed(self, views: list[NodeView]) -> tuple[str, ...]:
        bound = self.pool.dedicated.guest_max_running
        if not bound or not self._dedicated_guests:
            return ()
        dedicated = set(self.pool.dedicated.nodes)
        # A node not heard from keeps its guest rules: its budget already reflects staleness.
        return tuple(v.name for v in views if v.name in dedicated and v.metrics is not None
                     and v.metrics.running > bound)

    @property
    def _holds_room(self) -> bool:
        """Fair release that holds room back for light tenants (a fairness headroom)."""
        return self.store.policy.fair and self.store.policy.fair_headroom > 0

    @property
    def _dedicated_guests(self) -> bool:
        d = self.pool.dedicated
        return bool(d.nodes) and d.guest_max_prompt_tokens > 0 and d.max_guests_per_node > 0

    @property
    def _peak_projection(self) -> bool:
        return self.pool.zones.projection == "peak"

    def new_term(self) -> None:
        """A new leadership starts: rates start empty, the learned usage ratio resumes from the
        one the last leader published (`UsageLearner.resume`), the release
        control resumes from the prefill rates and gains the last leader published, the
        transition log starts afresh (scheduler.transitions), and the first poll waits for the
        whole scrape timeout (connections are cold). The nodes' readings of a former term are
        forgotten, and the zone resumes from the one the last leader published (its
        hysteresis band decides the way down)."""
        self.policy = ReleasePolicy(self.pool.zones, self.settings.release_batch, self.clock(),
                                    self._dedicated_guests, self._holds_room)
        self.clearance.reset()
        self.transitions.reset()
        # What a poll compares with its last one is from this term's polls only: a standby's
        # last term may be hours old (its counters' growth since then is not this moment's
        # preemptions, nor its drain this moment's rate). A cool-down still running is kept:
        # a lease lost and taken back within seconds does not forget a preemption.
        self.drains = DrainRates()
        self._preemptions.clear()
        self.poller.forget()
        if self.prober is not None:
            self.prober.forget()
        self._first_poll = True
        self._resume = self._inherit = True
        self._aged = None
        self.calm.restart()

    async def read_snapshot(self) -> Snapshot:
        control = self.control is not None
        # The whole running index is read only when the projection or the release control
        # uses it: with thousands of tasks in flight it is the largest reply of the tick.
        indexed = self._peak_projection or control
        reading = await self.store.read_tick(
            control=control, running=indexed,
            guests=control and self.pool.control.lane_nodes > 0)
        running: dict[str, list[RunningTask]] = {}
        prefill: dict[str, list[tuple[Any, int, float]]] = {}
        self._index_now_us = None
        if reading.running is not None:
            now_us = self._index_now_us = await self._redis_now_us(reading.frozen_us)
            if reading.frozen_us is not None:  # a test's frozen clock: no call to time
                self.clock_match.sample(now_us, self.clock())
            running, self._indexed = tasks_by_node(reading.running, now_us, self._indexed,
                                                   self.pool.engine)
            if control:
                prefill = prefill_tasks(self._indexed, now_us)
        return Snapshot(reading.reserved, reading.stats, reading.depths, running,
                        reading.prefill_released, reading.prefill_overdrawn,
                        reading.vip_reports, reading.vip_histogram, prefill, reading.guests,
                        reading.held)

    async def _aged_nodes(self, nodes: set[str], age_s: float) -> dict[str, float]:
        """For each of `nodes` holding a task released `age_s` ago or more (`age_s` at least
        `stuck_after_ms`), the latest such release, on this process's monotonic clock
        (scheduler.stuck): from the running index this tick read, if it read it; else from
        the tasks released `stuck_after_ms` ago or more, read at most once a second (a
        candidate that never holds such a task would read them at every tick)."""
        age_us = int(age_s * 1_000_000)
        if self._index_now_us is not None:
            now_us = self._index_now_us
            pairs: list[tuple[str, int]] = [(e.node, e.released_us) for e in self._indexed.values()
                                            if e is not None and e.node in nodes]
        else:
            now = self.clock()
            if self._aged is None or now - self._aged[0] >= AGED_READ_S:
                before = self.clock()
                read_us, releases = await self.store.releases_older_than(
                    self.settings.stuck_after_ms * 1000)
                self.clock_match.sample(read_us, before)
                self._aged = (now, read_us, releases)
            _, now_us, pairs = self._aged
        latest = latest_by_node(((node, at) for node, at in pairs if node in nodes),
                                now_us - age_us)
        return {node: at for node, released_us in latest.items()
                if (at := self.clock_match.local(released_us)) is not None}

    async def _redis_now_us(self, frozen: Any) -> int:
        """The pool clock the scripts use, without a TIME call on every tick (Redis Cluster
        refuses it in a pipeline): frozen_us when a test froze it, else the Redis time our last
        publish returned plus the local time since.

        A replica that never published reads TIME once. The last publish is the previous
        leader's, from before the takeover pause: against it, the tasks the fast path released
        since would look released in the future, so still waiting for their prefill, and the
        release control would hold every node's room shut until they finished."""
        if frozen is not None:
            return int(frozen)
        if self._redis_at is None:
            before = self.clock()
            self._redis_at = (await self.store.redis_time_us(), self.clock())
            self.clock_match.sample(self._redis_at[0], before)
        redis_us, local_s = self._redis_at
        return redis_us + int((self.clock() - local_s) * 1_000_000)

    def _node_factor(self, view: NodeView, now: float) -> float:
        """The pool's learned factor, or 1 (no overcommit) while the node cools down from a
        preemption it reported."""
        m = view.metrics
        until = self._cooldown_until.get(view.name)
        if until is not None and now >= until:
            del self._cooldown_until[view.name]
            until = None
            log.info("pool %s node %s: no preemption for %d ms, overcommit resumes", self.name,
                     view.name, self.settings.preemption_cooldown_ms)
        cooldown_ms = self.settings.preemption_cooldown_ms
        if m is not None and m.preemptions is not None:
            before = self._preemptions.get(view.name)
            if before is not None and m.preemptions > before and cooldown_ms:
                # Logged as the cool-down starts; further preemptions only extend it (an
                # overloaded node preempts at every poll, and a line each time is a flood).
                if until is None:
                    log.warning("pool %s node %s preempted: no overcommit for %d ms",
                                self.name, view.name, cooldown_ms)
                until = self._cooldown_until[view.name] = now + cooldown_ms / 1000
            self._preemptions[view.name] = m.preemptions
        return self.learner.factor if until is None else 1.0

    def plan(self, views: list[NodeView], snap: Snapshot, now: float) -> list[NodePlan]:
        self.learner.observe(snap.stats.get("settled_cost", 0),
                             snap.stats.get("settled_usage", 0), now)
        self.drains.observe(snap.stats, now)
        plans = []
        for view in views:
            reserved = snap.reserved.get(view.name, 0)
            plans.append(plan_node(
                view,
                reserved=reserved,
                factor=self._node_factor(view, now),
                kv_target=self.pool.zones.kv_target,
                stale_policy=self.settings.stale_policy,
                running=snap.running.get(view.name, []) if self._peak_projection else None,
                max_waiting=self.pool.zones.max_engine_waiting,
                vip_ceiling=self.ceilings[0],
                batch_ceiling=self.ceilings[2],
                dispatch_us=self.pool.engine.dispatch_us,
            ))
            if view.stale and not view.ejected:
                self.metrics.stale.labels(self.name, view.name,
                                          self.settings.stale_policy).inc()
        return plans

    def control_rooms(self, views: list[NodeView], plans: list[NodePlan], snap: Snapshot,
                      now: float, settled: bool, objective_ms: int, calm_p99_ms: float | None,
                      vips: Mapping[str, int]) -> tuple[dict[str, NodeRoom],
                                 dict[str, tuple[int, int, float, int, int, int]]]:
        """The release control's room per usable node, and the (limit, window, refill rate,
        running sequences, lane cap, VIP placements read before the scrape: `vips`) the
        scripts enforce and steer VIP by (scheduler.control; lua/_room.lua prefill_of,
        lane_takes; lua/_place.lua least_queued)."""
        control = self.control
        if control is None:
            return {}, {}
        rooms: dict[str, NodeRoom] = {}
        prefill: dict[str, tuple[int, int, float, int, int, int]] = {}
        by_name = {v.name: v for v in views}
        lanes = self.lanes(plans)
        for plan in plans:
            view = by_name.get(plan.name)
            if view is None or plan.budget is None:
                continue
            m = view.metrics
            room = control.update(
                plan.name, tasks=snap.prefill_tasks.get(plan.name, ()), now=now,
                prompt_total=None if m is None else m.prompt_tokens,
                read_at=now - view.age_s if math.isfinite(view.age_s) else now,
                seq=view.seq, running=None if m is None else m.running,
                waiting=0 if m is None else m.waiting,
                reports=snap.vip_reports.get(plan.name),
                overdrawn=snap.prefill_overdrawn.get(plan.name, 0), objective_ms=objective_ms,
                settled=settled, itl=None if m is None else m.itl,
                calm_p99_ms=calm_p99_ms, lane=plan.name in lanes,
                guests=snap.guests.get(plan.name, 0))
            rooms[plan.name] = room
            # A node held by max_engine_running gets no refill between polls either, nor one
            # under a running limit: its room counts the places the limit has left.
            running = -1 if m is None or m.running is None else int(m.running)
            refill = 0.0 if room.reason or room.running_limit is not None else room.rate
            prefill[plan.name] = (snap.prefill_released.get(plan.name, 0) + room.room,
                                  room.window, refill, running,
                                  -2 if room.lane_cap is None else room.lane_cap,
                                  vips.get(plan.name, 0))
        control.forget(by_name)
        return rooms, prefill

    def lanes(self, plans: Sequence[NodePlan]) -> list[str]:
        """The pool's lanes (`[pools.control] lane_nodes`, the lane cap C of scheduler.control): the
        first usable shared nodes by name, at most all but one. By name, so every leader picks
        the same ones and a lane stays one while it is usable (its Normal and Batch tasks are
        counted from when it became one)."""
        usable = sorted(p.name for p in plans
                        if p.budget is not None and p.name not in self.pool.dedicated.nodes)
        return usable[:min(self.pool.control.lane_nodes, len(usable) - 1)]

    def _extra(self, result: TickResult) -> dict[str, str | int | float]:
        extra: dict[str, str | int | float] = dict(self.drains.fields())
        out = []
        for p in result.plans:
            if not math.isnan(p.measured):
                extra[f"usage:{p.name}"] = f"{p.measured:.4f}"
                extra[f"projected:{p.name}"] = f"{p.projected:.4f}"
            if p.reason:
                out.append(f"{p.name}:{p.reason}")
        if self.control is not None:
            # The objective is also what the finish script counts VIP first tokens against.
            extra["vip_ttft_objective_ms"] = result.objective_ms
            calm = result.calm_p99_ms
            extra["vip_calm_p99_ms"] = "" if calm is None else f"{calm:.1f}"
            extra["prefill_quiet"] = self.pool.control.quiet_nodes
            extra["lane_output"] = self.pool.control.lane_output
            for name, room in result.rooms.items():
                extra[f"prefill_window:{name}"] = room.window
                extra[f"prefill_backlog:{name}"] = room.backlog
                extra[f"prefill_room:{name}"] = room.room
                extra[f"prefill_rate:{name}"] = f"{room.rate:.0f}"
                extra[f"prefill_gain:{name}"] = f"{room.gain:.3f}"
                extra[f"running_limit:{name}"] = ("" if room.running_limit is None
                                                  else room.running_limit)
                if room.lane_cap is not None:
                    extra[f"lane_cap:{name}"] = room.lane_cap
                    extra[f"floor_step_ms:{name}"] = _ms(room.floor_step_s)
                extra[f"decode_step_ms:{name}"] = _ms(room.step_s)
                extra[f"calm_step_ms:{name}"] = _ms(room.calm_step_s)
                extra[f"vip_miss:{name}"] = f"{room.miss_share:.3f}"
                if room.reason:
                    out.append(f"{name}:{room.reason}")
        extra["nodes_out"] = ",".join(out)
        extra["pool_usage"] = "" if result.usage is None else f"{result.usage:.4f}"
        extra["usage_ratio"] = f"{self.learner.ratio:.4f}"
        extra["leader"] = self.me
        # The ceilings the budgets were computed with, for operators (redis-cli, inspect).
        for tier, ceiling in zip(Tier, self.ceilings, strict=True):
            extra[f"ceiling_{tier.label}"] = f"{ceiling:.4f}"
        if result.red_clear_s is not None:
            extra["red_clear_s"] = f"{result.red_clear_s:.3f}"
        dedicated = self.pool.dedicated
        if dedicated.nodes:
            extra["dedicated_nodes"] = " ".join(dedicated.nodes)
            extra["dedicated_tiers"] = dedicated.tier_mask
            if dedicated.guest_max_prompt_tokens:
                extra["dedicated_guest_prompt"] = dedicated.guest_max_prompt_tokens
                extra["dedicated_guest_cap"] = dedicated.max_guests_per_node
                if dedicated.guest_prompt_tokens_per_s:
                    extra["dedicated_guest_rate"] = dedicated.guest_prompt_tokens_per_s
                if dedicated.guest_max_output_tokens:
                    extra["dedicated_guest_output"] = dedicated.guest_max_output_tokens
                if result.guests_closed:
                    extra["dedicated_guests_closed"] = " ".join(result.guests_closed)
        return extra

    def stand_by(self) -> None:
        """This replica does not lead: the probes it sent are dropped (scheduler.probe)."""
        if self.prober is not None:
            self.prober.forget()

    async def tick(self, epoch: int, leading: Callable[[], bool]) -> TickResult:
        """One poll and release; raises FencedError (step down) or Redis errors."""
        started = self.clock()
        first, self._first_poll = self._first_poll, False
        # Read before the poll, so that a VIP chat placed after a node's scrape is counted
        # beside it (lua/_room.lua prefill_room); one placed between this read and the scrape
        # counts twice until the next publish, which only spreads VIP more.
        vips = await self.store.vip_placements() if self.control is not None else {}
        if self._inherit:
            out = await self.store.nodes_out()
            self.poller.stuck_watch.inherit(n for n, why in out.items() if why == NODE_STUCK)
            self._inherit = False
        views = await self.poller.poll(self.first_wait_s if first else self.wait_s)
        if views and all(v.metrics is None and not v.ejected for v in views):
            # Nothing heard yet (a leader just took over): publishing now would say "no usable
            # node", i.e. RED, and turn clients away for a tick. Keep the state as it is. (A
            # pool without backends has nothing to hear: it is published RED, no_node, so that
            # requests are refused at once instead of queueing until their timeout.)
            return TickResult(self.tracker.zone, None, [], (0, 0, 0), (0, 0, 0))
        if self._resume:
            published = await self.store.published_state()
            self.tracker.zone = published_zone(published, self.tracker.zone)
            if self.control is not None:
                self.control.resume(learned_control(published))
            self.learner.resume(published_ratio(published))
        self._resume = False
        snap = await self.read_snapshot()
        if self.may_judge_stuck():
            hung = None
            if self.prober is not None:
                # A replica that stopped leading sends no probe, and so judges no frozen page
                # (asked at each call: the lease may lapse during the tick's reads).
                hung = functools.partial(_hung_if_leading, self.prober, leading)
            views = await self.poller.judge_stuck(views, self._aged_nodes, hung)
        else:
            self.clock_match.clear()  # Redis may have failed over to another clock
        if self.prober is not None and leading():
            self.prober.start(views)
        now = self.clock()
        plans = self.plan(views, snap, now)
        usage = pool_usage(plans, self.pool.zones.aggregate, self.pool.dedicated.nodes,
                           projection_cap=self.pool.zones.kv_target)
        zone = self.tracker.update(usage)
        self.transitions.observe(views, zone, usage)
        # Calm: nothing above VIP's line held back (scheduler.calm).
        calm = zone is Zone.GREEN and not snap.held
        if self.control is not None:
            self.calm.observe(snap.vip_histogram, calm, now)
        limits = self.policy.limits(zone, now)
        result = TickResult(zone, usage, plans, limits, snap.depths,
                            guests_closed=self._guests_closed(views),
                            red_clear_s=self.clearance.update(zone, usage, now),
                            held=snap.why_held if any(snap.depths) else {})
        if self.control is not None:
            result.objective_ms = self.calm.objective_ms()
            result.calm_p99_ms = self.calm.calm_ms()
            result.rooms, result.prefill = self.control_rooms(
                views, plans, snap, now, self.calm.settled(now), result.objective_ms,
                result.calm_p99_ms, vips)
        if not leading():
            return result
        before = self.clock()
        written_us = await self.store.publish_state(epoch, zone, budgets(plans),
                                                    self._extra(result), result.prefill,
                                                    refill_ms=self.refill_ms)
        self._redis_at = (written_us, self.clock())
        self.clock_match.sample(written_us, before)
        result.published = True
        if not leading() or not any(snap.depths):
            self.policy.share_observe(zone, (), False)  # nothing waits: Batch is owed nothing
            if snap.why_held and leading():
                await self.store.clear_held()
            self._observe(result, started)
            return result
        try:
            await self._release(epoch, zone, limits, snap, result, leading)
        except BaseException:
            if result.released:
                # An earlier call of this tick released them: their gateways are told now,
                # not at their fallback read. Best effort: the error that stopped the tick
                # (Redis gone, fenced) is the one to report, and the fallback still comes.
                with contextlib.suppress(Exception):
                    await self.store.notify(result.released, sharded=self.sharded)
            raise
        await self.store.notify(result.released, sharded=self.sharded)
        self._observe(result, started)
        return result

    async def _release(self, epoch: int, zone: Zone, limits: tuple[int, int, int],
                       snap: Snapshot, result: TickResult, leading: Callable[[], bool]) -> None:
        """The tick's release calls (Batch's share, the main one, the trickle), adding what
        each released to `result.released` as it returns."""
        owed = self.policy.share_limit(zone, snap.depths)
        if owed:
            # Batch's share goes first: after the higher tiers, it would find the room taken.
            result.released = await self.store.release(epoch, (0, 0, owed),
                                                        call_ms=self.settings.release_call_ms)
            result.shared = len(result.released)
        credit = ((self.policy.light_credit(zone, limits[Tier.NORMAL]), self.policy.credit_out)
                  if self.policy.credit_for_light else None)
        main = await self.store.release(epoch, limits, self.policy.guests_only(zone),
                                        credit=credit, call_ms=self.settings.release_call_ms,
                                        record_held=True)
        result.released += main
        per_tier = [result.count(t) for t in Tier]
        self.policy.released(zone, per_tier, credit=(main.credit_before, main.credit_after))
        trickle = self.policy.trickle_limit(zone, self.clock())
        higher_waiting = (snap.depths[Tier.VIP] + snap.depths[Tier.NORMAL]
                          > per_tier[Tier.VIP] + per_tier[Tier.NORMAL])
        batch_waiting = snap.depths[Tier.BATCH] > per_tier[Tier.BATCH]
        if trickle and higher_waiting and batch_waiting and leading():
            # Anti-starvation: a second call that skips the waiting higher tiers.
            more = await self.store.release(epoch, (0, 0, trickle),
                                            call_ms=self.settings.release_call_ms)
            self.policy.released(zone, [0, 0, sum(1 for t in more if t.node)], trickle=True)
            result.released += more
        self.policy.share_observe(zone, ((t.tier, t.cost) for t in result.released if t.node),
                                  snap.depths[Tier.BATCH] > 0)

    def _observe(self, result: TickResult, started: float) -> None:
        m, pool = self.metrics, self.name
        # Every published tick, not only those that release: an idle pool's ticks are what
        # shows a slow Redis before the queues fill.
        m.tick_duration.labels(pool).observe(self.clock() - started)
        m.zone.labels(pool).set(ZONE_LEVEL[result.zone])
        m.pool_usage.labels(pool).set(math.nan if result.usage is None else result.usage)
        m.usage_ratio.labels(pool).set(self.learner.ratio)
        m.set_plans(pool, result.plans)
        m.set_rooms(pool, result.rooms)
        if self.control is not None:
            m.vip_objective.labels(pool).set(result.objective_ms / 1000)
        for node in self.poller.nodes:
            if node.metrics is not None and node.metrics.preemptions is not None:
                m.preemptions.labels(pool, node.name).set(node.metrics.preemptions)
        for tier in Tier:
            released = result.count(tier)
            m.queue_depth.labels(pool, tier.label).set(
                max(0, result.depths[tier] - released)
            )
            if released:
                m.released.labels(pool, tier.label).inc(released)
            m.drain.labels(pool, tier.label).set(self.drains.rates[tier])
        m.set_held(pool, result.held)
        expired = sum(1 for t in result.released if t.node is None)
        if expired:
            m.expired.labels(pool).inc(expired)
