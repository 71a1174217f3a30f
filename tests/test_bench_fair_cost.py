"""bench.perf.fair_cost runs against the scripts of the revision before fairness (today's store
drives them too: the benchmark's premise), and admit and settle stay one round trip each. A
shallow clone without that revision measures this checkout against itself instead."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench.perf.fair_cost import BEFORE_FAIRNESS, main


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_hot_path_is_measured_against_the_scripts_before_fairness(tmp_path: Path) -> None:
    known = subprocess.run(["git", "cat-file", "-e", f"{BEFORE_FAIRNESS}^{{commit}}"],
                           capture_output=True, check=False).returncode == 0
    baseline = BEFORE_FAIRNESS if known else "HEAD"
    out = tmp_path / "fair_cost.md"
    assert main(["--baseline", baseline, "--seconds", "0.2", "--rounds", "1",
                 "--out", str(out)]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in out.read_text().splitlines()
            if line.startswith(("| fast path", "| queued"))]
    assert [(r[0], r[1].split(" ")[0]) for r in rows] == [
        (s, a) for s in ("fast path", "fast path, team", "queued + release")
        for a in ("this", "baseline")]
    for row in rows:
        assert row[2:4] == ["1.00", "1.00"], row  # one round trip per admit and per settle
        assert float(row[4]) > 0 and float(row[5]) > 0
    queued = [r for r in rows if r[0] == "queued + release"]
    assert all(float(r[7]) > 0 for r in queued), queued  # the older release too
