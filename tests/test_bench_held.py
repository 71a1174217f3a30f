"""bench.burst.held: the share of sampled time each reason held each tier's queue, per phase,
from a kvgate arm's samples.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.burst import held


def _sample(t: float, queues: dict[str, int], fields: dict[str, str]) -> dict[str, object]:
    return {"t": t, "queues": queues, "zone": "GREEN",
            "scheduler": {"zone": "GREEN", **{f"held_by:{k}": v for k, v in fields.items()}}}


SAMPLES = [
    _sample(1.0, {"vip": 0, "normal": 0, "batch": 0}, {}),
    # In the burst: Normal held by two nodes' KV and one node's prefill room, then by the
    # zone; Batch behind it; once a queue with no reason recorded yet.
    _sample(9.0, {"vip": 0, "normal": 3, "batch": 5},
            {"normal": "kv=2,prefill=1", "normal:task": "n1", "batch": "behind normal"}),
    _sample(10.0, {"vip": 0, "normal": 2, "batch": 5}, {"normal": "zone", "batch": "zone"}),
    _sample(11.0, {"vip": 0, "normal": 1, "batch": 5}, {"batch": "zone"}),
    # After: the hash still names Normal, but its queue is empty: not counted.
    _sample(25.0, {"vip": 0, "normal": 0, "batch": 1}, {"normal": "kv=1", "batch": "quiet=1"}),
]


def test_reasons_are_counted_per_sample_a_queue_waits_in() -> None:
    rows = held.tally(SAMPLES, baseline_s=8.0, burst_s=12.0)
    normal = rows[("burst", "normal")]
    assert (normal.samples, normal.waiting, normal.unrecorded) == (3, 3, 1)
    assert dict(normal.reasons) == {"kv": 1, "prefill": 1, "zone": 1}
    assert dict(rows[("burst", "batch")].reasons) == {"behind": 1, "zone": 2}
    assert rows[("after", "normal")].waiting == 0
    assert dict(rows[("after", "batch")].reasons) == {"quiet": 1}
    assert rows[("baseline", "batch")] == held.Tally(samples=1)


def test_the_table_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = held.render(held.tally(SAMPLES, 8.0, 12.0))
    header = lines[0].split(" | ")
    row = dict(zip(header, next(line for line in lines if line.startswith("| burst | normal"))
                   .split(" | "), strict=True))
    assert (row["kv"], row["prefill"], row["zone"], row["quiet"]) == ("33%", "33%", "33%", "")
    assert row["not recorded |"] == "1 |"
    (tmp_path / "samples.jsonl").write_text("\n".join(json.dumps(s) for s in SAMPLES) + "\n")
    assert held.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == lines
    with pytest.raises(SystemExit) as exc:
        held.main([str(tmp_path / "missing")])
    assert exc.value.code == 2


def test_a_run_in_which_nothing_waited_says_so() -> None:
    quiet = [_sample(9.0, {"vip": 0, "normal": 0, "batch": 0}, {"batch": "kv=1"})]
    lines = held.render(held.tally(quiet, 8.0, 12.0))
    assert lines[-1] == "\nNo queue was found waiting in any sample."
