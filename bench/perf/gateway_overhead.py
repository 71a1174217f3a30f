"""What the gateway adds to a request: instant backend direct vs through one gateway process.

    python -m bench.perf.gateway_overhead [--duration 15] [--sweep 500,750,1000,...] [--output FILE]

Everything runs as separate processes on loopback: a private redis-server, the instant
backend (`bench.common.instant_backend`), one gateway (`python -m gateway`) and the load generator.
Before measuring, a one-off "scheduler step" publishes GREEN with a large capacity for the
node, so every request takes the fast path (one admit call; the settle runs after the
response). The pool's staleness check is off, since no scheduler refreshes the state.

The load is open loop: request i is due at t0 + i / rate (fixed rate, or Poisson with
--poisson) whether or not earlier ones have finished, and its latency is measured from that
intended send time, so a stall shows up in the tail instead of silently lowering the rate
(coordinated omission). The generator is a separate process with a minimal keep-alive
HTTP/1.1 client (tens of microseconds per request) and as many connections as the load needs.

Reported: latency percentiles direct and through the gateway at 200 RPS (added p50, p99),
and the highest rate the gateway sustains (achieved >= 98% of offered, no errors, p99 <= 20 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.perf.httpload import (
    Phase,
    highest_sustained,
    publish_state_once,
    run_phase,
    start_server,
    stop_processes,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-bench-overhead"
POOL = "demo"
BODY = {
    "model": POOL,
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
}
P99_LIMIT_MS = 20.0
TARGETS = {"p50_added_ms": 1.0, "p99_added_ms": 3.0, "sustained_rps": 1000}
NOTES = [
    "## How these figures were reached (profile notes)",
    "",
    "CPU per request is measured from /proc for each server process over each phase (the "
    "columns above). The first version of the gateway cost about 850 µs of CPU per request at"
    " 500 RPS and missed the sustained-rate target (p99 from 21 to 165 ms at 1,000 RPS over "
    "three runs). py-spy and cProfile of the gateway under load, and timing each part alone, "
    "showed the two script calls through redis-py at about 90 µs of CPU each (connection "
    "taken from and returned to the blocking pool, command packing, retry and timeout "
    "wrappers), the upstream aiohttp client at about 100 µs, the aiohttp server side at about"
    " 200 µs, and the gateway's own logic (auth, body parse, token count from cache, metrics)"
    " at about 15 µs. Changes: script calls go through one multiplexed Redis connection "
    "(`gateway/redismux.py`: calls overlap on it and replies are matched in order, parsed by "
    "hiredis; no pool), metric children are cached, the upstream session has no cookie"
    " jar or decompression, and objects built at start are frozen out of the garbage "
    "collector. Result: about 500 µs per request at 1,000 RPS.",
    "",
    "Second round, on a machine about 1.7x slower (CPython loop and redis-benchmark "
    "yardsticks): py-spy at 800 RPS put the hop to the node (aiohttp's client: session, "
    "request and response objects, header multidicts, a timer and a stream reader per call) "
    "at 28% of the gateway's samples. It is now `gateway/nodeclient.py`: kept-alive "
    "connections, llhttp through httptools, one quiet-read timer per request, flow control; "
    "878 -> 688 µs of gateway CPU per request at 800 RPS, and 1,000-1,500 RPS sustained "
    "where 500-750 were before on the same machine. Smaller items from the same profile: "
    "pool keys built once per store, tier labels precomputed, task ids cut from a 4 KB "
    "block of urandom (one system call per 512 ids). What remains is aiohttp's server side "
    "and the event loop's socket work (about half of the samples), and the two script calls.",
    "",
    "The machine has 2 CPUs shared by all four processes, so the sweep's upper rates measure "
    "the machine as much as the gateway, and they move with whatever else runs on it: in a "
    "quiet run every rate up to 2,500 RPS passed (p99 5.4 ms at 1,500), while runs that "
    "overlapped other jobs failed at 1,000 to 1,500 RPS. The 200 RPS figures moved less "
    "(added p50 0.66 to 0.93 ms, added p99 0.9 to 1.7 ms over four runs).",
    "",
]


def gateway_config(redis_url: str, backend_port: int, gateway_lines: str = "") -> str:
    """One pool on the instant backend, one VIP tenant with limits no benchmark reaches, the
    staleness check off (no scheduler refreshes the state)."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
[redis]
url = "{redis_url}"
max_connections = 64

[gateway]
access_log = false
{gateway_lines}

[[pools]]
name = "{POOL}"
stale_after_ms = 0
backends = [{{ name = "node-0", url = "http://127.0.0.1:{backend_port}" }}]

[[tenants]]
name = "bench"
tier = "vip"
key_sha256 = ["{digest}"]
rate = 1000000000
burst = 1000000000
max_queued = 1000
"""


async def _stats(redis_url: str) -> dict[str, int]:
    import redis.asyncio as aioredis

    from admission.keys import PoolKeys

    client = aioredis.Redis.from_url(redis_url)
    try:
        raw = await client.hgetall(PoolKeys(POOL).stats)
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    finally:
        await client.aclose()


def _table(phases: list[Phase]) -> list[str]:
    rows = ["| target | offered RPS | achieved RPS | errors | p50 ms | p90 ms | p99 ms | "
            "p99.9 ms | max ms | CPU µs/req gateway | backend | redis |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in phases:
        cpu = [f"{p.cpu_us[k]:.0f}" if k in p.cpu_us else "-"
               for k in ("gateway", "backend", "redis")]
        rows.append(
            f"| {p.target} | {p.rate:.0f} | {p.achieved_rps:.0f} | "
            f"{sum(p.errors.values()) or 0} | {p.p50:.3f} | {p.p90:.3f} | {p.p99:.3f} | "
            f"{p.p999:.3f} | {p.max:.2f} | {' | '.join(cpu)} |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.gateway_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=15.0, help="seconds per 200 RPS phase")
    p.add_argument("--sweep-duration", type=float, default=8.0)
    p.add_argument("--sweep", default="500,750,1000,1250,1500,1750,2000,2500")
    p.add_argument("--poisson", action="store_true")
    p.add_argument("--output", default=str(ROOT / "bench/results/gateway_overhead.md"))
    args = p.parse_args(argv)

    from bench.common.localredis import start_redis

    redis = start_redis()
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-overhead-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        backend, backend_port = start_server(
            [sys.executable, "-m", "bench.common.instant_backend", "--port", "0", "--model", POOL],
            "listening on")
        procs.append(backend)
        config = workdir / "gateway.toml"
        config.write_text(gateway_config(redis.url, backend_port))
        asyncio.run(publish_state_once(redis.url, [POOL]))
        gateway, gateway_port = start_server(
            [sys.executable, "-m", "gateway", "--config", str(config), "--port", "0",
             "--log-level", "WARNING"], "listening on")
        procs.append(gateway)
        pids = {"gateway": gateway.pid, "backend": backend.pid, "redis": redis.process.pid}
        direct_pids = {"backend": backend.pid}
        print("warm-up", flush=True)
        run_phase("direct", [backend_port], 200, 3, args.poisson, direct_pids)
        run_phase("gateway", [gateway_port], 200, 3, args.poisson, pids)
        print("200 RPS", flush=True)
        direct = run_phase("direct", [backend_port], 200, args.duration, args.poisson,
                           direct_pids)
        through = run_phase("gateway", [gateway_port], 200, args.duration, args.poisson, pids)
        print("sweep", flush=True)
        sweep: list[Phase] = []
        failures = 0
        for rate in (float(r) for r in args.sweep.split(",")):
            sweep.append(run_phase("direct", [backend_port], rate, args.sweep_duration,
                                   args.poisson, direct_pids))
            phase = run_phase("gateway", [gateway_port], rate, args.sweep_duration, args.poisson,
                               pids)
            sweep.append(phase)
            failures += not phase.sustained(P99_LIMIT_MS)
            if failures >= 2:
                break
        stats = asyncio.run(_stats(redis.url))
    finally:
        stop_processes(procs)
        redis.stop()
        shutil.rmtree(redis.workdir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)

    sustained = highest_sustained(sweep, "gateway", P99_LIMIT_MS)
    direct_sustained = highest_sustained(sweep, "direct", P99_LIMIT_MS)
    added_p50 = through.p50 - direct.p50
    added_p99 = through.p99 - direct.p99
    met = {
        "p50": added_p50 <= TARGETS["p50_added_ms"],
        "p99": added_p99 <= TARGETS["p99_added_ms"],
        "rps": sustained >= TARGETS["sustained_rps"],
    }
    lines = [
        "# Gateway overhead",
        "",
        f"`python -m bench.perf.gateway_overhead` on {time.strftime('%Y-%m-%d')}: Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs ({platform.machine()}); "
        "redis-server, instant backend, one gateway process and the load generator all on "
        "this machine, separate processes, loopback.",
        "",
        "Open loop (" + ("Poisson" if args.poisson else "fixed-rate")
        + " schedule, latency from the intended send time), non-streaming chat completion "
        "(2 messages, max_tokens 16), VIP tenant, fast path (GREEN, large capacity). "
        f"Fast-path admits during the run: {stats.get('fast_path', 0)}, settled: "
        f"{stats.get('settled', 0)}.",
        "",
        f"## At 200 RPS ({args.duration:.0f} s each)",
        "",
        *_table([direct, through]),
        "",
        f"Added by the gateway: **p50 {added_p50:.3f} ms** (target <= 1 ms: "
        f"{'met' if met['p50'] else 'missed'}), **p99 {added_p99:.3f} ms** (target <= 3 ms: "
        f"{'met' if met['p99'] else 'missed'}).",
        "",
        f"## Sweep ({args.sweep_duration:.0f} s per rate)",
        "",
        *_table(sweep),
        "",
        f"Highest rate sustained through the gateway (achieved >= 98% of offered, no errors, "
        f"p99 <= {P99_LIMIT_MS:.0f} ms, and so at every lower rate of the sweep): "
        f"**{sustained:.0f} RPS** (target >= 1,000: "
        f"{'met' if met['rps'] else 'missed'}); direct to the backend: "
        f"{direct_sustained:.0f} RPS.",
        "",
        *NOTES,
    ]
    Path(args.output).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
