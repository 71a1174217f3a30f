"""Section 4 of the performance suite: token estimation latency, cold and warm, 1/8/32 KB chats.

The measuring is bench/perf/estimator.py's (`python -m bench.perf.estimator` runs it alone);
this module only sizes the run, states the check and draws the chart.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from bench.perf import estimator
from bench.perf.perfreport import Check, PerfOptions, Section, save_figure

TITLE = "Token estimation latency, cold and warm"
WARM32_P99_MS = 1.0
FULL = {"runs_cold": 300, "runs_warm": 3000, "runs_async": 100}
# Enough runs for a p99 that is not simply the maximum, a few seconds in all.
QUICK = {"runs_cold": 30, "runs_warm": 300, "runs_async": 10}


def _chart(rows: list[estimator.Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    sizes = list(dict.fromkeys(r.size for r in rows))
    width = 0.8 / len(scenarios)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, scenario in enumerate(scenarios):
        xs, p50, p99 = [], [], []
        for j, size in enumerate(sizes):
            row = next((r for r in rows if r.size == size and r.scenario == scenario), None)
            if row is not None:
                xs.append(j + (i - (len(scenarios) - 1) / 2) * width)
                p50.append(row.p50_ms)
                p99.append(row.p99_ms)
        ax.bar(xs, p99, width * 0.95, alpha=0.85, label=f"{scenario} (p99; dot = p50)")
        ax.plot(xs, p50, "o", color="black", ms=3)
    ax.axhline(WARM32_P99_MS, color="red", ls="--", lw=1, label="target: warm 32 KB p99")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_yscale("log")
    ax.set_ylabel("ms per estimate")
    ax.set_title("Chat token estimate latency")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def run(options: PerfOptions) -> Section:
    sizes = QUICK if options.quick else FULL
    result = estimator.measure(**sizes)
    warm32 = result.warm32_p99_ms
    chart = options.results_dir / "performance-tokens.png"
    _chart(result.rows, chart)
    markdown = (
        f"{result.env}. Multi-turn mixed Chinese/English conversations; *cold*: unseen\n"
        "conversation and empty per-message cache; *warm*: the history was counted on an\n"
        "earlier turn and the request adds the assistant's reply and a new question (2 new),\n"
        "or only a new question (1 new). Every run is a different conversation; times are one\n"
        "synchronous `count_chat` call (the async row includes the hop to a worker thread).\n"
        f"Runs: {sizes['runs_cold']} cold, {sizes['runs_warm']} warm per size. Alone:\n"
        "`python -m bench.perf.estimator`.\n\n"
        f"{estimator.render(result.rows)}\n\n"
        f"Warm 32 KB p99 (the worse of the two warm scenarios): **{warm32:.3f} ms**.\n"
    )
    return Section(
        title=TITLE,
        markdown=markdown,
        checks=[Check("token estimate, warm 32 KB chat, p99", f"<= {WARM32_P99_MS:g} ms",
                      f"{warm32:.3f} ms", warm32 <= WARM32_P99_MS)],
        charts=[chart],
        data={"load_s": result.load_s, "runs": sizes, "warm32_p99_ms": warm32,
              "rows": [asdict(r) for r in result.rows]},
    )
