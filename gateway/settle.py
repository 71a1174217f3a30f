"""Ending tasks off the latency path, and keeping this gateway's lease alive.

A response is sent first; its settle (or cancel) then runs as a background task that survives the
handler being cancelled by a client disconnect, retries on Redis errors (the finish script is
idempotent: a repeat is a no-op) and is awaited at shutdown. While it has not succeeded, the
task stays in this gateway's set, so nothing leaks: either it succeeds, or the gateway dies and
its lease expires, and the scheduler's reaper returns the whole reservation.

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
from collections.abc import Sequence

from admission.store import FinishResult, PoolStore
from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.gateway")


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
    def __init__(
        self, metrics: GatewayMetrics, live: LiveTasks, *, max_backoff_s: float = 2.0
    ) -> None:
        self.metrics = metrics
        self.live = live
        self.max_backoff_s = max_backoff_s
        self._tasks: set[asyncio.Task[FinishResult | None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def finish(
        self,
        store: PoolStore,
        task_id: str,
        usage: int | None,
        *,
        cancelled: bool,
        labels: tuple[str, ...] | None,
    ) -> asyncio.Task[FinishResult | None]:
        """Settle (`cancelled` False) or cancel the task in the background; returns at once.

        `usage`: real tokens (prompt + generated) to charge the tenant; None = unknown, refund
        the whole reservation.
        """
        task = asyncio.get_running_loop().create_task(
            self._finish(store, task_id, usage, cancelled, labels)
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
    ) -> FinishResult | None:
        try:
            return await self._finish_retrying(store, task_id, usage, cancelled, labels)
        finally:
            self.live.discard(task_id)

    async def _finish_retrying(
        self,
        store: PoolStore,
        task_id: str,
        usage: int | None,
        cancelled: bool,
        labels: tuple[str, ...] | None,
    ) -> FinishResult | None:
        delay = 0.01
        while True:
            try:
                result = await store.finish(task_id, usage, cancelled=cancelled)
            except asyncio.CancelledError:
                log.warning("task %s left unsettled at shutdown; its lease will expire", task_id)
                return None
            except Exception as exc:
                self.metrics.settle_retries.inc()
                self.metrics.child(self.metrics.redis_errors, "settle").inc()
                log.warning("settling task %s failed (%s); retrying in %.2fs",
                            task_id, type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            if usage is not None and labels is not None and result.outcome != "noop":
                self.metrics.child(self.metrics.tokens_settled, *labels).inc(usage)
            return result

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
    """One renew call per pool every `interval_s` keeps all of this gateway's tasks alive;
    orphans (in this gateway's set, not held by the process) are cancelled.

    Runs until `stop` is set. (Not only until cancelled: a cancellation that lands inside the
    Redis client can come out as a connection error, which this loop must survive.)
    """
    metrics = settler.metrics
    while not stop.is_set():
        for store in stores:
            # A task that finishes while SMEMBERS is in flight leaves the live set after
            # Redis dropped it but may still be in the reply: held before the read, it is
            # not an orphan.
            held_before = settler.live.snapshot()
            try:
                await store.renew(gateway_id)
                members = await store.client.smembers(store.keys.gateway_tasks_key(gateway_id))
            except Exception as exc:
                if stop.is_set():
                    return
                metrics.child(metrics.redis_errors, "renew").inc()
                log.warning("renewing the lease in pool %s failed: %s", store.pool,
                            type(exc).__name__)
                continue
            for raw in members:
                task_id = raw.decode() if isinstance(raw, bytes) else str(raw)
                if task_id not in held_before and task_id not in settler.live:
                    metrics.child(metrics.orphans, store.pool).inc()
                    log.warning("cancelling task %s: held in Redis, unknown to this process",
                                task_id)
                    settler.finish(store, task_id, None, cancelled=True, labels=None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
