"""Scheduler release throughput and release latency, against a real `python -m scheduler`.

    python -m bench.perf.scheduler_release [--tasks N] [--samples N] [--poll-ms MS] [--output FILE]

Everything is real except the GPUs: a private redis-server, the scheduler as its own process
(default configuration but for the pools), vLLM-format /metrics served from a thread of this
process, and this process playing the gateways (admit, wake-up subscription, settle).

- Throughput: N tasks wait in the queue of a 4-node pool whose nodes report a full cache;
  then the nodes report an empty one, and we time from that moment to the last wake-up the
  gateway receives (the scheduler's release batches, one script call per pool per tick, with
  the pub/sub notification of every task). Target: >= 5,000 tasks/s.
- Latency: a 1-node pool kept exactly full (every reservation equals what the budget allows)
  with a backlog queued behind; at Poisson times the gateway settles one running task, which
  frees room for exactly one queued task. Latency is from the settle call's start (capacity
  freeing, measured pessimistically) to the wake-up for the task that took the room, pairing
  settles and wake-ups in FIFO order. Target: p99 <= poll interval + 10 ms. Meanwhile the
  throughput pool keeps `--running` of its tasks in flight (default 4,096: four nodes at
  vLLM's largest default max_num_seqs) and the rest are settled: under the "peak" projection
  (`--projection peak`) the leader reads and projects every task in flight on every tick, so
  that count is part of the tick's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier
from bench.common.localredis import LocalRedis, free_port, start_redis

ROOT = Path(__file__).resolve().parents[2]
TENANT = TenantQuota("bench", rate=1_000_000_000, burst=1_000_000_000, max_queued=10_000_000)
POLICY = PoolPolicy(tier_queue_caps=(1_000_000, 1_000_000, 1_000_000), lease_ttl_ms=600_000)
GATEWAY = "gw-bench"
RUNNING_DEFAULT = 4_096
"""Throughput tasks still running during the latency phase: 4 nodes at vLLM V1's largest
default max_num_seqs (1,024, on >= 70 GiB GPUs), the most a real pool of 4 runs at once."""


# --- vLLM-format /metrics for many nodes, served from a thread --------------------------------


@dataclass
class StubNode:
    usage: float
    blocks: int


class MetricsStub:
    """One HTTP server, one path per node (`/<node>/metrics`), values set from any thread."""

    def __init__(self, nodes: dict[str, StubNode]) -> None:
        self.nodes = nodes
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.port}/{node}"

    def _render(self, node: StubNode) -> str:
        labels = 'engine="0",model_name="bench"'
        return (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {node.usage}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} 0.0\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{node.blocks}"}}'
            " 1.0\n"
        )

    async def _handler(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["node"])
        if node is None:
            return web.Response(status=404)
        return web.Response(text=self._render(node), content_type="text/plain")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/{node}/metrics", self._handler)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> MetricsStub:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --- the scheduler process ----------------------------------------------------------------


def write_config(path: Path, redis_url: str, stub: MetricsStub, poll_ms: int,
                 projection: str | None = None) -> None:
    """`projection` None: the project's default."""
    tp_nodes = [n for n in stub.nodes if n.startswith("tp")]
    projection_line = f'projection = "{projection}"\n' if projection else ""
    lines = [
        f'[redis]\nurl = "{redis_url}"\n',
        f"[scheduler]\npoll_interval_ms = {poll_ms}\n",
        f'[[pools]]\nname = "tp"\n[pools.zones]\n{projection_line}',
    ]
    for node in tp_nodes:
        lines.append(f'[[pools.backends]]\nname = "{node}"\nurl = "{stub.url(node)}"\n')
    # The latency pool runs full by design (every token of its budget reserved): thresholds
    # above its target keep it GREEN so that Normal is not metered by the YELLOW rate.
    lines.append('[[pools]]\nname = "lat"\n[pools.zones]\nyellow = 0.85\nred = 0.95\n'
                 + projection_line)
    lines.append(f'[[pools.backends]]\nname = "lat0"\nurl = "{stub.url("lat0")}"\n')
    path.write_text("\n".join(lines))


@contextlib.contextmanager
def scheduler_process(config: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "--config", str(config), "--id", "bench",
         "--port", str(free_port()), "--log-level", "WARNING"],
        cwd=ROOT, env=env,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


class Wakeups:
    """The gateway's subscription: arrival time of every wake-up, in order, of the tasks whose
    id starts with `prefix`."""

    def __init__(self, client: Any, store: PoolStore, prefix: str = "") -> None:
        self.pubsub = client.pubsub()
        self.channel = store.keys.wake_channel(GATEWAY)
        self.prefix = prefix
        self.arrivals: list[tuple[float, str]] = []
        self.event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.pubsub.subscribe(self.channel)
        self.task = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        async for message in self.pubsub.listen():
            if message["type"] == "message":
                data = message["data"].decode()
                if data.startswith(self.prefix):
                    self.arrivals.append((time.perf_counter(), data))
                    self.event.set()

    async def wait_count(self, n: int, timeout_s: float) -> None:
        """Until `n` wake-ups have arrived; raises TimeoutError."""
        async with asyncio.timeout(timeout_s):
            while len(self.arrivals) < n:
                self.event.clear()
                await self.event.wait()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.pubsub.aclose()


async def admit_many(
    store: PoolStore, ids: list[str], cost: int, tier: Tier = Tier.NORMAL
) -> dict[AdmitOutcome, int]:
    outcomes: dict[AdmitOutcome, int] = {}

    async def one(task_id: str) -> None:
        r = await store.admit(task_id=task_id, tenant=TENANT, tier=tier,
                              prompt_tokens=cost // 2, max_tokens=cost - cost // 2,
                              gateway=GATEWAY, queue_timeout_ms=3_600_000)
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1

    for i in range(0, len(ids), 256):
        await asyncio.gather(*(one(t) for t in ids[i:i + 256]))
    return outcomes


# --- the two measurements -------------------------------------------------------------------


async def throughput(client: Any, stub: MetricsStub, tasks: int) -> dict[str, float]:
    store = PoolStore(client, register_scripts(client), "tp", POLICY)
    wake = Wakeups(client, store)
    await wake.start()
    # The nodes report a full cache: the scheduler publishes no room, so everything queues
    # (as VIP: a full pool is RED, where Normal and Batch would be turned away).
    outcomes = await admit_many(store, [f"tp{i}" for i in range(tasks)], 100, Tier.VIP)
    assert outcomes == {AdmitOutcome.QUEUED: tasks}, outcomes
    start = time.perf_counter()
    for node in stub.nodes.values():
        node.usage = 0.0
    await wake.wait_count(tasks, 60)
    first, last = wake.arrivals[0][0], wake.arrivals[-1][0]
    ids = [a[1].split(" ")[0] for a in wake.arrivals]
    await wake.stop()
    assert len(set(ids)) == tasks, "a task was woken twice"
    # Bursts: wake-ups more than 5 ms apart belong to different ticks.
    bursts = 1 + sum(1 for a, b in zip(wake.arrivals, wake.arrivals[1:], strict=False)
                     if b[0] - a[0] > 0.005)
    return {
        "tasks": tasks,
        "first_wakeup_ms": (first - start) * 1000,
        "total_s": last - start,
        "rate_from_capacity": tasks / (last - start),
        "rate_while_releasing": tasks / max(1e-9, last - first),
        "bursts": bursts,
    }


async def latency(client: Any, samples: int, rate: float, poll_ms: int) -> dict[str, float]:
    store = PoolStore(client, register_scripts(client), "lat", POLICY)
    cost = 1_000
    fits = 78  # 0.78 x 100,000 tokens / 1,000: the budget holds exactly this many
    backlog = samples + 200
    # Fill the node first (fast path or the next release), then queue the backlog behind it.
    outcomes = await admit_many(store, [f"run{i}" for i in range(fits)], cost)
    # Only the backlog's wake-ups: those of the first tasks, when the scheduler rather than the
    # fast path released them (pool state not yet published; a loaded machine), may still be
    # arriving, and must neither fail the check below nor pair with a settle.
    wake = Wakeups(client, store, prefix="q")
    await wake.start()

    async def all_running() -> bool:
        reserved = await client.hget(store.keys.node_reserved, "lat0")
        return int(reserved or 0) == fits * cost

    await wait_for(all_running, 10, f"the first {fits} tasks never ran ({outcomes})")
    ids = [f"q{i}" for i in range(backlog)]
    for i in range(0, backlog, 256):  # one admit at a time keeps FIFO order = id order
        for task_id in ids[i:i + 256]:
            await store.admit(task_id=task_id, tenant=TENANT, tier=Tier.NORMAL,
                              prompt_tokens=cost // 2, max_tokens=cost - cost // 2,
                              gateway=GATEWAY, queue_timeout_ms=3_600_000)
    assert not wake.arrivals, "a queued task was released while the node was full"
    running = [f"run{i}" for i in range(fits)]
    seen = 0
    settle_times: list[float] = []
    rng = random.Random(7)
    next_at = time.perf_counter()
    for _ in range(samples):
        next_at += rng.expovariate(rate)
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        # Tasks woken so far are running now; settle the oldest running one.
        running.extend(a[1].split(" ")[0] for a in wake.arrivals[seen:])
        seen = len(wake.arrivals)
        task_id = running.pop(0)
        settle_times.append(time.perf_counter())
        # usage == cost keeps the learned ratio at 1: the budget stays exactly `fits` tasks.
        await store.settle(task_id, cost)
    with contextlib.suppress(TimeoutError):
        await wake.wait_count(samples, 5)
    await wake.stop()
    released = [a[1].split(" ")[0] for a in wake.arrivals]
    assert released == ids[:len(released)], "release order is not FIFO"
    lat = sorted((t - s) * 1000 for (t, _), s in zip(wake.arrivals, settle_times, strict=False))
    q = statistics.quantiles(lat, n=100)
    return {
        "samples": len(lat),
        "p50_ms": q[49],
        "p90_ms": q[89],
        "p99_ms": q[98],
        "max_ms": lat[-1],
        "mean_ms": statistics.fmean(lat),
        "target_ms": poll_ms + 10,
    }


def _report(tp: dict[str, float], lat: dict[str, float], args: argparse.Namespace) -> str:
    ok_tp = "met" if tp["rate_from_capacity"] >= 5_000 else "MISSED"
    ok_lat = "met" if lat["p99_ms"] <= lat["target_ms"] else "MISSED"
    projection = f" --projection {args.projection}" if args.projection else ""
    return f"""# Scheduler release benchmark

`python -m bench.perf.scheduler_release --tasks {args.tasks} --samples {args.samples} \
--poll-ms {args.poll_ms} --running {args.running}{projection}` on {platform.machine()}, \
{os.cpu_count()} CPUs, Python \
{platform.python_version()}, {platform.system()}. Real redis-server and a real
`python -m scheduler` process (poll interval {args.poll_ms} ms, release batch 2,000 per tick);
vLLM nodes are /metrics stubs; this process plays the gateways. See the module docstring for
the method.

## Release throughput (target >= 5,000 tasks/s: {ok_tp})

| figure | value |
|---|---|
| tasks queued, then capacity freed on 4 nodes | {tp['tasks']:,} |
| first wake-up after capacity freed | {tp['first_wakeup_ms']:.1f} ms |
| all woken after capacity freed | {tp['total_s'] * 1000:.0f} ms |
| **throughput, capacity freed to last wake-up** | **{tp['rate_from_capacity']:,.0f} tasks/s** |
| throughput while releasing (first to last wake-up) | {tp['rate_while_releasing']:,.0f} tasks/s |
| release bursts (ticks) | {tp['bursts']:.0f} |

## Release latency, capacity freed to gateway woken (target p99 <= {lat['target_ms']:.0f} ms: \
{ok_lat})

| figure | value |
|---|---|
| samples (Poisson settles, {args.rate:.0f}/s) | {lat['samples']:.0f} |
| p50 | {lat['p50_ms']:.1f} ms |
| p90 | {lat['p90_ms']:.1f} ms |
| **p99** | **{lat['p99_ms']:.1f} ms** |
| max | {lat['max_ms']:.1f} ms |
| mean | {lat['mean_ms']:.1f} ms |

A release waits for the next tick, so latency is spread evenly over one poll interval (mean
about half of it) plus the tick's own work: a scrape of every node, one pipelined read, the
state write, the release script and the wake-up. Projection of both pools:
{args.projection or "the default"}; tasks in flight in the throughput pool meanwhile:
{args.running:,} (read and projected on every tick under "peak").
"""


async def settle_all_but(client: Any, tasks: int, running: int) -> None:
    """End the throughput pool's tasks but `running` of them, as their requests would have.

    They stay released otherwise, and the scheduler keeps every released task of a pool in
    its view: with the "peak" projection it reads and projects them all on every tick."""
    store = PoolStore(client, register_scripts(client), "tp", POLICY)
    ids = [f"tp{i}" for i in range(running, tasks)]
    for i in range(0, len(ids), 512):
        await asyncio.gather(*(store.settle(task_id, 100) for task_id in ids[i:i + 512]))


async def measure(
    tasks: int = 20_000, samples: int = 600, rate: float = 50.0, poll_ms: int = 50,
    projection: str | None = None, running: int = RUNNING_DEFAULT,
) -> tuple[dict[str, float], dict[str, float]]:
    """(throughput, latency) figures, as the two functions above return them."""
    nodes = {f"tp{i}": StubNode(usage=1.0, blocks=62_500) for i in range(4)}
    nodes["lat0"] = StubNode(usage=0.0, blocks=6_250)
    server: LocalRedis = start_redis()
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-sched-"))
    try:
        with MetricsStub(nodes) as stub:
            config = workdir / "bench.toml"
            write_config(config, server.url, stub, poll_ms, projection)
            pool = aioredis.BlockingConnectionPool.from_url(server.url, max_connections=64)
            client = aioredis.Redis.from_pool(pool)
            try:
                with scheduler_process(config):
                    async def leading() -> bool:
                        return bool(await client.hget("kvg:{tp}:state", "epoch"))

                    await wait_for(leading, 20, "the scheduler never published state")
                    tp = await throughput(client, stub, tasks)
                    await settle_all_but(client, tasks, running)
                    lat = await latency(client, samples, rate, poll_ms)
            finally:
                await client.aclose()
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return tp, lat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.scheduler_release")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--rate", type=float, default=50.0, help="settles per second")
    parser.add_argument("--poll-ms", type=int, default=50)
    parser.add_argument("--projection", choices=("final", "peak"),
                        help="zones.projection of both pools (default: the project's)")
    parser.add_argument("--running", type=int, default=RUNNING_DEFAULT,
                        help="throughput tasks left running through the latency phase")
    parser.add_argument("--output", default=str(ROOT / "bench/results/scheduler_release.md"))
    args = parser.parse_args(argv)
    tp, lat = asyncio.run(measure(args.tasks, args.samples, args.rate, args.poll_ms,
                                  args.projection, args.running))
    report = _report(tp, lat, args)
    Path(args.output).write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
