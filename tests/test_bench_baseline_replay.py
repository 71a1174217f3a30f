"""Arms (a) and (b) replayed offline (bench.burst.baseline_replay)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from admission.tiers import Tier
from bench.burst import jsonlines
from bench.burst.baseline_replay import main, replay_baseline, replay_seed
from bench.burst.workload import PlannedRequest
from bench.sim.config import SimConfig

# 1,349 usable blocks of 16 tokens per node.
CONFIG = SimConfig(capacity_scale=0.05, max_model_len=8192)


def _overload(seed: int) -> list[PlannedRequest]:
    """Documents of at most 6,400 tokens (400 blocks) with their outputs, far more than two such
    nodes hold, and VIP chats throughout."""
    rng = random.Random(seed)
    docs = [PlannedRequest(i, "docs", Tier.BATCH, at=rng.uniform(0, 20),
                           prompt_tokens=rng.randint(2000, 6000),
                           output_tokens=rng.randint(50, 400), stream=False)
            for i in range(60)]
    vips = [PlannedRequest(100 + i, "vip", Tier.VIP, at=0.5 * i, prompt_tokens=200,
                           output_tokens=50, stream=True)
            for i in range(60)]
    return docs + vips


@pytest.mark.parametrize("seed", range(3))
def test_a_limit_whose_worst_case_fits_never_preempts_and_no_limit_does(seed: int) -> None:
    requests = _overload(seed)
    # Three in flight hold at most 3 x 400 blocks: always within the 1,349.
    bounded = replay_baseline(CONFIG, 2, requests, 1.0, (5.0, 25.0), max_inflight=3)
    unbounded = replay_baseline(CONFIG, 2, requests, 1.0, (5.0, 25.0), max_inflight=None)
    assert bounded.preemptions == 0
    assert bounded.kv_peak <= 3 * 400 / 1349
    assert unbounded.preemptions > 0
    assert unbounded.kv_peak == 1.0
    assert bounded.policy == "fifo=3" and unbounded.policy == "rr"


def test_a_fifo_limit_queues_vip_behind_documents() -> None:
    requests = _overload(1)
    result = replay_baseline(CONFIG, 2, requests, 1.0, (5.0, 25.0), max_inflight=3)
    # Before the documents arrive in numbers VIP chats start at once; in the flood they wait in
    # the one queue behind documents that each hold a slot for seconds.
    assert all(math.isfinite(x) for x in (*result.vip_ttft_base, *result.vip_ttft_burst))
    assert result.vip_ttft_burst[1] > 5 * result.vip_ttft_base[1]


def test_replay_seed_reads_the_preset_and_its_limit() -> None:
    row = replay_seed("short", "fifo", seed=3)
    assert row["policy"] == "fifo=32" and row["seed"] == 3
    other = replay_seed("short", "fifo=4", seed=3, baseline_sim_s=32.0)
    assert other["policy"] == "fifo=4" and other["baseline_sim_s"] == 32.0
    with pytest.raises(ValueError, match="policy"):
        replay_seed("short", "lifo")


def test_the_command_appends_json_lines_and_tables_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "draws.jsonl"
    assert main(["rr", "fifo=4", "--preset", "short", "--seeds", "3", "--jsonl", str(out)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in printed] == ["rr", "fifo=4"]
    assert jsonlines.read(out) == printed
    assert main(["--table", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| fifo=4 | 64 | 1 |" in table and "| rr | 64 | 3 |" in table
