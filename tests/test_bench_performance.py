"""The performance suite's command and report: it runs, writes both files, and its verdict
follows the checks. No assertion on a figure: these run on a busy CI machine."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from bench.perf import performance
from bench.perf import release as perf_release
from bench.perf import tokens as perf_tokens
from bench.perf.perfreport import Check, PerfOptions, Section

SPEC = {s.key: s for s in performance.SPECS}


def test_quick_run_of_the_cheap_sections_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    # Smaller still than --quick: the test proves the wiring, in seconds.
    monkeypatch.setattr(perf_tokens, "QUICK", {"runs_cold": 5, "runs_warm": 30, "runs_async": 3})
    monkeypatch.setattr(perf_release, "QUICK", {"tasks": 500, "samples": 20, "rate": 50.0})
    out = tmp_path / "results"

    code = performance.main(["--quick", "--only", "release,tokens", "--output-dir", str(out)])

    md = (out / "performance.md").read_text()
    report = json.loads((out / "performance.json").read_text())
    checks = [c for key in ("tokens", "release")
              for s in report["sections"][key]["sections"] for c in s["checks"]]
    assert code == (0 if all(c["met"] for c in checks) else 1)
    assert report["exit_code"] == code
    assert report["run"]["quick"] is True
    assert "python -m bench.perf.performance --quick --only release,tokens" in md
    assert "| § | check | target | measured | result |" in md
    assert "| 4 | token estimate, warm 32 KB chat, p99 | <= 1 ms |" in md
    assert "| 5 | scheduler releases/s" in md
    # Issue order, whatever the order of --only.
    assert md.index("## 4. Token estimation") < md.index("## 5. Scheduler release")
    assert "redis-server " in md and "load average" in md
    for key in ("tokens", "release"):
        assert report["sections"][key]["error"] is None
    tokens = report["sections"]["tokens"]["sections"][0]["data"]
    assert {r["size"] for r in tokens["rows"]} == {"1 KB", "8 KB", "32 KB"}
    assert tokens["warm32_p99_ms"] > 0
    release = report["sections"]["release"]["sections"][0]["data"]
    assert release["throughput"]["tasks"] == 500
    assert release["latency"]["samples"] > 0
    for chart in ("performance-tokens.png", "performance-release.png"):
        assert (out / chart).stat().st_size > 0
        assert f"]({chart})" in md
    assert "[1/2] release" not in capsys.readouterr().out  # tokens (4) runs before release (5)


def _section(title: str, *checks: Check) -> Section:
    return Section(title, f"body of {title}\n", list(checks), [], {"title": title})


def _outcome(key: str, *sections: Section, error: str | None = None
             ) -> performance.Outcome:
    return performance.Outcome(SPEC[key], list(sections), error, "Traceback: boom" if error
                               else "", 1.0)


def _info() -> performance.RunInfo:
    return performance.RunInfo("python -m bench.perf.performance", "2026-01-01 00:00:00 UTC",
                               "abc123", 2, "3.11", "7.0.15", (0.1, 0.2, 0.3), quick=False)


def test_report_shows_failed_sections_and_missed_checks(tmp_path: Path) -> None:
    met = Check("warm 32 KB p99", "<= 1 ms", "0.8 ms", True)
    missed = Check("releases/s", ">= 5,000/s", "4,000/s", False)
    outcomes = [
        _outcome("latency", error="RuntimeError: LiteLLM never came up"),
        _outcome("scale", _section("Scaling", met), _section("Redis cost", met)),
        _outcome("tokens", _section("Tokens", met)),
    ]
    md = performance.render(_info(), outcomes, tmp_path)
    assert "| 1 | Latency vs LiteLLM: section did not complete | - | RuntimeError: LiteLLM " \
           "never came up | **failed** |" in md
    assert "## 1. Latency vs LiteLLM: failed" in md and "Traceback: boom" in md
    # Two sections from the scale module take numbers 2 and 3.
    assert "## 2. Scaling" in md and "## 3. Redis cost" in md
    assert "| 2 | warm 32 KB p99 | <= 1 ms | 0.8 ms | met |" in md
    assert performance.exit_code(outcomes) == 1  # a failed section alone fails the run
    assert performance.exit_code(outcomes[1:]) == 0
    assert "Overall: all checks met." in performance.render(_info(), outcomes[1:], tmp_path)

    with_miss = [*outcomes[1:], _outcome("release", _section("Release", missed))]
    assert performance.exit_code(with_miss) == 1
    md = performance.render(_info(), with_miss, tmp_path)
    assert "| 5 | releases/s | >= 5,000/s | 4,000/s | **missed** |" in md

    # One section for both of scale's numbers.
    one = performance.Outcome(SPEC["scale"], [_section("Both", met)])
    assert "## 2 and 3. Both" in performance.render(_info(), [one], tmp_path)

    # Charts are linked relative to the report, once even when the section placed one itself;
    # a long error is cut short in the table (whole in performance.json and the traceback).
    placed = Section("Memory", "![soak](mem.png)\n", [met], [tmp_path / "mem.png",
                                                              tmp_path / "rss.png"])
    long_error = "CalledProcessError: " + "x" * 400
    md = performance.render(_info(), [performance.Outcome(SPEC["memory"], [placed]),
                                      _outcome("release", error=long_error)], tmp_path)
    assert md.count("](mem.png)") == 1 and "](rss.png)" in md
    assert long_error not in md and "| CalledProcessError: xxxxxxxxxx" in md and "x… |" in md

    md_path, js_path = performance.write_report(_info(), with_miss, tmp_path / "out")
    data = json.loads(js_path.read_text())
    assert data["exit_code"] == 1
    assert data["sections"]["scale"]["sections"][1]["data"] == {"title": "Redis cost"}
    assert md_path.read_text().startswith("# Performance")


def test_a_missing_or_raising_module_is_recorded_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = PerfOptions(results_dir=tmp_path, workdir=tmp_path / "work", quick=True)
    absent = performance.SectionSpec("x", "bench.perf_does_not_exist", ("9",), "Absent")
    outcome = performance.run_one(absent, options)
    assert outcome.failed and "not found" in (outcome.error or "")

    def boom(options: PerfOptions) -> Section:
        raise ValueError("no LiteLLM")

    module = types.ModuleType("bench.perf_fake")
    module.run = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench.perf_fake", module)
    spec = performance.SectionSpec("fake", "bench.perf_fake", ("9",), "Fake")
    lines: list[str] = []
    outcomes, interrupted = performance.run_suite([spec, absent], options, lines.append)
    assert not interrupted and [o.error for o in outcomes] == [
        "ValueError: no LiteLLM", "RuntimeError: module bench.perf_does_not_exist not found"]
    assert any("FAILED" in line for line in lines)
    assert (tmp_path / "work" / "fake").is_dir()  # each section its own scratch directory
