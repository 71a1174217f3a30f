"""The goodput criterion's fallback: where the measured frontier shows that no setting reaches
both the VIP bar and the goodput bar, the best goodput that keeps the VIP bar.

The frontier is the ideal admission replayed on each matrix cell (bench.burst.ideal, its
records in ``ideal-<scale>.json``): below the KV bar, and below it at each of a series of
running caps (its ``vip_frontier``: the one lever on VIP's first token once its prefill is
first in line). Where the ideal's goodput below the KV bar falls short of ``GOODPUT_BAR`` by
more than a margin (``slack``: how far any arm was ever above the ideal in its cell, since a
greedy ideal is not an upper bound), the bar is out of reach, and an arm passes the criterion
if it keeps the VIP bar and its goodput, plus that margin, is at least the best goodput of the
frontier's points that keep the VIP bar (``best_keeping_vip``; a point is judged against its
own calm VIP P99, the replay's, as an arm is against arm (a)'s). Where no point of the frontier
keeps the VIP bar there is nothing measured to reach, and the arm passes if no other valid arm
of the cell that keeps the VIP bar has more goodput. Elsewhere the criterion is the bar itself.
Both bench.burst.ideal and the matrix's table judge with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.burst.criteria import CRITERIA, GOODPUT_BAR, VIP_RATIO_BAR


def load_ideal(path: Path) -> list[dict[str, Any]]:
    """The ideal's cell records in ``path`` (none when it is not there)."""
    return list(json.loads(path.read_text())) if path.exists() else []


def cell_key(r: dict[str, Any]) -> str:
    """A cell's identity, the same in the ideal's records and the matrix's."""
    return json.dumps(r["cell"], sort_keys=True)


def arm_of(matrix: dict[str, Any] | None, arm: str) -> dict[str, Any] | None:
    """``arm``'s record in a matrix cell record (None: not run there)."""
    if matrix is None:
        return None
    return next((a for a in matrix["arms"] if a["arm"] == arm), None)


def number(arm: dict[str, Any] | None, key: str) -> float:
    """The figure of ``arm``'s verdict ``key`` (NaN: none)."""
    if arm is None:
        return math.nan
    v = next((v for v in arm["verdicts"] if v["key"] == key), None)
    return math.nan if v is None else float(v.get("number", math.nan))


def ok(arm: dict[str, Any] | None, key: str) -> bool | None:
    """Whether ``arm`` passed verdict ``key`` (None: not judged)."""
    if arm is None:
        return None
    v = next((v for v in arm["verdicts"] if v["key"] == key), None)
    return None if v is None else v["ok"]


def keeps_vip(point: dict[str, Any]) -> bool:
    """The ideal's point keeps the VIP bar: its VIP P99 in the burst within the bar of its own
    calm P99 (a point without those figures keeps nothing)."""
    burst, base = point.get("vip_p99_burst_ms"), point.get("vip_p99_base_ms")
    if burst is None or base is None:
        return False
    return float(burst) <= VIP_RATIO_BAR * float(base)


def best_keeping_vip(record: dict[str, Any]) -> dict[str, Any] | None:
    """The ideal's point below the KV bar with the most goodput that keeps the VIP bar (None:
    no point keeps it)."""
    points = [record["points"]["under_bar"], *record.get("vip_frontier", [])]
    kept = [p for p in points if keeps_vip(p)]
    return max(kept, key=lambda p: float(p["goodput_ratio"]), default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class Frontier:
    """One cell's goodput criterion judged with the fallback, for one arm."""

    reachable: bool
    """The ideal under the KV bar reaches the goodput bar."""
    passed: bool | None
    """The criterion: the bar where reachable; else the arm keeps the VIP bar and reaches the
    frontier's best goodput that keeps it, or, where no point of the frontier keeps it, no
    other arm that keeps it has more goodput (None: the arm's figures are not there, not valid,
    or its VIP verdict is not judged)."""
    target: float | None = None
    """Out of reach: the frontier's best goodput that keeps the VIP bar, the figure the arm
    must reach less the margin (None: judged against the other arms, or reachable)."""


def slack(records: Sequence[dict[str, Any]], matrix: Sequence[dict[str, Any]]) -> float:
    """How far any valid arm's goodput was above the ideal's best point in its cell: the greedy
    ideal is not an upper bound, so a cell counts as out of reach only this far below the bar."""
    by_cell = {cell_key(m): m for m in matrix}
    gaps = [0.0]
    for r in records:
        m = by_cell.get(cell_key(r))
        best = max(float(p["goodput_ratio"]) for p in r["points"].values())
        gaps += [number(a, "goodput") - best for a in (m or {}).get("arms", []) if a["valid"]]
    return max(g for g in gaps if not math.isnan(g))


def frontier(ideal: dict[str, Any], matrix: dict[str, Any] | None, arm: str = "c",
             margin: float = 0.0) -> Frontier:
    """``arm``'s goodput criterion in one cell, counting the bar out of reach where the ideal
    below the KV bar, plus ``margin``, falls short of it."""
    reach = float(ideal["points"]["under_bar"]["goodput_ratio"])
    # Only a measured shortfall opens the fallback: without the ideal's figure the bar stands.
    reachable = math.isnan(reach) or reach + margin >= GOODPUT_BAR
    mine = arm_of(matrix, arm)
    if mine is None or not mine["valid"] or matrix is None:
        return Frontier(reachable, None)
    goodput = number(mine, "goodput")
    if reachable:
        return Frontier(True, goodput >= GOODPUT_BAR)
    vip = ok(mine, "vip_p99")
    if vip is None:  # its reference, arm (a), is not valid: as the VIP criterion, not judged
        return Frontier(False, None)
    best = best_keeping_vip(ideal)
    target = None if best is None else float(best["goodput_ratio"])
    # An arm with no goodput figure is ahead of no one (all() over no rivals would pass it).
    if math.isnan(goodput) or not vip:
        return Frontier(False, False, target)
    if target is not None:
        return Frontier(False, goodput + margin >= target, target)
    rivals = [number(a, "goodput") for a in matrix["arms"]
              if a["arm"] != arm and a["valid"] and ok(a, "vip_p99")]
    return Frontier(False, all(goodput >= g for g in rivals if not math.isnan(g)))


def one_draw(ideal_under_bar: dict[str, Any], arms: Sequence[dict[str, Any]]
             ) -> tuple[float, dict[str, Frontier]]:
    """The goodput criterion with the fallback for each arm of a single run (one draw, outside
    the matrix): ``ideal_under_bar`` is the ideal's point below the KV bar on the same schedule
    (bench.burst.idealpoint.replay) and ``arms`` are as matrix.cell_record writes them (arm,
    valid, verdicts). Returns the margin (this draw's own ``slack``) and each arm's verdict."""
    ideal = {"cell": {}, "points": {"under_bar": ideal_under_bar}}
    run = {"cell": {}, "arms": list(arms)}
    margin = slack([ideal], [run])
    return margin, {a["arm"]: frontier(ideal, run, a["arm"], margin) for a in arms}


def others_pass(arm: dict[str, Any] | None) -> bool:
    """The arm meets the six criteria other than goodput."""
    return arm is not None and all(v["ok"] for v in arm["verdicts"]
                                   if v["key"] in CRITERIA and v["key"] != "goodput")


@dataclasses.dataclass(frozen=True, slots=True)
class Tally:
    """One arm over the cells that have an ideal record and a valid run of the arm."""

    judged: int = 0
    goodput: int = 0
    """Cells passing the goodput criterion with the fallback."""
    all_seven: int = 0
    """Cells passing it and the six other criteria."""


def tally(matrix: Sequence[dict[str, Any]], ideal: Sequence[dict[str, Any]],
          arms: Sequence[str]) -> dict[str, Tally]:
    """Per arm, the goodput criterion and all seven judged with the fallback."""
    margin = slack(ideal, matrix)
    by_cell = {cell_key(r): r for r in ideal}
    out: dict[str, Tally] = {}
    for name in arms:
        judged = goodput = seven = 0
        for m in matrix:
            r = by_cell.get(cell_key(m))
            f = frontier(r, m, name, margin) if r is not None else None
            if f is None or f.passed is None:
                continue
            judged += 1
            goodput += f.passed
            seven += f.passed and others_pass(arm_of(m, name))
        out[name] = Tally(judged, goodput, seven)
    return out
