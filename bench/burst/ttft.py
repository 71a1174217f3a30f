"""Where a tier's TTFT went, per phase and per node, from one arm's raw logs.

``python -m bench.burst.ttft LOG_DIR/arm-c [--tier vip] [--baseline 120] [--burst 240]`` joins the
load generator's ``requests.jsonl`` (intended send time, client-side TTFT, the gateway's request
id) with the nodes' traces (``nodes/node{i}-trace.jsonl``, bench.sim.trace) and splits each
request's TTFT into

* ``outside``: client-side TTFT minus the engine's (send lag, the gateway's admission and queue,
  the forward and the first chunk's way back),
* ``queue``: arrival at the engine to its first scheduled step,
* ``engine``: arrival to the first token, with the steps it waited through (their longest
  duration, the prefill tokens they carried, the batch size at arrival).

Phases are by intended send time: baseline, burst (``[baseline, baseline + burst)``), after.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.burst.workload import burst_profile
from bench.common.stats import percentile

_PHASES = ("baseline", "burst", "after")


@dataclass(frozen=True, slots=True)
class Step:
    start: float
    duration: float
    prefill: int


@dataclass(frozen=True, slots=True)
class Breakdown:
    phase: str
    node: int
    ttft_ms: float
    outside_ms: float
    queue_ms: float
    engine_ms: float
    steps: int
    longest_step_ms: float
    prefill_tokens: int
    running_at_arrival: int


def _read_jsonl(path: Path) -> Iterable[dict[str, object]]:
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load_traces(nodes_dir: Path) -> tuple[dict[str, tuple[int, dict[str, object]]],
                                          dict[int, list[Step]]]:
    requests: dict[str, tuple[int, dict[str, object]]] = {}
    steps: dict[int, list[Step]] = {}
    for path in sorted(nodes_dir.glob("node*-trace.jsonl")):
        node = int(path.name[len("node"):].split("-")[0])
        node_steps: list[Step] = []
        for row in _read_jsonl(path):
            if row["k"] == "s":
                node_steps.append(Step(float(row["t"]), float(row["d"]),  # type: ignore[arg-type]
                                       int(row["p"])))  # type: ignore[call-overload]
            else:
                requests[str(row["id"])] = (node, row)
        node_steps.sort(key=lambda s: s.start)
        steps[node] = node_steps
    return requests, steps


def breakdowns(arm_dir: Path, tier: str, baseline_s: float, burst_s: float,
               time_scale: float = 1.0) -> list[Breakdown]:
    """Engine times are simulated; dividing by ``time_scale`` puts them in wall ms like TTFT."""
    wall_ms = 1000 / time_scale
    traced, steps = load_traces(arm_dir / "nodes")
    starts = {node: [s.start for s in node_steps] for node, node_steps in steps.items()}
    profile = burst_profile(baseline_s, burst_s, after_s=math.inf)
    out: list[Breakdown] = []
    for row in _read_jsonl(arm_dir / "requests.jsonl"):
        ttft = row.get("ttft")
        if row["tier"] != tier or ttft is None or row.get("request_id") not in traced:
            continue
        node, rec = traced[str(row["request_id"])]
        arrival, first, sched = rec["arr"], rec["first"], rec["sched"]
        if not isinstance(arrival, float) or not isinstance(first, float):
            continue
        node_steps = steps[node]
        lo = max(0, bisect.bisect_right(starts[node], arrival) - 1)
        hi = bisect.bisect_left(starts[node], first)
        waited = [s for s in node_steps[lo:hi] if s.start + s.duration > arrival]
        engine_ms = (first - arrival) * wall_ms
        out.append(Breakdown(
            phase=profile.phase_at(float(row["at"])),  # type: ignore[arg-type]
            node=node,
            ttft_ms=float(ttft) * 1000,  # type: ignore[arg-type]
            outside_ms=float(ttft) * 1000 - engine_ms,  # type: ignore[arg-type]
            queue_ms=((sched if isinstance(sched, float) else first) - arrival) * wall_ms,
            engine_ms=engine_ms,
            steps=len(waited),
            longest_step_ms=max((s.duration for s in waited), default=0.0) * wall_ms,
            prefill_tokens=sum(s.prefill for s in waited),
            running_at_arrival=int(rec["run0"]),  # type: ignore[call-overload]
        ))
    return out


def report(rows: Sequence[Breakdown]) -> list[str]:
    lines = ["| phase | node | n | TTFT P50 / P99 | outside P50 / P99 | queue P50 / P99 "
             "| engine P50 / P99 | longest step P50 / P99 | running at arrival P50 / P99 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str], list[Breakdown]] = defaultdict(list)
    for r in rows:
        groups[(r.phase, "all")].append(r)
        groups[(r.phase, str(r.node))].append(r)
    for phase in _PHASES:
        for node in ["all", *sorted({str(r.node) for r in rows})]:
            group = groups.get((phase, node))
            if not group:
                continue

            def pair(values: list[float]) -> str:
                return f"{percentile(values, 50):.0f} / {percentile(values, 99):.0f}"

            lines.append(
                f"| {phase} | {node} | {len(group)} | {pair([r.ttft_ms for r in group])} "
                f"| {pair([r.outside_ms for r in group])} | {pair([r.queue_ms for r in group])} "
                f"| {pair([r.engine_ms for r in group])} "
                f"| {pair([r.longest_step_ms for r in group])} "
                f"| {pair([float(r.running_at_arrival) for r in group])} |")
    return lines


def slowest(rows: Sequence[Breakdown], phase: str, share: float) -> list[str]:
    picked = sorted((r for r in rows if r.phase == phase), key=lambda r: -r.ttft_ms)
    picked = picked[:max(1, math.ceil(share * len(picked)))]
    lines = [f"slowest {len(picked)} in {phase} (ms): ttft outside queue engine | steps longest "
             "prefill-tokens running node"]
    lines += [f"  {r.ttft_ms:7.0f} {r.outside_ms:6.0f} {r.queue_ms:6.0f} {r.engine_ms:6.0f} | "
              f"{r.steps:3d} {r.longest_step_ms:5.0f} {r.prefill_tokens:7d} "
              f"{r.running_at_arrival:4d} {r.node}" for r in picked]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst.ttft",
                                description=__doc__.split("\n")[0])
    p.add_argument("arm_dir", type=Path, help="an arm's log directory (LOG_DIR/arm-c)")
    p.add_argument("--tier", default="vip")
    p.add_argument("--baseline", type=float, default=120.0, help="wall seconds")
    p.add_argument("--burst", type=float, default=240.0, help="wall seconds")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated s per wall s (the run's)")
    p.add_argument("--slowest", type=float, default=0.02, help="share of each phase to list")
    args = p.parse_args(argv)
    rows = breakdowns(args.arm_dir, args.tier, args.baseline, args.burst, args.time_scale)
    if not rows:
        print("no traced requests of that tier (were the nodes started with --trace?)")
        return 1
    print("\n".join(report(rows)))
    for phase in _PHASES:
        print("\n".join(slowest(rows, phase, args.slowest)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
