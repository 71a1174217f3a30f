"""The matrix's plot (``matrix-<scale>.png``): every cell's figure on each criterion, per arm.

    python -m bench.burst.matrixplot bench/results/matrix            # from the cell records
    python -m bench.burst.matrixplot bench/results/matrix --scale full

One panel per criterion with a number (KV peak, VIP P99 in the burst over (a)'s calm P99,
goodput as work, when the last Batch request was done, how many were not), its bar drawn
across, cells along the x axis grouped by mix, then size, then seed, one marker per arm. An
arm run left out of the aggregate for lag is drawn hollow: its figure is shown, not judged.
The matrix writes it after every cell beside ``matrix-<scale>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render straight to a file
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from bench.burst.criteria import (
    GOODPUT_BAR,
    KV_BAR,
    VIP_RATIO_BAR,
    apply_validity,
    void_invalid_reference,
)
from bench.burst.expconfig import ARM_TITLES, ARMS
from bench.burst.fallback import number

_COLORS = {"a": "tab:gray", "b": "tab:orange", "c": "tab:blue", "d": "tab:purple"}
_MARKERS = {"a": "o", "b": "s", "c": "D", "d": "^"}


@dataclass(frozen=True, slots=True)
class Panel:
    key: str
    """A verdict key, or ``batch_left`` (the summary's count of unfinished Batch requests)."""
    title: str
    bar: float | None
    log: bool = False
    scale: float = 1.0
    """Multiplies the figure (fractions shown as percent)."""


PANELS = (
    Panel("kv_peak", f"KV peak, % (bar: below {KV_BAR:.0%})", KV_BAR * 100, scale=100.0),
    Panel("vip_p99", f"VIP P99 in the burst / (a)'s calm VIP P99 (bar: {VIP_RATIO_BAR:.2f})",
          VIP_RATIO_BAR, log=True),
    Panel("goodput", f"goodput as work, % of its upper bound (bar: {GOODPUT_BAR:.0%})",
          GOODPUT_BAR * 100, scale=100.0),
    Panel("batch_done", "last Batch request done, bursts after the burst's end, when all were "
          "(bar: 2)", 2.0),
    Panel("batch_left", "Batch requests sent before the burst's end and not done", None),
)


@dataclass(frozen=True, slots=True)
class Point:
    x: int
    """The cell's place on the x axis."""
    y: float
    valid: bool


def load_records(out: Path, scale: str) -> list[dict[str, Any]]:
    """The cell records of `scale` in a matrix's output directory (``<out>/cells``), with no
    verdict judged against an invalid arm (a) (criteria.void_invalid_reference), each arm judged
    by the validity rules of this code (criteria.apply_validity)."""
    return [void_invalid_reference(apply_validity(json.loads(p.read_text())))
            for p in sorted((out / "cells").glob(f"{scale}-*.json"))]


def ordered(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: (r["cell"]["mix"], r["cell"]["size"],
                                          r["cell"]["seed"]))


def figure(arm: dict[str, Any], key: str) -> float:
    """The arm's figure on `key` (NaN when the cell has none); non-finite numbers are stored
    as strings, which float() reads."""
    if key == "batch_left":
        return float(arm["summary"]["batch_unfinished"])
    return number(arm, key)


def series(records: Sequence[dict[str, Any]], panel: Panel) -> dict[str, list[Point]]:
    """Per arm, the finite figures of `panel` at each cell's place (cells in `ordered`
    order); a cell whose figure is not finite (no Batch done time while some are left, a
    missing reference) has no point."""
    out: dict[str, list[Point]] = {}
    for x, rec in enumerate(ordered(records)):
        for arm in rec["arms"]:
            y = figure(arm, panel.key) * panel.scale
            if math.isfinite(y):
                out.setdefault(arm["arm"], []).append(Point(x, y, bool(arm["valid"])))
    return out


def plot_matrix(records: Sequence[dict[str, Any]], path: Path) -> None:
    cells = ordered(records)
    arms = [a for a in ARMS if any(x["arm"] == a for r in cells for x in r["arms"])]
    width = max(8.0, 0.32 * len(cells) + 3)
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(width, 2.6 * len(PANELS)), sharex=True)
    offsets = {a: (i - (len(arms) - 1) / 2) * 0.16 for i, a in enumerate(arms)}
    for ax, panel in zip(axes, PANELS, strict=True):
        for arm, points in series(cells, panel).items():
            for hollow in (False, True):
                pts = [p for p in points if p.valid != hollow]
                if not pts:
                    continue
                ax.scatter([p.x + offsets[arm] for p in pts], [p.y for p in pts],
                           s=18, marker=_MARKERS[arm], linewidths=0.9,
                           facecolors="none" if hollow else _COLORS[arm],
                           edgecolors=_COLORS[arm])
        if panel.bar is not None:
            ax.axhline(panel.bar, color="black", lw=0.8, ls="--")
        if panel.log:
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=9, loc="left")
        ax.grid(axis="y", alpha=0.3)
        _mark_mixes(ax, cells, named=ax is axes[0])
    # One entry per arm in the records, drawn apart from the points: a panel may show no valid
    # point of an arm, or none at all (every run invalid), and the legend still names them.
    axes[0].legend(handles=[Line2D([], [], ls="none", marker=_MARKERS[a], color=_COLORS[a],
                                   markersize=5, label=ARM_TITLES[a]) for a in arms],
                   fontsize=7, ncol=max(1, len(arms)), loc="lower left")
    axes[-1].set_xticks(range(len(cells)))
    axes[-1].set_xticklabels([f"n{r['cell']['size']} s{r['cell']['seed']}" for r in cells],
                             rotation=90, fontsize=6)
    scale = cells[0]["cell"]["scale"] if cells else "?"
    fig.suptitle(f"Burst matrix, {scale} scale: {len(cells)} cells (hollow: run invalid for "
                 "lag, not judged)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mark_mixes(ax: Any, cells: Sequence[dict[str, Any]], named: bool) -> None:
    """A line between mixes, and (`named`) the mix's name over its cells."""
    start = 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or cells[i]["cell"]["mix"] != cells[start]["cell"]["mix"]:
            if i < len(cells):
                ax.axvline(i - 0.5, color="0.6", lw=0.8)
            if named:
                ax.text((start + i - 1) / 2, 1.0, cells[start]["cell"]["mix"], ha="center",
                        va="bottom", fontsize=8, transform=ax.get_xaxis_transform())
            start = i


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst.matrixplot",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("out", type=Path, help="the matrix's --out directory (holds cells/)")
    p.add_argument("--scale", default="reduced")
    args = p.parse_args(argv)
    records = load_records(args.out, args.scale)
    if not records:
        print(f"error: no {args.scale} cells in {args.out / 'cells'}", file=sys.stderr)
        return 2
    path = args.out / f"matrix-{args.scale}.png"
    plot_matrix(records, path)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
