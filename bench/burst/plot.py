"""The burst timeline plot (<name>.png): one column per arm; KV usage per node, queue depth
per tier, admitted and rejected rates, VIP TTFT, over simulated time with the burst shaded."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render straight to a file
import matplotlib.pyplot as plt

from admission.tiers import Tier
from bench.burst.arm import ArmResult
from bench.burst.expconfig import ARM_TITLES

_TIER_COLORS = {Tier.VIP: "tab:red", Tier.NORMAL: "tab:blue", Tier.BATCH: "tab:green"}


_BIN_SIM_S = 10.0
"""Rates are counted in bins of this many simulated seconds: Poisson counts per second are
too noisy to read at a few requests per second."""


def _rate(events: Sequence[tuple[float, Tier]], tier: Tier, ts: float, end: float
          ) -> tuple[list[float], list[float]]:
    """Events per simulated second, at the middle of each bin."""
    width = _BIN_SIM_S / ts
    counts = Counter(int(t / width) for t, k in events if k is tier)
    bins = range(int(end / width) + 1)
    return [(i + 0.5) * _BIN_SIM_S for i in bins], [counts.get(i, 0) / _BIN_SIM_S for i in bins]


def plot(results: Sequence[ArmResult], path: Path) -> None:
    cols = len(results)
    fig, axes = plt.subplots(4, cols, figsize=(5.2 * cols, 12), sharex="col", squeeze=False)
    ttft_max = 1.0
    for col, result in enumerate(results):
        s = result.settings
        ts = s.time_scale
        b0, b1 = (x * ts for x in s.profile.window("burst"))
        end = result.stopped_at
        ax_kv, ax_q, ax_rate, ax_ttft = (axes[r][col] for r in range(4))
        for ax in (ax_kv, ax_q, ax_rate, ax_ttft):
            ax.axvspan(b0, b1, color="orange", alpha=0.12, lw=0)
            ax.grid(alpha=0.3)
        ax_kv.set_title(ARM_TITLES[result.arm])
        times = [smp.t * ts for smp in result.samples]
        for i in range(s.nodes):
            kv = [smp.nodes[i].kv * 100 if smp.nodes[i].up else math.nan
                  for smp in result.samples]
            ax_kv.plot(times, kv, lw=0.8, label=f"node-{i}")
        ax_kv.axhline(80, color="k", ls="--", lw=0.8)
        ax_kv.set_ylim(0, 105)
        for tier in Tier:
            depth = [smp.queues.get(tier.label, math.nan) for smp in result.samples]
            if not all(math.isnan(d) for d in depth):
                ax_q.plot(times, depth, color=_TIER_COLORS[tier], lw=0.9,
                          label=f"{tier.label} queued")
        waiting = [sum(n.waiting for n in smp.nodes) for smp in result.samples]
        ax_q.plot(times, waiting, color="0.4", ls=":", lw=0.9, label="engines' waiting")
        for tier in Tier:
            xs, ys = _rate(result.admitted, tier, ts, end)
            ax_rate.plot(xs, ys, color=_TIER_COLORS[tier], lw=0.8, label=f"{tier.label} admitted")
            xs, ys = _rate(result.rejected, tier, ts, end)
            if any(ys):
                ax_rate.plot(xs, ys, color=_TIER_COLORS[tier], lw=0.8, ls="--",
                             label=f"{tier.label} 429")
        ok_x, ok_y, bad_x = [], [], []
        burst_end = b1 / ts
        for o in result.outcomes:
            if o.req.tier is not Tier.VIP or not o.req.stream or o.req.at > end:
                continue
            if not o.finished and o.req.at >= burst_end:
                continue  # censored: sent after the burst, cut off by the arm's end
            if o.ttft is not None:
                ok_x.append(o.req.at * ts)
                ok_y.append(o.ttft * ts * 1000)
            else:
                bad_x.append(o.req.at * ts)
        ax_ttft.scatter(ok_x, ok_y, s=3, color=_TIER_COLORS[Tier.VIP], label="VIP TTFT")
        ttft_max = max([ttft_max, *ok_y])
        if bad_x:
            ax_ttft.scatter(bad_x, [ttft_max] * len(bad_x), s=12, marker="x", color="k",
                            label="VIP failed")
        ax_ttft.set_yscale("log")
        ax_ttft.set_xlabel("simulated seconds")
    axes[0][0].set_ylabel("KV-cache usage per node (%)")
    axes[1][0].set_ylabel("queued requests")
    axes[2][0].set_ylabel(f"answers per simulated second ({_BIN_SIM_S:g} s bins)")
    axes[3][0].set_ylabel("VIP TTFT (simulated ms)")
    for row in range(4):
        axes[row][cols - 1].legend(fontsize=7, loc="upper right")
    for col in range(cols):
        axes[3][col].set_ylim(1, ttft_max * 2)
    fig.suptitle("400% long-text burst (shaded): KV usage, queues, admissions, VIP TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
