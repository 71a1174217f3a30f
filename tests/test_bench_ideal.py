"""The ideal admission per matrix cell: the replay's Batch deadline, the valuation against the
arms' bound, and the goodput criterion's fallback."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from admission.tiers import Tier
from bench.burst.capacity import ideal_replay
from bench.burst.criteria import CRITERIA, GOODPUT_BAR
from bench.burst.fallback import best_keeping_vip, frontier, slack, tally
from bench.burst.ideal import (
    RUNNING_CAPS,
    cell_record,
    deadline_load,
    least_seconds,
    main,
    merge,
    render,
)
from bench.burst.idealpoint import POINTS
from bench.burst.matrix import Cell
from bench.burst.workload import PlannedRequest
from bench.sim.config import SimConfig
from bench.sim.engine import Engine, SimRequest


def _batch_and_vip(seed: int) -> list[PlannedRequest]:
    """Long generations in the first 20 s, VIP chats throughout."""
    rng = random.Random(seed)
    requests = [PlannedRequest(i, "gen", Tier.BATCH, at=rng.uniform(0, 20),
                               prompt_tokens=rng.randint(100, 400),
                               output_tokens=rng.randint(200, 800), stream=False)
                for i in range(40)]
    requests += [PlannedRequest(100 + i, "vip", Tier.VIP, at=0.5 * i, prompt_tokens=200,
                                output_tokens=20, stream=True) for i in range(60)]
    return requests


def test_the_replay_measures_the_batch_deadline_only_when_asked() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=4096)
    requests = _batch_and_vip(1)
    window = (5.0, 20.0)
    plain = ideal_replay(config, 2, requests, 1.0, window)
    assert plain.batch_left is None and plain.last_batch_s is None
    ample = ideal_replay(config, 2, requests, 1.0, window, drain_s=10_000.0)
    assert ample.batch_left == 0
    assert ample.last_batch_s is not None and 0 < ample.last_batch_s < 10_000.0
    # A deadline before the last one finished leaves some, and says when none was the last.
    short = ideal_replay(config, 2, requests, 1.0, window, drain_s=ample.last_batch_s / 2)
    assert short.batch_left is not None and short.batch_left > 0
    assert short.last_batch_s is None
    # Draining changes nothing the burst's window counted.
    assert ample.counted == plain.counted and ample.counted_before == plain.counted_before
    assert sum(ample.counted) > 0


@pytest.mark.parametrize(("prompt", "output"), [(1, 1), (300, 1), (300, 2), (900, 57)])
def test_a_request_alone_costs_its_least_time_plus_the_steps_fixed_part(
        prompt: int, output: int) -> None:
    config = SimConfig(capacity_scale=0.25, max_model_len=4096)
    engine = Engine(config)
    engine.add(SimRequest("r", prompt_tokens=prompt, max_tokens=output), 0.0)
    now, steps = 0.0, 0
    while engine.has_work():
        plan = engine.schedule(now)
        now += engine.step_seconds(plan)
        engine.complete(plan, now)
        steps += 1
    assert now - steps * config.step_costs.fixed_s == pytest.approx(
        least_seconds(prompt, output, config))


def test_the_work_due_by_the_deadline_is_batch_before_the_end_and_the_rest_before_it() -> None:
    settings = Cell("ci", "chat", 2, 1).settings()
    ts = settings.time_scale
    end = settings.profile.window("burst")[1]  # wall seconds, as requests are planned
    deadline = end + settings.drain_factor * settings.burst_sim_s / ts

    def req(i: int, tier: Tier, at: float) -> PlannedRequest:
        return PlannedRequest(i, "x", tier, at=at, prompt_tokens=100 * (i + 1),
                              output_tokens=10 * (i + 1), stream=False)
    due = [req(0, Tier.BATCH, end - 1), req(1, Tier.NORMAL, deadline - 1),
           req(2, Tier.VIP, deadline - 1)]
    not_due = [req(3, Tier.BATCH, end + 1), req(4, Tier.NORMAL, deadline + 1)]
    config = settings.sim_config(0)
    expected = sum(least_seconds(r.prompt_tokens, r.output_tokens, config) for r in due)
    assert deadline_load(settings, due + not_due) == pytest.approx(
        expected / (settings.nodes * deadline * ts))


def test_a_cell_is_valued_against_the_arms_bound_at_both_ceilings() -> None:
    record = cell_record(Cell("ci", "chat", 2, 1))
    json.dumps(record)  # stored as JSON: nothing non-finite left raw
    assert set(record["points"]) == set(POINTS)
    assert 0 < record["deadline_load"] < 2
    # The VIP frontier: the caps scaled to the quarter node, tightest last, all below the bar.
    caps = [p["running_cap"] for p in record["vip_frontier"]]
    assert caps == sorted({max(1, round(c * 0.25)) for c in RUNNING_CAPS}, reverse=True)
    assert all(p["kv_peak"] < 0.80 and p["preemptions"] == 0 for p in record["vip_frontier"])
    for point in record["points"].values():
        assert 0 < point["goodput_ratio"] <= 1.0, point["goodput_bound"]
        assert point["goodput_bound"]["unit"] == "node-seconds"
        assert point["preemptions"] == 0
    assert record["points"]["under_bar"]["kv_peak"] < 0.80


def _verdict(key: str, ok: bool, number: float) -> dict[str, Any]:
    return {"key": key, "value": "", "ok": ok, "number": number}


def _arm(name: str, goodput: float, vip_kept: bool, valid: bool = True,
         others: bool = True) -> dict[str, Any]:
    verdicts = [_verdict(k, others, 0.0) for k in CRITERIA if k not in ("goodput", "vip_p99")]
    verdicts += [_verdict("vip_p99", vip_kept, 1.0 if vip_kept else 2.0),
                 _verdict("goodput", goodput >= GOODPUT_BAR, goodput)]
    return {"arm": name, "valid": valid, "verdicts": verdicts}


def _cell(seed: int) -> dict[str, Any]:
    return {"scale": "reduced", "mix": "article", "size": 2, "seed": seed}


def _ideal(seed: int, under: float, whole: float | None = None) -> dict[str, Any]:
    def point(ratio: float) -> dict[str, Any]:
        return {"goodput_ratio": ratio, "batch_left": 0, "last_batch_s": 10.0,
                "vip_p99_base_ms": 100.0, "vip_p99_burst_ms": 300.0}
    return {"cell": _cell(seed), "points": {"whole": point(whole or under),
                                            "under_bar": point(under)}}


def _matrix(seed: int, *arms: dict[str, Any]) -> dict[str, Any]:
    return {"cell": _cell(seed), "arms": list(arms)}


def test_where_the_ideal_reaches_the_bar_the_bar_is_the_criterion() -> None:
    ideal = _ideal(1, 0.92)
    assert frontier(ideal, _matrix(1, _arm("c", 0.91, False))).passed
    short = frontier(ideal, _matrix(1, _arm("c", 0.89, True)))
    assert short.reachable and short.passed is False


def test_out_of_reach_the_arm_must_keep_the_vip_bar_and_lead_those_that_do() -> None:
    ideal = _ideal(1, 0.86)
    kept = frontier(ideal, _matrix(1, _arm("a", 0.88, False), _arm("c", 0.84, True)))
    assert not kept.reachable and kept.passed  # (a) is ahead but misses the VIP bar
    assert frontier(ideal, _matrix(1, _arm("c", 0.84, False))).passed is False
    behind = frontier(ideal, _matrix(1, _arm("b", 0.85, True), _arm("c", 0.84, True)))
    assert behind.passed is False
    # An invalid run of the rival does not count; one of the arm itself is not judged.
    assert frontier(ideal, _matrix(1, _arm("b", 0.85, True, valid=False),
                                   _arm("c", 0.84, True))).passed
    assert frontier(ideal, _matrix(1, _arm("c", 0.84, True, valid=False))).passed is None
    assert frontier(ideal, None).passed is None


def test_the_margin_is_how_far_an_arm_beat_the_ideal_and_it_widens_the_reach() -> None:
    records = [_ideal(1, 0.898, whole=0.896), _ideal(2, 0.80)]
    matrix = [_matrix(1, _arm("b", 0.901, False)), _matrix(2, _arm("c", 0.79, True))]
    margin = slack(records, matrix)
    assert margin == pytest.approx(0.003)
    assert not frontier(records[0], matrix[0]).reachable
    assert frontier(records[0], matrix[0], margin=margin).reachable
    table = render(records, matrix, "reduced")
    assert "reaches 90% of the bound in 1" in table
    assert table.count("| article | 2 |") == 2


def test_merge_replaces_a_rerun_cell_and_keeps_the_matrix_order() -> None:
    old = [_ideal(2, 0.8), _ideal(1, 0.8)]
    merged = merge(old, [_ideal(2, 0.9)])
    assert [r["cell"]["seed"] for r in merged] == [1, 2]
    assert merged[1]["points"]["under_bar"]["goodput_ratio"] == 0.9


def test_the_command_writes_the_records_and_the_table(tmp_path: Path) -> None:
    args = ["--scale", "ci", "--mix", "chat", "--size", "2", "--seed", "1", "--out",
            str(tmp_path)]
    assert main(args) == 0
    assert main(args) == 0  # a rerun replaces its cell
    (tmp_path / "ideal-ci.md").unlink()
    assert main([*args, "--tables-only"]) == 0
    records = json.loads((tmp_path / "ideal-ci.json").read_text())
    assert [r["cell"] for r in records] == [{"scale": "ci", "mix": "chat", "size": 2,
                                             "seed": 1}]
    table = (tmp_path / "ideal-ci.md").read_text()
    assert "| chat | 2 | 1 |" in table
    assert main(["--mix", "nope", "--out", str(tmp_path)]) == 2


def test_the_best_point_keeping_the_vip_bar_is_the_one_with_most_goodput_within_it() -> None:
    def point(ratio: float, base: float, burst: float, cap: int | None) -> dict[str, Any]:
        return {"goodput_ratio": ratio, "vip_p99_base_ms": base, "vip_p99_burst_ms": burst,
                "running_cap": cap}
    record: dict[str, Any] = {"points": {"under_bar": point(0.86, 100.0, 250.0, None)},
                              "vip_frontier": [point(0.80, 100.0, 121.0, 8),
                                               point(0.75, 100.0, 119.0, 4),
                                               point(0.60, 100.0, 90.0, 2)]}
    best = best_keeping_vip(record)
    assert best is not None and best["running_cap"] == 4
    record["points"]["under_bar"] = point(0.86, 100.0, 120.0, None)  # exactly the bar
    best = best_keeping_vip(record)
    assert best is not None and best["running_cap"] is None
    assert best_keeping_vip({"points": {"under_bar": point(0.86, 100.0, 250.0, None)}}) is None


def test_the_tally_counts_each_arm_with_the_fallback_and_the_six_others() -> None:
    ideal = [_ideal(1, 0.86), _ideal(2, 0.92), _ideal(3, 0.86)]
    matrix = [
        _matrix(1, _arm("a", 0.88, False), _arm("c", 0.84, True)),  # out of reach: c kept VIP
        _matrix(2, _arm("a", 0.91, True), _arm("c", 0.89, True)),  # in reach: the bar
        _matrix(3, _arm("a", 0.80, True, others=False), _arm("c", 0.85, True, valid=False)),
        _matrix(4, _arm("a", 0.95, True), _arm("c", 0.95, True)),  # no ideal record
    ]
    counts = tally(matrix, ideal, ["a", "c"])
    assert counts["c"].judged == 2 and counts["c"].goodput == 1 and counts["c"].all_seven == 1
    # (a): misses the VIP bar out of reach; passes the bar in reach, with the six others; leads
    # out of reach on 3 (c's run is invalid there) but fails another criterion.
    assert counts["a"].judged == 3 and counts["a"].goodput == 2 and counts["a"].all_seven == 1


def test_out_of_reach_an_arm_must_reach_the_frontiers_best_point_that_keeps_vip() -> None:
    """Where a point of the ideal's VIP frontier keeps the VIP bar, keeping the bar with more
    goodput than the other arms is not enough: the arm must reach that point's goodput (less
    the margin). Where no point keeps it, the other arms are the reference."""
    ideal = _ideal(1, 0.86)
    ideal["vip_frontier"] = [{"goodput_ratio": 0.84, "vip_p99_base_ms": 100.0,
                              "vip_p99_burst_ms": 110.0, "running_cap": 8}]
    alone = _matrix(1, _arm("a", 0.88, False), _arm("c", 0.83, True))
    short = frontier(ideal, alone)
    assert (short.reachable, short.passed, short.target) == (False, False, 0.84)
    assert frontier(ideal, alone, margin=0.01).passed  # within the margin
    assert frontier(ideal, _matrix(1, _arm("c", 0.845, True))).passed
    ideal["vip_frontier"][0]["vip_p99_burst_ms"] = 130.0  # no point keeps the bar
    against_arms = frontier(ideal, alone)
    assert against_arms.passed and against_arms.target is None
    # Judged against an invalid arm (a), the VIP verdict is n/a: so is the fallback's.
    unjudged = _arm("c", 0.85, True)
    next(v for v in unjudged["verdicts"] if v["key"] == "vip_p99")["ok"] = None
    assert frontier(ideal, _matrix(1, unjudged)).passed is None


def test_no_figure_is_a_pass_and_no_ideal_figure_opens_the_fallback() -> None:
    """An arm whose goodput was not measured leads no one, even with no rival keeping the VIP
    bar; an ideal whose figure is missing shows no shortfall, so the bar stands."""
    nan = float("nan")
    alone = frontier(_ideal(1, 0.86), _matrix(1, _arm("a", 0.88, False),
                                              _arm("c", nan, True)))
    assert not alone.reachable and alone.passed is False
    unknown = frontier(_ideal(1, nan), _matrix(1, _arm("c", 0.84, True)))
    assert unknown.reachable and unknown.passed is False
    assert frontier(_ideal(1, nan), _matrix(1, _arm("c", 0.91, False))).passed
