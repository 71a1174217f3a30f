"""Admission-core benchmark: admit+settle throughput and admit latency against a local Redis.

    python -m bench.perf.core [--seconds 5] [--concurrency 64] [--rate 1000]

Starts a private redis-server, measures `redis-benchmark`'s plain SET rate on it as the
ceiling, then (1) closed-loop admit+settle pairs per second from one Python process and
(2) open-loop admits at a fixed rate, latency measured from each admit's intended send time
(so a stall is not hidden by the generator waiting for it). Writes bench/results/core.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis

from admission.outcomes import AdmitOutcome
from admission.scripts import load_scripts, register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.localredis import running_redis
from bench.common.openloop import sleep_until
from bench.common.stats import percentile

RESULTS = Path(__file__).resolve().parents[1] / "results" / "core.md"
TENANT = TenantQuota("bench", rate=10**8, burst=10**9, max_queued=10**6)


def redis_benchmark_set_rate(port: int, requests: int = 200_000, clients: int = 50) -> float:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return float("nan")
    out = subprocess.run(
        [binary, "-p", str(port), "-t", "set", "-n", str(requests), "-c", str(clients), "-q"],
        capture_output=True, text=True, check=True,
    ).stdout
    match = re.search(r"SET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    return float(match.group(1)) if match else float("nan")


async def admit_settle_pairs(store: PoolStore, seconds: float, concurrency: int,
                             label: str) -> float:
    ids = itertools.count()
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            tid = f"{label}{next(ids)}"
            result = await store.admit(task_id=tid, tenant=TENANT, tier=Tier.NORMAL,
                                       prompt_tokens=500, max_tokens=500, gateway=f"gw{w % 4}",
                                       queue_timeout_ms=60_000)
            assert result.outcome is AdmitOutcome.RELEASED, result
            await store.settle(tid, 600)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - started)


async def open_loop(
    call: Callable[[int], Awaitable[object]], rate: float, seconds: float
) -> tuple[list[float], list[float]]:
    """Fire `call(i)` at a fixed rate; latency from each call's intended send time, and the
    generator's own lag behind its schedule."""
    interval = 1.0 / rate
    total = int(rate * seconds)
    latencies: list[float] = []
    lags: list[float] = []
    running: set[asyncio.Task[None]] = set()

    async def one(i: int, intended: float) -> None:
        lags.append(time.perf_counter() - intended)
        await call(i)
        latencies.append(time.perf_counter() - intended)

    start = time.perf_counter() + 0.05
    for i in range(total):
        intended = start + i * interval
        await sleep_until(intended)
        task = asyncio.create_task(one(i, intended))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    return latencies, lags


def admit_then_settle(store: PoolStore, label: str) -> Callable[[int], Awaitable[object]]:
    """The timed call is the admit; its settle runs after, off the clock, as in the gateway."""
    settles: set[asyncio.Task[object]] = set()

    async def call(i: int) -> None:
        tid = f"{label}{i}"
        await store.admit(task_id=tid, tenant=TENANT, tier=Tier.VIP, prompt_tokens=500,
                          max_tokens=500, gateway="gw-open", queue_timeout_ms=60_000)
        settle = asyncio.create_task(store.settle(tid, 600))
        settles.add(settle)
        settle.add_done_callback(settles.discard)

    return call


async def run(seconds: float, concurrency: int, rate: float) -> str:
    with running_redis() as server:
        set_rate = redis_benchmark_set_rate(server.port)
        client = aioredis.Redis.from_url(server.url, max_connections=concurrency * 2)
        scripts = register_scripts(client)
        await load_scripts(client, scripts)
        store = PoolStore(client, scripts, "bench", PoolPolicy())
        await store.publish_state(1, Zone.GREEN, {f"n{i}": 10**12 for i in range(4)})
        print(f"redis-benchmark SET ceiling: {set_rate:,.0f} ops/s", flush=True)
        await admit_settle_pairs(store, 1.0, concurrency, "warm")
        pairs = await admit_settle_pairs(store, seconds, concurrency, "p")
        print(f"admit+settle pairs: {pairs:,.0f}/s ({concurrency} concurrent)", flush=True)
        # PING through the same client and event loop, same schedule: the floor this machine
        # and redis-py give any one-round-trip call, measured in the same run.
        ping_lat, _ = await open_loop(lambda i: client.ping(), rate, seconds)
        lat, lags = await open_loop(admit_then_settle(store, "o"), rate, seconds)
        await asyncio.sleep(0.2)
        info = await client.info("commandstats")
        await client.aclose()
    p50, p99, p999 = (percentile(lat, q) * 1000 for q in (50, 99, 99.9))
    lag99 = percentile(lags, 99) * 1000
    ping50, ping99 = (percentile(ping_lat, q) * 1000 for q in (50, 99))
    print(f"open-loop admit at {rate:.0f}/s: p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
          f"p99.9 {p999:.3f} ms ({len(lat)} admits; generator lag p99 {lag99:.3f} ms; "
          f"PING p50 {ping50:.3f} p99 {ping99:.3f} ms)",
          flush=True)
    evalsha = info.get("cmdstat_evalsha", {})
    usec_per_call = float(evalsha.get("usec_per_call", float("nan")))
    return "\n".join([
        "# Admission core benchmark",
        "",
        f"`python -m bench.perf.core --seconds {seconds:g} --concurrency {concurrency} "
        f"--rate {rate:g}` on {platform.machine()}, Python {platform.python_version()}, "
        f"one process, private redis-server.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| redis-benchmark plain SET (ceiling, same server) | {set_rate:,.0f} ops/s |",
        f"| admit+settle pairs/s, {concurrency} concurrent, one process | {pairs:,.0f} |",
        f"| pairs/s as a share of the SET ceiling (2 scripts per pair) | "
        f"{2 * pairs / set_rate:.1%} |",
        f"| Redis CPU per script call (EVALSHA usec_per_call) | {usec_per_call:.1f} µs |",
        f"| admit latency at {rate:.0f}/s open loop, p50 | {p50:.3f} ms |",
        f"| admit latency p99 | {p99:.3f} ms |",
        f"| admit latency p99.9 | {p999:.3f} ms |",
        f"| load generator's own lag behind schedule, p99 (included above) | {lag99:.3f} ms |",
        f"| PING at the same rate, same client (floor), p50 / p99 | {ping50:.3f} / "
        f"{ping99:.3f} ms |",
        f"| admit p99 / PING p99 | {p99 / ping99:.2f}x |",
        "",
        f"Load average at the end of the run: {os.getloadavg()[0]:.2f} on "
        f"{os.cpu_count()} cores (other work on the machine shows up in the tail).",
        "",
        "Targets: at least 5,000 pairs/s from one process; admit p99 at most 1 ms "
        "at 1,000/s.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    report = asyncio.run(run(args.seconds, args.concurrency, args.rate))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(report)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
