"""Performance suite, sections 2 and 3: gateway processes sharing one Redis, and what one
request costs Redis.

    python -m bench.perf_scale [--quick] [--output bench/results/perf-scale-draft.md]

Everything runs as separate processes on loopback: a private redis-server, the instant backend,
N gateways (`python -m gateway`) and the open-loop load generator of `bench.httpload`. As in
`bench.gateway_overhead`, a one-off "scheduler step" publishes GREEN with a large capacity and
the staleness check is off, so every request takes the fast path: one admit script call, the
response, then one settle script call.

Section 2 sweeps the offered rate upward for N = 1, 2 and 4 gateways (load round robin over
them) and keeps, for each N, the highest rate sustained (achieved >= 98% of offered, no errors,
p99 <= 50 ms, every lower rate passing too). Section 3 counts what a fast-path request costs
Redis: commands and round trips (`INFO commandstats` over a loaded phase, and `MONITOR` over a
slow sequential sample, which tells a client's own command from one run inside a script), Redis
CPU per request (`INFO cpu`), and `redis-benchmark`'s ceiling on the same server in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from admission.keys import PoolKeys
from admission.localredis import LocalRedis, start_redis
from admission.scripts import script_source
from bench.gateway_overhead import POOL, gateway_config
from bench.httpload import (
    Phase,
    highest_sustained,
    publish_state_once,
    run_phase,
    start_server,
    stop_processes,
)
from bench.perfreport import Check, PerfOptions, Section

ROOT = Path(__file__).resolve().parent.parent
BENCH_POOL = "rbench"  # redis-benchmark's admits go to a pool of their own
GATEWAY_COUNTS = (1, 2, 4)
P99_LIMIT_MS = 50.0
RENEW_INTERVAL_MS = 3_000
QUIET_SET_RPS = 153_965.0
"""redis-benchmark SET on this machine when it was quiet (bench/results/core.md): the yardstick
for how much of the machine a run got, since other work shares it."""
BACKGROUND = ("renew", "smembers")
SCRIPT_CALLS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")
MONITOR_LINE = re.compile(r'^(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]*)"(?: "([^"]*)")?')
SHAS = {hashlib.sha1(script_source(name).encode()).hexdigest(): name
        for name in ("admit", "finish", "renew", "reap", "release", "state", "leader")}


class Rig:
    """The shared redis-server and backend, and the gateways started on them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        self.redis: LocalRedis = start_redis(workdir=workdir / "redis")
        self.client = redis.Redis.from_url(self.redis.url)
        try:
            self.backend, self.backend_port = start_server(
                [sys.executable, "-m", "bench.instant_backend", "--port", "0", "--model", POOL],
                "listening on")
        except BaseException:
            self.redis.stop()
            raise
        self.config = workdir / "gateway.toml"
        self.config.write_text(gateway_config(
            self.redis.url, self.backend_port, f"renew_interval_ms = {RENEW_INTERVAL_MS}"))
        asyncio.run(publish_state_once(self.redis.url, [POOL, BENCH_POOL]))
        self.gateways: list[tuple[subprocess.Popen[str], int]] = []

    def start_gateways(self, n: int) -> list[int]:
        for _ in range(n):
            self.gateways.append(start_server(
                [sys.executable, "-m", "gateway", "--config", str(self.config), "--port", "0",
                 "--log-level", "WARNING"], "listening on"))
        return [port for _, port in self.gateways]

    def pids(self) -> dict[str, int]:
        pids = {f"gateway-{i + 1}": proc.pid for i, (proc, _) in enumerate(self.gateways)}
        return {**pids, "backend": self.backend.pid, "redis": self.redis.process.pid}

    def stop_gateways(self) -> None:
        for proc, _ in self.gateways:
            stop_processes([proc])
        self.gateways = []

    def stats(self) -> dict[str, int]:
        raw: dict[bytes, bytes] = self.client.hgetall(PoolKeys(POOL).stats)  # type: ignore[assignment]
        return {k.decode(): int(v) for k, v in raw.items()}

    def info(self, section: str) -> dict[str, Any]:
        info: dict[str, Any] = self.client.info(section)
        return info

    def close(self) -> None:
        self.stop_gateways()
        stop_processes([self.backend])
        self.client.close()
        self.redis.stop()
        shutil.rmtree(self.redis.workdir, ignore_errors=True)


def _revision() -> str:
    """HEAD, and the files under test that differ from it (others work in the same checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip()
    dirty = git("status", "--porcelain", "--", "lua", "admission", "gateway").split("\n")
    changed = [line[3:] for line in dirty if line.strip()]
    return head + (f" plus uncommitted changes to {', '.join(changed)}" if changed else "")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _served(p: Phase) -> int:
    """Requests answered (any status): the count run_phase divides CPU time by."""
    return p.completed + sum(v for k, v in p.errors.items() if k.isdigit())


def _figures(p: Phase, gateways: int) -> dict[str, Any]:
    gateway_us = sum(v for k, v in p.cpu_us.items() if k.startswith("gateway"))
    total_us = sum(p.cpu_us.values())
    duration = p.offered / p.rate
    cores = total_us * _served(p) / 1e6 / duration
    return {
        "gateways": gateways, "offered_rps": p.rate, "achieved_rps": p.achieved_rps,
        "sustained": p.sustained(P99_LIMIT_MS), "errors": p.errors, "p50_ms": p.p50,
        "p99_ms": p.p99, "max_ms": p.max, "cpu_us": {
            "gateways": gateway_us, "backend": p.cpu_us.get("backend", 0.0),
            "redis": p.cpu_us.get("redis", 0.0), "total": total_us},
        "cores_used": cores, "rps_per_core": p.achieved_rps / cores if cores else 0.0,
    }


# -- section 2 -----------------------------------------------------------------------------------

def scaling(rig: Rig, options: PerfOptions) -> dict[str, Any]:
    sweep = (200.0, 400.0) if options.quick else (
        250.0, 500.0, 1000.0, 1500.0, 2000.0, 2500.0, 3000.0, 4000.0)
    phase_s = 2.0 if options.quick else 8.0
    runs: list[dict[str, Any]] = []
    for n in GATEWAY_COUNTS:
        print(f"{n} gateway(s), load average {_load()}", flush=True)
        ports = rig.start_gateways(n)
        pids = rig.pids()
        try:
            run_phase("warm-up", ports, 200, 1.0 if options.quick else 3.0, False, pids)
            phases: list[Phase] = []
            failures = 0
            for rate in sweep:
                phase = run_phase(f"{n}gw", ports, rate, phase_s, False, pids)
                phases.append(phase)
                failures += not phase.sustained(P99_LIMIT_MS)
                if failures >= 2:
                    break
        finally:
            rig.stop_gateways()
        best = highest_sustained(phases, f"{n}gw", P99_LIMIT_MS)
        at_best = next((p for p in phases if p.rate == best), None)
        runs.append({
            "gateways": n, "highest_sustained_rps": best, "per_gateway_rps": best / n,
            "per_machine_core_rps": best / (os.cpu_count() or 1),
            "at_highest": _figures(at_best, n) if at_best else None,
            "phases": [_figures(p, n) for p in phases],
            "load_average_after": _load(),
        })
    return {"phase_s": phase_s, "p99_limit_ms": P99_LIMIT_MS, "runs": runs}


def _scaling_markdown(data: dict[str, Any]) -> list[str]:
    rows = ["| gateways | offered RPS | achieved RPS | p50 ms | p99 ms | errors | CPU µs/req "
            "gateways | backend | redis | cores used | RPS per core used | one gateway's "
            "CPU-bound RPS |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in data["runs"]:
        for f in run["phases"]:
            cpu = f["cpu_us"]
            mark = "" if f["sustained"] else " ✗"
            rows.append(
                f"| {f['gateways']} | {f['offered_rps']:.0f}{mark} | {f['achieved_rps']:.0f} | "
                f"{f['p50_ms']:.2f} | {f['p99_ms']:.1f} | {sum(f['errors'].values())} | "
                f"{cpu['gateways']:.0f} | {cpu['backend']:.0f} | {cpu['redis']:.0f} | "
                f"{f['cores_used']:.2f} | {f['rps_per_core']:.0f} | "
                f"{1e6 / cpu['gateways'] if cpu['gateways'] else 0:.0f} |")
    cpus = os.cpu_count() or 1
    summary = ["| gateways | highest sustained RPS | per gateway process | per machine core "
               f"({cpus}) | CPU µs/req gateways | backend | redis | cores used | RPS per core "
               "used | load avg after |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in data["runs"]:
        f, best = run["at_highest"], run["highest_sustained_rps"]
        cells = ["-"] * 5 if f is None else [
            f"{f['cpu_us'][k]:.0f}" for k in ("gateways", "backend", "redis")] + [
            f"{f['cores_used']:.2f}", f"{f['rps_per_core']:.0f}"]
        summary.append(f"| {run['gateways']} | **{best:.0f}** | {best / run['gateways']:.0f} | "
                       f"{best / cpus:.0f} | {' | '.join(cells)} | {run['load_average_after']} |")
    return [
        f"Fixed-rate open loop, {data['phase_s']:.0f} s per rate, load spread round robin over "
        "the gateways (one keep-alive connection pool per gateway), all gateways sharing one "
        "Redis and one instant backend. A rate is sustained when >= 98% of the offered "
        f"requests complete, none fails and p99 <= {data['p99_limit_ms']:.0f} ms (latency from "
        "the intended send time); the sweep stops after the second failing rate.",
        "",
        *summary,
        "",
        "CPU per request is user + system time from /proc over the phase divided by the requests"
        " answered (the gateways' column sums all gateway processes); \"cores used\" is the CPU "
        "time of gateways, backend and Redis over the phase divided by its duration, and \"RPS "
        "per core used\" is the throughput divided by that (the load generator is a further "
        "process on the same CPUs, not counted). \"One gateway's CPU-bound RPS\" is 1 s "
        "divided by the gateways' CPU per request: what one gateway process (one thread) "
        "would serve with a whole core to itself at that cost; 1,000 RPS per process needs at "
        "most 1,000 µs. All phases (✗ = not sustained):",
        "",
        *rows,
    ]


def chart(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Open loop: the achieved rate follows the offered one until the very end; what gives out
    # first is the tail, so the tail is what the left panel shows.
    for run in data["runs"]:
        phases = run["phases"]
        left.plot([f["offered_rps"] for f in phases], [f["p99_ms"] for f in phases],
                  marker="o", label=f"{run['gateways']} gateway(s)")
    left.axhline(data["p99_limit_ms"], color="grey", linestyle=":", label="p99 limit")
    left.set_yscale("log")
    left.set_xlabel("offered RPS (round robin over the gateways)")
    left.set_ylabel("p99 latency, ms (log)")
    left.set_title("Tail latency by offered rate")
    left.legend(loc="best", fontsize="small")
    # The lowest rate of the sweep ran for every N: the one comparison that always exists.
    firsts = [r["phases"][0] for r in data["runs"]]
    labels = [f"{f['gateways']} gw\np99 {f['p99_ms']:.0f} ms" for f in firsts]
    bottoms = [0.0] * len(labels)
    for part, color in (("gateways", "tab:blue"), ("backend", "tab:orange"),
                        ("redis", "tab:red")):
        values = [f["cpu_us"][part] for f in firsts]
        right.bar(labels, values, bottom=bottoms, color=color, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    right.set_ylabel("CPU µs per request")
    right.set_title(f"CPU per request at {firsts[0]['offered_rps']:.0f} RPS")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- section 3 -----------------------------------------------------------------------------------

@contextlib.contextmanager
def monitoring(port: int, out: Path) -> Iterator[None]:
    """`redis-cli MONITOR` into `out` while the block runs (started before, stopped after)."""
    with out.open("w") as sink:
        proc = subprocess.Popen(["redis-cli", "-p", str(port), "monitor"], stdout=sink,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while "OK" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        yield
        time.sleep(0.3)  # the last replies reach the file
    finally:
        stop_processes([proc])


def parse_monitor(text: str, exclude: set[str]) -> dict[str, Any]:
    """Direct calls by connection and by script, and the commands each script ran.

    Redis 7 writes a script's own line first, then the commands it ran ("[0 lua]"), so the lua
    lines that follow a direct EVALSHA belong to it.
    """
    direct: Counter[str] = Counter()
    by_conn: Counter[str] = Counter()
    inner: dict[str, Counter[str]] = {}
    calls: Counter[str] = Counter()
    current: str | None = None
    first = last = None
    for line in text.splitlines():
        m = MONITOR_LINE.match(line)
        if m is None:
            continue
        stamp, source, command, arg = float(m[1]), m[2], m[3].lower(), m[4]
        if source == "lua":
            if current is not None:
                inner.setdefault(current, Counter())[command] += 1
            continue
        if source in exclude:
            current = None
            continue
        first = stamp if first is None else first
        last = stamp
        name = SHAS.get(arg or "", "unknown script") if command == "evalsha" else command
        current = name if command in SCRIPT_CALLS else None
        direct[name] += 1
        by_conn[source] += 1
        if current is not None:
            calls[current] += 1
    return {
        "direct": dict(direct), "connections": dict(by_conn),
        "inner_per_call": {s: {c: n / calls[s] for c, n in sorted(cmds.items())}
                           for s, cmds in inner.items()},
        "span_s": (last - first) if first is not None and last is not None else 0.0,
    }


def redis_benchmark(port: int, requests: int, command: Sequence[str] = (),
                    tests: str = "") -> dict[str, float]:
    """requests/s per test, from `redis-benchmark -q` (50 clients)."""
    cmd = ["redis-benchmark", "-p", str(port), "-n", str(requests), "-c", "50", "-q"]
    cmd += ["-t", tests] if tests else ["-r", "1000000000", *command]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    rates: dict[str, float] = {}
    for line in out.replace("\r", "\n").splitlines():
        m = re.match(r"^\s*(.+?): ([\d.]+) requests per second", line)
        if m:
            rates["script" if command else m[1].lower()] = float(m[2])
    return rates


class _Capture:
    """Stands in for the scripts: records the keys and arguments of the call it receives."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.args: list[Any] = []

    async def admit(self, keys: list[str], args: list[Any]) -> list[Any]:
        self.keys, self.args = keys, args
        return ["released", "node-0", 0, 0, "GREEN"]


def _admit_command() -> list[str]:
    """An admit exactly as the gateway's PoolStore sends it, with a fresh random number (from
    redis-benchmark) in place of each mention of the task id, so every call is a new task. The
    number differs between mentions (key vs id): harmless for measuring the script's cost."""
    from admission.store import PoolPolicy, PoolStore, TenantQuota
    from admission.tiers import Tier

    capture = _Capture()
    store = PoolStore(None, capture, BENCH_POOL, PoolPolicy(stale_after_ms=0))  # type: ignore[arg-type]
    asyncio.run(store.admit(
        task_id="benchtaskid", tenant=TenantQuota("bench", 10**9, 10**9, 1000), tier=Tier.VIP,
        prompt_tokens=34, max_tokens=16, gateway="rb", queue_timeout_ms=60_000))
    sha = next(s for s, name in SHAS.items() if name == "admit")
    words = [str(w).replace("benchtaskid", "__rand_int__") for w in capture.keys + capture.args]
    return ["EVALSHA", sha, str(len(capture.keys)), *words]


def _cpu_s(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _cmdstats(info: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for k, v in info.items()}


def redis_cost(rig: Rig, options: PerfOptions, sustained_rps: float) -> dict[str, Any]:
    port = rig.start_gateways(1)
    pids = rig.pids()
    try:
        run_phase("warm-up", port, 200, 1.0 if options.quick else 3.0, False, pids)
        # A slow sample (one request at a time in practice) under MONITOR, long enough to hold
        # at least two lease renewals, tells direct commands from script-run ones.
        sample_s = 3.5 if options.quick else 2 * RENEW_INTERVAL_MS / 1000 + 0.5
        me = str(rig.client.client_info()["addr"])
        before = rig.stats()
        log = options.workdir / "monitor.txt"
        with monitoring(rig.redis.port, log):
            sample = run_phase("sample", port, 10, sample_s, False, pids)
            time.sleep(0.2)  # the last settles run after their responses
        sample_requests = rig.stats().get("fast_path", 0) - before.get("fast_path", 0)
        monitor = parse_monitor(log.read_text(), exclude={me})
        # The loaded phase: commandstats and CPU over a known number of fast-path requests.
        # At a rate the machine sustains (section 2): an overloaded run counts the same calls
        # but times out connections and skews the CPU figures.
        rate, load_s = (300.0, 3.0) if options.quick else (
            min(1000.0, max(200.0, sustained_rps)), 10.0)
        # Redis's CPU with the gateway idle (its cron, the lease renewal): at a few hundred
        # requests per second it is a visible share of the per-request figure.
        idle0, idle_t0 = _cpu_s(rig.info("cpu")), time.monotonic()
        time.sleep(1.0 if options.quick else 3.0)
        idle_per_s = (_cpu_s(rig.info("cpu")) - idle0) / (time.monotonic() - idle_t0)
        stats0, cmd0, cpu0 = rig.stats(), rig.info("commandstats"), rig.info("cpu")
        t0 = time.monotonic()
        loaded = run_phase("loaded", port, rate, load_s, False, pids)
        time.sleep(0.3)
        stats1, cmd1, cpu1 = rig.stats(), rig.info("commandstats"), rig.info("cpu")
        span = time.monotonic() - t0
    finally:
        rig.stop_gateways()
    admits = stats1.get("fast_path", 0) - stats0.get("fast_path", 0)
    settles = stats1.get("settled", 0) - stats0.get("settled", 0)
    c0, c1 = _cmdstats(cmd0), _cmdstats(cmd1)
    # Our own INFO and HGETALL calls around the phase are not the gateway's.
    ours = {"info": 2, "hgetall": 1}
    deltas = {name: (calls - c0.get(name, (0, 0))[0] - ours.get(name, 0),
                     usec - c0.get(name, (0, 0))[1]) for name, (calls, usec) in c1.items()}
    deltas = {k: v for k, v in deltas.items() if v[0] > 0}
    direct_names = set(monitor["direct"]) - set(SHAS.values()) - {"unknown script"}
    inner_names = {c for cmds in monitor["inner_per_call"].values() for c in cmds}
    script_calls = sum(deltas.get(n, (0, 0))[0] for n in SCRIPT_CALLS)
    other_direct = sum(v[0] for k, v in deltas.items() if k in direct_names and k not in
                       inner_names)
    inner = sum(v[0] for k, v in deltas.items() if k not in SCRIPT_CALLS and k not in
                direct_names)
    # Background traffic (lease renewal every RENEW_INTERVAL_MS and its SMEMBERS) is measured
    # per second in the sample and taken out of the loaded phase's top-level count.
    per_s = max(monitor["span_s"], sample_s)
    background = {k: v / per_s for k, v in monitor["direct"].items() if k in BACKGROUND}
    top_level = script_calls + other_direct
    hot = top_level - sum(background.values()) * span
    redis_cpu_us = (_cpu_s(cpu1) - _cpu_s(cpu0)) * 1e6 / max(1, admits)
    net_cpu_us = (_cpu_s(cpu1) - _cpu_s(cpu0) - idle_per_s * span) * 1e6 / max(1, admits)
    # Ceiling: redis-benchmark against the same server, now that the gateway is stopped.
    n = 20_000 if options.quick else 200_000
    cpu_b0 = _cpu_s(rig.info("cpu"))
    plain = redis_benchmark(rig.redis.port, n, tests="set,get")
    set_cpu_us = (_cpu_s(rig.info("cpu")) - cpu_b0) * 1e6 / (2 * n)
    admit_rate = redis_benchmark(rig.redis.port, n // 2, _admit_command()).get("script", 0.0)
    trivial = redis_benchmark(rig.redis.port, n, ["EVAL", "return 1", "0"]).get("script", 0.0)
    # Every direct call in the sample counts against the requests, except the lease renewal's
    # two (renew script, then SMEMBERS of the gateway's task set: gateway/settle.py).
    sample_hot = sum(n for k, n in monitor["direct"].items() if k not in BACKGROUND)
    return {
        "sample": {"requests": sample_requests, "completed": sample.completed, **monitor},
        "sample_round_trips_per_request": sample_hot / max(1, sample_requests),
        "background_per_s": background,
        "loaded": {"rate": rate, "duration_s": load_s, "span_s": span, "admits": admits,
                   "settles": settles, "achieved_rps": loaded.achieved_rps,
                   "p99_ms": loaded.p99, "commandstats": deltas},
        "top_level_per_request": top_level / max(1, admits),
        "hot_round_trips_per_request": hot / max(1, admits),
        "inner_commands_per_request": inner / max(1, admits),
        "redis_usec_in_commands_per_request":
            sum(deltas.get(k, (0, 0))[1] for k in SCRIPT_CALLS) / max(1, admits),
        "redis_cpu_us_per_request": redis_cpu_us,
        "redis_cpu_us_per_request_proc": loaded.cpu_us.get("redis", 0.0),
        "redis_idle_cpu_per_s": idle_per_s, "redis_cpu_us_per_request_net": net_cpu_us,
        # At saturation the idle share vanishes: the bound uses the net figure.
        "redis_bound_rps": 1e6 / max(net_cpu_us, 1e-3) if net_cpu_us > 0 else (
            1e6 / redis_cpu_us if redis_cpu_us > 0 else 0.0),
        "ceiling": {"requests": n, **plain, "admit_evalsha": admit_rate, "eval_return_1": trivial,
                    "redis_cpu_us_per_set_or_get": set_cpu_us},
    }


def _cost_markdown(d: dict[str, Any]) -> list[str]:
    ld, c, s = d["loaded"], d["ceiling"], d["sample"]
    set_rate = c.get("set", 0.0)
    inner = ", ".join(f"{script}: " + " ".join(f"{cmd} {n:.1f}" for cmd, n in cmds.items())
                      for script, cmds in d["sample"]["inner_per_call"].items())
    per = max(1, ld["admits"])
    cmd_rows = [f"| {name} | {calls} | {calls / per:.2f} | {usec / max(1, calls):.1f} |"
                for name, (calls, usec) in sorted(ld["commandstats"].items(),
                                                  key=lambda kv: -kv[1][0])]
    cpu, set_cpu = d["redis_cpu_us_per_request_net"], c["redis_cpu_us_per_set_or_get"]
    measures = [
        ("round trips per fast-path request, sample (direct calls but the renewal's / "
         "requests)", f"**{d['sample_round_trips_per_request']:.2f}**"),
        ("round trips per fast-path request, loaded phase (top-level calls less background)",
         f"**{d['hot_round_trips_per_request']:.2f}**"),
        ("top-level calls per request, background included", f"{d['top_level_per_request']:.3f}"),
        ("commands run inside scripts per request", f"{d['inner_commands_per_request']:.1f}"),
        ("background, per gateway per second (sample)",
         ", ".join(f"{k} {v:.2f}" for k, v in d["background_per_s"].items())),
        ("Redis time inside the script calls per request (commandstats usec)",
         f"{d['redis_usec_in_commands_per_request']:.1f} µs"),
        ("Redis CPU per request (`INFO cpu` sys + user)",
         f"{d['redis_cpu_us_per_request']:.1f} µs"),
        ("same from /proc", f"{d['redis_cpu_us_per_request_proc']:.1f} µs"),
        ("Redis CPU with the gateway idle (cron, renewal)",
         f"{d['redis_idle_cpu_per_s'] * 1e3:.1f} ms/s"),
        ("Redis CPU per request net of that idle share",
         f"**{d['redis_cpu_us_per_request_net']:.1f} µs**"),
        ("Redis-bound maximum (1 / net Redis CPU per request)",
         f"{d['redis_bound_rps']:,.0f} RPS"),
        ("redis-benchmark SET / GET, 50 clients, same server",
         f"{set_rate:,.0f} / {c.get('get', 0.0):,.0f} ops/s"),
        ("redis-benchmark EVALSHA admit (fast path)", f"{c['admit_evalsha']:,.0f} calls/s"),
        ('redis-benchmark EVAL "return 1"', f"{c['eval_return_1']:,.0f} calls/s"),
        ("Redis CPU per SET/GET under redis-benchmark", f"{set_cpu:.1f} µs"),
        ("one gateway request costs Redis as much CPU (net) as",
         f"{cpu / max(1e-9, set_cpu):.1f} SETs"),
        ("Redis-bound maximum as a share of the SET ceiling",
         f"{d['redis_bound_rps'] / set_rate:.1%}" if set_rate else "n/a"),
    ]
    return [
        f"One gateway, {ld['rate']:.0f} RPS for {ld['duration_s']:.0f} s: {ld['admits']} "
        f"fast-path admits and {ld['settles']} settles (pool stats hash), achieved "
        f"{ld['achieved_rps']:.0f} RPS, p99 {ld['p99_ms']:.1f} ms. `INFO commandstats` deltas "
        "over the phase (scripts' own commands are counted under their names too):",
        "",
        "| command | calls | per request | µs per call |",
        "|---|---:|---:|---:|",
        *cmd_rows,
        "",
        f"MONITOR over a sequential sample ({s['requests']} requests at 10 RPS, "
        f"{s['span_s']:.1f} s) shows who sends what: direct calls {s['direct']} on "
        f"{len(s['connections'])} connection(s) {s['connections']}; commands run inside each "
        f"script call (mean): {inner}.",
        "",
        "| measure | value |",
        "|---|---:|",
        *(f"| {label} | {value} |" for label, value in measures),
    ]


# -- the section ---------------------------------------------------------------------------------

def _explain(scale: dict[str, Any]) -> list[str]:
    """What the scaling figures mean on this machine, from the figures themselves."""
    cpus = os.cpu_count() or 1
    lines = [
        f"This machine has {cpus} CPUs, and every process of the run shares them: the load "
        "generator, the instant backend, Redis and the N gateways (and whatever else runs on "
        "the machine: see the load averages). More gateway processes add no CPU: once the CPUs "
        "are busy they only split the same CPU time, with more context switches, so on this "
        "machine the sweep shows where the machine runs out, not how kvgate scales with cores. "
        "With 4 gateways there are more busy processes than cores, and a gateway that is not "
        "scheduled for a few ms holds its requests that long: that is where the tail goes. "
        "What carries over to a larger machine is the CPU per request of each component (the "
        "gateway's must stay below 1 s / 1,000 for 1,000 RPS per process, i.e. 1,000 µs) and "
        "that Redis's share per request does not grow with the number of gateways (compare "
        "the redis column across N: one admit and one settle call per request, whichever "
        "gateway sends them).",
        "",
    ]
    for run in scale["runs"]:
        f = run["at_highest"]
        if f is not None:
            lines.append(
                f"- {run['gateways']} gateway(s): {run['highest_sustained_rps']:.0f} RPS "
                f"sustained on {f['cores_used']:.2f} of {cpus} cores (measured processes, load "
                f"generator not counted): {f['rps_per_core']:.0f} RPS per core used; the "
                f"gateways' CPU per request {f['cpu_us']['gateways']:.0f} µs in total.")
        else:
            lines.append(f"- {run['gateways']} gateway(s): no rate of the sweep sustained.")
        failed = next((p for p in run["phases"] if not p["sustained"]), None)
        if failed is not None and failed["cores_used"] < 0.75 * cpus and (
                _gateway_cores(failed) < 0.75):
            # The run's own processes left CPU idle, yet the tail blew up: the CPU went to
            # something else on the machine, and this rate says nothing about kvgate.
            lines.append(
                f"  At {failed['offered_rps']:.0f} RPS (p99 {failed['p99_ms']:.0f} ms) the "
                f"measured processes used only {failed['cores_used']:.2f} of {cpus} cores: "
                f"the rest went to other work on the machine (and no gateway process was "
                f"near a full core: {_gateway_cores(failed):.2f} each), so that failure is "
                "most likely the machine's, not the gateways' limit.")
    return [*lines, "",
            "\"RPS per core used\" is the inverse of the whole stack's CPU per request "
            "(gateways + backend + Redis): what each further core would add if the work spread "
            "perfectly over cores. It is an upper bound; the sustained rate on this machine "
            "ends where its CPUs (and the latency limit) do. CPU time per request also grows "
            "when the machine is shared (caches and cores taken by other processes, more "
            "context switches): compare the gateway's CPU per request here with "
            "bench/results/gateway_overhead.md, measured when the machine was quiet."]


def _span(a: float, b: float) -> str:
    low, high = f"{min(a, b):.0%}", f"{max(a, b):.0%}"
    return low if low == high else f"{low} to {high}"


def _gateway_cores(f: dict[str, Any]) -> float:
    """Cores used per gateway process over a phase (a gateway is one thread: 1.0 is its max)."""
    cpu = f["cpu_us"]
    share = cpu["gateways"] / cpu["total"] if cpu["total"] else 0.0
    return float(f["cores_used"] * share / f["gateways"])


def run(options: PerfOptions) -> Section:
    options.results_dir.mkdir(parents=True, exist_ok=True)
    options.workdir.mkdir(parents=True, exist_ok=True)
    load_before, revision = _load(), _revision()
    started = time.monotonic()
    rig = Rig(options.workdir / "perf-scale")
    try:
        set_before = redis_benchmark(rig.redis.port, 20_000 if options.quick else 100_000,
                                     tests="set").get("set", 0.0)
        scale = scaling(rig, options)
        one = next(r for r in scale["runs"] if r["gateways"] == 1)
        cost = redis_cost(rig, options, one["highest_sustained_rps"])
    finally:
        rig.close()
    png = chart(scale, options.results_dir / "performance-scaling.png")
    trips = max(cost["sample_round_trips_per_request"], cost["hot_round_trips_per_request"])
    checks = [
        Check("Redis round trips on a fast-path request (admit, settle)", "<= 2",
              f"{cost['sample_round_trips_per_request']:.2f} (sample), "
              f"{cost['hot_round_trips_per_request']:.2f} (loaded)", trips <= 2.05),
        Check("RPS per gateway process (1 gateway, p99 <= 50 ms)", ">= 1,000",
              f"{one['highest_sustained_rps']:.0f}", one["highest_sustained_rps"] >= 1000),
    ]
    load_after, set_after = _load(), cost["ceiling"].get("set", 0.0)
    markdown = "\n".join([
        f"Code: {revision}. Load average (1, 5, 15 min) before: {load_before}, after: "
        f"{load_after} (other work on the machine shows in the figures); "
        f"{time.monotonic() - started:.0f} s. redis-benchmark SET on the run's Redis: "
        f"{set_before:,.0f}/s at the start, {set_after:,.0f}/s at the end; on this machine when "
        f"quiet (bench/results/core.md) {QUIET_SET_RPS:,.0f}/s: loopback request/reply "
        f"exchanges ran at {_span(set_before / QUIET_SET_RPS, set_after / QUIET_SET_RPS)} of "
        "the quiet machine's rate "
        "(a ping-pong needs both sides scheduled, so it suffers more than CPU share alone)."
        + (" Quick mode: short phases, figures not meaningful." if options.quick else ""),
        "",
        "### 2. Gateway processes sharing one Redis",
        "",
        *_scaling_markdown(scale),
        "",
        f"![throughput and CPU per request by gateway count]({png.name})",
        "",
        *_explain(scale),
        "",
        "### 3. Redis cost per fast-path request",
        "",
        *_cost_markdown(cost),
        "",
        "A round trip is one request/reply exchange between a gateway and Redis; commands a "
        "script runs inside Redis cost Redis CPU but no network exchange. The MONITOR sample "
        "above shows which calls a gateway sends itself and on how many connections (the admit "
        "and settle script calls go through the multiplexed one, gateway/redismux.py); the "
        "lease renewal "
        "(one renew EVALSHA and one SMEMBERS per gateway every "
        f"{RENEW_INTERVAL_MS / 1000:.0f} s) is per gateway, not per request. Redis CPU per "
        "request includes reading and writing the sockets, which commandstats' usec leaves "
        "out; that usec is wall time inside the script, so it also counts the time Redis waits "
        "for a CPU on a busy machine. redis-benchmark runs on the same CPUs as the server, as "
        "the gateways did, so its "
        "ceiling is this machine's, client included.",
    ])
    return Section(
        title="Scaling out gateways and the Redis cost of a request",
        markdown=markdown, checks=checks, charts=[png],
        data={"scaling": scale, "redis_cost": cost, "load_average_before": load_before,
              "load_average_after": load_after, "cpus": os.cpu_count(), "revision": revision,
              "set_rps_start": set_before, "quiet_set_rps": QUIET_SET_RPS},
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf_scale",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short phases: checks that it runs")
    p.add_argument("--output", default=str(ROOT / "bench/results/perf-scale-draft.md"))
    args = p.parse_args(argv)
    output = Path(args.output)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-perf-scale-"))
    try:
        section = run(PerfOptions(results_dir=output.parent, workdir=workdir, quick=args.quick))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    checks = ["| check | target | measured | met |", "|---|---|---|---|"]
    checks += [f"| {c.name} | {c.target} | {c.value} | {'yes' if c.met else 'no'} |"
               for c in section.checks]
    text = "\n".join([f"# {section.title}", "", "`python -m bench.perf_scale"
                      + (" --quick" if args.quick else "") + f"` on {time.strftime('%Y-%m-%d')}.",
                      "", *checks, "", section.markdown, ""])
    output.write_text(text)
    print(text)
    return 0 if all(c.met for c in section.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
