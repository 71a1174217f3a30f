"""The burst matrix: one tiny cell end to end, and what the configuration may depend on.

The smoke cell runs arms (a), (c) and (d) with real processes (simulated nodes, a private Redis,
a scheduler and a gateway) on the ``ci`` scale, about 45 s on two shared cores. It checks the
artefacts, not the verdicts: the table and the cell's JSON exist, every criterion is judged for
every arm, and no arm's goodput exceeds its upper bound.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from admission.tiers import Tier
from bench.burst.arm import ArmResult, client_settings
from bench.burst.criteria import CRITERIA, EXTRA, LABELS, REFERENCED, judge_all
from bench.burst.expconfig import ARM_TITLES, PRESETS, Settings, default_max_tokens, kvgate_toml
from bench.burst.experiment import fallback_section
from bench.burst.ideal import main as ideal_main
from bench.burst.loadgen import OK, ClientSettings, LoadGenerator, Outcome
from bench.burst.matrix import (
    RESULTS,
    SCALES,
    Cell,
    aggregate,
    build_parser,
    cells,
    error_record,
    is_done,
    main,
    parse_seeds,
    render,
)
from bench.burst.matrixplot import load_records, plot_matrix
from bench.burst.mixes import MIXES, REALISTIC, with_mix
from bench.burst.monitor import NodeSample, Sample
from bench.burst.points import Point
from bench.burst.report import ArmSummary, summarize
from bench.burst.workload import EXACT_MAX_TOKENS, PlannedRequest, Schedule, plan, prompt_text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_one_cell_end_to_end_writes_the_table_and_the_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["--scale", "ci", "--seed", "1", "--mix", "article", "--size", "2",
                 "--arms", "a,c,d", "--out", str(out), "--log-dir", str(tmp_path / "logs"),
                 "--quiet"]) == 0
    table = (out / "matrix-ci.md").read_text()
    assert (out / "matrix-ci.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "cells" / "ci-article-n2-s1.json").read_text())
    assert record["cell"] == {"scale": "ci", "mix": "article", "size": 2, "seed": 1}
    assert [a["arm"] for a in record["arms"]] == ["a", "c", "d"]
    for key in (*CRITERIA, *EXTRA):
        assert LABELS[key] in table
    for arm in ("a", "c", "d"):
        assert ARM_TITLES[arm] in table
    assert "## Aggregate over cells" in table and "## article, 2 nodes, seed 1" in table
    reference_valid = next(a["valid"] for a in record["arms"] if a["arm"] == "a")
    for arm in record["arms"]:
        verdicts = arm["verdicts"]
        assert [v["key"] for v in verdicts] == [*CRITERIA, *EXTRA]
        # Every criterion is judged (pass or fail): arm (a) is in the run, so the VIP ratio
        # has its reference; unless (a)'s run was invalid (its loop lagged on a loaded
        # machine), when the ratios against it read n/a and the rest is still judged.
        for v in verdicts:
            if v["key"] not in CRITERIA:
                continue
            if reference_valid or v["key"] not in REFERENCED:
                assert v["ok"] in (True, False), verdicts
            else:  # unjudged in the record; the tables say why
                assert v["ok"] is None and v["value"].startswith("n/a"), verdicts
                assert "n/a: (a) invalid" in table
        summary = arm["summary"]
        assert 0 < summary["goodput_ratio"] <= 1.0, summary["goodput_bound"]
        assert 0 < summary["token_ratio"] <= 1.0, summary["token_bound"]
        for bound, unit in ((summary["goodput_bound"], "node-seconds"),
                            (summary["token_bound"], "tokens")):
            assert bound["ceiling"] == min(bound["offered"], bound["capacity"])
            assert bound["unit"] == unit
        assert arm["validity"].startswith(("yes", "**INVALID**"))
        # The load generator's own loop was measured, second by second, and kept in the logs.
        assert summary["client_lag_ms"][3] > 0 and summary["client_lag_ms"][1] > 0
        lags = json.loads((tmp_path / "logs" / "ci-article-n2-s1" / f"arm-{arm['arm']}"
                           / "client_lag.json").read_text())
        # The summary reads the seconds up to the load's end; the file holds the whole run,
        # whose last seconds (cancelling what is left) may lag more.
        per_second = [lag * 1000 for lag in lags]
        assert len(lags) >= 4
        assert any(max(per_second[:k]) == pytest.approx(summary["client_lag_ms"][1])
                   for k in range(1, len(lags) + 1)), (per_second, summary["client_lag_ms"])
    # Every arm judged VIP requests (how many depends on when each arm stopped: requests still
    # in flight after the burst are censored).
    assert all(a["summary"]["counted"]["vip"] > 0 for a in record["arms"])
    # The nodes traced VIP requests under the ids clients (or the gateway) sent, in every arm:
    # the engine's part of a TTFT is known, and it is never more than the whole.
    for arm in record["arms"]:
        engine, whole = arm["summary"]["vip_engine_base"], arm["summary"]["vip_ttft_base"]
        assert 0 < engine[0] <= whole[1], (arm["arm"], engine, whole)
        assert arm["summary"]["vip_front_burst"][0] >= 0, arm["arm"]
    # The ideal of the same cell reads the arms' records: kvgate's goodput is set beside it.
    assert ideal_main(["--scale", "ci", "--seed", "1", "--mix", "article", "--size", "2",
                       "--out", str(out)]) == 0
    goodput = next(v for v in record["arms"][1]["verdicts"] if v["key"] == "goodput")
    assert f"| {goodput['number']:.1%} |" in (out / "ideal-ci.md").read_text()
    # ...and the matrix's table, written again, judges goodput with the fallback too.
    table = (out / "matrix-ci.md").read_text()
    assert "| all seven, goodput with the fallback |" in table
    assert "The ideal admission (ideal-ci.md) gets" in table


def test_nothing_in_a_cell_but_the_schedule_depends_on_the_seed() -> None:
    for scale in SCALES:
        for mix in MIXES:
            a = Cell(scale, mix, 4, 1).settings()
            b = Cell(scale, mix, 4, 987_654).settings()
            assert a.seed != b.seed
            assert dataclasses.replace(a, seed=0) == dataclasses.replace(b, seed=0)
            # What the arms are built from, not only the settings: the matrix runs each cell
            # at Point() (the defaults), and arm (c)'s configuration, the clients' and the
            # engines' are the same whatever the seed...
            assert Point().apply(a) == a
            assert kvgate_toml(a, "redis://r", ["http://n"], 9, 5.0) == kvgate_toml(
                b, "redis://r", ["http://n"], 9, 5.0)
            assert client_settings(a) == client_settings(b)
            assert [dataclasses.replace(a.sim_config(i), seed=0) for i in range(a.nodes)] == [
                dataclasses.replace(b.sim_config(i), seed=0) for i in range(b.nodes)]
            # ...and the engines' own seed draws nothing: an output length is drawn only when
            # no output is forced and output_fraction < 1, and the load generator forces every
            # one (X-Sim-Output-Tokens).
            assert a.sim_config(0).output_fraction == 1.0
            assert plan(a.profile, a.classes, a.scale, a.seed) != plan(
                b.profile, b.classes, b.scale, b.seed)
            # kvgate's shipped defaults: no dedicated node, no guests, no zone overrides.
            assert (a.vip_nodes, a.guest_prompt, a.kv_target, a.yellow, a.batch_ceiling,
                    a.vip_ceiling, a.projection, a.max_engine_waiting,
                    a.max_engine_running, a.vip_ttft_objective_ms, a.running_min,
                    a.vip_slowdown) == (
                        0, 0, None, None, None, None, None, None, None, None, None, None)


def test_default_cells_cover_ten_article_seeds_and_five_of_the_others_on_two_sizes() -> None:
    todo = cells("reduced", list(MIXES), [2, 4], None)
    by_mix = {m: sorted({c.seed for c in todo if c.mix == m}) for m in MIXES}
    assert by_mix == {"article": list(range(1, 11)), "chat": [1, 2, 3, 4, 5],
                      "generation": [1, 2, 3, 4, 5]}
    assert {c.size for c in todo} == {2, 4}
    assert parse_seeds("1,4,7-9,4") == [1, 4, 7, 8, 9]
    with pytest.raises(ValueError):
        parse_seeds("5-3")


def test_max_tokens_mix_changes_what_clients_declare_not_the_work() -> None:
    settings = with_mix(SCALES["reduced"], "article")
    real = plan(settings.profile, settings.classes, settings.scale, 7, REALISTIC,
                settings.max_model_len)
    exact = plan(settings.profile, settings.classes, settings.scale, 7, EXACT_MAX_TOKENS,
                 settings.max_model_len)
    strip = [(r.at, r.klass, r.prompt_tokens, r.output_tokens) for r in real.requests]
    assert strip == [(r.at, r.klass, r.prompt_tokens, r.output_tokens) for r in exact.requests]
    asks = [r.ask for r in real.requests]
    n = len(asks)
    assert n > 500
    for kind, share in (("none", REALISTIC.none), ("cap", REALISTIC.cap),
                        ("exact", REALISTIC.exact)):
        assert abs(asks.count(kind) / n - share) < 0.06, (kind, asks.count(kind), n)
    for r in real.requests:
        if r.ask == "cap":
            assert r.max_tokens is not None and r.output_tokens <= r.max_tokens
            assert r.prompt_tokens + r.max_tokens <= settings.max_model_len
        elif r.ask == "exact":
            assert r.max_tokens == r.output_tokens
        else:
            assert r.max_tokens is None
            # What arm (c)'s gateway fills in never cuts a real output short.
            assert r.output_tokens <= default_max_tokens(settings)
    assert all(r.ask == "exact" for r in exact.requests)


async def test_arm_d_clients_send_their_tier_as_priority_and_omit_max_tokens_when_none(
) -> None:
    bodies: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        bodies.append(orjson.loads(await request.read()))
        return web.json_response({"choices": [{"message": {"content": "x"}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 3}})

    settings = with_mix(SCALES["ci"], "chat")
    schedule = plan(settings.profile, settings.classes, settings.scale, 3, REALISTIC,
                    settings.max_model_len)
    # One request of each tier and each kind of max_tokens, sent at once, each with its own
    # prompt size so that its body can be told apart.
    picked: dict[tuple[Tier, str], PlannedRequest] = {}
    for r in schedule.requests:
        picked.setdefault((r.tier, r.ask), r)
    requests = [dataclasses.replace(r, index=i, at=0.0, stream=False, output_tokens=3,
                                    prompt_tokens=100 + 10 * i)
                for i, r in enumerate(picked.values())]
    assert len(requests) >= 6
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    server = TestServer(app)
    await server.start_server()
    try:
        clients = {c.name: ClientSettings("k", None) for c in settings.classes}
        gen = LoadGenerator(Schedule(requests), [str(server.make_url("")).rstrip("/")], "m",
                            clients, send_priority=True)
        async with aiohttp.ClientSession() as session:
            await gen.run(session, time.perf_counter())
            await gen.wait_idle()
    finally:
        await server.close()
    by_text = {prompt_text(r.prompt_tokens): r for r in requests}
    assert len(bodies) == len(requests)
    for body in bodies:
        req = by_text[body["messages"][0]["content"]]
        assert body["priority"] == int(req.tier)
        assert body.get("max_tokens") == req.max_tokens
        assert ("max_tokens" in body) == (req.ask != "none")


def _summary(arm: str, engine_base: float, engine_burst: float,
             front: tuple[float, float] = (30.0, 60.0)) -> ArmSummary:
    return ArmSummary(arm=arm, kv_peak=0.5, preemptions=0, crashed_nodes=0,
                      success={t: 1.0 for t in Tier}, counted={t: 10 for t in Tier},
                      vip_ttft_base=(100.0, 150.0), vip_ttft_burst=(120.0, 200.0),
                      last_batch_s=0.0, batch_unfinished=0, goodput=1.0, goodput_ratio=0.9,
                      vip_engine_base=(60.0, engine_base), vip_engine_burst=(80.0, engine_burst),
                      vip_front_burst=front)


def test_stalls_in_arm_a_calm_void_the_verdicts_against_it_not_the_other_arm() -> None:
    """(a)'s calm P99 carries a stall of its load generator (150 ms; 130 without the VIP
    requests that waited across it): (c)'s burst P99 of 170 ms passes against one, fails
    against the other. That is the reference's doubt, not (c)'s: (c) stays valid and its
    verdicts against (a) read n/a. A stall in (c)'s own run that decides it voids (c)."""
    a = dataclasses.replace(_summary("a", 100.0, 300.0), vip_ttft_base=(100.0, 150.0),
                            vip_p99_steady=(130.0, 400.0))
    c = dataclasses.replace(_summary("c", 90.0, 115.0), vip_ttft_burst=(120.0, 170.0),
                            vip_p99_steady=(150.0, 170.0))
    judged = judge_all([a, c], 96.0, 2.0)
    assert not a.invalid and not c.invalid
    assert next(v for v in judged[1] if v.key == "vip_p99").ok is None
    steady_a = dataclasses.replace(a, vip_p99_steady=(150.0, 400.0))
    c_stalled = dataclasses.replace(c, vip_ttft_burst=(120.0, 190.0), invalid=[])
    judged = judge_all([steady_a, c_stalled], 96.0, 2.0)  # (c)'s own: 190 with, 170 without
    assert c_stalled.invalid and "load generator's stalls" in c_stalled.invalid[0]


def test_a_p99_over_fewer_than_100_chats_says_how_few() -> None:
    """Under 100 chats the nearest rank's P99 is the largest: one request sets the bar."""
    few = dataclasses.replace(_summary("c", 90.0, 115.0), vip_samples=(43, 58))
    many = dataclasses.replace(_summary("c", 90.0, 115.0), vip_samples=(430, 580))
    texts = [next(v.value for v in verdicts if v.key == "vip_p99")
             for verdicts in judge_all([_summary("a", 100.0, 300.0), few, many], 96.0, 2.0)[1:]]
    assert texts[0].endswith("(P99s over 43 calm, 58 burst VIP chats)")
    assert "P99s over" not in texts[1]


def test_the_engine_part_of_vip_ttft_is_judged_against_arm_a_calm_engine_p99() -> None:
    judged = judge_all([_summary("a", 100.0, 300.0), _summary("c", 90.0, 115.0),
                        _summary("d", 80.0, 125.0, (float("nan"), float("nan")))], 96.0, 2.0)
    engine = [next(v for v in verdicts if v.key == "vip_engine") for verdicts in judged]
    assert [v.ok for v in engine] == [False, True, False]
    assert [round(v.number, 2) for v in engine] == [3.0, 1.15, 1.25]
    assert engine[1].value == "x1.15; rest 30 / 60 ms" and engine[2].value.endswith("rest n/a")
    # Without (a)'s traces there is no reference: not judged.
    alone = judge_all([_summary("c", 90.0, 115.0)], 96.0, 2.0)[0]
    assert next(v for v in alone if v.key == "vip_engine").ok is None


def test_a_point_runs_arm_c_at_that_setting_and_the_table_says_it_is_not_the_defaults() -> None:
    """``--point l=1`` applies the setting to the cell's settings (only arm (c) reads the
    control), and a matrix of such records is titled with it, never as the shipped defaults."""
    args = build_parser().parse_args(["--point", "l=1"])
    assert args.point == Point(lane_nodes=1)
    cell = Cell("reduced", "chat", 2, 3)
    assert args.point.apply(cell.settings()) == dataclasses.replace(cell.settings(),
                                                                     lane_nodes=1)
    [path] = (RESULTS / "cells").glob("reduced-chat-n2-s3.json")
    record = json.loads(path.read_text())
    assert "kvgate on its shipped defaults" in render([record], "reduced")
    record["point"] = Point(lane_nodes=1).label
    text = render([record], "reduced")
    assert "kvgate on its shipped defaults" not in text
    assert "at l=1 (`--point`), not the shipped defaults" in text


def test_a_cell_whose_run_failed_is_in_the_table_not_left_out(tmp_path: Path) -> None:
    """An error in one cell's run (a service that did not start, a goodput above its bound)
    is written as that cell's record, shown with its error and counted; --skip-done reruns it."""
    [path] = (RESULTS / "cells").glob("reduced-chat-n2-s3.json")
    record = json.loads(path.read_text())
    failed = error_record(Cell("reduced", "chat", 2, 4), 12.0, "abc1234",
                          RuntimeError("the scheduler published nothing within 30 s"))
    text = render([record, failed], "reduced")
    assert ("the run ended in an error, RuntimeError: the scheduler published nothing "
            "within 30 s") in text
    assert "| cells whose run ended in an error (left out) | 1 | 1 | 1 | 1 |" in text
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "reduced-chat-n2-s4.json").write_text(json.dumps(failed))
    assert not is_done(tmp_path / "cells" / "reduced-chat-n2-s4.json", ["a", "c"], Point())
    plot_matrix([record, failed], tmp_path / "m.png")  # the plot leaves it out


def test_skip_done_skips_only_cells_recorded_with_these_arms_at_this_point(
        tmp_path: Path) -> None:
    """A record at another point, with fewer arms, or unreadable is rerun, so a matrix
    continued at ``--point l=1`` never keeps a cell measured on the defaults."""
    [source] = (RESULTS / "cells").glob("reduced-chat-n2-s3.json")
    record = json.loads(source.read_text())
    path = tmp_path / "cell.json"
    path.write_text(json.dumps(record))
    recorded = [a["arm"] for a in record["arms"]]
    assert is_done(path, recorded, Point())
    assert is_done(path, recorded[:1], Point())
    assert not is_done(path, recorded, Point(lane_nodes=1))
    assert not is_done(path, [*recorded, "x"], Point())
    record["point"] = Point(lane_nodes=1).label
    path.write_text(json.dumps(record))
    assert is_done(path, recorded, Point(lane_nodes=1))
    assert not is_done(path, recorded, Point())
    del record["point"]  # records written before points existed are the defaults'
    path.write_text(json.dumps(record))
    assert is_done(path, recorded, Point())
    path.write_text(json.dumps(record)[:50])
    assert not is_done(path, recorded, Point())
    assert not is_done(tmp_path / "missing.json", recorded, Point())


def test_one_run_judges_goodput_with_the_fallback_against_its_own_ideal() -> None:
    """The experiment's report (``make demo``) judges goodput as the matrix does: where the
    ideal below the KV bar cannot reach 90% on the draw, the arm that keeps the VIP bar with the
    most goodput passes; where it can, the bar stands."""
    def summary(arm: str, goodput: float, burst_p99: float) -> ArmSummary:
        return dataclasses.replace(_summary(arm, 100.0, 100.0), goodput_ratio=goodput,
                                   vip_ttft_base=(100.0, 150.0),
                                   vip_ttft_burst=(120.0, burst_p99))
    settings = PRESETS["short"]

    def section(runs: list[ArmSummary], ideal: dict[str, Any] | None) -> str:
        judged = judge_all(runs, settings.burst_sim_s, settings.drain_factor)
        return "\n".join(fallback_section(runs, judged, ideal))

    runs = [summary("a", 0.84, 900.0), summary("c", 0.82, 160.0)]
    out_of_reach = section(runs, {"goodput_ratio": 0.847})
    assert "reaches 84.7% of the goodput bound" in out_of_reach
    assert "out of its reach on this draw" in out_of_reach
    assert "| goodput (work done), with the fallback | 84.0% **FAIL** | 82.0% **PASS** |" in (
        out_of_reach)
    assert "| criteria met (of 7), goodput with the fallback | 5 | 7 |" in out_of_reach
    within = section(runs, {"goodput_ratio": 0.93})
    assert "within its reach, so the bar stands" in within
    assert "| 84.0% **FAIL** | 82.0% **FAIL** |" in within
    assert "| criteria met (of 7), goodput with the fallback | 5 | 6 |" in within
    # An arm above the ideal widens the reach by that much (a greedy ideal is not a bound).
    ahead = [summary("a", 0.95, 900.0), summary("c", 0.82, 160.0)]
    widened = section(ahead, {"goodput_ratio": 0.86})
    assert "an arm did 9.0% of the bound more" in widened
    assert "within its reach" in widened
    assert section(runs, None) == ""


def test_an_invalid_arm_a_is_no_reference_for_the_others() -> None:
    """Arm (a)'s calm is the reference for "slower"; a run of (a) left out for lag cannot be
    what another arm passes against, so the verdicts judged against it read n/a."""
    def verdicts(a_invalid: bool) -> dict[str, bool | None]:
        a = _summary("a", 100.0, 300.0)
        if a_invalid:
            a.invalid.append("simulator loop lag above 25 ms 6.1% of the time")
        judged = judge_all([a, _summary("c", 90.0, 115.0)], 96.0, 2.0)[1]
        return {v.key: v.ok for v in judged if v.key in REFERENCED}

    assert verdicts(False) == {"vip_p99": False, "calm": True, "vip_engine": True}
    assert verdicts(True) == {"vip_p99": None, "calm": None, "vip_engine": None}


def test_records_judged_against_an_invalid_arm_a_are_read_without_those_verdicts(
        tmp_path: Path) -> None:
    """Cells recorded before the rule hold (c)'s VIP verdict judged against an invalid (a):
    the tables read it as n/a, never as a pass in the aggregate."""
    source = RESULTS / "vip-hold" / "reduced" / "cells" / "reduced-chat-n2-s1.json"
    record = json.loads(source.read_text())
    a, c = (next(x for x in record["arms"] if x["arm"] == arm) for arm in ("a", "c"))
    assert not a["valid"] and c["valid"]
    assert next(v for v in c["verdicts"] if v["key"] == "vip_p99")["ok"] is True
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / source.name).write_text(source.read_text())
    [loaded] = load_records(tmp_path, "reduced")
    for arm in loaded["arms"]:
        for v in arm["verdicts"]:
            if v["key"] in REFERENCED:
                assert v["ok"] is None and v["value"] == "n/a: (a) invalid"
    row = next(line for line in aggregate([loaded]) if line.startswith("| VIP P99 burst"))
    assert row.endswith("| n/a | n/a |")
    # A cell whose arm (a) is valid is read as recorded.
    [valid] = (RESULTS / "cells").glob("reduced-chat-n2-s3.json")
    (tmp_path / "cells" / source.name).unlink()
    (tmp_path / "cells" / valid.name).write_text(valid.read_text())
    assert load_records(tmp_path, "reduced") == [json.loads(valid.read_text())]


def test_the_simulators_lag_is_judged_up_to_the_loads_end_not_while_the_arm_cancels() -> None:
    """The arm cancels what is left once the load ends (thousands of aborts at once) and
    samples the nodes once more: that lag is not the measured load's, and must not void it."""
    settings: Settings = PRESETS["smoke"]
    b0, _ = settings.profile.window("burst")
    outcomes = [Outcome(PlannedRequest(i, "vip-chat", Tier.VIP, b0 + 0.1 * i, 50, 7, True),
                        status=OK, ttft=0.01, finished=True, done_at=b0 + 0.1 * i + 1,
                        sent_at=b0 + 0.1 * i) for i in range(50)]
    stopped_at = 20.0
    during = [Sample(0.25 * i, [NodeSample(kv_peak=0.5, loop_lag=0.002)])
              for i in range(int(stopped_at / 0.25) + 1)]
    after = [Sample(stopped_at + 0.25 * i, [NodeSample(kv_peak=0.5, loop_lag=0.2)])
             for i in range(1, 6)]
    result = ArmResult(arm="a", settings=settings, outcomes=outcomes, samples=during + after,
                       admitted=[], rejected=[], crashed_nodes=0, max_loop_lag_s=0.2,
                       send_lag_max_s=0.0, stopped_at=stopped_at, client_lag=[0.001] * 20)
    summary = summarize(result, None)
    assert not summary.invalid, summary.invalid
    assert summary.lag_ms[0] == 0.0 and summary.lag_ms[1] == pytest.approx(2.0)
    # The same lag while the load ran voids the run.
    result.samples = during[:-6] + [Sample(s.t, after[0].nodes) for s in during[-6:]]
    assert "simulator loop lag" in summarize(result, None).invalid[0]


def test_a_record_is_judged_by_this_codes_validity_rules(tmp_path: Path) -> None:
    """A record written before a rule holds the figures the rule reads: its tables judge it
    by the rule (here: gateways' loops late on over 5% of their probes)."""
    def arm(name: str, late: float) -> dict[str, Any]:
        return {"arm": name, "valid": True, "validity": "yes (figures)", "verdicts": [],
                "summary": {"phase_load": {"burst": {"gateway_late_share": late}}}}
    record = {"cell": {"scale": "reduced", "mix": "chat", "size": 2, "seed": 1},
              "arms": [arm("a", 0.0), arm("c", 0.08)]}
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "reduced-chat-n2-s1.json").write_text(json.dumps(record))
    (loaded,) = load_records(tmp_path, "reduced")
    a, c = loaded["arms"]
    assert a["valid"] and not c["valid"]
    assert c["validity"] == ("**INVALID**: the gateways' loops ran over 5 ms late in 8.0% of "
                             "their probes (burst) (figures)")

