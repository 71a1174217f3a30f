"""An open-loop HTTP load generator and the phase runner the performance benchmarks share.

    python -m bench.perf.httpload --port P [--port P2 ...] --rate R --duration S --out FILE
        [--key K] [--body-file F] [--path /v1/chat/completions] [--poisson]

The generator runs in its own process with a minimal keep-alive HTTP/1.1 client (tens of
microseconds per request), so its own cost stays out of the measured servers' CPU. Request i is
due at t0 + i / rate (or on a Poisson schedule) whether or not earlier ones have finished, and
its latency is measured from that intended send time: a stall shows in the tail instead of
silently lowering the rate (coordinated omission). With several ports, requests go round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_KEY = "sk-bench-overhead"
DEFAULT_BODY: dict[str, Any] = {
    "model": "demo",
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
}
INITIAL_CONNECTIONS = 32


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


async def loadgen(host: str, ports: Sequence[int], path: str, rate: float, duration: float,
                  poisson: bool, seed: int, key: str = DEFAULT_KEY,
                  body: Mapping[str, Any] = DEFAULT_BODY) -> dict[str, Any]:
    """Send rate x duration requests on schedule; latencies in ms from the intended time."""
    payload = orjson.dumps(body)
    requests = [
        (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
         f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
         ).encode() + payload
        for port in ports
    ]
    idle: list[list[_Conn]] = [[] for _ in ports]
    for i, port in enumerate(ports):
        for _ in range(max(1, INITIAL_CONNECTIONS // len(ports))):
            idle[i].append(_Conn(*await asyncio.open_connection(host, port)))
    latencies: list[float] = []
    errors: dict[str, int] = {}
    # Not loop.time(): uvloop's clock has millisecond resolution.
    clock = time.perf_counter
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()

    async def one(due: float, target: int) -> None:
        pool = idle[target]
        conn = pool.pop() if pool else _Conn(*await asyncio.open_connection(host, ports[target]))
        try:
            status = await _exchange(conn, requests[target])
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            conn.writer.close()
            return
        latencies.append((clock() - due) * 1000)
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
        pool.append(conn)

    rng = random.Random(seed)
    n = int(rate * duration)
    start = clock() + 0.05
    due = start
    late_max = 0.0
    for i in range(n):
        wait = due - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            late_max = max(late_max, -wait)
        task = loop.create_task(one(due, i % len(ports)))
        pending.add(task)
        task.add_done_callback(pending.discard)
        due += rng.expovariate(rate) if poisson else 1.0 / rate
    sent_span = clock() - start
    if pending:
        await asyncio.wait(pending, timeout=30)
    for pool in idle:
        for conn in pool:
            conn.writer.close()
    return {"latencies_ms": latencies, "errors": errors, "offered": n,
            "send_span_s": sent_span, "duration_s": duration, "late_max_ms": late_max * 1000}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.httpload", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, action="append", required=True)
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--poisson", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--key", default=DEFAULT_KEY)
    p.add_argument("--body-file", help="JSON request body (default: a short chat)")
    p.add_argument("--out", required=True, help="file to write the JSON result to")
    args = p.parse_args(argv)
    body = json.loads(Path(args.body_file).read_text()) if args.body_file else DEFAULT_BODY
    coro = loadgen(args.host, args.port, args.path, args.rate, args.duration, args.poisson,
                   args.seed, args.key, body)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    Path(args.out).write_text(json.dumps(result))
    return 0


# -- measuring a phase ---------------------------------------------------------------------------

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

    def sustained(self, p99_limit_ms: float) -> bool:
        return (not self.errors and self.completed >= 0.98 * self.offered
                and self.p99 <= p99_limit_ms)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(target: str, ports: Sequence[int], rate: float, duration: float, poisson: bool,
              pids: Mapping[str, int], *, key: str = DEFAULT_KEY,
              body: Mapping[str, Any] | None = None, path: str = "/v1/chat/completions"
              ) -> Phase:
    """One open-loop phase against `ports`; CPU per request of every process in `pids`."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.perf.httpload", "--rate", str(rate),
               "--duration", str(duration), "--out", str(out), "--key", key, "--path", path,
               *(["--poisson"] if poisson else [])]
        for port in ports:
            cmd += ["--port", str(port)]
        if body is not None:
            body_file = Path(tmp) / "body.json"
            body_file.write_text(json.dumps(body))
            cmd += ["--body-file", str(body_file)]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=duration + 120)
        cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        data = json.loads(out.read_text())
    lat: list[float] = data["latencies_ms"]
    ok = len(lat) - sum(v for k, v in data["errors"].items() if k.isdigit())
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


def start_server(cmd: list[str], marker: str, env: Mapping[str, str] | None = None
                 ) -> tuple[subprocess.Popen[str], int]:
    """Start a server that prints '<marker> ...:<port>' as its first line; return it and port."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if marker not in line:
        proc.kill()
        raise RuntimeError(f"{cmd[2]} did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def stop_processes(procs: Sequence[subprocess.Popen[Any]], timeout_s: float = 10.0) -> None:
    """Terminate, newest first; kill what does not exit within `timeout_s`."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


async def publish_state_once(redis_url: str, pools: Sequence[str], zone: str = "GREEN",
                             capacity: int = 1_000_000_000) -> None:
    """What a leader's first tick writes, for benchmarks that run no scheduler: the zone and
    one node ('node-0') with `capacity` tokens, in each pool."""
    import redis.asyncio as aioredis

    from admission.scripts import register_scripts
    from admission.store import PoolPolicy, PoolStore
    from admission.tiers import Zone

    client = aioredis.Redis.from_url(redis_url)
    try:
        for pool in pools:
            store = PoolStore(client, register_scripts(client), pool, PoolPolicy())
            await store.publish_state(1, Zone(zone), {"node-0": capacity})
    finally:
        await client.aclose()


def highest_sustained(sweep: Sequence[Phase], target: str, p99_limit_ms: float) -> float:
    """The highest rate that passed, every lower rate of the sweep having passed too."""
    best = 0.0
    for phase in sweep:
        if phase.target != target:
            continue
        if not phase.sustained(p99_limit_ms):
            break
        best = phase.rate
    return best


if __name__ == "__main__":
    sys.exit(main())
