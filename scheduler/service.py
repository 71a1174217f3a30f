"""The scheduler service: leadership, the poll loop of every pool, and the reaper.

Every replica runs the elector; only the leader ticks and reaps. Each pool ticks in a loop of
its own at a fixed cadence (`poll_interval_ms`, from a monotonic clock, skipping missed beats
rather than bunching them): a pool whose ticks are slow (hung nodes on the first poll of a
term, its Redis shard slow) does not hold back the others' releases. A Redis error costs that
pool that tick and is counted; an epoch refusal (`FencedError`) makes the replica step down at
once. A failure that repeats is logged once per streak (admission.failurelog), per pool: never
once per tick.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from admission.config import Config
from admission.connection import connect, eviction_warning, redis_address, version_error
from admission.errors import REDIS_ERRORS, FencedError
from admission.failurelog import FailureLog
from admission.scripts import Scripts, register_scripts
from admission.servicemetrics import probe as probe_loop_lag
from admission.servicemetrics import watch_gc
from admission.store import PoolStore
from scheduler.leader import Elector
from scheduler.metrics import SchedulerMetrics
from scheduler.pool import PoolScheduler
from scheduler.probe import Prober, key_warning, probe_headers
from scheduler.scrape import Poller
from scheduler.tick import TickResult

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
    """Unique per process: two containers on the host's network share its hostname and are
    both PID 1, and two replicas holding one id would both lead, under one epoch."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


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
        self.metrics = SchedulerMetrics.of(config)
        self._client = client
        self._own_client = client is None
        self.client: Any = None
        self.scripts: Scripts | None = None
        self.session: aiohttp.ClientSession | None = None
        self.elector: Elector | None = None
        self.pools: list[PoolScheduler] = []
        self.last: dict[str, TickResult] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stop_watching_gc: Callable[[], None] = lambda: None
        self._changes_seen = 0
        self.ticks = 0
        """Pool ticks completed, every pool's together."""
        self.pool_ticks: dict[str, int] = {}
        self._redis_failed_at: dict[str, float] = {}
        """pool -> when one of its Redis calls last failed (this replica's clock)."""
        self._failure_logs: dict[tuple[str, str], FailureLog] = {}

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
                stuck_after_s=s.stuck_after_ms / 1000,
                on_scrape=self._scrape_hook(pool.name),
                clock=self.clock,
                pool=pool.name,
            )
            store = PoolStore(self.client, self.scripts, pool.name,
                              self.config.pool_policy(pool.name))
            prober = None
            if s.stuck_after_ms and s.probe_still_nodes:
                if (warning := key_warning(pool, os.environ)) is not None:
                    log.warning("%s", warning)
                prober = Prober(pool, self.session, s.stuck_after_ms / 1000,
                                headers=probe_headers(pool, os.environ),
                                on_probe=self._probe_hook(pool.name), clock=self.clock)
            self.pools.append(PoolScheduler(
                store, pool, s, poller, self.metrics, me=self.me,
                sharded_pubsub=self.config.redis.sharded_pubsub, clock=self.clock,
                may_judge_stuck=functools.partial(self.judging_allowed, pool.name),
                prober=prober,
            ))
        self.elector = Elector(self.client, self.scripts, self.me, s.leader_ttl_ms,
                               clock=self.clock, on_failure=self.metrics.leadership_errors.inc,
                               on_change=self._sync_leader_metrics)
        self._tasks = [
            asyncio.create_task(self.elector.run(), name="elector"),
            *(asyncio.create_task(self._tick_loop(pool), name=f"ticks:{pool.name}")
              for pool in self.pools),
            asyncio.create_task(self._reap_loop(), name="reaper"),
            asyncio.create_task(self._fair_metrics_loop(), name="fair-metrics"),
            asyncio.create_task(probe_loop_lag(self.metrics.loop_lag.observe), name="loop-lag"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._loop_ended)
        self._stop_watching_gc = watch_gc(self.metrics.gc_pause)
        log.info("scheduler %s started: %d pool(s), poll %d ms, Redis %s", self.me,
                 len(self.pools), s.poll_interval_ms, redis_address(self.config.redis))
        if problem := await version_error(self.client, self.config.redis):
            log.error("%s", problem)
        if warning := await eviction_warning(self.client):
            log.warning("%s", warning)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task not in self._tasks:
            return  # stopped on purpose
        why = "cancelled" if task.cancelled() else repr(task.exception())
        log.error("scheduler loop %s ended (%s): /healthz answers 503 until the replica is "
                  "restarted", task.get_name(), why)

    @property
    def ended_loops(self) -> list[str]:
        """Loops that ended while the service runs: the replica no longer does its work (a
        pool's ticks or the reaper stopped, or the elector renews nothing), and only a restart
        brings them back."""
        return [task.get_name() for task in self._tasks if task.done()]

    def _probe_hook(self, pool: str) -> Callable[[str, str], None]:
        def hook(node: str, outcome: str) -> None:
            self.metrics.probes.labels(pool, node, outcome).inc()
        return hook

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
        self._stop_watching_gc()
        await cancel_until_done(tasks)
        if self.elector is not None:
            await self.elector.resign()
            self._sync_leader_metrics()
        for pool in self.pools:
            await pool.poller.close()
            if pool.prober is not None:
                await pool.prober.close()
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
            for failures in self._failure_logs.values():
                failures.ended("this replica stopped leading")
        delta = self.elector.changes - self._changes_seen
        if delta > 0:
            self.metrics.leadership_changes.inc(delta)
            self._changes_seen = self.elector.changes

    async def _tick_loop(self, pool: PoolScheduler) -> None:
        assert self.elector is not None
        interval = self.settings.poll_interval_ms / 1000
        term: int | None = None
        while True:
            self._sync_leader_metrics()
            if not self.elector.leading:
                pool.stand_by()
            epoch = await self.elector.wait_leading()
            if epoch != term:
                term = epoch
                pool.new_term()
            self._sync_leader_metrics()
            start = self.clock()
            await self._tick_pool(pool, epoch)
            self.ticks += 1
            self.pool_ticks[pool.name] = self.pool_ticks.get(pool.name, 0) + 1
            # Fixed cadence: sleep to the next beat; if the tick overran, skip to the next one.
            elapsed = self.clock() - start
            await asyncio.sleep(interval - (elapsed % interval))

    def _failure_log(self, pool: str, what: str) -> FailureLog:
        key = (pool, what)
        found = self._failure_logs.get(key)
        if found is None:
            found = self._failure_logs[key] = FailureLog(f"pool {pool} {what}", self.clock, log)
        return found

    def _redis_failed(self, pool: str, what: str, exc: BaseException) -> None:
        self._redis_failed_at[pool] = self.clock()
        self.metrics.redis_errors.labels(pool).inc()
        self._failure_log(pool, what).failed(exc)

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
        except REDIS_ERRORS as exc:
            # REDIS_ERRORS, not RedisError alone: an unreachable Redis Cluster raises a
            # RedisClusterException, which ended this loop (and the replica's work with it).
            self._redis_failed(pool.name, "tick", exc)
        else:
            self._failure_log(pool.name, "tick").succeeded()

    def reaping_allowed(self, pool: str | None = None) -> bool:
        """After Redis was unreachable, wait one gateway lease TTL before reaping: the leases
        expired in Redis time while nobody could renew them, and live gateways must get the
        chance to renew before their requests are taken for dead.

        Failed leadership calls count too: a leader loses its lease during an outage longer
        than the lease, its ticks and reaps stop (so they record no failure), and without them
        it would reap the live gateways' tasks the moment it leads again. A pool's own failed
        calls hold back only its own reaping (`pool`; None: every pool's count): another
        pool's keys may live on another shard, or fail for a reason of their own, and one pool
        failing every tick must not leave every other pool's dead gateways unreaped."""
        return self._quiet_for(pool, self.config.gateway.lease_ttl_ms / 1000)

    def judging_allowed(self, pool: str) -> bool:
        """Whether the pool may judge a node stuck (scheduler.stuck): not until the reaper has
        had its lease's wait and one interval to run after Redis failures, so that no dead
        gateway's task left in the running index passes for a task the node still holds."""
        return self._quiet_for(pool, (self.config.gateway.lease_ttl_ms
                                      + self.settings.reap_interval_ms) / 1000)

    def _quiet_for(self, pool: str | None, seconds: float) -> bool:
        """No Redis failure of `pool` (None: of any pool) nor of a leadership call for
        `seconds`."""
        failed: list[float | None] = (list(self._redis_failed_at.values()) if pool is None
                                      else [self._redis_failed_at.get(pool)])
        failed.append(self.elector.failed_at if self.elector else None)
        failures = [t for t in failed if t is not None]
        return not failures or self.clock() - max(failures) >= seconds

    async def _reap_loop(self) -> None:
        assert self.elector is not None
        interval = self.settings.reap_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            for pool in self.pools:
                if not self.elector.leading or not self.reaping_allowed(pool.name):
                    continue
                try:
                    await self.reap(pool)
                except REDIS_ERRORS as exc:
                    self._redis_failed(pool.name, "reap", exc)
                else:
                    self._failure_log(pool.name, "reap").succeeded()

    async def _fair_metrics_loop(self) -> None:
        assert self.elector is not None
        teams = tuple(sorted(self.config.teams))
        bursts = {name: team.burst for name, team in self.config.teams.items()}
        while True:
            await asyncio.sleep(FAIR_METRICS_INTERVAL_S)
            if not self.elector.leading:
                continue
            for pool in self.pools:
                failures = self._failure_log(pool.name, "fairness read")
                try:
                    reading = await pool.store.read_fairness(teams)
                except REDIS_ERRORS as exc:
                    self.metrics.redis_errors.labels(pool.name).inc()
                    failures.failed(exc)
                    continue
                failures.succeeded()
                self.metrics.fair.observe(pool.name, reading, bursts)

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
            "ended_loops": self.ended_loops,
            "redis": _redis_health(elector),
            "pools": {
                name: {"zone": r.zone.value, "usage": r.usage,
                       "ticks": self.pool_ticks.get(name, 0)}
                for name, r in self.last.items()
            },
        }


def _redis_health(elector: Elector | None) -> dict[str, Any]:
    """What the latest leadership call met: "ok", "unreachable" (it passes when Redis is back)
    or "refused" (a wrong password, an ACL, a certificate: the operator must act; the replica
    keeps retrying and heals once they do), with the error's class (`describe`)."""
    if elector is None or elector.last_error is None:
        return {"state": "ok", "error": None}
    return {"state": "refused" if elector.error_permanent else "unreachable",
            "error": elector.last_error}
