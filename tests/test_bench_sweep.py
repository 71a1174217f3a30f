"""bench.burst.sweep: the points it parses, how each is judged against the one arm (a), the
best goodput that keeps the VIP bar, and one tiny sweep end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from admission.tiers import Tier
from bench.burst.matrix import Cell
from bench.burst.points import Point
from bench.burst.report import ArmSummary
from bench.burst.sweep import best, judge_points, main, markdown


def _summary(arm: str, calm_p99: float, burst_p99: float, goodput: float,
             invalid: list[str] | None = None) -> ArmSummary:
    return ArmSummary(arm=arm, kv_peak=0.7, preemptions=0, crashed_nodes=0,
                      success={t: 1.0 for t in Tier}, counted={t: 10 for t in Tier},
                      vip_ttft_base=(80.0, calm_p99), vip_ttft_burst=(100.0, burst_p99),
                      last_batch_s=10.0, batch_unfinished=0, goodput=1.0,
                      goodput_ratio=goodput, invalid=invalid or [])


def test_points_parse_and_name_themselves() -> None:
    assert Point.parse("default") == Point()
    assert Point.parse("o=120") == Point(vip_ttft_objective_ms=120)
    assert Point.parse("o=120,r=16") == Point(120, 16)
    assert Point.parse("r=0").max_engine_running == 0
    assert Point.parse("m=0,s=0") == Point(running_min=0, vip_slowdown=0.0)
    assert Point.parse("l=0") == Point(lane_nodes=0) and Point(lane_nodes=0).label == "l=0"
    assert Point.parse("q=0") == Point(quiet_nodes=0) and Point(quiet_nodes=0).label == "q=0"
    assert Point.parse("s=1.5").vip_slowdown == 1.5
    assert Point.parse("l=1,ls=1.5") == Point(lane_nodes=1, lane_slowdown=1.5)
    assert Point.parse("l=1,lo=1024,le=1") == Point(lane_nodes=1, lane_output=1024,
                                                    lane_on_miss=True)
    assert Point.parse("le=0").lane_on_miss is False
    for spec in ("default", "o=120", "r=16", "o=120,r=16", "m=0,s=0", "s=1.5,m=4", "l=1,ls=2",
                 "l=1,ls=2,lo=1024,le=1", "le=0"):
        assert Point.parse(spec).label == (spec if spec != "s=1.5,m=4" else "m=4,s=1.5")
    for bad in ("o=0", "x=3", "o", "", "r=-1", "o=fast", "s=0.5", "m=-1", "ls=0.9", "ls=101",
                "le=2", "lo=-1"):
        with pytest.raises(ValueError):
            Point.parse(bad)


def test_a_point_changes_only_its_own_settings_of_the_cell() -> None:
    base = Cell("reduced", "generation", 2, 1).settings()
    changed = Point(120, 16).apply(base)
    assert (changed.vip_ttft_objective_ms, changed.max_engine_running) == (120, 16)
    assert dataclasses.replace(changed, vip_ttft_objective_ms=None,
                               max_engine_running=None) == base
    assert Point().apply(base) == base


def test_best_is_the_highest_goodput_among_valid_points_that_keep_the_vip_bar() -> None:
    settings = Cell("reduced", "article", 2, 1).settings()
    reference = _summary("a", calm_p99=100.0, burst_p99=9_000.0, goodput=0.7)
    runs = [(Point(), _summary("c", 110.0, 190.0, 0.80)),              # x1.90: over the bar
            (Point(120), _summary("c", 110.0, 118.0, 0.60)),            # x1.18: keeps it
            (Point(80), _summary("c", 110.0, 115.0, 0.65)),             # keeps it, more goodput
            (Point(60), _summary("c", 110.0, 100.0, 0.90, ["lag"]))]    # invalid: left out
    rows = judge_points(reference, runs, settings)
    assert [r.keeps_vip_bar for r in rows] == [False, True, True, False]
    top = best(rows)
    assert top is not None and top.point == Point(80)
    text = markdown(Cell("reduced", "article", 2, 1), reference, rows, "cmd", "abc", 60.0)
    assert "Best goodput that keeps the VIP bar: 65.0% at `o=80`." in text
    assert "| default | x1.90 of (a) calm" in text and "INVALID: lag" in text
    assert best(rows[:1]) is None
    assert "no valid point keeps it" in markdown(Cell("reduced", "article", 2, 1), reference,
                                                 rows[:1], "cmd", "abc", 60.0)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_one_point_end_to_end_writes_the_table_and_the_json(tmp_path: Path) -> None:
    assert main(["--scale", "ci", "--mix", "article", "--size", "2", "--seed", "1", "r=16",
                 "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]) == 0
    table = (tmp_path / "out" / "sweep-ci-article-n2-s1.md").read_text()
    record = json.loads((tmp_path / "out" / "sweep-ci-article-n2-s1.json").read_text())
    assert "| r=16 |" in table and "Best goodput that keeps the VIP bar" in table
    assert [p["point"] for p in record["points"]] == ["r=16"]
    keys = [v["key"] for v in record["points"][0]["verdicts"]]
    assert "vip_p99" in keys and "goodput" in keys
    assert record["reference"]["summary"]["arm"] == "a"
