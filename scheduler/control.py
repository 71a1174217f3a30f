"""Release control: how much Normal and Batch prefill each node may take now, every poll.

KV budgets (scheduler.budget) keep the cache under its line; they say nothing about compute. A
VIP chat's first token waits for the prefill released to its node before it: the engine runs
chunked prefill, its running list first, so the prompt tokens already there are computed
before the chat's. The control keeps that queue short enough for the VIP objective.

Per node, every poll (all in prompt tokens and seconds):

    mu  prefill throughput: the rate of the node's ``vllm:prompt_tokens_total`` averaged over
        ~2 s of intervals in which its engine queued requests at both ends (its token budget
        was full; at other times the rate is the offered load, not the capacity), and never
        below the ~2 s average of the counter's rate at any load; ``prefill_tokens_per_s``
        until measured (a new leader starts from the rate the last one published)
    B   backlog: prompt tokens released to the node (every tier: the running index's members
        new since the last poll) less those the counter reports prefilled since; 0 when a
        reading shows the engine idle (then only what was released after it, or up to
        `DISPATCH_S` before it, counts), never more than the prompts of the tasks still in
        the index (one cancelled before its prefill leaves both). The counter moves when a
        prompt's prefill ends, so B errs by the part of one prompt being prefilled, high.
        Without the counter: the Lindley recursion at rate mu (w = max(0, w - mu x gap) + p),
        which a new leader also starts from.
    g   gain, from the VIP first tokens the gateways report per node (finish script): AIMD,
        halved (at most once per `hold_s`) at a poll reporting a miss when more than
        `vip_miss_target` of the recent ones (~10 s) were later than the objective while
        the backlog averaged at least half the window (over ~`queue_tau_s`; else the queue
        did not make them late, a long decode batch or one large prompt did, and a smaller
        window would starve Normal and Batch without helping), plus
        `GAIN_STEP` at each poll with reports and no miss if the window was used (the
        backlog at the last poll and the releases since were at least half of it), within
        [GAIN_MIN, GAIN_MAX]; 1 when no report came for `signal_stale_ms`
    O   objective: the configured `vip_ttft_objective_ms`; with `vip_slowdown` set (off by
        default), that many times the pool's learned calm VIP P99 once learned
        (scheduler.calm)
    X   window = clamp(g x mu x O x MODEL_SHARE, window_min, window_max)
    L   running limit (with `running_min` set; off by default), for the part of a VIP first
        token the queue does not control: every step the chat waits for costs a fixed part
        plus a part per running sequence, so a flood admitted into the decode batch slows
        VIP with no queue at all. From the node's mean step time over the last reading,
        tau (the rate of vLLM's inter-token latency histogram: sum over count), the step
        time it had at calm, tau0 (averaged, ~`CALM_STEP_TAU_SHARE`, over polls at which the
        pool has been calm for `signal_stale_ms`: a flood below the YELLOW line counts until
        the limit holds, see C), and the pool's calm VIP P99, P
        (scheduler.calm): a flood may add O - P to a first token
        in the calm tail (the objective's slowdown of it; at least 0), and such a first
        token waits for about `STEP_SPAN` steps (the one it arrives in, a long prompt's
        chunk ahead of it, its own), so each step may grow by (O - P) / `STEP_SPAN`:
        tau_max = tau0 + (O - P) / STEP_SPAN, and L = running x tau_max / tau (the batch
        whose step would take tau_max if the step time were proportional to it: below the
        true one, whose fixed part does not grow, so L converges from the safe side over
        a few polls), at least `running_min`. None without a VIP report in the pool for
        `signal_stale_ms` (nothing to protect), before tau0 and P are learned, or while the
        node decodes nothing (no step to measure)
    C   lane cap (for the pool's lanes, `lane_nodes`): the Normal and Batch tasks the node
        may hold alive, which the scripts count (lua/_room.lua lane_takes): the batch whose
        step would take tau_lane = tau_min + (`lane_slowdown` - 1) x P / `STEP_SPAN`, as L is
        computed, less the sequences the engine runs that are not such tasks (VIP), at least
        0. tau_min is the shortest step the lane was read at (a batch of a few sequences: the
        step's fixed part), not a calm average: a flood that starts below the YELLOW line
        looks calm to the pool (nothing waits), and a step averaged then grows with it (the
        lab's nodes learned four to ten times their calm step that way), so a cap sized by
        it would open as the flood grows. A lane so held runs shorter steps than calm, which
        pays for the gateway's hop in the VIP first token. The configured objective stands
        in for P until learned; an idle node keeps its last cap, at least 1, to grow from;
        -1 (no cap) while its engine reports no inter-token histogram. A new leader starts
        from the tau_min the last one published for the lane (`floor_step_ms`), else from its
        calm step (longer: a looser cap until a shorter step is read): one that took over in
        a flood would otherwise read only the flood's steps.
        Unlike L it holds without VIP reports: a lane must be short when VIP arrives, not
        a poll after, and the long generations it would otherwise take run for minutes.
        With `lane_on_miss` it holds only once the pool's VIP first tokens have missed the
        objective (more than `vip_miss_target` of the recent ones), and from then on until
        the pool is calm again with no such miss for `signal_stale_ms`; before, -1 (no
        cap; so also for a new leader until VIP misses again). A lane then costs nothing
        where VIP keeps its objective without it, and `lane_output` (the scripts refuse a
        lane any task declaring a longer output) keeps the minutes-long generations off it,
        so that a cap that closes in a flood holds within the short tasks' lifetimes
    room = X - B (negative: B beyond the window), at most 0 while the engine runs more than
        `max_engine_running` sequences or L, else at most the places L leaves (L - running -
        waiting - released since the reading) x the node's mean prompt, less
        what light tenants overdrew since the last poll (take_overdraw)

Between polls the room refills at mu (up to the window; for `REFILL_POLLS` poll intervals after
the publish), as the node prefills what is queued: work flows at the node's prefill rate, not
one window per poll, and the next poll's measured backlog corrects the estimate.

Enforcement is in the scripts that admit and release (lua/_room.lua prefill_of): a Normal or
Batch task goes to a node only if its prompt fits the room, which its release then takes; a
prompt larger than the room passes on a node whose room is at least half the window, so long
documents run instead of never (a node always has a chat or two to prefill). The room is
published as an absolute limit on the node's count of such prompt tokens released so far,
read before the running index: a release between that read and the publish counts against the
new room (never freed twice), so the rule holds across gateways between polls.

Response to a step in offered load (tests/test_scheduler_control.py, a node a third faster
than configured): releases track the node's prefill within one poll, the queue ahead of a VIP
chat stays within the window plus one prompt from the 20th poll after the step on, mu is
within 15% of the truth 10 s after it, the node prefills at 85% or more of its capacity. The
gain grows only with use and halves on misses: a node slower than any model shrinks the window
to a quarter within the chats' duration plus three `hold_s`, and it recovers at
`GAIN_STEP` per reported poll once they meet the objective again (~13 s from 0.1 to 1 at four
chats a second). VIP reports come with the settle, at the end of a chat: the correction lags
by a chat's duration, which GAIN_MAX < 2 (at most 3/4 of the objective queued) leaves room for.
A flood that slows only the decode batch (tests/test_scheduler_running_limit.py, six times the
calm load, long generations): the limit follows the step time within a poll (the signal is
every decoded token, not the few VIP chats), VIP's P99 over the flood stays within 1.25x of
the calm one where it is more than 3x without the limit, and the flood is served faster than
calm traffic arrives.
Stale or missing signals: no VIP report for `signal_stale_ms` means gain 1 (the model alone)
and no running limit; a page without the inter-token histogram sets no limit;
a stale scrape keeps the last mu and drains nothing from B until the counter moves again (the
queue looks longer: the safe side); a page without the counter keeps the configured rate.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping

from admission.controlconfig import ControlSettings
from scheduler.nodestate import NodeRoom, NodeState, engine_restarted, take_overdraw

MODEL_SHARE = 0.5
"""Share of the objective the queue ahead of a VIP chat may take; the rest is for the chat's
own prefill and the decode steps around it."""
GAIN_MIN, GAIN_MAX = 0.1, 1.5
GAIN_STEP = 0.02
"""Additive increase per poll with VIP reports and no excess misses."""
GAIN_DECREASE = 0.5
STEP_SPAN = 3.0
"""Decode steps a VIP first token in the calm tail waits for: the one it arrives in, a long
prompt's chunk ahead of it and its own. The slowdown a flood may add to such a first token is
spread over this many steps."""
# The law's time constants are shares of `signal_stale_ms` (10 s by default: 1 s, 2 s, 1 s and
# 10 s), so a deployment, or the lab on its faster clock, scales them with the one setting.
HOLD_SHARE = 0.1
"""After a decrease, no other one for this long: the reports of chats that were already
waiting when the window shrank describe the old window."""
RATE_TAU_SHARE = 0.2
"""Time constant of the throughput average (the prompt counter moves in whole prompts)."""
REFILL_POLLS = 3
"""Between polls a node's room refills at its measured prefill rate (lua/_room.lua prefill_of)
for this many poll intervals after a publish: a late poll or two keeps work flowing, a leader
that stopped publishing stops feeding the nodes on an estimate."""
DISPATCH_S = 0.05
"""A task released this long before a reading that shows the engine idle may still be on its
way to the engine: it stays in the backlog."""
QUEUE_TAU_SHARE = 0.1
"""Time constant of the average backlog a VIP miss is blamed on: a prompt prefilled within a
poll or two is not a queue."""
SIGNAL_TAU_SHARE = 1.0
"""Time constant of the recent VIP miss share."""
CALM_STEP_TAU_SHARE = 6.0
"""Time constant of the step time learned at calm."""


def backlog(tasks: Iterable[tuple[int, float]], rate: float) -> float:
    """Prompt tokens not yet prefilled now of tasks given as (prompt tokens, seconds since
    release), by a FCFS server of `rate` tokens/s (Lindley: w = max(0, w - rate x gap) + p)."""
    work = 0.0
    prev: float | None = None
    for prompt, age_s in sorted(tasks, key=lambda t: -t[1]):
        at = -max(0.0, age_s)
        if prev is not None:
            work = max(0.0, work - rate * (at - prev))
        work += prompt
        prev = at
    if prev is not None:
        work = max(0.0, work + rate * prev)
    return work


def _batch_for(running: int, step_s: float, measured_s: float) -> int:
    """The batch whose step would take `step_s`, were the step time proportional to the batch:
    `running` sequences take `measured_s` now. Below the true batch (the step's fixed part does
    not grow), so limits built on it converge from the safe side."""
    return math.floor(running * step_s / measured_s + 1e-9)  # (float noise)


class ReleaseControl:
    """The control law's state for one pool's nodes (see the module docstring)."""

    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self._nodes: dict[str, NodeState] = {}
        # The law's time constants, in seconds: shares of signal_stale_ms (10 s by default).
        clock = self.stale_s = settings.signal_stale_ms / 1000
        self.hold_s = HOLD_SHARE * clock
        self.rate_tau_s = RATE_TAU_SHARE * clock
        self.queue_tau_s = QUEUE_TAU_SHARE * clock
        self.signal_tau_s = SIGNAL_TAU_SHARE * clock
        self.calm_step_tau_s = CALM_STEP_TAU_SHARE * clock
        self._vip_at: float | None = None
        """When a VIP first token was last reported on any node of the pool."""
        self._missed_at: float | None = None
        """When a report last took the pool's recent share of VIP first tokens later than the
        objective past `vip_miss_target`; None once the lanes open again (`_lanes_engaged`)."""
        self._pool_recent = [0.0, 0.0]
        """The pool's recent VIP first tokens and those later than the objective: every node's
        recent counts, decayed to `_pool_at` as each node's are. Kept as the nodes' counts
        change rather than summed over the nodes at each report, which cost a pass over the
        pool per node, every poll: quadratic in the nodes."""
        self._pool_at: float | None = None

    def node(self, name: str) -> NodeState:
        state = self._nodes.get(name)
        if state is None:
            state = self._nodes[name] = NodeState(float(self.settings.prefill_tokens_per_s))
        return state

    def _observe_rate(self, s: NodeState, prompt_total: float | None, read_at: float, seq: int,
                      waiting: int) -> bool:
        """Learn from a new reading of the prompt counter; False when there is none."""
        if prompt_total is None or seq == s.seq:
            return False
        s.seq = seq
        was_waiting, s.waiting = s.waiting, waiting
        last, s.counter = s.counter, (prompt_total, read_at)
        if last is None or read_at <= last[1]:
            return True
        done, dt = prompt_total - last[0], read_at - last[1]
        if done < 0:
            # The engine restarted (its counter starts again): a replaced node is learned
            # anew, not with its predecessor's figures (a stuck one's 3 s step lasted 30 s).
            engine_restarted(s, float(self.settings.prefill_tokens_per_s))
            return True
        sample = done / dt
        alpha = 1.0 - math.exp(-dt / self.rate_tau_s)
        # The counter moves in whole prompts, as each one's prefill ends: one interval's rate
        # says little, an average over a few seconds is what the node did.
        s.observed += alpha * (sample - s.observed)
        if waiting > 0 and was_waiting > 0:
            # The engine queued requests at both readings, so all along: its token budget was
            # full, the rate is its capacity. (Not our backlog estimate: it is computed with
            # this rate, and a low rate would confirm itself.)
            s.rate += alpha * (sample - s.rate)
        # A node seen doing this much can do it: releases limited by a low estimate cannot
        # lower it further, the average of what they got done raises it.
        s.rate = max(s.rate, s.observed)
        return True

    def _observe_reports(self, s: NodeState, reports: tuple[int, int] | None, now: float,
                         used: bool) -> None:
        if s.at is not None:
            decay = math.exp(-max(0.0, now - s.at) / self.signal_tau_s)
            s.n_recent *= decay
            s.over_recent *= decay
        s.at = now
        if reports is None:
            reports = (0, 0)
        last, s.reports = s.reports, reports
        if last is None:
            return  # the first reading is history: it starts the deltas
        n, over = reports[0] - last[0], reports[1] - last[1]
        if n < 0 or over < 0:
            return  # the counters were reset (Redis flushed): start again
        if n > 0:
            s.reported_at = now
            self._vip_at = now if self._vip_at is None else max(self._vip_at, now)
            s.n_recent += n
            s.over_recent += over
            self._pool_add(now, n, over)
            if over > 0 and self._pool_miss_share(now) > self.settings.vip_miss_target:
                self._missed_at = now
            miss = s.over_recent / s.n_recent
            if over > 0 and miss > self.settings.vip_miss_target:
                # A window the node did not keep half full did not make these chats late: the
                # decode batch they joined did (every step costs time per sequence), which the
                # running limit answers from the step time.
                if s.queued >= 0.5 and now >= s.hold_until:
                    s.gain = max(GAIN_MIN, s.gain * GAIN_DECREASE)
                    s.hold_until = now + self.hold_s
            elif over == 0 and used:
                # Only a window that was used is known to be safe (TCP's rule for a window
                # that limits): a quiet node would otherwise grow it to the bound and let a
                # burst through at once.
                s.gain = min(GAIN_MAX, s.gain + GAIN_STEP)
        elif not self._fresh(s, now):
            s.gain = 1.0

    def _fresh(self, s: NodeState, now: float) -> bool:
        """A VIP first token was reported on the node within `signal_stale_ms`."""
        return s.reported_at is not None and now - s.reported_at <= self.stale_s

    def _observe_step(self, s: NodeState, itl: tuple[float, float] | None, seq: int) -> bool:
        """The step time from a new reading of the inter-token histogram: a mean over every
        token decoded since the last one. False when there is no new one."""
        if itl is None or seq == s.itl_seq:
            return False
        s.itl_seq = seq
        last, s.itl = s.itl, itl
        if last is None:
            return False
        count, total = itl[1] - last[1], itl[0] - last[0]
        # (total 0 with tokens decoded: a sum that did not move, e.g. a page with the _count
        # but not the _sum. A step of 0 s is no measurement, and the running limit and a
        # lane's cap divide by it: a ZeroDivisionError out of the tick ended the pool's loop.)
        if count <= 0 or total <= 0:
            return False  # nothing decoded since (or the engine restarted: so did its histogram)
        s.step_s = total / count
        s.min_step_s = s.step_s if s.min_step_s is None else min(s.min_step_s, s.step_s)
        return True

    def _learn_calm_step(self, s: NodeState, now: float) -> None:
        """Average the step time over calm polls, from the first ones while they are few."""
        assert s.step_s is not None
        dt = 0.0 if s.calm_at is None else max(0.0, now - s.calm_at)
        s.calm_at = now
        s.calm_polls += 1
        weight = max(1.0 / s.calm_polls, 1.0 - math.exp(-dt / self.calm_step_tau_s))
        base = s.step_s if s.calm_step_s is None else s.calm_step_s
        s.calm_step_s = base + weight * (s.step_s - base)

    def _running_limit(self, s: NodeState, running: int | None, objective_ms: float,
                      calm_p99_ms: float | None, now: float) -> int | None:
        """The sequences the node may run before Normal and Batch wait (module docstring:
        L); None when no limit holds."""
        floor = self.settings.running_min
        if (not floor or not running or s.step_s is None or s.calm_step_s is None
                or calm_p99_ms is None or self._vip_at is None
                or now - self._vip_at > self.stale_s):
            return None
        budget_s = max(0.0, objective_ms - calm_p99_ms) / 1000 / STEP_SPAN
        return max(floor, _batch_for(running, s.calm_step_s + budget_s, s.step_s))

    def _lane_cap(self, s: NodeState, running: int | None, guests: int,
                  calm_p99_ms: float | None) -> int:
        """The Normal and Batch tasks a lane may hold alive (module docstring: C); -1 when
        its engine reports no step time."""
        if s.itl is None:
            return -1
        if not running or s.step_s is None or s.min_step_s is None:
            s.lane_cap = max(1, s.lane_cap)  # idle: what it may start from
            return s.lane_cap
        p99 = self.settings.vip_ttft_objective_ms if calm_p99_ms is None else calm_p99_ms
        budget_s = (self.settings.lane_slowdown - 1.0) * p99 / 1000 / STEP_SPAN
        total = _batch_for(running, s.min_step_s + budget_s, s.step_s)
        s.lane_cap = max(0, total - max(0, running - guests))
        return s.lane_cap

    def _pool_decay(self, now: float) -> None:
        if self._pool_at is not None and now > self._pool_at:
            decay = math.exp(-(now - self._pool_at) / self.signal_tau_s)
            self._pool_recent = [v * decay for v in self._pool_recent]
        if self._pool_at is None or now > self._pool_at:
            self._pool_at = now

    def _pool_add(self, now: float, n: float, over: float) -> None:
        self._pool_decay(now)
        self._pool_recent = [self._pool_recent[0] + n, self._pool_recent[1] + over]

    def _pool_miss_share(self, now: float) -> float:
        """The share of the pool's recent VIP first tokens later than the objective: every
        node's recent counts, decayed to `now` as each node's are."""
        self._pool_decay(now)
        n, over = self._pool_recent
        return over / n if n > 0 else 0.0

    def _lanes_engaged(self, now: float, settled: bool) -> bool:
        """Whether the lanes' caps hold now (module docstring: C). Always, unless
        `lane_on_miss`: then from a report that took the pool's recent share of VIP first
        tokens later than the objective past `vip_miss_target`, until the pool is calm
        (`settled`: calm for `signal_stale_ms`) with no such report for `signal_stale_ms`. A
        flood therefore keeps the caps once VIP has missed in it: a lane that opened each
        time VIP recovered would take the flood's work again and make the next chats late
        before the next miss closed it."""
        if not self.settings.lane_on_miss:
            return True
        if (self._missed_at is not None and settled
                and now - self._missed_at >= self.stale_s):
            self._missed_at = None
        return self._missed_at is not None

    def update(
        self,
        name: str,
        *,
        tasks: Iterable[tuple[Hashable, int, float]],
        now: float,
        prompt_total: float | None = None,
        read_at: float | None = None,
        seq: int = 0,
        running: int | None = None,
        waiting: int = 0,
        reports: tuple[int, int] | None = None,
        overdrawn: int | None = None,
        objective_ms: int | None = None,
        settled: bool = False,
        itl: tuple[float, float] | None = None,
        calm_p99_ms: float | None = None,
        lane: bool = False,
        guests: int = 0,
    ) -> NodeRoom:
        """One poll for node `name`: `tasks` (key, prompt, seconds since release) released to
        it and running (the key, the running index's member, tells the new ones); its prompt
        counter as read at `read_at` (reading number `seq`); its engine's running and waiting
        counts; the VIP reports (first tokens, those over the objective); the count of prompt
        tokens light tenants released beyond the room (`overdrawn`, monotonic), which the
        rooms that follow pay back; the VIP objective now (scheduler.calm; None: the
        configured one); whether the pool's calm (zone GREEN, nothing waiting) has lasted
        `signal_stale_ms` (`settled`, scheduler.calm: the step time is learned then); the
        (sum, count) of the engine's inter-token latency histogram, and the pool's calm VIP
        P99 (scheduler.calm; None: not learned); whether the node is one of the pool's lanes,
        and the Normal and Batch tasks alive on it as the scripts count them (`guests`)."""
        c = self.settings
        s = self.node(name)
        if prompt_total is None:
            # The node's last page has no counter (one that is not finite reads as absent, or
            # another server now answers at the URL): the recursion, as for a node that never
            # had one. Kept, the last reading made every poll's drain 0, and B, only ever
            # raised by releases, stayed at the prompts of every task alive on the node: no
            # room while long generations ran there, though their prefills were long done.
            # (A stale scrape still passes the last page's counter: it drains nothing.)
            s.counter = None
        before = s.counter
        new_reading = self._observe_rate(s, prompt_total, now if read_at is None else read_at,
                                         seq, waiting)
        drained: float | None = None
        if before is not None and s.counter is not None and s.counter[0] >= before[0]:
            drained = s.counter[0] - before[0]
        listed = list(tasks)
        timed = [(p, age) for _, p, age in listed]
        new = [(p, age) for key, p, age in listed if key not in s.seen]
        s.seen = {key for key, _, _ in listed}
        # The window was used if the node held at least half of it at the last poll, counting
        # what it was given since (a small window on a fast node is drained within a poll).
        used = s.backlog + sum(p for p, _ in new) >= s.window / 2
        stepped = self._observe_step(s, itl, seq)
        self._observe_reports(s, reports, now, used)
        read = now if read_at is None else read_at
        if s.at_poll is None:
            # A new leader: the recursion over the tasks the index holds.
            s.backlog = backlog(timed, s.rate)
        elif drained is not None:
            # Measured: what was released since, less what the engine reports prefilled.
            s.backlog = max(0.0, s.backlog + sum(p for p, _ in new) - drained)
        else:
            # No counter: the recursion from the last poll's backlog, at the estimated rate.
            s.backlog = backlog([(round(s.backlog), now - s.at_poll), *new], s.rate)
        if new_reading and running == 0 and waiting == 0:
            # The engine was idle when read: nothing released well before is queued. A task
            # released just before the reading may not have reached the engine yet (the
            # gateway forwards it after the release): idle then says nothing about it.
            s.backlog = float(sum(p for p, age in timed if age < now - read + DISPATCH_S))
        # Nothing that has ended is queued: a task cancelled before its prefill (never in
        # the counter) leaves the index, and with it the estimate.
        s.backlog = min(s.backlog, float(sum(p for p, _ in timed)))
        if s.at_poll is not None and s.window:
            weight = 1.0 - math.exp(-max(0.0, now - s.at_poll) / self.queue_tau_s)
            s.queued += (s.backlog / s.window - s.queued) * weight
        s.at_poll = now
        objective = c.vip_ttft_objective_ms if objective_ms is None else objective_ms
        limit = self._running_limit(s, running, objective, calm_p99_ms, now)
        limited = False
        model = s.gain * s.rate * objective / 1000 * MODEL_SHARE
        window = s.window = int(min(c.window_max_tokens, max(c.window_min_tokens, model)))
        # Below 0 when the backlog exceeds the window: no Normal or Batch work fits either way,
        # but VIP, steered to the node with the most room when none is quiet, then goes to the
        # shortest queue, not to any node whose room reads 0 (one may hold seconds of prefill).
        room = window - math.ceil(s.backlog)
        reason = ""
        if c.max_engine_running and running is not None and running > c.max_engine_running:
            room, reason = min(room, 0), "max_engine_running"
        elif limit is not None and running is not None:
            # Releases between two readings of the running count are bounded by the room in
            # tokens: as many of the node's typical prompts as the limit has places left
            # (the requests the engine has waiting join its batch next, and those released
            # since the reading, or just before it, may not be in its counts yet).
            unseen = sum(1 for _, age in timed if age < now - read + DISPATCH_S)
            places = limit - running - waiting - unseen
            if places <= 0:
                room, reason = min(room, 0), "running_limit"
                limited = True
            else:
                prompts = [p for p, _ in timed]
                typical = sum(prompts) / len(prompts) if prompts else window
                room = min(room, math.ceil(places * typical))
        if stepped and settled and not limited:
            # (Not while the limit holds the node: that batch is the limit's, not calm's.)
            self._learn_calm_step(s, now)
        room -= take_overdraw(s, overdrawn, room)
        miss = s.over_recent / s.n_recent if s.n_recent > 0 else 0.0
        lane_cap = None
        if lane:
            lane_cap = (self._lane_cap(s, running, guests, calm_p99_ms)
                        if self._lanes_engaged(now, settled) else -1)
        return NodeRoom(window, math.ceil(s.backlog), room, s.gain, s.rate, reason, limit, miss,
                        s.step_s, s.calm_step_s, lane_cap, s.min_step_s)

    def resume(self, learned: Mapping[str, tuple[float, float, float, float]]) -> None:
        """Start a new leadership from the (prefill rate, gain, calm step time, shortest step
        time) per node that the last leader published, forgetting the rest. A standby's
        configured rate may be far from what the nodes were measured to do (on the lab's nodes
        30,000 tokens/s against 17,600 measured), and the windows built on it would release a
        burst of Normal and Batch work until the rate is measured again; a leader taking over
        in a flood keeps the running limit, and a lane its cap, without waiting for calm to
        learn the step times again. Readings, backlogs and VIP counts start afresh (a new
        leader's backlog is the recursion over the running index). Values that are not finite
        and positive are ignored."""
        self._nodes = {}
        self._vip_at = None
        self._missed_at = None
        self._pool_recent, self._pool_at = [0.0, 0.0], None
        for name, (rate, gain, calm_step, floor_step) in learned.items():
            if not (math.isfinite(rate) and rate > 0):
                continue
            state = self.node(name)
            state.rate = rate
            if math.isfinite(gain) and gain > 0:
                state.gain = min(GAIN_MAX, max(GAIN_MIN, gain))
            if math.isfinite(calm_step) and calm_step > 0:
                # Learned over many calm polls: the next one moves it by its time's share.
                state.calm_step_s, state.calm_polls = calm_step, 1_000_000
            state.min_step_s = (floor_step if math.isfinite(floor_step) and floor_step > 0
                                else state.calm_step_s)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the state of nodes no longer in the pool."""
        names = set(keep)
        gone = [n for n in self._nodes if n not in names]
        for name in gone:
            del self._nodes[name]
        if gone and self._pool_at is not None:
            # What they counted in the pool's recent first tokens leaves with them: summed
            # again (a subtraction would leave rounding behind, a share of nothing).
            n = over = 0.0
            for s in self._nodes.values():
                if s.at is not None:
                    decay = math.exp(-max(0.0, self._pool_at - s.at) / self.signal_tau_s)
                    n, over = n + s.n_recent * decay, over + s.over_recent * decay
            self._pool_recent = [n, over]
