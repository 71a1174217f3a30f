"""The matrix plot reads each cell's figures where the table does, and renders them."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from bench.burst.matrixplot import PANELS, Point, figure, plot_matrix, series

PANEL = {p.key: p for p in PANELS}


def arm(name: str, valid: bool, kv: float, batch_done: float, left: int) -> dict[str, Any]:
    # As matrix.cell_record writes them: non-finite numbers stored as strings.
    done = "inf" if math.isinf(batch_done) else batch_done
    return {"arm": name, "valid": valid,
            "verdicts": [{"key": "kv_peak", "value": "", "ok": kv < 0.8, "number": kv},
                         {"key": "batch_done", "value": "", "ok": False, "number": done}],
            "summary": {"batch_unfinished": left}}


def cell(mix: str, size: int, seed: int, *arms: dict[str, Any]) -> dict[str, Any]:
    return {"cell": {"scale": "reduced", "mix": mix, "size": size, "seed": seed},
            "arms": list(arms)}


RECORDS = [
    cell("generation", 2, 1, arm("a", True, 0.7, math.inf, 12), arm("c", True, 0.6, 2.5, 0)),
    cell("article", 2, 10, arm("a", True, 1.0, 1.5, 0), arm("c", False, 0.75, 1.2, 0)),
    cell("article", 2, 9, arm("a", True, 0.99, math.inf, 3), arm("c", True, 0.74, 1.9, 0)),
]


def test_cells_are_placed_by_mix_size_then_seed_and_figures_scaled() -> None:
    kv = series(RECORDS, PANEL["kv_peak"])
    # article s9, article s10, generation s1; percent.
    assert kv["a"] == [Point(0, 99.0, True), Point(1, 100.0, True), Point(2, 70.0, True)]
    assert kv["c"] == [Point(0, 74.0, True), Point(1, 75.0, False), Point(2, 60.0, True)]


def test_a_figure_that_is_not_finite_has_no_point_and_counts_come_from_the_summary() -> None:
    done = series(RECORDS, PANEL["batch_done"])
    assert done["a"] == [Point(1, 1.5, True)]
    assert [p.y for p in done["c"]] == [1.9, 1.2, 2.5]
    left = series(RECORDS, PANEL["batch_left"])
    assert [p.y for p in left["a"]] == [3.0, 0.0, 12.0]
    assert math.isnan(figure(RECORDS[0]["arms"][0], "vip_p99"))


def test_the_plot_is_written_as_a_png(tmp_path: Path) -> None:
    path = tmp_path / "matrix-reduced.png"
    plot_matrix(RECORDS, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_run_invalid_still_plots_with_a_legend_and_no_warning(tmp_path: Path) -> None:
    """The legend names the arms apart from the points, so a matrix whose every run is hollow
    (invalid) renders without matplotlib's "no artists with labels" warning."""
    records = [cell("chat", 2, 1, arm("a", False, 0.7, 1.0, 0), arm("c", False, 0.6, 1.0, 0))]
    path = tmp_path / "matrix-reduced.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_matrix(records, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
