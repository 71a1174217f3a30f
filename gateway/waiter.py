"""Waiting for a queued task's release: pub/sub wake-ups, with the task record as the truth.

The scheduler publishes ``"<task_id> <node>"`` on this gateway's wake channel of the pool when
it releases a task (node empty: the task expired in the queue). Pub/sub is at most once: a
message published while the subscription reconnects is lost. So every waiter also reads its
task record every `wake_fallback_ms`, and at once whenever the subscription (re)connects; a
lost message costs at most one fallback interval, never a stranded request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from admission.store import PoolStore, TaskState
from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.gateway")


@dataclass(frozen=True, slots=True)
class Woken:
    node: str | None
    """The node to send the request to; None: the task left the queue without a release."""
    state: str
    """The task's state as found: released, or expired/reaped/cancelled/unknown."""
    polled: bool
    """Learned by reading the record rather than from a wake-up message."""


class WakeHub:
    """One subscription per gateway process to its wake channels (one per pool)."""

    def __init__(
        self,
        client: Any,
        channels: Sequence[str],
        metrics: GatewayMetrics,
        *,
        sharded: bool = False,
    ) -> None:
        self.client = client
        self.channels = list(channels)
        self.metrics = metrics
        self.sharded = sharded
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._resync: asyncio.Future[None] | None = None
        self.subscribed = asyncio.Event()
        self.stop = asyncio.Event()

    def expect(self, task_id: str) -> asyncio.Future[str]:
        """Register before admitting, so that a release published at once is not missed."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = future
        return future

    def forget(self, task_id: str) -> None:
        self._waiting.pop(task_id, None)

    @property
    def resync(self) -> asyncio.Future[None]:
        """Completes when the subscription (re)connects: waiters should read their records."""
        if self._resync is None or self._resync.done():
            self._resync = asyncio.get_running_loop().create_future()
        return self._resync

    def _trigger_resync(self) -> None:
        if self._resync is not None and not self._resync.done():
            self._resync.set_result(None)
        self._resync = None

    def deliver(self, data: bytes | str) -> None:
        text = data.decode() if isinstance(data, bytes) else data
        task_id, _, node = text.partition(" ")
        future = self._waiting.get(task_id)
        if future is not None and not future.done():
            future.set_result(node.strip())

    async def run(self) -> None:
        """Listen until `stop` is set (or cancelled); reconnects with backoff, never raises."""
        backoff = 0.05
        while not self.stop.is_set():
            pubsub = self.client.pubsub()
            try:
                if self.sharded:
                    await pubsub.ssubscribe(*self.channels)
                else:
                    await pubsub.subscribe(*self.channels)
                while not self.stop.is_set():
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    kind = message.get("type")
                    if kind in ("message", "smessage"):
                        self.deliver(message["data"])
                    elif kind in ("subscribe", "ssubscribe"):
                        self.subscribed.set()
                        self._trigger_resync()
                        backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.stop.is_set():
                    return
                self.subscribed.clear()
                self.metrics.pubsub_reconnects.inc()
                self.metrics.child(self.metrics.redis_errors, "subscribe").inc()
                log.warning("wake-up subscription lost (%s); reconnecting in %.2fs",
                            type(exc).__name__, backoff)
                self._trigger_resync()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())


async def wait_for_release(
    hub: WakeHub,
    store: PoolStore,
    task_id: str,
    woken: asyncio.Future[str],
    *,
    timeout_s: float,
    poll_s: float,
) -> Woken | None:
    """The task's release (or its end), or None when `timeout_s` passes while it is queued.

    Redis errors while polling are not fatal: the wait goes on (the wake-up may still come)
    and the caller's timeout bounds it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None
        await asyncio.wait(
            (woken, hub.resync), timeout=min(poll_s, remaining),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if woken.done():
            node = woken.result()
            return Woken(node or None, TaskState.RELEASED if node else TaskState.EXPIRED, False)
        try:
            record = await store.client.hmget(store.keys.task_key(task_id), "state", "node")
        except Exception as exc:  # a poll is best effort; the deadline still holds
            hub.metrics.child(hub.metrics.redis_errors, "poll").inc()
            log.debug("polling task record failed: %s", type(exc).__name__)
            continue
        state = _text(record[0]) or "unknown"
        if state == TaskState.QUEUED:
            continue
        hub.metrics.child(hub.metrics.wake_fallbacks, store.pool).inc()
        node = _text(record[1])
        if state == TaskState.RELEASED and node:
            return Woken(node, state, True)
        return Woken(None, state, True)


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value
