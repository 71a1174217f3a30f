"""The goodput criterion's fallback: where the measured frontier shows that no setting reaches
both the VIP bar and the goodput bar, the best goodput that keeps the VIP bar.

The frontier's top is the ideal admission replayed on each matrix cell (bench.burst.ideal, its
records in ``ideal-<scale>.json``). Where its goodput below the KV bar falls short of
``GOODPUT_BAR`` by more than a margin (``slack``: how far any arm was ever above the ideal in
its cell, since a greedy ideal is not an upper bound), an arm passes the criterion if it keeps
the VIP bar and no valid arm of the same cell that keeps it has more goodput. Elsewhere the
criterion is the bar itself. Both bench.burst.ideal and the matrix's table judge with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.burst.criteria import CRITERIA, GOODPUT_BAR


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


@dataclasses.dataclass(frozen=True, slots=True)
class Frontier:
    """One cell's goodput criterion judged with the fallback, for one arm."""

    reachable: bool
    """The ideal under the KV bar reaches the goodput bar."""
    passed: bool | None
    """The criterion: the bar where reachable; else the arm keeps the VIP bar and no other arm
    that keeps it has more goodput (None: the arm's figures are not there or not valid)."""


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
    # An arm with no goodput figure is ahead of no one (all() over no rivals would pass it).
    if math.isnan(goodput) or not ok(mine, "vip_p99"):
        return Frontier(False, False)
    rivals = [number(a, "goodput") for a in matrix["arms"]
              if a["arm"] != arm and a["valid"] and ok(a, "vip_p99")]
    return Frontier(False, all(goodput >= g for g in rivals))


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
