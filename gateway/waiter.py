"""Waiting for a queued task's release: pub/sub wake-ups, with the task record as the truth.

The scheduler publishes ``"<task_id> <node>"`` on this gateway's wake channel of the pool when
it releases a task (node empty: the task expired in the queue). Pub/sub is at most once: a
message published while the subscription reconnects is lost. So the hub also checks, every
`wake_fallback_ms` and at once whenever the subscription (re)connects, whether any task this
process waits for has left its queue; a lost message costs at most one fallback interval, never
a stranded request.

The check costs the same whatever the number of waiters: one ``ZMSCORE`` per pool and tier
over all of its waiting task ids (a task missing from its queue has left it), then one read of
the record of each task that left. Per-request polling would cost Redis one read per waiter
per interval, 400,000 reads a second for 100,000 queued Batch requests at 250 ms.

Each pool and tier is checked on its own: one whose calls fail (its Redis shard down, a key
an operator broke) is counted and logged (once per streak) and skipped, and the others'
waiters are still found every interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from admission.errors import describe
from admission.failurelog import FailureLog
from admission.outcomes import TaskState, parse_wake
from admission.pubsub import MESSAGE_KINDS, SUBSCRIBE_KINDS, Subscription
from admission.store import PoolStore
from admission.tiers import Tier
from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.gateway")

_CHUNK = 1000  # task ids per ZMSCORE


@dataclass(frozen=True, slots=True)
class Woken:
    node: str | None
    """The node to send the request to; None: the task left the queue without a release."""
    state: str
    """The task's state as found: released, or expired/reaped/cancelled/unknown."""
    polled: bool
    """Learned by reading the record rather than from a wake-up message."""


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[Woken]
    store: PoolStore | None = None
    tier: Tier | None = None
    """Set once the admit said 'queued': only then is the task checked in its queue."""


class WakeHub:
    """One subscription per gateway process to its wake channels (one per pool), and one
    fallback check for all of its waiting requests."""

    def __init__(
        self,
        client: Any,
        channels: Sequence[str],
        metrics: GatewayMetrics,
        *,
        poll_s: float,
        sharded: bool = False,
    ) -> None:
        self.client = client
        self.channels = list(channels)
        self.metrics = metrics
        self.poll_s = poll_s
        self.sharded = sharded
        self._waiting: dict[str, _Waiter] = {}
        self._kick = asyncio.Event()
        self._listeners = 1
        self._subscribed: set[int] = set()
        """Listeners (one, or one per channel) whose subscription is confirmed."""
        self.subscribed = asyncio.Event()
        self.stop = asyncio.Event()
        self._check_failures: dict[tuple[str, Tier], FailureLog] = {}
        """The fallback check's failures per pool and tier: one line per streak, not per
        round (every `poll_s` for as long as it lasts)."""

    def expect(self, task_id: str) -> asyncio.Future[Woken]:
        """Register before admitting, so that a release published at once is not missed."""
        future: asyncio.Future[Woken] = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = _Waiter(future)
        return future

    def queued(self, task_id: str, store: PoolStore, tier: Tier) -> None:
        """The admit queued the task: include it in the fallback checks from now on."""
        waiter = self._waiting.get(task_id)
        if waiter is not None:
            waiter.store, waiter.tier = store, tier

    def forget(self, task_id: str) -> None:
        self._waiting.pop(task_id, None)

    def deliver(self, data: bytes | str) -> None:
        task_id, node = parse_wake(data)
        waiter = self._waiting.get(task_id)
        if waiter is not None and not waiter.future.done():
            state = TaskState.RELEASED if node else TaskState.EXPIRED
            waiter.future.set_result(Woken(node, state, False))

    async def run(self) -> None:
        """Listen until `stop` is set (or cancelled); reconnects with backoff, never raises.

        On a Redis Cluster with sharded pub/sub each channel lives on its own pool's shard:
        one listener per channel then, because redis-py's cluster pub/sub reads the shards'
        connections one after the other, each read waiting out its timeout, so a quiet shard
        would hold up the messages of another for up to a second.
        """
        per_channel = self.sharded and isinstance(self.client, RedisCluster)
        groups = [[c] for c in self.channels] if per_channel else [self.channels]
        self._listeners = len(groups)
        await asyncio.gather(*(self._listen(i, group, per_channel)
                               for i, group in enumerate(groups)))

    async def _listen(self, index: int, channels: list[str], cluster_sharded: bool) -> None:
        backoff = 0.05
        # Once per outage, not at every attempt (up to one every 2 s for as long as it lasts);
        # each attempt is counted in pubsub_reconnects.
        lost = FailureLog("wake-up subscription", time.monotonic, log,
                          recovered="wake-up subscription restored")
        while not self.stop.is_set():
            subscription = Subscription(self.client, channels, sharded=self.sharded,
                                        per_shard=cluster_sharded)
            try:
                await subscription.open()
                while not self.stop.is_set():
                    message = await subscription.get(1.0)
                    if message is None:
                        continue
                    kind, data = message
                    if kind in MESSAGE_KINDS:
                        self.deliver(data)
                    elif kind in SUBSCRIBE_KINDS:
                        # (Re)subscribed: whatever was published meanwhile is lost; look now.
                        lost.succeeded()
                        self._subscribed.add(index)
                        if len(self._subscribed) >= self._listeners:
                            self.subscribed.set()
                        self._kick.set()
                        backoff = 0.05
            except Exception as exc:
                if self.stop.is_set():
                    return
                self._subscribed.discard(index)
                self.subscribed.clear()
                self.metrics.pubsub_reconnects.inc()  # no labels: no child
                self.metrics.child(self.metrics.redis_errors, "subscribe").inc()
                lost.failed(describe(exc))
                self._kick.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(subscription.aclose())

    async def poll_forever(self) -> None:
        """The fallback: every `poll_s` (or when kicked), until `stop` is set."""
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.poll_s)
            self._kick.clear()
            try:
                await self.poll_once()
            except Exception as exc:  # best effort: the next round, or the deadline, follows
                if self.stop.is_set():
                    return
                self.metrics.child(self.metrics.redis_errors, "poll").inc()
                log.debug("fallback check failed: %s", type(exc).__name__)

    async def poll_once(self) -> int:
        """Resolve every queued waiter whose task has left its queue; returns how many."""
        groups: dict[tuple[int, Tier], list[str]] = defaultdict(list)
        stores: dict[int, PoolStore] = {}
        for task_id, waiter in self._waiting.items():
            if waiter.store is not None and waiter.tier is not None and not waiter.future.done():
                groups[(id(waiter.store), waiter.tier)].append(task_id)
                stores[id(waiter.store)] = waiter.store
        resolved = 0
        for (store_key, tier), ids in groups.items():
            store = stores[store_key]
            failures = self._check_failures.get((store.pool, tier))
            try:
                for start in range(0, len(ids), _CHUNK):
                    left = await store.left_queue(tier, ids[start:start + _CHUNK])
                    if left:
                        resolved += await self._read_records(store, left)
            except Exception as exc:  # this group only: the next ones are still checked
                if self.stop.is_set():  # stopping: the connections are closing under it
                    return resolved
                if failures is None:
                    failures = self._check_failures[(store.pool, tier)] = FailureLog(
                        f"wake-up fallback check of pool {store.pool} tier {tier.label}",
                        time.monotonic, log)
                self.metrics.child(self.metrics.redis_errors, "poll").inc()
                failures.failed(describe(exc))
                continue
            if failures is not None:
                failures.succeeded()
        return resolved

    async def _read_records(self, store: PoolStore, task_ids: list[str]) -> int:
        records = await store.task_states(task_ids)
        resolved = 0
        for task_id, (state, node) in zip(task_ids, records, strict=True):
            state = state or "unknown"
            waiter = self._waiting.get(task_id)
            if state == TaskState.QUEUED or waiter is None or waiter.future.done():
                continue
            released = state == TaskState.RELEASED and bool(node)
            waiter.future.set_result(Woken(node if released else None, state, True))
            self.metrics.child(self.metrics.wake_fallbacks, store.pool).inc()
            resolved += 1
        return resolved


async def wait_for_release(woken: asyncio.Future[Woken], *, timeout_s: float) -> Woken | None:
    """The task's release (or its end), or None when `timeout_s` passes while it is queued."""
    done, _ = await asyncio.wait((woken,), timeout=max(0.0, timeout_s))
    return woken.result() if done else None

