"""The scheduler service: leadership, the poll loop of every pool, and the reaper.

Every replica runs the elector; only the leader ticks and reaps. Ticks follow a fixed cadence
(`poll_interval_ms`, from a monotonic clock, skipping missed beats rather than bunching them)
and all pools tick concurrently. A Redis error costs that pool that tick and is counted; an
epoch refusal (`FencedError`) makes the replica step down at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from admission.config import Config
from admission.connection import connect, eviction_warning, redis_address
from admission.errors import FencedError
from admission.scripts import Scripts, register_scripts
from admission.store import PoolStore
from scheduler.leader import Elector
from scheduler.metrics import SchedulerMetrics
from scheduler.pool import PoolScheduler, TickResult
from scheduler.scrape import Poller

log = logging.getLogger("kvgate.scheduler")
RECANCEL_S = 0.5


async def cancel_until_done(tasks: list[asyncio.Task[Any]], recancel_s: float = RECANCEL_S) -> None:
    """Cancel `tasks` and wait for them, cancelling again every `recancel_s` until they end.

    One cancel is not always enough on Python 3.11: `asyncio.wait_for` can swallow a
    cancellation that lands as its inner call completes (CPython gh-86296, fixed in 3.12), and
    redis-py calls it whenever it opens a connection. A loop that lost its cancel would keep
    running and `stop()` would never resign the lease.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
    for task in tasks:  # collect outcomes so that none is reported as never retrieved
        if not task.cancelled():
            task.exception()


FAIR_METRICS_INTERVAL_S = 1.0
"""How often the leader reads the fairness and quota figures it exports (scheduler.fairmetrics)."""

REAP_BATCH = 1000
REAP_CALLS = 10
"""At most this many reap calls per pool per round, so a backlog cannot stall the loop."""


def default_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class SchedulerService:
    def __init__(
        self,
        config: Config,
        *,
        me: str | None = None,
        client: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.settings = config.scheduler
        self.me = me or config.scheduler.id or default_id()
        self.clock = clock
        self.metrics = SchedulerMetrics()
        self._client = client
        self._own_client = client is None
        self.client: Any = None
        self.scripts: Scripts | None = None
        self.session: aiohttp.ClientSession | None = None
        self.elector: Elector | None = None
        self.pools: list[PoolScheduler] = []
        self.last: dict[str, TickResult] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._term: int | None = None
        self._changes_seen = 0
        self.ticks = 0
        self._redis_failed_at: float | None = None

    async def start(self) -> None:
        self.client = self._client if self._client is not None else connect(self.config.redis)
        self.scripts = register_scripts(self.client)
        backend_tls = self.config.backend_ssl_context()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60,
                                           ssl=backend_tls if backend_tls else True),
        )
        s = self.settings
        for pool in self.config.pools.values():
            poller = Poller(
                pool.backends,
                self.session,
                timeout_s=s.scrape_timeout_ms / 1000,
                stale_after_s=(s.scrape_timeout_ms + s.poll_interval_ms) / 1000,
                eject_after=s.eject_after_failures,
                on_scrape=self._scrape_hook(pool.name),
                clock=self.clock,
            )
            store = PoolStore(self.client, self.scripts, pool.name,
                              self.config.pool_policy(pool.name))
            self.pools.append(PoolScheduler(
                store, pool, s, poller, self.metrics, me=self.me,
                sharded_pubsub=self.config.redis.sharded_pubsub, clock=self.clock,
            ))
        self.elector = Elector(self.client, self.scripts, self.me, s.leader_ttl_ms,
                               clock=self.clock, on_failure=self.metrics.leadership_errors.inc)
        self._tasks = [
            asyncio.create_task(self.elector.run(), name="elector"),
            asyncio.create_task(self._tick_loop(), name="ticks"),
            asyncio.create_task(self._reap_loop(), name="reaper"),
            asyncio.create_task(self._fair_metrics_loop(), name="fair-metrics"),
        ]
        log.info("scheduler %s started: %d pool(s), poll %d ms, Redis %s", self.me,
                 len(self.pools), s.poll_interval_ms, redis_address(self.config.redis))
        if warning := await eviction_warning(self.client):
            log.warning("%s", warning)

    def _scrape_hook(self, pool: str) -> Callable[[str, float, str | None], None]:
        def hook(node: str, seconds: float, error: str | None) -> None:
            self.metrics.scrape_duration.labels(pool, node).observe(seconds)
            if error is not None:
                self.metrics.scrape_errors.labels(pool, node, error).inc()
        return hook

    @property
    def leading(self) -> bool:
        return self.elector is not None and self.elector.leading

    async def stop(self) -> None:
        """Stop ticking, resign (standbys take over at once), close connections. Idempotent."""
        tasks, self._tasks = self._tasks, []
        await cancel_until_done(tasks)
        if self.elector is not None:
            await self.elector.resign()
            self._sync_leader_metrics()
        for pool in self.pools:
            await pool.poller.close()
        self.pools = []
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.client is not None and self._own_client:
            await self.client.aclose()
        self.client = None

    def _sync_leader_metrics(self) -> None:
        assert self.elector is not None
        leading = self.elector.leading
        self.metrics.leader.set(1 if leading else 0)
        self.metrics.epoch.set((self.elector.epoch or 0) if leading else 0)
        if not leading:
            self.metrics.forget_pools()
        delta = self.elector.changes - self._changes_seen
        if delta > 0:
            self.metrics.leadership_changes.inc(delta)
            self._changes_seen = self.elector.changes

    async def _tick_loop(self) -> None:
        assert self.elector is not None
        interval = self.settings.poll_interval_ms / 1000
        while True:
            self._sync_leader_metrics()
            epoch = await self.elector.wait_leading()
            if epoch != self._term:
                self._term = epoch
                for pool in self.pools:
                    pool.new_term()
            self._sync_leader_metrics()
            start = self.clock()
            await asyncio.gather(*(self._tick_pool(pool, epoch) for pool in self.pools))
            self.ticks += 1
            # Fixed cadence: sleep to the next beat; if the tick overran, skip to the next one.
            elapsed = self.clock() - start
            await asyncio.sleep(interval - (elapsed % interval))

    async def _tick_pool(self, pool: PoolScheduler, epoch: int) -> None:
        assert self.elector is not None
        elector = self.elector
        try:
            self.last[pool.name] = await pool.tick(
                epoch, lambda: elector.leading and elector.epoch == epoch
            )
        except FencedError as exc:
            self.metrics.fenced.labels(pool.name).inc()
            elector.step_down(str(exc))
        except (RedisError, OSError) as exc:
            self._redis_failed_at = self.clock()
            self.metrics.redis_errors.labels(pool.name).inc()
            log.warning("pool %s tick failed: %s", pool.name, exc)

    def reaping_allowed(self) -> bool:
        """After Redis was unreachable, wait one gateway lease TTL before reaping: the leases
        expired in Redis time while nobody could renew them, and live gateways must get the
        chance to renew before their requests are taken for dead.

        Failed leadership calls count too: a leader loses its lease during an outage longer
        than the lease, its ticks and reaps stop (so they record no failure), and without them
        it would reap the live gateways' tasks the moment it leads again."""
        failures = [t for t in (self._redis_failed_at,
                                self.elector.failed_at if self.elector else None)
                    if t is not None]
        if not failures:
            return True
        grace = self.config.gateway.lease_ttl_ms / 1000
        return self.clock() - max(failures) >= grace

    async def _reap_loop(self) -> None:
        assert self.elector is not None
        interval = self.settings.reap_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            if not self.elector.leading or not self.reaping_allowed():
                continue
            for pool in self.pools:
                try:
                    await self.reap(pool)
                except (RedisError, OSError) as exc:
                    self._redis_failed_at = self.clock()
                    self.metrics.redis_errors.labels(pool.name).inc()
                    log.warning("pool %s reap failed: %s", pool.name, exc)

    async def _fair_metrics_loop(self) -> None:
        assert self.elector is not None
        teams = tuple(sorted(self.config.teams))
        while True:
            await asyncio.sleep(FAIR_METRICS_INTERVAL_S)
            if not self.elector.leading:
                continue
            for pool in self.pools:
                try:
                    reading = await pool.store.read_fairness(teams)
                except (RedisError, OSError) as exc:
                    self.metrics.redis_errors.labels(pool.name).inc()
                    log.warning("pool %s fairness read failed: %s", pool.name, exc)
                    continue
                self.metrics.fair.observe(pool.name, reading)

    async def reap(self, pool: PoolScheduler) -> None:
        for _ in range(REAP_CALLS):
            result = await pool.store.reap(REAP_BATCH)
            if result.reaped:
                self.metrics.reaped.labels(pool.name, "reaped").inc(result.reaped)
            if result.expired:
                self.metrics.reaped.labels(pool.name, "expired").inc(result.expired)
            if not result.more:
                return

    def health(self) -> dict[str, Any]:
        elector = self.elector
        return {
            "id": self.me,
            "leading": self.leading,
            "epoch": elector.epoch if elector is not None and self.leading else None,
            "holder": elector.holder if elector is not None else None,
            "ticks": self.ticks,
            "pools": {
                name: {"zone": r.zone.value, "usage": r.usage} for name, r in self.last.items()
            },
        }
