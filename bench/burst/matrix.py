"""The burst experiment over seeds x traffic mixes x cluster sizes, kvgate on its shipped defaults.

    python -m bench.burst.matrix                                  # the reduced matrix (see below)
    python -m bench.burst.matrix --seed 3 --mix chat --size 2     # one cell again
    python -m bench.burst.matrix --seed 101-110 --mix article     # seeds not in the repository
    python -m bench.burst.matrix --mix-file mine.toml --seed 1-5  # mixes not in the repository
    python -m bench.burst.matrix --scale full --seed 1 --size 4   # a headline cell at full scale

Every cell runs the arms (default a, b, c, d) of bench.burst.experiment on one draw: the schedule is
drawn from the seed and nothing else depends on it (scale, mixes, the ``max_tokens`` mix and
every arm's settings are fixed before any draw; arm (c) runs kvgate's shipped defaults, no CLI
overrides exist here). Default cells: seeds 1-10 of the ``article`` mix and 1-5 of ``chat`` and
``generation`` (bench.burst.mixes), each on 2 and 4 nodes: 40 cells. ``--mix-file`` adds mixes
defined in a TOML file (bench.burst.mixfile says how), which then run instead of the
repository's unless ``--mix`` names some; their default seeds are 1-5.

Each cell writes ``<out>/cells/<scale>-<mix>-n<size>-s<seed>.json`` (every arm's figures, its
verdicts on the seven criteria, the lag the run measured, its wall time), and after every cell
``<out>/matrix-<scale>.md`` is written again from all cell files of that scale in ``<out>``:
one table per cell, then the aggregate (per arm and criterion: cells passed of valid cells, the
median and worst figure), and ``<out>/matrix-<scale>.png``, every cell's figures per criterion
(bench.burst.matrixplot). An arm whose simulators lagged or whose load generator sent late
beyond the bound (bench.burst.report) is marked INVALID in its cell and left out of the aggregate,
never counted as a pass.

Scales (``--scale``):

* ``reduced`` (default): quarter-size nodes on a clock eight times faster, 64 s baseline, 96 s
  burst (simulated), the lag bound 25 ms: fits two cores when nothing else runs. One cell
  with four arms takes about 3 minutes of wall time on 2 cores with 2 or 4 nodes (each arm
  stops at most 44 wall seconds after its start, plus start-up), so the default 40 cells take
  about 2 hours.
* ``full``: real-size nodes in real time, 300 s baseline, 240 s burst: the headline cells, about
  an hour per cell with four arms (run it per cell, with ``--seed``/``--mix``/``--size``).
* ``ci``: a tiny cell for the test suite (seconds per arm; its figures mean little).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.burst import jsonlines
from bench.burst.arm import flush_print
from bench.burst.criteria import (
    CRITERIA,
    EXTRA,
    GOODPUT_BAR,
    LABELS,
    Verdict,
    cell_table,
    judge_all,
    validity,
)
from bench.burst.expconfig import ARM_TITLES, ARMS, Settings
from bench.burst.experiment import run_experiment
from bench.burst.fallback import cell_key, frontier, load_ideal, slack, tally
from bench.burst.matrixplot import load_records, ordered, plot_matrix
from bench.burst.mixes import MIXES, with_mix
from bench.burst.mixfile import MixFileError, chosen_mixes, definition
from bench.burst.points import Point
from bench.burst.report import ArmSummary
from bench.common.gitrev import revision as git_revision

RESULTS = Path(__file__).resolve().parents[1] / "results" / "matrix"

SCALES: dict[str, Settings] = {
    "reduced": Settings(capacity_scale=0.25, time_scale=8.0, baseline_sim_s=64.0,
                        burst_sim_s=96.0, min_after_sim_s=48.0, max_loop_lag_ms=25.0,
                        max_send_lag_ms=25.0),
    "full": Settings(baseline_sim_s=300.0),
    "ci": Settings(capacity_scale=0.25, time_scale=8.0, baseline_sim_s=16.0, burst_sim_s=24.0,
                   drain_factor=0.5, min_after_sim_s=8.0, crash_after_full_sim_s=None,
                   gateways=1, schedulers=1, max_loop_lag_ms=25.0, max_send_lag_ms=25.0),
}
DEFAULT_SEEDS = {"article": "1-10", "chat": "1-5", "generation": "1-5"}
FILE_SEEDS = "1-5"
"""Default seeds of a mix from a mix file."""
DEFAULT_SIZES = (2, 4)


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    scale: str
    mix: str
    size: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.scale}-{self.mix}-n{self.size}-s{self.seed}"

    def settings(self) -> Settings:
        # The seed enters here and nowhere else: it draws the schedule (bench.burst.workload.plan).
        base = with_mix(SCALES[self.scale], self.mix)
        return dataclasses.replace(base, nodes=self.size, seed=self.seed)


def parse_seeds(spec: str) -> list[int]:
    """"3", "1-10" or "1,4,7-9" -> the seeds, in order, without repeats."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"empty seed range {part!r}")
        out += [s for s in range(first, last + 1) if s not in out]
    if not out:
        raise ValueError("no seeds")
    return out


def cells(scale: str, mixes: Sequence[str], sizes: Sequence[int], seeds: str | None
          ) -> list[Cell]:
    return [Cell(scale, mix, size, seed) for mix in mixes for size in sizes
            for seed in parse_seeds(seeds or DEFAULT_SEEDS.get(mix, FILE_SEEDS))]


def is_done(path: Path, arms: Sequence[str], point: Point) -> bool:
    """Whether a cell's JSON records a run of every one of `arms` at `point`. A cell recorded
    at another point, with fewer arms, or unreadable is not done: `--skip-done` reruns it, and
    its new record replaces the old one."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("point", "default") != point.label:
        return False
    recorded = {a.get("arm") for a in record.get("arms", ()) if isinstance(a, dict)}
    return set(arms) <= recorded


def cell_record(cell: Cell, settings: Settings, summaries: Sequence[ArmSummary],
                wall_s: float, revision: str, point: Point | None = None) -> dict[str, Any]:
    judged = judge_all(summaries, settings.burst_sim_s, settings.drain_factor)
    record: dict[str, Any] = jsonlines.safe({
        "cell": dataclasses.asdict(cell),
        "code": revision,
        "point": (point or Point()).label,
        "wall_s": wall_s,
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "classes"},
        "traffic": definition(MIXES[cell.mix]),
        "arms": [{"arm": s.arm, "valid": not s.invalid, "validity": validity(s),
                  "verdicts": [dataclasses.asdict(v) for v in verdicts],
                  "summary": dataclasses.asdict(s)}
                 for s, verdicts in zip(summaries, judged, strict=True)],
    })
    return record


def error_record(cell: Cell, wall_s: float, revision: str, error: BaseException,
                 point: Point | None = None) -> dict[str, Any]:
    """The record of a cell whose run ended in an error (a service that did not start, the
    load generator raising, a goodput above its bound): no arm's figures, the error, so that
    the table shows the cell instead of leaving it out."""
    return {"cell": dataclasses.asdict(cell), "code": revision,
            "point": (point or Point()).label, "wall_s": wall_s, "arms": [],
            "error": f"{type(error).__name__}: {error}"}


def _verdict(d: dict[str, Any]) -> Verdict:
    # Non-finite figures are stored as strings ("inf", "nan"); float() reads both forms.
    return Verdict(d["key"], d["value"], d["ok"], float(d.get("number", math.nan)))


def render(records: Sequence[dict[str, Any]], scale: str,
           ideal: Sequence[dict[str, Any]] = ()) -> str:
    """The matrix's markdown: the aggregate, then one table per cell; with the ideal's records
    (bench.burst.ideal), the goodput criterion is also judged with its fallback."""
    points = sorted({r.get("point", "default") for r in records})
    kvgate = ("kvgate on its shipped defaults" if points == ["default"] else
              f"kvgate with its release control at {', '.join(points)} (`--point`), not the "
              "shipped defaults")
    parts = [f"# Burst matrix, {scale} scale", "",
             f"{len(records)} cells; {kvgate}; every arm on the same "
             "engines. Criteria and method: bench/README.md; each cell's figures: "
             "cells/*.json.", ""]
    parts += aggregate(records, ideal)
    by_cell = {cell_key(r): r for r in ideal}
    margin = slack(ideal, records)
    for rec in ordered(records):
        c = rec["cell"]
        if "error" in rec:
            parts += [f"## {c['mix']}, {c['size']} nodes, seed {c['seed']}", "",
                      f"{rec['wall_s'] / 60:.1f} minutes wall, code {rec['code']}: the run ended "
                      f"in an error, {rec['error']}; no figures (in no row of the aggregate but "
                      "its last).", ""]
            continue
        arms = [a["arm"] for a in rec["arms"]]
        judged = [[_verdict(v) for v in a["verdicts"]] for a in rec["arms"]]
        parts += [f"## {c['mix']}, {c['size']} nodes, seed {c['seed']}", "",
                  f"{rec['wall_s'] / 60:.1f} minutes wall, code {rec['code']}", "",
                  cell_table(arms, judged, [a["validity"] for a in rec["arms"]]), ""]
        top = by_cell.get(cell_key(rec))
        if top is not None:
            parts += [_fallback_line(top, rec, arms, margin, scale), ""]
    return "\n".join(parts)


def _fallback_line(top: dict[str, Any], rec: dict[str, Any], arms: Sequence[str],
                   margin: float, scale: str) -> str:
    reach = float(top["points"]["under_bar"]["goodput_ratio"])
    verdicts = {a: frontier(top, rec, a, margin) for a in arms}
    marks = ", ".join(f"({a}) {'n/a' if v.passed is None else ('PASS' if v.passed else 'FAIL')}"
                      for a, v in verdicts.items())
    reachable = all(v.reachable for v in verdicts.values())  # the same for every arm
    target = next((v.target for v in verdicts.values() if v.target is not None), None)
    rule = ("" if reachable else
            f" An arm that keeps the VIP bar must reach {target:.1%}, the ideal's best goodput "
            "that keeps it (its VIP frontier)." if target is not None else
            " No point of the ideal's VIP frontier keeps the VIP bar: an arm that keeps it "
            "passes if no other arm that keeps it has more goodput.")
    return (f"The ideal admission (ideal-{scale}.md) gets {reach:.1%} of the goodput bound "
            f"below the KV bar: {GOODPUT_BAR:.0%} is "
            f"{'in reach' if reachable else 'out of reach'}.{rule} Goodput with the fallback: "
            f"{marks}.")


def aggregate(records: Sequence[dict[str, Any]],
              ideal: Sequence[dict[str, Any]] = ()) -> list[str]:
    """Per arm and criterion over the valid cells: passed / judged, median and worst figure;
    with the ideal's records, goodput and all seven also judged with the fallback."""
    arms = [a for a in ARMS if any(x["arm"] == a for r in records for x in r["arms"])]
    by_arm: dict[str, list[list[Verdict]]] = {a: [] for a in arms}
    invalid: dict[str, int] = dict.fromkeys(arms, 0)
    for rec in records:
        for a in rec["arms"]:
            if a["valid"]:
                by_arm[a["arm"]].append([_verdict(v) for v in a["verdicts"]])
            else:
                invalid[a["arm"]] += 1
    lines = ["## Aggregate over cells", "",
             "Per criterion: valid cells passed / valid cells judged; median and worst figure "
             "(worst: highest, except success and goodputs: lowest). Invalid arm runs (lag) are "
             "left out and counted in the last row.", "",
             "| criterion | " + " | ".join(ARM_TITLES[a] for a in arms) + " |",
             "|---|" + "---|" * len(arms)]
    for key in (*CRITERIA, *EXTRA):
        row = []
        for a in arms:
            # By key: a cell recorded before a check was added has no verdict for it.
            vs = [x for v in by_arm[a] for x in v if x.key == key and x.ok is not None]
            if not vs:
                row.append("n/a")
                continue
            nums = [v.number for v in vs if not math.isnan(v.number)]
            low_is_bad = key in ("vip_success", "goodput", "goodput_tokens")
            worst = (min if low_is_bad else max)(nums) if nums else math.nan
            med = statistics.median(nums) if nums else math.nan
            row.append(f"{sum(1 for v in vs if v.ok)}/{len(vs)} (median {_fmt(key, med)}, "
                       f"worst {_fmt(key, worst)})")
        lines.append(f"| {LABELS[key]} | " + " | ".join(row) + " |")
    lines.append("| cells meeting all seven | " + " | ".join(
        f"{sum(1 for v in by_arm[a] if all(x.ok for x in v if x.key in CRITERIA))}"
        f"/{len(by_arm[a])}" for a in arms) + " |")
    if ideal:
        counts = tally(records, ideal, arms)
        lines.append("| goodput with the fallback: where the ideal admission cannot reach "
                     f"{GOODPUT_BAR:.0%}, the best goodput that keeps the VIP bar | "
                     + " | ".join(f"{counts[a].goodput}/{counts[a].judged}" for a in arms)
                     + " |")
        lines.append("| all seven, goodput with the fallback | " + " | ".join(
            f"{counts[a].all_seven}/{counts[a].judged}" for a in arms) + " |")
    lines.append("| invalid runs (left out) | " + " | ".join(str(invalid[a]) for a in arms)
                 + " |")
    failed = sum(1 for r in records if "error" in r)
    lines.append("| cells whose run ended in an error (left out) | "
                 + " | ".join(str(failed) for _ in arms) + " |")
    return [*lines, ""]


def _fmt(key: str, x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf"
    if key in ("kv_peak", "vip_success", "goodput", "goodput_tokens"):
        return f"{x:.1%}" if key != "vip_success" else f"{x:.2%}"
    if key in ("vip_p99", "calm", "batch_done", "vip_engine"):
        return f"x{x:.2f}"
    return f"{x:,.0f}"


async def run_cells(todo: Sequence[Cell], arms: Sequence[str], out: Path, log_root: Path,
                    say: Callable[[str], None], verbose: bool, point: Point | None = None
                    ) -> None:
    revision = git_revision()
    (out / "cells").mkdir(parents=True, exist_ok=True)
    spent: list[float] = []
    for n, cell in enumerate(todo, 1):
        eta = (f", about {statistics.mean(spent) * (len(todo) - n + 1) / 60:.0f} min left"
               if spent else "")
        say(f"=== cell {n}/{len(todo)}: {cell.mix} mix, {cell.size} nodes, seed {cell.seed} "
            f"({cell.scale} scale{eta}) ===")
        settings = (point or Point()).apply(cell.settings())
        started = time.monotonic()
        try:
            _, _, summaries = await run_experiment(settings, arms, log_root / cell.name,
                                                   progress=verbose)
        except Exception as exc:  # one cell's failure is a result to report, not the end
            wall = time.monotonic() - started
            record = error_record(cell, wall, revision, exc, point)
            say(f"  the run ended in an error: {record['error']} (logs: "
                f"{log_root / cell.name})")
        else:
            wall = time.monotonic() - started
            record = cell_record(cell, settings, summaries, wall, revision, point)
        spent.append(wall)
        (out / "cells" / f"{cell.name}.json").write_text(json.dumps(record, indent=1))
        for a in record["arms"]:
            met = sum(1 for v in a["verdicts"] if v["key"] in CRITERIA and v["ok"])
            say(f"  {ARM_TITLES[a['arm']]}: {met}/7 criteria"
                + ("" if a["valid"] else " (INVALID: lag)"))
        say(f"  {wall:.0f} s wall")
        records = load_records(out, cell.scale)
        ideal = load_ideal(out / f"ideal-{cell.scale}.json")
        (out / f"matrix-{cell.scale}.md").write_text(render(records, cell.scale, ideal))
        plot_matrix(records, out / f"matrix-{cell.scale}.png")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.burst.matrix",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    p.add_argument("--seed", help='seeds for every chosen mix: "3", "1-10", "1,4,7-9" '
                                  "(default: 1-10 for article, 1-5 for the others)")
    p.add_argument("--mix", help=f"comma-separated mixes: of {', '.join(MIXES)}, or of "
                                 "--mix-file (default: the file's mixes, else the three)")
    p.add_argument("--mix-file", type=Path,
                   help="a TOML file of more mixes (bench.burst.mixfile)")
    p.add_argument("--size", default=",".join(map(str, DEFAULT_SIZES)),
                   help="comma-separated node counts")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temporary directory)")
    p.add_argument("--skip-done", action="store_true",
                   help="skip cells whose JSON in --out already records these arms at this "
                        "--point (any other is rerun and replaced)")
    p.add_argument("--quiet", action="store_true", help="one line per arm, not per second")
    p.add_argument("--point", type=Point.parse, default=Point(),
                   help="arm (c)'s release control at a setting other than the shipped one, "
                        "as bench.burst.sweep takes it (l=1: one lane per pool); the table "
                        "says so. Exploration: the matrix's record is the defaults")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mixes = chosen_mixes(args.mix, args.mix_file)
    except MixFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        print(f"error: unknown arm {bad}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.size.split(",") if s.strip()]
    todo = cells(args.scale, mixes, sizes, args.seed)
    if args.skip_done:
        todo = [c for c in todo
                if not is_done(args.out / "cells" / f"{c.name}.json", arms, args.point)]
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="kvgate-matrix-"))
    flush_print(f"{len(todo)} cells, arms {','.join(arms)}, logs {log_root}, out {args.out}")
    coro = run_cells(todo, arms, args.out, log_root, flush_print, verbose=not args.quiet,
                     point=args.point)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    flush_print(f"written: {args.out / f'matrix-{args.scale}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
