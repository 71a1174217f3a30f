"""Performance suite, sections 2 and 3: gateway processes sharing one Redis, and what one
request costs Redis.

    python -m bench.perf.scale [--quick] [--output bench/results/perf-scale-draft.md]

Everything runs as separate processes on loopback: a private redis-server, the instant backend,
N gateways (`python -m gateway`) and the open-loop load generator of `bench.perf.httpload`. As in
`bench.perf.gateway_overhead`, a one-off "scheduler step" publishes GREEN with a large capacity and
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
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.perf.httpload import (
    Phase,
    highest_sustained,
    run_phase,
)
from bench.perf.perfreport import Check, PerfOptions, Section, save_figure
from bench.perf.redis_cost import cost_markdown, redis_benchmark, redis_cost
from bench.perf.rig import RENEW_INTERVAL_MS, Rig

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_COUNTS = (1, 2, 4)
P99_LIMIT_MS = 50.0
QUIET_SET_RPS = 153_965.0
"""redis-benchmark SET on this machine when it was quiet (bench/results/core.md): the yardstick
for how much of the machine a run got, since other work shares it."""


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
    save_figure(fig, path)
    return path


# -- section 3 -----------------------------------------------------------------------------------

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
        *cost_markdown(cost),
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
    p = argparse.ArgumentParser(prog="python -m bench.perf.scale",
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
    text = "\n".join([f"# {section.title}", "", "`python -m bench.perf.scale"
                      + (" --quick" if args.quick else "") + f"` on {time.strftime('%Y-%m-%d')}.",
                      "", *checks, "", section.markdown, ""])
    output.write_text(text)
    print(text)
    return 0 if all(c.met for c in section.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
