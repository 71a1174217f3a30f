"""Performance suite, section 1: the gateway against a LiteLLM proxy on the same instant backend.

    python -m bench.perf.latency [--quick] [--output FILE] [--results-dir DIR]

Everything runs as separate processes on loopback: the instant backend, one gateway process
(configured and primed as in `bench.perf.gateway_overhead`: GREEN with a large capacity published
once, staleness check off, so every request takes the fast path) on its private redis-server,
and a LiteLLM proxy with one worker (`bench.perf.litellm_env`: its own venv, the deployment's
rpm/tpm limits counted in a second private redis-server by usage-based-routing-v2). The load
generator (`bench.perf.httpload`, open loop, latency from the intended send time) is a process of
its own. Measured: the backend direct, through the gateway and through LiteLLM at 50, 200 and
500 RPS (p50/p99, added p50/p99 = target minus direct, CPU per request of each server process),
then for each target the highest rate sustained with p99 under 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.perf import litellm_env
from bench.perf.gateway_overhead import BODY, KEY, POOL, gateway_config
from bench.perf.httpload import (
    Phase,
    highest_sustained,
    publish_state_once,
    run_phase,
    start_server,
    stop_processes,
)
from bench.perf.perfreport import Check, PerfOptions, Section, save_figure

ROOT = Path(__file__).resolve().parents[2]
RATES = (50.0, 200.0, 500.0)
P99_LIMIT_MS = 50.0
TARGETS = ("direct", "gateway", "litellm")
SWEEPS: dict[str, tuple[float, ...]] = {
    "direct": (500.0, 750.0, 1000.0, 1250.0, 1500.0, 2000.0, 2500.0, 3000.0),
    "gateway": (500.0, 750.0, 1000.0, 1250.0, 1500.0, 2000.0, 2500.0, 3000.0),
    # Low rates first: on this 2-core machine one LiteLLM worker spends tens of ms of CPU on a
    # request, so its knee can sit far below the reference figure (about 70 RPS).
    "litellm": (5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0),
}
QUICK_SWEEPS: dict[str, tuple[float, ...]] = {
    "direct": (500.0, 1000.0), "gateway": (500.0, 1000.0), "litellm": (5.0, 10.0)}
CHART = "performance-latency.png"


@dataclasses.dataclass
class _Target:
    name: str
    port: int
    key: str
    pids: dict[str, int]
    restart: Callable[[_Target], None] | None = None
    """Starts the server anew (new port and pids) after an overload, instead of waiting."""
    restarts: int = 0


def _load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def _worker_pid(pid: int) -> int:
    """The process that serves LiteLLM's requests: the CLI itself, or its only child if it forks
    a worker (uvicorn with workers > 1, gunicorn), so CPU is read where the work happens."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return pid
    return int(children[0]) if len(children) == 1 else pid


def _quiesce(target: _Target, limit_s: float = 120.0) -> None:
    """Wait until an overloaded server has worked off its backlog before the next phase.

    An open-loop phase above a server's capacity leaves requests queued in it after the load
    generator gives up; the next phase (another target's, on the same two cores) would pay for
    them. A request that answers quickly three times in a row means the backlog is gone.
    """
    deadline = time.monotonic() + limit_s
    fast = 0
    payload = (b'{"model": "demo", "max_tokens": 4, '
               b'"messages": [{"role": "user", "content": "hi"}]}')
    while fast < 3 and time.monotonic() < deadline:
        request = urllib.request.Request(
            f"http://127.0.0.1:{target.port}/v1/chat/completions", data=payload, method="POST",
            headers={"Authorization": f"Bearer {target.key}",
                     "Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
        except OSError:
            fast = 0
            time.sleep(0.5)
            continue
        fast = fast + 1 if time.perf_counter() - start < 0.05 else 0
        time.sleep(0.2)


def _phase(target: _Target, rate: float, duration: float) -> Phase:
    phase = run_phase(target.name, [target.port], rate, duration, False, target.pids,
                      key=target.key, body=BODY)
    if not phase.sustained(P99_LIMIT_MS):
        if target.restart is not None:
            # Thousands of requests the load generator gave up on are still queued in the
            # proxy, which would work them off for minutes, on the CPUs the next phase needs.
            target.restart(target)
            target.restarts += 1
            run_phase(target.name, [target.port], 5, 2, False, {}, key=target.key, body=BODY)
        else:
            _quiesce(target)
    return phase


def _measure(group: Sequence[_Target], duration: float, sweep_duration: float,
             sweeps: Mapping[str, Sequence[float]]) -> tuple[list[Phase], list[Phase]]:
    """Fixed rates, then a sweep per target, for the targets of one group."""
    print("warm-up", flush=True)
    for target in group:
        # Unmeasured: connections, caches and lazy imports (LiteLLM's are many) warm up first.
        warm = 5.0 if target.restart is not None else 200.0
        run_phase(target.name, [target.port], warm, 3, False, {}, key=target.key, body=BODY)
    fixed: list[Phase] = []
    for rate in RATES:
        print(f"{rate:.0f} RPS", flush=True)
        for target in group:
            fixed.append(_phase(target, rate, duration))
    sweep: list[Phase] = []
    for target in group:
        print(f"sweep {target.name}", flush=True)
        failures = 0
        for rate in sweeps[target.name]:
            phase = _phase(target, rate, sweep_duration)
            sweep.append(phase)
            failures += not phase.sustained(P99_LIMIT_MS)
            if failures >= 2:
                break
    return fixed, sweep


def _redis_commands(port: int) -> dict[str, int]:
    """Calls per command on LiteLLM's Redis: shows what its limits really do there."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "commandstats"],
                         capture_output=True, text=True, timeout=10, check=False).stdout
    calls: dict[str, int] = {}
    for line in out.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_"):].split(":", 1)
            calls[name] = int(rest.split(",", 1)[0].split("=", 1)[1])
    return calls


def _table(phases: Sequence[Phase]) -> list[str]:
    rows = ["| target | offered RPS | achieved RPS | done / offered | errors | p50 ms | p99 ms | "
            "max ms | CPU µs/req: proxy | backend | redis |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for p in phases:
        proxy = p.cpu_us.get("gateway", p.cpu_us.get("litellm"))
        cpu = [f"{v:.0f}" if v is not None else "-"
               for v in (proxy, p.cpu_us.get("backend"), p.cpu_us.get("redis"))]
        errors = ", ".join(f"{k}: {v}" for k, v in p.errors.items()) or "0"
        rows.append(f"| {p.target} | {p.rate:.0f} | {p.achieved_rps:.0f} | "
                    f"{p.completed}/{p.offered} | {errors} | {p.p50:.2f} | {p.p99:.2f} | "
                    f"{p.max:.1f} | {' | '.join(cpu)} |")
    return rows


def _added(fixed: Sequence[Phase]) -> tuple[list[str], dict[str, dict[str, float]]]:
    by = {(p.target, p.rate): p for p in fixed}
    rows = ["| offered RPS | gateway added p50 ms | gateway added p99 ms | "
            "LiteLLM added p50 ms | LiteLLM added p99 ms |", "|---:|---:|---:|---:|---:|"]
    added: dict[str, dict[str, float]] = {}
    for rate in RATES:
        direct = by[("direct", rate)]
        cells = []
        for name in ("gateway", "litellm"):
            p = by[(name, rate)]
            a50, a99 = p.p50 - direct.p50, p.p99 - direct.p99
            added[f"{name}@{rate:.0f}"] = {"p50": a50, "p99": a99}
            cells += [f"{a50:.2f}", f"{a99:.2f}"]
        rows.append(f"| {rate:.0f} | " + " | ".join(cells) + " |")
    return rows, added


QUIET_BACKEND_CPU_US = 297.0
"""The instant backend's CPU per request at 200 RPS in the quiet run that
bench/results/gateway_overhead.md records: the yardstick for how much other jobs slowed this
run down. A run on another machine compares against another CPU, so the ratio is a rough
guide only."""


def _contention(fixed: Sequence[Phase]) -> str:
    """One line saying how loaded the machine was, measured, not guessed from the load average:
    the same backend code costs more CPU per request when other processes thrash the caches and
    share the cores, and every figure of the run moves with it."""
    direct = next((p for p in fixed if p.target == "direct" and p.rate == 200.0), None)
    if direct is None or "backend" not in direct.cpu_us:
        return ""
    cpu = direct.cpu_us["backend"]
    return (f"Machine slowdown: the backend alone cost {cpu:.0f} µs of CPU per request at 200 "
            f"RPS direct, against {QUIET_BACKEND_CPU_US:.0f} µs in the quiet run of "
            f"bench/results/gateway_overhead.md, so this run's CPU was about "
            f"{cpu / QUIET_BACKEND_CPU_US:.1f}x slower than quiet; latencies and sustained rates "
            "shift with it, for all three targets.")


def _chart(phases: Sequence[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"direct": "tab:gray", "gateway": "tab:blue", "litellm": "tab:red"}
    labels = {"direct": "backend direct", "gateway": "kvgate gateway", "litellm": "LiteLLM proxy"}
    for name in TARGETS:
        # One point per offered rate; the fixed-rate phase (longer) wins over a sweep phase.
        points: dict[float, Phase] = {}
        for p in phases:
            if p.target == name and p.completed:
                points.setdefault(p.rate, p)
        rates = sorted(points)
        ax.plot(rates, [points[r].p50 for r in rates], "o-", color=colors[name],
                label=f"{labels[name]} p50")
        ax.plot(rates, [points[r].p99 for r in rates], "s--", color=colors[name],
                label=f"{labels[name]} p99")
    ax.axhline(P99_LIMIT_MS, color="black", linewidth=0.8, linestyle=":",
               label=f"p99 limit {P99_LIMIT_MS:.0f} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered RPS (open loop)")
    ax.set_ylabel("latency from intended send, ms")
    ax.set_title("Instant backend: direct, through kvgate, through LiteLLM")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(options: PerfOptions) -> Section:
    duration = 2.0 if options.quick else 15.0
    sweep_duration = 2.0 if options.quick else 8.0
    sweeps = QUICK_SWEEPS if options.quick else SWEEPS
    litellm_env.ensure_installed()
    version = litellm_env.installed_version() or "?"
    from bench.common.localredis import start_redis

    options.workdir.mkdir(parents=True, exist_ok=True)
    options.results_dir.mkdir(parents=True, exist_ok=True)
    load_before = _load_average()
    gw_redis = start_redis(workdir=Path(tempfile.mkdtemp(prefix="gw-redis-", dir=options.workdir)))
    ll_redis = start_redis(workdir=Path(tempfile.mkdtemp(prefix="ll-redis-", dir=options.workdir)))
    procs: list[subprocess.Popen[Any]] = []
    proxy: litellm_env.Proxy | None = None
    try:
        backend, backend_port = start_server(
            [sys.executable, "-m", "bench.common.instant_backend", "--port", "0", "--model", POOL],
            "listening on")
        procs.append(backend)
        gw_config = options.workdir / "gateway.toml"
        gw_config.write_text(gateway_config(gw_redis.url, backend_port))
        asyncio.run(publish_state_once(gw_redis.url, [POOL]))
        gateway, gateway_port = start_server(
            [sys.executable, "-m", "gateway", "--config", str(gw_config), "--port", "0",
             "--log-level", "WARNING"], "listening on")
        procs.append(gateway)
        targets = {
            "direct": _Target("direct", backend_port, KEY, {"backend": backend.pid}),
            "gateway": _Target("gateway", gateway_port, KEY,
                               {"gateway": gateway.pid, "backend": backend.pid,
                                "redis": gw_redis.process.pid}),
        }
        # LiteLLM starts only after the backend and the gateway are measured: its start (tens
        # of seconds of CPU) and any backlog it holds would otherwise load their phases.
        fixed, sweep = _measure(list(targets.values()), duration, sweep_duration, sweeps)
        load_litellm = _load_average()
        ll_config = litellm_env.write_config(options.workdir / "litellm.yaml", backend_port,
                                             "127.0.0.1", ll_redis.port)
        from bench.common.localredis import free_port

        proxy = litellm_env.start_proxy(ll_config, free_port(), options.workdir / "litellm.log")

        def restart_litellm(target: _Target) -> None:
            nonlocal proxy
            assert proxy is not None
            proxy.stop()
            proxy = None
            proxy = litellm_env.start_proxy(ll_config, free_port(),
                                            options.workdir / "litellm.log")
            target.port = proxy.port
            target.pids["litellm"] = _worker_pid(proxy.process.pid)

        targets["litellm"] = _Target(
            "litellm", proxy.port, litellm_env.MASTER_KEY,
            {"litellm": _worker_pid(proxy.process.pid), "backend": backend.pid,
             "redis": ll_redis.process.pid}, restart=restart_litellm)
        ll_fixed, ll_sweep = _measure([targets["litellm"]], duration, sweep_duration, sweeps)
        fixed = sorted([*fixed, *ll_fixed], key=lambda p: (p.rate, TARGETS.index(p.target)))
        sweep += ll_sweep
        redis_calls = _redis_commands(ll_redis.port)
        litellm_log = (options.workdir / "litellm.log").read_text(errors="replace").splitlines()
        restarts = targets["litellm"].restarts
    finally:
        if proxy is not None:
            proxy.stop()
        stop_processes(procs)
        for r in (gw_redis, ll_redis):
            r.stop()
            shutil.rmtree(r.workdir, ignore_errors=True)
    load_after = _load_average()
    return _section(options, fixed, sweep, version, redis_calls, litellm_log, restarts,
                    (load_before, load_litellm, load_after), duration, sweep_duration,
                    ll_config)


def _section(options: PerfOptions, fixed: list[Phase], sweep: list[Phase], version: str,
             redis_calls: dict[str, int], litellm_log: list[str], restarts: int,
             loads: tuple[str, str, str], duration: float, sweep_duration: float, ll_config: Path
             ) -> Section:
    sustained = {name: highest_sustained(sweep, name, P99_LIMIT_MS) for name in TARGETS}
    added_rows, added = _added(fixed)
    gw200 = added["gateway@200"]
    # LiteLLM sustaining no rate of its sweep leaves no ratio to state; the check then holds
    # only if the gateway sustains at least ten times the sweep's lowest rate.
    floor = sustained["litellm"] or min(SWEEPS["litellm"])
    ratio = sustained["gateway"] / floor
    checks = [
        Check("gateway added p50 at 200 RPS", "<= 1 ms", f"{gw200['p50']:.2f} ms",
              gw200["p50"] <= 1.0),
        Check("gateway added p99 at 200 RPS", "<= 3 ms", f"{gw200['p99']:.2f} ms",
              gw200["p99"] <= 3.0),
        Check("RPS one gateway process sustains (p99 < 50 ms)", ">= 1,000",
              f"{sustained['gateway']:.0f}", sustained["gateway"] >= 1000),
        Check("gateway sustained RPS vs LiteLLM's", ">= 10x",
              ("" if sustained["litellm"] else ">= ")
              + f"{ratio:.1f}x ({sustained['gateway']:.0f} vs "
              + (f"{sustained['litellm']:.0f})" if sustained["litellm"]
                 else f"< {floor:.0f}, none of its sweep)"),
              ratio >= 10),
    ]
    chart = options.results_dir / CHART
    _chart([*fixed, *sweep], chart)
    top = {name: max(SWEEPS[name] if not options.quick else QUICK_SWEEPS[name])
           for name in TARGETS}
    commands = ", ".join(f"{k} {v}" for k, v in sorted(redis_calls.items(),
                                                         key=lambda kv: -kv[1])[:8])
    md = [
        f"Run on {time.strftime('%Y-%m-%d %H:%M')}: Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), load average (1, 5, 15 min) "
        f"{loads[0]} at the start, {loads[1]} when LiteLLM started (after the backend and the "
        f"gateway were measured), {loads[2]} at the end; other jobs may share the machine. "
        "Instant backend, one gateway process, one LiteLLM proxy worker, two private "
        "redis-servers and the load generator all on this machine, separate processes, loopback. "
        "Open loop (fixed-rate schedule, latency from the intended send time), non-streaming "
        "chat completion (2 messages, max_tokens 16), bearer key on every request."
        + (" **Quick mode: short phases, figures not meaningful.**" if options.quick else ""),
        "",
        f"LiteLLM {version} (`litellm[proxy]` from PyPI in its own venv), "
        "`litellm --config ... --num_workers 1`: model `demo` -> `openai/demo` at the instant "
        f"backend's `/v1`; deployment limits rpm {litellm_env.RPM_LIMIT:,} / tpm "
        f"{litellm_env.TPM_LIMIT:,} (never reached) enforced by `usage-based-routing-v2`, "
        "counted in its redis-server (`router_settings` redis_host / "
        "redis_port); master_key set, no database; quiet: `LITELLM_LOG=ERROR`, set_verbose "
        "false, turn_off_message_logging, disable_spend_logs, disable_error_logs, no callbacks. "
        f"Redis calls LiteLLM made during the run (top): {commands or 'none'}. "
        f"Proxy log lines over the run: {len(litellm_log)}, start banners included. After a "
        "phase it could not sustain, the proxy was restarted so that its abandoned backlog did "
        f"not load the next phase ({restarts} restarts); the other targets were given time to "
        "drain. The kvgate gateway: VIP tenant, fast path "
        "(GREEN with a large capacity, published once), access log off.",
        "",
        _contention(fixed),
        "",
        f"### Latency at fixed rates ({duration:.0f} s each)",
        "",
        *_table(fixed),
        "",
        "Added latency (target minus direct, same rate). An overloaded target's figures cover "
        "only the requests that finished within 30 s of the phase's end (see done / offered).",
        "",
        *added_rows,
        "",
        f"### Highest sustained rate ({sweep_duration:.0f} s per rate)",
        "",
        *_table(sweep),
        "",
        "Sustained: achieved >= 98% of offered, no errors, p99 <= 50 ms, at this rate and every "
        "lower rate of the target's sweep (a sweep stops after two failed rates). "
        + "; ".join(f"**{n}: {sustained[n]:.0f} RPS**"
                    + (" (the sweep's highest rate: a lower bound)"
                       if sustained[n] >= top[n] else "") for n in TARGETS) + ".",
        "",
    ]
    data = {
        "fixed": [dataclasses.asdict(p) for p in fixed],
        "sweep": [dataclasses.asdict(p) for p in sweep],
        "added_ms": added, "sustained_rps": sustained, "litellm_version": version,
        "litellm_config": ll_config.read_text() if ll_config.exists() else "",
        "litellm_redis_calls": redis_calls, "litellm_restarts": restarts,
        "litellm_log_tail": litellm_log[-20:], "load_average": list(loads),
    }
    return Section(title="Added latency and throughput vs LiteLLM", markdown="\n".join(md),
                   checks=checks, charts=[chart], data=data)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.latency",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output", help="markdown file (default: stdout)")
    p.add_argument("--results-dir", default=str(ROOT / "bench/results"))
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-perf-latency-"))
    try:
        section = run(PerfOptions(results_dir=Path(args.results_dir), workdir=workdir,
                                  quick=args.quick))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lines = [f"## {section.title}", "", section.markdown, "", "| check | target | value | met |",
             "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.target} | {c.value} | {'yes' if c.met else 'no'} |"
              for c in section.checks]
    lines += ["", *(f"![chart]({path.name})" for path in section.charts), ""]
    text = "\n".join(lines)
    if args.output:
        Path(args.output).write_text(text)
    print(text)
    return 0 if all(c.met for c in section.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
