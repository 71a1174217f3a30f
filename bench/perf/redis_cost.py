"""Performance suite, section 3: what one fast-path request costs Redis.

Commands and round trips (`INFO commandstats` over a loaded phase, and `MONITOR` over a slow
sequential sample, which tells a client's own command from one run inside a script), Redis CPU
per request (`INFO cpu`), and `redis-benchmark`'s ceiling on the same server in the same run.
Run by `bench.perf.scale` on its rig (one gateway in front of the instant backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from admission.scripts import script_source
from bench.perf.httpload import run_phase, stop_processes
from bench.perf.perfreport import PerfOptions
from bench.perf.rig import BENCH_POOL, RENEW_INTERVAL_MS, Rig

BACKGROUND = ("renew", "smembers")
SCRIPT_CALLS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")
MONITOR_LINE = re.compile(r'^(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]*)"(?: "([^"]*)")?')
SHAS = {hashlib.sha1(script_source(name).encode()).hexdigest(): name
        for name in ("admit", "finish", "renew", "reap", "release", "state", "leader")}


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


def cost_markdown(d: dict[str, Any]) -> list[str]:
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
