"""What the gateway adds to a request: instant backend direct vs through one gateway process.

    python -m bench.gateway_overhead [--duration 15] [--sweep 500,750,1000,...] [--output FILE]

Everything runs as separate processes on loopback: a private redis-server, the instant
backend (`bench.instant_backend`), one gateway (`python -m gateway`) and the load generator.
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
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
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
    "The machine has 2 CPUs shared by all four processes, so the sweep's upper rates measure "
    "the machine as much as the gateway, and they move with whatever else runs on it: in a "
    "quiet run every rate up to 2,500 RPS passed (p99 5.4 ms at 1,500), while runs that "
    "overlapped other jobs failed at 1,000 to 1,500 RPS. The 200 RPS figures moved less "
    "(added p50 0.66 to 0.93 ms, added p99 0.9 to 1.7 ms over four runs).",
    "",
]


# -- load generator (runs in its own process) ------------------------------------------------

class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer


async def _exchange(conn: _Conn, request: bytes) -> int:
    conn.writer.write(request)
    head = await conn.reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        raise ValueError("response without Content-Length")
    end = lower.index(b"\r\n", at + 2)
    length = int(lower[at + 17:end])
    await conn.reader.readexactly(length)
    return status


async def _loadgen(host: str, port: int, path: str, rate: float, duration: float,
                   poisson: bool, seed: int) -> dict[str, Any]:
    body = orjson.dumps(BODY)
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    idle: list[_Conn] = []
    for _ in range(32):
        idle.append(_Conn(*await asyncio.open_connection(host, port)))
    latencies: list[float] = []
    errors: dict[str, int] = {}
    # Not loop.time(): uvloop's clock has millisecond resolution.
    clock = time.perf_counter
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()

    async def one(due: float) -> None:
        conn = idle.pop() if idle else _Conn(*await asyncio.open_connection(host, port))
        try:
            status = await _exchange(conn, request)
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            conn.writer.close()
            return
        latencies.append((clock() - due) * 1000)
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
        idle.append(conn)

    rng = random.Random(seed)
    n = int(rate * duration)
    start = clock() + 0.05
    due = start
    late_max = 0.0
    for _ in range(n):
        wait = due - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            late_max = max(late_max, -wait)
        task = loop.create_task(one(due))
        pending.add(task)
        task.add_done_callback(pending.discard)
        due += rng.expovariate(rate) if poisson else 1.0 / rate
    sent_span = clock() - start
    if pending:
        await asyncio.wait(pending, timeout=30)
    for conn in idle:
        conn.writer.close()
    return {"latencies_ms": latencies, "errors": errors, "offered": n,
            "send_span_s": sent_span, "duration_s": duration, "late_max_ms": late_max * 1000}


def _loadgen_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_overhead loadgen")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--poisson", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True, help="file to write the JSON result to")
    args = p.parse_args(argv)
    coro = _loadgen(args.host, args.port, args.path, args.rate, args.duration, args.poisson,
                    args.seed)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    Path(args.out).write_text(json.dumps(result))
    return 0


# -- orchestration ------------------------------------------------------------------------------

@dataclass
class Phase:
    target: str
    rate: float
    offered: int
    completed: int
    errors: dict[str, int]
    achieved_rps: float
    p50: float
    p90: float
    p99: float
    p999: float
    max: float
    late_max_ms: float
    cpu_us: dict[str, float]
    """CPU time per completed request of each server process (user + system), µs."""

    @property
    def sustained(self) -> bool:
        return (not self.errors and self.completed >= 0.98 * self.offered
                and self.p99 <= P99_LIMIT_MS)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_phase(target: str, port: int, rate: float, duration: float, poisson: bool,
               pids: dict[str, int]) -> Phase:
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run(
            [sys.executable, "-m", "bench.gateway_overhead", "loadgen", "--port", str(port),
             "--rate", str(rate), "--duration", str(duration), "--out", result.name,
             *(["--poisson"] if poisson else [])],
            cwd=ROOT, check=True, timeout=duration + 120,
        )
        cpu = {name: _cpu_s(pid) - before[name] for name, pid in pids.items()}
        data = json.loads(Path(result.name).read_text())
    lat: list[float] = data["latencies_ms"]
    ok = len(lat) - sum(v for k, v in data["errors"].items() if k.isdigit())
    if target == "direct":
        cpu.pop("gateway", None)
        cpu.pop("redis", None)
    phase = Phase(
        target=target, rate=rate, offered=data["offered"], completed=ok,
        errors=data["errors"], achieved_rps=ok / data["duration_s"],
        p50=_pct(lat, 0.50), p90=_pct(lat, 0.90), p99=_pct(lat, 0.99), p999=_pct(lat, 0.999),
        max=max(lat) if lat else float("nan"), late_max_ms=data["late_max_ms"],
        cpu_us={name: seconds * 1e6 / max(1, len(lat)) for name, seconds in cpu.items()},
    )
    print(f"  {target:8s} {rate:7.0f} rps: done {phase.completed}/{phase.offered} "
          f"p50 {phase.p50:.3f} p99 {phase.p99:.3f} max {phase.max:.2f} ms "
          f"errors {phase.errors or '-'} cpu us/req "
          + " ".join(f"{k} {v:.0f}" for k, v in phase.cpu_us.items()), flush=True)
    return phase


def _start(cmd: list[str], marker: str, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if marker not in line:
        proc.kill()
        raise RuntimeError(f"{cmd[2]} did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def _config(redis_url: str, backend_port: int) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
[redis]
url = "{redis_url}"
max_connections = 64

[gateway]
access_log = false

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


async def _scheduler_step(redis_url: str) -> None:
    """Publish GREEN with a large capacity, as the scheduler would on its first tick."""
    import redis.asyncio as aioredis

    from admission.scripts import register_scripts
    from admission.store import PoolStore
    from admission.tiers import Zone

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = PoolStore(client, register_scripts(client), POOL, _policy())
        await store.publish_state(1, Zone.GREEN, {"node-0": 1_000_000_000})
    finally:
        await client.aclose()


async def _stats(redis_url: str) -> dict[str, int]:
    import redis.asyncio as aioredis

    from admission.keys import PoolKeys

    client = aioredis.Redis.from_url(redis_url)
    try:
        raw = await client.hgetall(PoolKeys(POOL).stats)
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    finally:
        await client.aclose()


def _policy() -> Any:
    from admission.store import PoolPolicy

    return PoolPolicy(stale_after_ms=0)


def _sustained(sweep: list[Phase], target: str) -> float:
    """The highest rate that passed, every lower rate of the sweep having passed too."""
    best = 0.0
    for phase in sweep:
        if phase.target != target:
            continue
        if not phase.sustained:
            break
        best = phase.rate
    return best


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "loadgen":
        return _loadgen_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.gateway_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=15.0, help="seconds per 200 RPS phase")
    p.add_argument("--sweep-duration", type=float, default=8.0)
    p.add_argument("--sweep", default="500,750,1000,1250,1500,1750,2000,2500")
    p.add_argument("--poisson", action="store_true")
    p.add_argument("--output", default=str(ROOT / "bench/results/gateway_overhead.md"))
    args = p.parse_args(argv)

    from admission.localredis import start_redis

    redis = start_redis()
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-overhead-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        backend, backend_port = _start(
            [sys.executable, "-m", "bench.instant_backend", "--port", "0", "--model", POOL],
            "listening on")
        procs.append(backend)
        config = workdir / "gateway.toml"
        config.write_text(_config(redis.url, backend_port))
        asyncio.run(_scheduler_step(redis.url))
        gateway, gateway_port = _start(
            [sys.executable, "-m", "gateway", "--config", str(config), "--port", "0",
             "--log-level", "WARNING"], "listening on")
        procs.append(gateway)
        pids = {"gateway": gateway.pid, "backend": backend.pid, "redis": redis.process.pid}
        print("warm-up", flush=True)
        _run_phase("direct", backend_port, 200, 3, args.poisson, pids)
        _run_phase("gateway", gateway_port, 200, 3, args.poisson, pids)
        print("200 RPS", flush=True)
        direct = _run_phase("direct", backend_port, 200, args.duration, args.poisson, pids)
        through = _run_phase("gateway", gateway_port, 200, args.duration, args.poisson, pids)
        print("sweep", flush=True)
        sweep: list[Phase] = []
        failures = 0
        for rate in (float(r) for r in args.sweep.split(",")):
            sweep.append(_run_phase("direct", backend_port, rate, args.sweep_duration,
                                    args.poisson, pids))
            phase = _run_phase("gateway", gateway_port, rate, args.sweep_duration, args.poisson,
                               pids)
            sweep.append(phase)
            failures += not phase.sustained
            if failures >= 2:
                break
        stats = asyncio.run(_stats(redis.url))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()
        shutil.rmtree(redis.workdir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)

    sustained = _sustained(sweep, "gateway")
    direct_sustained = _sustained(sweep, "direct")
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
        f"`python -m bench.gateway_overhead` on {time.strftime('%Y-%m-%d')}: Python "
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
