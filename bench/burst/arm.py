"""One arm of the burst experiment: its services, its load, its timeline.

(a) clients go straight to the nodes, round robin; (b) through bench.burst.fifo_proxy; (c) through
kvgate: a private Redis, ``schedulers`` scheduler processes (one leads, the others stand by)
and ``gateways`` gateway processes, clients spread over the gateways round robin; (d) straight
to the nodes like (a), each client sending its tier as vLLM's ``priority`` (VIP 0, the highest):
what vLLM's own priority scheduling gives without any gateway.

Every arm gets fresh nodes (and, for (c), a fresh Redis), so counters, peaks and crashes belong
to that arm alone, and all arms replay the same planned schedule on the same engine
configuration (``Settings.sim_config``: the priority policy on every node, in every arm).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from admission.keys import PoolKeys
from admission.tiers import Tier
from bench.burst.expconfig import POOL, Settings, api_key, kvgate_toml
from bench.burst.loadgen import ClientSettings, LoadGenerator, Outcome
from bench.burst.monitor import Monitor, QueueSource, Sample, proxy_queues, redis_queues
from bench.burst.phaseload import PhaseClock
from bench.burst.workload import Schedule
from bench.common.localredis import LocalRedis, free_port, start_redis
from bench.common.openloop import LoopLag, quiet_collector
from bench.common.procs import Child, python_module, spawn, wait_http_ok
from bench.sim.cluster import SimCluster
from bench.sim.config import DEFAULT_MODEL
from kvgate_client.policy import RetryPolicy

_GATEWAY_READY = re.compile(r"listening on (http://\S+)")
_FIFO_READY = re.compile(r'"fifo_ready"')
_CRASH_STATUS = 137


@dataclass(slots=True)
class ArmResult:
    arm: str
    settings: Settings
    outcomes: list[Outcome]
    samples: list[Sample]
    admitted: list[tuple[float, Tier]]
    rejected: list[tuple[float, Tier]]
    crashed_nodes: int
    max_loop_lag_s: float
    send_lag_max_s: float
    stopped_at: float
    """Wall seconds from the arm's start at which the load stopped."""
    cpu: dict[str, float] = field(default_factory=dict)
    """Cores used on average while the load ran, by kind of process (sims, gateways, ...)."""
    client_lag: list[float] = field(default_factory=list)
    """The load generator's own worst event-loop lag (wall s) in each second of the arm."""
    phase_load: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase (calm, burst): cores used by kind of process and, in arm (c), how late the
    gateways' event loops ran (bench.burst.phaseload)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # Fields 14 and 15 of stat (utime, stime) are the 12th and 13th after the ")".
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_by_kind(pids: dict[str, list[int]]) -> dict[str, float]:
    return {kind: sum(cpu_seconds(p) for p in ps) for kind, ps in pids.items()}


def client_settings(settings: Settings) -> dict[str, ClientSettings]:
    """VIP does not retry; Normal uses the SDK's defaults; Batch, an offline job, is patient:
    more attempts and a deadline as long as the observation window (still budgeted)."""
    window_s = settings.profile.duration_s
    out = {}
    for klass in settings.classes:
        policy: RetryPolicy | None
        if klass.tier is Tier.VIP:
            policy = None
        elif klass.tier is Tier.NORMAL:
            policy = RetryPolicy()
        else:
            policy = RetryPolicy(max_attempts=6, deadline_s=window_s)
        out[klass.name] = ClientSettings(api_key(klass.name), policy)
    return out


class _Services:
    """What an arm started; ``close`` stops all of it by PID, newest first."""

    def __init__(self) -> None:
        self.cluster: SimCluster | None = None
        self.redis: LocalRedis | None = None
        self.children: list[Child] = []

    def pids(self) -> dict[str, list[int]]:
        """Process ids by kind, for CPU accounting (the runner itself is "loadgen")."""
        out: dict[str, list[int]] = {"loadgen": [os.getpid()]}
        if self.cluster is not None:
            out["sims"] = [n.process.pid for n in self.cluster.nodes]
        if self.redis is not None:
            out["redis"] = [self.redis.process.pid]
        for child in self.children:
            out.setdefault(child.name.rsplit("-", 1)[0] + "s", []).append(child.pid)
        return out

    def crashed_nodes(self) -> int:
        if self.cluster is None:
            return 0
        return sum(1 for n in self.cluster.nodes if n.process.poll() == _CRASH_STATUS)

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.redis is not None:
            self.redis.stop()
            shutil.rmtree(self.redis.workdir, ignore_errors=True)


async def _start_kvgate(settings: Settings, services: _Services, node_urls: list[str],
                        log_dir: Path) -> tuple[list[str], aioredis.Redis]:
    services.redis = await asyncio.to_thread(start_redis)
    config_path = log_dir / "kvgate.toml"
    sched_ports = [free_port() for _ in range(settings.schedulers)]
    window = settings.profile.duration_s + 60.0
    config_path.write_text(kvgate_toml(settings, services.redis.url, node_urls, sched_ports[0],
                                       window))
    for i, port in enumerate(sched_ports):
        child = spawn(f"scheduler-{i}", python_module(
            "scheduler", "--config", str(config_path), "--id", f"sched-{i}", "--port", str(port),
            "--log-level", "WARNING"), log_dir)
        services.children.append(child)
        await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{port}/healthz", child)
    urls = []
    for i in range(settings.gateways):
        child = await asyncio.to_thread(spawn, f"gateway-{i}", python_module(
            "gateway", "--config", str(config_path), "--id", f"gw-{i}", "--port", "0",
            "--log-level", "WARNING"), log_dir, ready=_GATEWAY_READY, timeout=60.0)
        services.children.append(child)
        match = _GATEWAY_READY.search(child.ready_line)
        assert match is not None
        urls.append(match.group(1))
        await asyncio.to_thread(wait_http_ok, urls[-1] + "/readyz", child)
    client = aioredis.Redis.from_url(services.redis.url)
    await _wait_scheduler_state(client, len(node_urls))
    return urls, client


async def _wait_scheduler_state(client: aioredis.Redis, nodes: int, limit_s: float = 30.0
                                ) -> None:
    """The leader has published every node's capacity and a zone: admission can start."""
    keys = PoolKeys(POOL)
    deadline = time.monotonic() + limit_s
    while True:
        capacities = await client.hlen(keys.node_capacity)
        zone = await client.hget(keys.state, "zone")
        if capacities >= nodes and zone:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler published {capacities}/{nodes} node capacities "
                               f"and zone {zone!r} within {limit_s:.0f} s")
        await asyncio.sleep(0.1)


async def run_arm(
    arm: str,
    settings: Settings,
    schedule: Schedule,
    log_dir: Path,
    progress: Callable[[str], None] = print,
) -> ArmResult:
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    services = _Services()
    redis_client: aioredis.Redis | None = None
    configs = [settings.sim_config(i) for i in range(settings.nodes)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    session = aiohttp.ClientSession(connector=connector,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
    try:
        services.cluster = await asyncio.to_thread(
            SimCluster.start, configs, log_dir=log_dir / "nodes", crash_exit=True, trace=True)
        node_urls = services.cluster.urls
        queues: QueueSource | None = None
        model = DEFAULT_MODEL
        if arm in ("a", "d"):
            targets = node_urls
        elif arm == "b":
            argv = python_module("bench.burst.fifo_proxy",
                                 "--max-inflight", str(settings.fifo_slots))
            for url in node_urls:
                argv += ["--backend", url]
            child = await asyncio.to_thread(spawn, "fifo-proxy", argv, log_dir, ready=_FIFO_READY)
            services.children.append(child)
            port = int(child.ready_line.split('"port":')[1].strip(" }"))
            targets = [f"http://127.0.0.1:{port}"]
            queues = proxy_queues(session, targets[0])
        elif arm == "c":
            targets, redis_client = await _start_kvgate(settings, services, node_urls, log_dir)
            queues = redis_queues(redis_client, POOL)
            model = POOL
        else:
            raise ValueError(f"unknown arm {arm!r}")
        return await _drive(arm, settings, schedule, session, targets, model, node_urls, queues,
                            services, progress)
    finally:
        await session.close()
        if redis_client is not None:
            await redis_client.aclose()
        await asyncio.to_thread(services.close)


async def _drive(
    arm: str,
    settings: Settings,
    schedule: Schedule,
    session: aiohttp.ClientSession,
    targets: list[str],
    model: str,
    node_urls: list[str],
    queues: QueueSource | None,
    services: _Services,
    progress: Callable[[str], None],
) -> ArmResult:
    profile = settings.profile
    gen = LoadGenerator(schedule, targets, model, client_settings(settings), seed=settings.seed,
                        send_priority=arm == "d")
    monitor = Monitor(session, node_urls, interval_s=settings.sample_interval_s, queues=queues)
    burst_end = profile.window("burst")[1]
    window_end = profile.duration_s
    min_end = burst_end + settings.wall(settings.min_after_sim_s)
    # The arm may stop once every Batch request sent before the burst's end has finished.
    watched = [o for o in gen.outcomes if o.req.tier is Tier.BATCH and o.req.at < burst_end]

    pids = services.pids()
    cpu_start = _cpu_by_kind(pids)
    phases = PhaseClock(session, targets if arm == "c" else [], lambda: _cpu_by_kind(pids),
                        {"calm": profile.window("baseline"), "burst": profile.window("burst")})
    with quiet_collector():
        t0 = time.perf_counter() + 0.2
        stop_monitor, stop_probe = asyncio.Event(), asyncio.Event()
        client_lag = LoopLag()
        lag_task = asyncio.create_task(client_lag.run(t0, stop_probe))
        monitor_task = asyncio.create_task(monitor.run(t0, stop_monitor))
        phase_task = asyncio.create_task(phases.run(t0, time.perf_counter))
        sender = asyncio.create_task(gen.run(session, t0))
        stopped_at = window_end
        try:
            next_line = 1.0
            while True:
                await asyncio.sleep(max(0.0, t0 + next_line - time.perf_counter()))
                now = time.perf_counter() - t0
                progress(_progress_line(arm, profile.phase_at(now), now, gen, monitor))
                next_line += 1.0
                drained = all(o.finished for o in watched)
                if now >= window_end or (now >= min_end and drained):
                    stopped_at = now
                    break
                if sender.done() and sender.exception() is not None:
                    raise sender.exception()  # type: ignore[misc]
        finally:
            # Cancelling thousands of requests holds the loop: the load is over, not measured.
            stop_probe.set()
            phase_task.cancel()
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            await gen.cancel()
            stop_monitor.set()
            await asyncio.gather(monitor_task, lag_task)
            with contextlib.suppress(asyncio.CancelledError):
                await phase_task
    elapsed = max(1e-9, time.perf_counter() - t0)
    # A process that died (a crashed node) reads 0 at the end; clamp rather than go negative.
    cpu = {kind: max(0.0, used - cpu_start.get(kind, 0.0)) / elapsed
           for kind, used in _cpu_by_kind(pids).items()}
    await monitor.sample_once()
    crashed = services.crashed_nodes()
    return ArmResult(
        arm=arm, settings=settings, outcomes=gen.outcomes, samples=monitor.samples,
        admitted=gen.stats.admitted, rejected=gen.stats.rejected, crashed_nodes=crashed,
        max_loop_lag_s=monitor.max_lag, send_lag_max_s=gen.stats.send_lag_max,
        stopped_at=stopped_at, cpu=cpu, client_lag=client_lag.per_second,
        phase_load=phases.loads(),
    )


def _progress_line(arm: str, phase: str, now: float, gen: LoadGenerator,
                   monitor: Monitor) -> str:
    parts = [f"[{arm}] {phase:<8} {now:6.1f}s"]
    for tier in Tier:
        c = gen.stats.tiers[tier]
        parts.append(f"{tier.label} {c.sent}/{c.ok}/{c.rejected_responses}/{c.failed}")
    sample = monitor.latest()
    if sample is not None:
        kv = " ".join("down" if not n.up else f"{n.kv * 100:3.0f}" for n in sample.nodes)
        parts.append(f"kv% {kv}")
        waiting = sum(int(n.waiting) for n in sample.nodes)
        queued = " ".join(f"{k[0]}{v}" for k, v in sample.queues.items())
        parts.append(f"queued {queued or '-'} eng-wait {waiting}")
        if sample.zone:
            parts.append(sample.zone)
        parts.append(f"lag {max(n.loop_lag for n in sample.nodes) * 1000:.0f}ms")
    return "  ".join(parts)


def flush_print(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
