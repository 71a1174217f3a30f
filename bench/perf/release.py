"""Section 5 of the performance suite: scheduler release throughput and latency.

The measuring is bench/perf/scheduler_release.py's (`python -m bench.perf.scheduler_release` runs it
alone): a real redis-server and `python -m scheduler` process, /metrics stubs for the GPUs, this
process as the gateways. This module sizes the run, states the check and draws the chart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.perf import scheduler_release
from bench.perf.perfreport import Check, PerfOptions, Section, save_figure

TITLE = "Scheduler release throughput and latency"
RELEASES_PER_S = 5_000
POLL_MS = 50
FULL = {"tasks": 20_000, "samples": 600, "rate": 50.0}
# A few release batches (2,000 per tick): the quick run shows the path works, not the rate.
QUICK = {"tasks": 5_000, "samples": 100, "rate": 50.0}


def _chart(lat: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    names = ["p50", "p90", "p99", "max"]
    values = [lat[f"{n}_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar(names, values, color="tab:blue", alpha=0.85)
    ax.axhline(POLL_MS, color="grey", ls=":", lw=1, label=f"poll interval ({POLL_MS} ms)")
    ax.axhline(lat["target_ms"], color="red", ls="--", lw=1,
               label=f"poll + 10 ms ({lat['target_ms']:.0f} ms)")
    ax.set_ylabel("ms, capacity freed to gateway woken")
    ax.set_title("Scheduler release latency")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def run(options: PerfOptions) -> Section:
    sizes = QUICK if options.quick else FULL
    tp, lat = asyncio.run(scheduler_release.measure(
        int(sizes["tasks"]), int(sizes["samples"]), sizes["rate"], POLL_MS))
    rate = tp["rate_from_capacity"]
    chart = options.results_dir / "performance-release.png"
    _chart(lat, chart)
    markdown = f"""Real redis-server and `python -m scheduler` (poll interval {POLL_MS} ms, \
release batch 2,000 per tick); the vLLM nodes are /metrics stubs and the suite's process \
plays the gateways (admit, wake-up subscription, settle). Alone: \
`python -m bench.perf.scheduler_release`; method in that module's docstring.

**Throughput**: {tp['tasks']:,.0f} tasks queued on a 4-node pool reporting a full cache, then \
the nodes report an empty one; timed from that moment to the gateway's last wake-up.

| figure | value |
|---|---|
| first wake-up after capacity freed | {tp['first_wakeup_ms']:.1f} ms |
| all woken after capacity freed | {tp['total_s'] * 1000:.0f} ms |
| **releases/s, capacity freed to last wake-up** | **{rate:,.0f}** |
| releases/s while releasing (first to last wake-up) | {tp['rate_while_releasing']:,.0f} |
| release bursts (ticks) | {tp['bursts']:.0f} |

**Latency**: a 1-node pool kept exactly full with a backlog behind it; at Poisson times \
({sizes['rate']:.0f}/s) the gateway settles one running task, freeing room for exactly one \
queued task; from the settle call's start to that task's wake-up. Meanwhile \
{scheduler_release.RUNNING_DEFAULT:,} tasks stay in flight in the 4-node pool (four nodes at \
vLLM's largest default max_num_seqs): under the "peak" projection the leader projects every \
task in flight on every tick.

| samples | p50 ms | p90 ms | p99 ms | max ms | mean ms |
|---:|---:|---:|---:|---:|---:|
| {lat['samples']:.0f} | {lat['p50_ms']:.1f} | {lat['p90_ms']:.1f} | {lat['p99_ms']:.1f} \
| {lat['max_ms']:.1f} | {lat['mean_ms']:.1f} |

A release waits for the next tick, so latency spreads over one poll interval (mean about half \
of it) plus the tick's own work; the scheduler's own target is p99 <= poll interval + 10 ms \
({lat['target_ms']:.0f} ms).
"""
    return Section(
        title=TITLE,
        markdown=markdown,
        checks=[Check("scheduler releases/s (capacity freed to last wake-up)",
                      f">= {RELEASES_PER_S:,}/s", f"{rate:,.0f}/s", rate >= RELEASES_PER_S)],
        charts=[chart],
        data={"poll_ms": POLL_MS, "runs": sizes, "throughput": tp, "latency": lat},
    )
