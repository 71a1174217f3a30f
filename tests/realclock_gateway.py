"""A gateway process for the real-clock soak test (tests/test_core_real_clock.py).

It runs the gateway's own lease renewal loop (`gateway.settle.renew_leases`) and settler, so
what races the reaper is the code a gateway runs, not a stand-in for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

from admission.outcomes import AdmitOutcome, FinishResult
from admission.store import PoolStore
from admission.tiers import Tier
from gateway.metrics import GatewayMetrics
from gateway.settle import LiveTasks, Settler, renew_leases
from tests.realclock_support import (
    TENANTS,
    TIER_TIMEOUT_MS,
    Ledger,
    admit,
    lease_expiry,
    sleep_until_redis_us,
)


class RecordingSettler(Settler):
    """The gateway's settler, keeping each finish it starts so its reply can be booked."""

    def __init__(self, live: LiveTasks) -> None:
        super().__init__(GatewayMetrics(), live)
        self.started: list[tuple[str, int | None, bool, asyncio.Task[FinishResult | None]]] = []

    def finish(self, store: PoolStore, task_id: str, usage: int | None, *, cancelled: bool,
               labels: tuple[str, ...] | None,
               ttft_ms: int | None = None) -> asyncio.Task[FinishResult | None]:
        task = super().finish(store, task_id, usage, cancelled=cancelled, labels=labels,
                              ttft_ms=ttft_ms)
        self.started.append((task_id, usage, cancelled, task))
        return task


class Gateway:
    """One gateway process, with the gateway's own lease renewal loop and settler. Most of the
    time it admits requests, holds them a while and settles or cancels them. Now and then it
    stalls (a long pause: its renewals stop and it comes back around its lease's expiry, then
    settles what it held, racing the reaper), dies (a new process with a new id takes over and
    the old tasks are left to the reaper), or gives up one task (`abandon`, sometimes followed
    by a late settle that races the reaper of the abandoned set)."""

    def __init__(self, n: int, store: PoolStore, ledger: Ledger, rng: random.Random) -> None:
        self.n, self.store, self.ledger, self.rng = n, store, ledger, rng
        # A few renewals per lease, as with the defaults (every 3 s for a 10 s lease).
        self.renew_s = store.policy.lease_ttl_ms / 4 / 1000
        self.life = 0
        self.settlers: list[RecordingSettler] = []
        self.stalls = self.deaths = self.abandons = 0
        self._new_life()

    def _new_life(self) -> None:
        self.id = f"gw{self.n}-{self.life}"
        self.live = LiveTasks()
        self.settler = RecordingSettler(self.live)
        self.settlers.append(self.settler)
        self.held: dict[str, tuple[int, float]] = {}
        self.admitted = 0

    def _start_renewing(self) -> None:
        self.stop = asyncio.Event()
        self.renewer = asyncio.create_task(
            renew_leases([self.store], self.id, self.renew_s, self.settler, self.stop))

    async def _stop_renewing(self) -> None:
        self.stop.set()
        await self.renewer

    async def run(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        self._start_renewing()
        while loop.time() < until:
            roll = self.rng.random()
            if roll < 0.015 and self.held:
                await self._stall()
            elif roll < 0.025 and self.held:
                await self._die()
            elif roll < 0.05 and self.held:
                await self._abandon_one()
            else:
                if len(self.held) < 6:
                    await self._admit_one()
                for task_id in [t for t, (_, due) in self.held.items() if due <= loop.time()]:
                    self._finish(task_id)
            await asyncio.sleep(self.rng.uniform(0.002, 0.015))
        # The gateway stops: what it still holds is left to the reaper.
        await self._stop_renewing()

    async def _admit_one(self) -> None:
        self.admitted += 1
        task_id = f"{self.id}-{self.admitted}"
        prompt, out = self.rng.randint(10, 200), self.rng.randint(10, 200)
        timeout_ms = self.rng.choice((TIER_TIMEOUT_MS, self.rng.randint(100, 800)))
        self.live.add(task_id)
        outcome = await admit(self.store, self.ledger, task_id, self.id, prompt=prompt, out=out,
                               tenant=self.rng.choice(TENANTS),
                               tier=self.rng.choice(list(Tier)), timeout_ms=timeout_ms)
        if outcome in (AdmitOutcome.RELEASED, AdmitOutcome.QUEUED):
            hold = asyncio.get_running_loop().time() + self.rng.uniform(0.02, 0.4)
            self.held[task_id] = (prompt + out, hold)
        else:
            self.live.discard(task_id)

    def _finish(self, task_id: str) -> None:
        cost, _ = self.held.pop(task_id)
        if self.rng.random() < 0.75:
            self.settler.finish(self.store, task_id, self.rng.randint(0, cost), cancelled=False,
                                labels=None)
        else:
            self.settler.finish(self.store, task_id, None, cancelled=True, labels=None)

    async def _stall(self) -> None:
        self.stalls += 1
        await self._stop_renewing()
        expiry = await lease_expiry(self.store, self.id)
        if expiry is not None:
            await sleep_until_redis_us(self.store.client,
                                       expiry + self.rng.randint(-30_000, 50_000))
        if self.rng.random() < 0.5:
            self._start_renewing()
            for task_id in list(self.held):
                self._finish(task_id)
        else:
            for task_id in list(self.held):
                self._finish(task_id)
            self._start_renewing()

    async def _die(self) -> None:
        self.deaths += 1
        await self._stop_renewing()
        self.life += 1
        self._new_life()
        self._start_renewing()

    async def _abandon_one(self) -> None:
        self.abandons += 1
        task_id = self.rng.choice(sorted(self.held))
        await self.store.abandon(self.id, task_id)
        self.live.discard(task_id)
        if self.rng.random() < 0.5:
            self._finish(task_id)
        else:
            del self.held[task_id]

    def orphans_cancelled(self) -> float:
        """Tasks the renewal loop's sweep cancelled as unknown to the process: none should be,
        since each task is held from before its admit until its finish has run."""
        return sum(s.metrics.registry.get_sample_value(
            "kvgate_gateway_orphans_total", {"pool": self.store.pool}) or 0.0
            for s in self.settlers)

    def book_finishes(self) -> None:
        for settler in self.settlers:
            for task_id, usage, cancelled, task in settler.started:
                result = task.result()
                assert result is not None, f"the settle of {task_id} was given up"
                self.ledger.finished(task_id, usage, cancelled, result)


async def every(period_s: float, stop: asyncio.Event, step: Callable[[], Awaitable[None]]) -> int:
    """Run `step` every `period_s` until `stop`; how many times it ran."""
    runs = 0
    while not stop.is_set():
        await step()
        runs += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
    return runs
