"""``python -m bench.burst.sweep``: the measured frontier of one matrix cell. Arm (c) runs at
several settings of its release control on the cell's draw; arm (a), the reference of the VIP
criterion, runs once in the same run. Exploration, not the matrix: the matrix judges kvgate's
shipped defaults only, and a setting found here becomes a default only after it is judged on
seeds it was not chosen on.

    python -m bench.burst.sweep --mix generation --size 2 --seed 1 default o=120 r=16
    python -m bench.burst.sweep --scale full --mix article --size 4 --seed 3 default o=120,r=32

A point is ``default`` (the shipped control) or comma-separated settings at real scale,
converted to the lab clock as the defaults are (bench.burst.expconfig):

* ``o=<ms>``: ``control.vip_ttft_objective_ms``, the VIP objective the prefill window is sized
  for;
* ``r=<n>``: ``control.max_engine_running``, no Normal or Batch work to a node whose engine
  runs more sequences (0: no bound);
* ``m=<n>``: ``control.running_min``, the floor of the running limit (0: no limit);
* ``s=<x>``: ``control.vip_slowdown``, the objective as a multiple of the learned calm P99 (0:
  the absolute ``vip_ttft_objective_ms``). ``m=0,s=0`` is the control without either;
* ``l=<n>``: ``control.lane_nodes``, the nodes kept as VIP lanes (0: none);
* ``ls=<x>``: ``control.lane_slowdown``, how far a lane's decode step may grow (from 1 to 100);
* ``lo=<tokens>``: ``control.lane_output``, the longest output a lane's Normal and Batch tasks
  may declare (0: any);
* ``le=<0|1>``: ``control.lane_on_miss``, a lane's cap only once VIP has missed in a flood.
* ``q=<n>``: ``control.quiet_nodes``, the nodes kept free of long prefills for VIP (0: none).

Writes ``<out>/sweep-<scale>-<mix>-n<size>-s<seed>.md`` (per point: the VIP criterion, its
engine part, goodput as work and as tokens against their upper bounds, KV peak, preemptions,
Batch, calm VIP, validity, criteria met; then the best goodput among the valid points that
keep the VIP bar) and the same figures as ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.burst import jsonlines
from bench.burst.arm import flush_print
from bench.burst.criteria import Verdict, judge_all, passed, validity
from bench.burst.expconfig import Settings
from bench.burst.experiment import run_experiment
from bench.burst.matrix import RESULTS, SCALES, Cell
from bench.burst.mixes import MIXES
from bench.burst.mixfile import MixFileError, one_mix
from bench.burst.points import Point
from bench.burst.report import ArmSummary
from bench.common.gitrev import revision as git_revision


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    point: Point
    summary: ArmSummary
    verdicts: list[Verdict]

    def verdict(self, key: str) -> Verdict:
        return next(v for v in self.verdicts if v.key == key)

    @property
    def keeps_vip_bar(self) -> bool:
        return not self.summary.invalid and self.verdict("vip_p99").ok is True


def judge_points(reference: ArmSummary, runs: Sequence[tuple[Point, ArmSummary]],
                 settings: Settings) -> list[Row]:
    """Each point's arm (c) judged against the one arm (a)."""
    rows = []
    for point, summary in runs:
        verdicts = judge_all([reference, summary], settings.burst_sim_s,
                             settings.drain_factor)[1]
        rows.append(Row(point, summary, verdicts))
    return rows


def best(rows: Sequence[Row]) -> Row | None:
    """The valid point of highest goodput among those that keep the VIP bar."""
    kept = [r for r in rows if r.keeps_vip_bar and r.summary.goodput_ratio is not None]
    return max(kept, key=lambda r: r.summary.goodput_ratio or 0.0, default=None)


_COLUMNS = (("vip_p99", "VIP P99 burst vs (a) calm"), ("vip_engine", "engine part; rest"),
            ("goodput", "goodput (work)"), ("goodput_tokens", "goodput (tokens)"),
            ("kv_peak", "KV peak"), ("preemptions", "preemptions"),
            ("batch_done", "Batch"), ("calm", "calm VIP vs (a)"))


def markdown(cell: Cell, reference: ArmSummary, rows: Sequence[Row], command: str,
             revision: str, wall_s: float) -> str:
    ref = reference.vip_ttft_base
    lines = [
        f"# Frontier: {cell.mix} mix, {cell.size} nodes, seed {cell.seed} ({cell.scale} scale)",
        "",
        f"`{command}` on `{revision}`, {wall_s / 60:.1f} minutes wall. Arm (c) at each setting "
        f"of its release control (real-scale values; `default` is the shipped control); arm "
        f"(a) once, the VIP criterion's reference: calm VIP P50 / P99 {ref[0]:.0f} / "
        f"{ref[1]:.0f} ms ({validity(reference)}). Exploration: the matrix judges the "
        "shipped defaults only. Each point's run validity (lag) is in the JSON.",
        "",
        "| point | " + " | ".join(title for _, title in _COLUMNS) + " | valid | criteria met |",
        "|---|" + "---|" * (len(_COLUMNS) + 2),
    ]
    for r in rows:
        cells = [f"{r.verdict(k).value} {r.verdict(k).mark}" for k, _ in _COLUMNS]
        valid = "yes" if not r.summary.invalid else "INVALID: " + "; ".join(r.summary.invalid)
        lines.append(f"| {r.point.label} | " + " | ".join(cells)
                     + f" | {valid} | {passed(r.verdicts)}/7 |")
    top = best(rows)
    lines += ["", "Best goodput that keeps the VIP bar: " + (
        f"{top.verdict('goodput').value} at `{top.point.label}`." if top is not None
        else "no valid point keeps it."), ""]
    return "\n".join(lines)


def record(cell: Cell, reference: ArmSummary, rows: Sequence[Row], revision: str,
           wall_s: float) -> dict[str, Any]:
    def arm(summary: ArmSummary, verdicts: Sequence[Verdict] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"valid": not summary.invalid,
                               "summary": dataclasses.asdict(summary)}
        if verdicts is not None:
            out["verdicts"] = [dataclasses.asdict(v) for v in verdicts]
        return out

    top = best(rows)
    out: dict[str, Any] = jsonlines.safe({
        "cell": dataclasses.asdict(cell), "code": revision, "wall_s": wall_s,
        "reference": arm(reference, None),
        "points": [{"point": r.point.label, **arm(r.summary, r.verdicts)} for r in rows],
        "best": None if top is None else top.point.label})
    return out


async def run_sweep(cell: Cell, points: Sequence[Point], log_root: Path, verbose: bool
                    ) -> tuple[ArmSummary, list[Row]]:
    settings = cell.settings()
    _, _, (reference,) = await run_experiment(settings, ["a"], log_root / "a",
                                              progress=verbose)
    flush_print(f"(a): calm VIP P99 {reference.vip_ttft_base[1]:.0f} ms")
    rows = []
    for point in points:
        _, _, (summary,) = await run_experiment(point.apply(settings), ["c"],
                                                log_root / f"c-{point.label}", progress=verbose)
        (row,) = judge_points(reference, [(point, summary)], settings)
        rows.append(row)
        flush_print(f"(c) {point.label}: VIP {row.verdict('vip_p99').value}, goodput "
                    f"{row.verdict('goodput').value}, Batch {row.verdict('batch_done').value}")
    return reference, rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.burst.sweep",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("points", nargs="+",
                   help="default, or comma-separated o=<ms>, r=<n>, m=<n>, s=<x>, l=<n>, "
                        "ls=<x>, lo=<tokens>, le=<0|1>, q=<n> (see above)")
    p.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    p.add_argument("--mix", required=True,
                   help=f"one of {', '.join(MIXES)}, or of --mix-file")
    p.add_argument("--mix-file", type=Path,
                   help="a TOML file of more mixes (bench.burst.mixfile)")
    p.add_argument("--size", type=int, required=True, help="nodes")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temporary directory)")
    p.add_argument("--verbose", action="store_true", help="the arms' progress every second")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        points = [Point.parse(p) for p in args.points]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        one_mix(args.mix, args.mix_file)
    except MixFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cell = Cell(args.scale, args.mix, args.size, args.seed)
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="kvgate-sweep-"))
    flush_print(f"{cell.name}: (a) once, then (c) at {', '.join(p.label for p in points)}; "
                f"logs {log_root}")
    started = time.monotonic()
    reference, rows = asyncio.run(run_sweep(cell, points, log_root, args.verbose))
    wall = time.monotonic() - started
    revision = git_revision()
    command = "python -m bench.burst.sweep " + " ".join(
        [*(["--scale", args.scale] if args.scale != "reduced" else []),
         *(["--mix-file", str(args.mix_file)] if args.mix_file else []), "--mix", args.mix,
         "--size", str(args.size), "--seed", str(args.seed), *(p.label for p in points)])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"sweep-{cell.name}"
    stem.with_suffix(".md").write_text(markdown(cell, reference, rows, command, revision, wall))
    stem.with_suffix(".json").write_text(
        json.dumps(record(cell, reference, rows, revision, wall), indent=1) + "\n")
    flush_print(f"written: {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
