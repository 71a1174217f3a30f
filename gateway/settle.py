"""Ending tasks off the latency path, and keeping this gateway's lease alive.

A response is sent first; its settle (or cancel) then runs as a background task that survives the
handler being cancelled by a client disconnect and is awaited at shutdown. It retries the errors
that can pass (connection, timeout, failover, busy or loading server: `admission.errors.
is_transient`; the finish script is idempotent, a repeat is a no-op) within `SETTLE_RETRY`'s
bounds. A permanent error (ACL, a key of the wrong type, a failing script) is not retried, and
neither are transient ones past the retry deadline: the settle is given up, counted in
`kvgate_gateway_settles_abandoned_total` and logged once, and at the next renewal the task moves
out of this gateway's renewed set into its abandoned set (`lua/abandon.lua`), whose lease is
never renewed. Within one lease TTL the scheduler's reaper returns the whole reservation, as if
this gateway had died, while its other tasks stay alive. So nothing leaks and nothing loops:
either the settle succeeds, or the lease of the task expires (also when the gateway dies).

The lease is renewed for every task in this gateway's set, so a task the process lost track of
would be kept alive for as long as the process lives: an admit whose reply was lost (Redis
timed out after running it). `LiveTasks` holds every id from before its admit is sent until
its finish has run; each renewal also cancels the ids of this gateway's set that the process
does not hold (orphans). Cancelling a task that just finished is a no-op, so the sweep needs
no locking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence

from admission.errors import RetryPolicy, describe, is_transient
from admission.failurelog import FailureLog
from admission.outcomes import FinishResult
from admission.store import PoolStore
from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.gateway")

SETTLE_RETRY = RetryPolicy(initial_delay_s=0.01, max_delay_s=2.0, max_attempts=30,
                           deadline_s=30.0)
"""Retries of one settle or cancel on transient errors: from 10 ms, doubling to 2 s, for at
most 30 s (about 20 calls); a Redis outage longer than that leaves the task to its lease."""

ABANDON_BATCH = 100
"""Given-up tasks moved out of the renewed set per pool and renewal round, at most: bounds how
long a round can take before it renews the gateway's lease."""

PERMANENT = "permanent"
DEADLINE = "deadline"


class LiveTasks:
    """Ids of the tasks this process holds in Redis: from before the admit is sent until the
    finish has run (or the admit was refused)."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def add(self, task_id: str) -> None:
        self._ids.add(task_id)

    def discard(self, task_id: str) -> None:
        self._ids.discard(task_id)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def snapshot(self) -> frozenset[str]:
        return frozenset(self._ids)


class Settler:
    """The one place a gateway ends a task (`finish`, hence `PoolStore.finish` and
    `lua/finish.lua`): a response done or failed, a client gone while queued or admitting, a
    queue deadline, a release to a node this gateway does not know, an orphan. No other
    module calls a store's finish, settle or cancel (tests/test_layering.py)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        live: LiveTasks,
        *,
        policy: RetryPolicy = SETTLE_RETRY,
        rng: random.Random | None = None,
    ) -> None:
        self.metrics = metrics
        self.live = live
        self.policy = policy
        self.rng = rng or random.Random()
        self._tasks: set[asyncio.Task[FinishResult | None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._given_up: dict[str, PoolStore] = {}
        """Tasks whose settle was given up and that are still in this gateway's renewed set:
        held (in `live`, so the orphan sweep leaves them alone) until `abandon_given_up` has
        moved them out."""

    @property
    def pending(self) -> int:
        return len(self._tasks)

    @property
    def given_up(self) -> frozenset[str]:
        """Ids of given-up tasks not yet moved out of the renewed set."""
        return frozenset(self._given_up)

    def finish(
        self,
        store: PoolStore,
        task_id: str,
        usage: int | None,
        *,
        cancelled: bool,
        labels: tuple[str, ...] | None,
        ttft_ms: int | None = None,
    ) -> asyncio.Task[FinishResult | None]:
        """Settle (`cancelled` False) or cancel the task in the background; returns at once.

        `usage`: real tokens (prompt + generated) to charge the tenant; None = unknown, refund
        the whole reservation. `ttft_ms`: ms from the dispatch to the node until the first
        token, reported to the leader with the settle (None: no first token).
        """
        task = asyncio.get_running_loop().create_task(
            self._finish(store, task_id, usage, cancelled, labels, ttft_ms)
        )
        self._tasks.add(task)
        self._idle.clear()
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[FinishResult | None]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()

    async def _finish(
        self,
        store: PoolStore,
        task_id: str,
        usage: int | None,
        cancelled: bool,
        labels: tuple[str, ...] | None,
        ttft_ms: int | None = None,
    ) -> FinishResult | None:
        try:
            return await self._finish_retrying(store, task_id, usage, cancelled, labels,
                                               ttft_ms)
        finally:
            if task_id not in self._given_up:
                self.live.discard(task_id)

    async def _finish_retrying(
        self,
        store: PoolStore,
        task_id: str,
        usage: int | None,
        cancelled: bool,
        labels: tuple[str, ...] | None,
        ttft_ms: int | None = None,
    ) -> FinishResult | None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        failures = 0
        while True:
            try:
                result = await store.finish(task_id, usage, cancelled=cancelled,
                                            ttft_ms=ttft_ms)
            except asyncio.CancelledError:
                log.warning("task %s left unsettled at shutdown; its lease will expire", task_id)
                return None
            except Exception as exc:
                failures += 1
                self.metrics.child(self.metrics.redis_errors, "settle").inc()
                transient = is_transient(exc)
                delay = self.policy.next_delay(
                    failures, loop.time() - started, self.rng.random()) if transient else None
                if delay is None:
                    self._give_up(store, task_id, cancelled, exc, failures, transient)
                    return None
                self.metrics.settle_retries.inc()
                # Debug, not a warning per attempt: in an outage every settle in flight retries
                # about 20 times (counted in settle_retries); a given-up one is logged once.
                log.debug("settling task %s failed (%s); retrying in %.2fs",
                          task_id, describe(exc), delay)
                await asyncio.sleep(delay)
                continue
            if usage is not None and labels is not None and result.outcome != "noop":
                self.metrics.child(self.metrics.tokens_settled, *labels).inc(usage)
            return result

    def _give_up(self, store: PoolStore, task_id: str, cancelled: bool, exc: Exception,
                 failures: int, transient: bool) -> None:
        op = "cancel" if cancelled else "settle"
        reason = DEADLINE if transient else PERMANENT
        self.metrics.child(self.metrics.settles_abandoned, op, reason).inc()
        log.error("giving up the %s of task %s in pool %s after %d attempt(s) (%s, %s): its "
                  "lease is no longer renewed; the scheduler's reaper returns its reservation "
                  "once it expires", op, task_id, store.pool, failures, reason, describe(exc))
        self._given_up[task_id] = store

    async def abandon_given_up(self, store: PoolStore, gateway_id: str) -> None:
        """Move this pool's given-up tasks out of the gateway's renewed set (`PoolStore.
        abandon`). Never raises: a task that cannot be moved now stays held, renewed, and is
        tried again at the next round. Any error ends this round's attempts: every call
        touches the same keys (the gateway's sets and leases), so what refuses one task
        refuses the rest, and a permanent error (credentials, ACL) would otherwise cost up
        to `ABANDON_BATCH` failing calls every round for as long as nobody fixes it."""
        ids = [t for t, s in self._given_up.items() if s.pool == store.pool][:ABANDON_BATCH]
        for task_id in ids:
            try:
                await store.abandon(gateway_id, task_id)
            except Exception as exc:
                self.metrics.child(self.metrics.redis_errors, "abandon").inc()
                log.debug("abandoning task %s failed: %s", task_id, describe(exc))
                return
            del self._given_up[task_id]
            self.live.discard(task_id)

    async def idle(self) -> None:
        """Until no settle is pending (tests, shutdown)."""
        await self._idle.wait()

    async def drain(self, timeout_s: float) -> None:
        """Wait for pending settles at shutdown; those still failing after `timeout_s` are
        abandoned to the lease reaper."""
        if not self._tasks:
            return
        _, stuck = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in stuck:
            task.cancel()
        if stuck:
            await asyncio.wait(stuck)


async def renew_leases(
    stores: Sequence[PoolStore],
    gateway_id: str,
    interval_s: float,
    settler: Settler,
    stop: asyncio.Event,
) -> None:
    """One renew call per pool every `interval_s` keeps all of this gateway's tasks alive,
    except those whose settle was given up, first moved out of the renewed set; orphans (in
    this gateway's set, not held by the process) are cancelled.

    Runs until `stop` is set. (Not only until cancelled: a cancellation that lands inside the
    Redis client can come out as a connection error, which this loop must survive.)
    """
    metrics = settler.metrics
    # Once per streak per pool, not at every round of an outage (each is counted).
    failing = {store.pool: FailureLog(f"renewing the lease in pool {store.pool}", time.monotonic,
                                      log) for store in stores}
    while not stop.is_set():
        for store in stores:
            await settler.abandon_given_up(store, gateway_id)
            # A task that finishes while SMEMBERS is in flight leaves the live set after
            # Redis dropped it but may still be in the reply: held before the read, it is
            # not an orphan.
            held_before = settler.live.snapshot()
            try:
                await store.renew(gateway_id)
                members = await store.gateway_tasks(gateway_id)
            except Exception as exc:
                if stop.is_set():
                    return
                metrics.child(metrics.redis_errors, "renew").inc()
                failing[store.pool].failed(describe(exc))
                continue
            failing[store.pool].succeeded()
            for task_id in members:
                if task_id not in held_before and task_id not in settler.live:
                    metrics.child(metrics.orphans, store.pool).inc()
                    log.warning("cancelling task %s: held in Redis, unknown to this process",
                                task_id)
                    settler.finish(store, task_id, None, cancelled=True, labels=None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
