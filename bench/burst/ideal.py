"""The ideal admission in every matrix cell: how much of the goodput bound, and how much of the
Batch deadline, an admission controller could reach on the same engines and traffic.

    python -m bench.burst.ideal                              # every reduced cell, ~4 min
    python -m bench.burst.ideal --mix article --size 4 --seed 3
    python -m bench.burst.ideal --scale full --mix article --size 4 --seed 1   # ~5 min
    python -m bench.burst.ideal --mix-file mine.toml --seed 1-5   # the matrix's --mix-file cells

Each cell's schedule (the one its arms replay, drawn from its seed) is replayed offline by
``bench.burst.capacity.ideal_replay``: the simulator's own engine, in simulated time, behind an
admission that knows every request's exact size and each sequence's progress and starts any
queued request (oldest first, VIP before Normal before Batch) wherever its projected KV peak
fits. Two points per cell (``POINTS``): with the whole cache, and held below the KV bar as the
arms are judged. Each is valued exactly as the arms are (bench.burst.goodput): goodput as work
in the burst against the same upper bound, offered work and node time alike, and the Batch
criterion's deadline, with the replay run on through the traffic that follows the burst.

A third set of points is the ideal's VIP frontier: the same replay below the KV bar with
each node kept to at most ``RUNNING_CAPS`` Normal and Batch sequences (VIP goes past), since
once VIP's prefill is first in line, a shorter decode batch is what shortens its first token.
The best goodput among the points whose VIP P99 in the burst stays within the VIP bar of the
same point's calm P99 is what keeping VIP fast costs an omniscient admission. Its reference is
its own calm, without a gateway's hop, and it places long prefills wherever they fit, so where
documents arrive (the article mix) a placement that keeps them away from VIP does better.

What it is for: the goodput criterion (``GOODPUT_BAR`` of the bound) allows, where the measured
frontier shows it out of reach, the best goodput that keeps the VIP bar instead. An ideal below
the bar in a cell is that frontier for the cell: the rest of the bound is lost inside the
engines (the fixed cost of a step that is not full, the cached context each decode token reads)
or is slack in the bound's relaxations, not held back by admission. The ideal is not an upper
bound itself (it is greedy, so another order could pack better) and puts no VIP objective
first: its VIP P99 is shown, and is far above the bar where the cache is full.

Output: ``ideal-<scale>.json`` (one record per cell; reruns replace their cells) and
``ideal-<scale>.md``, which sets each cell's ideal beside the arms' figures from the matrix's
cell records in the same directory, when they are there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from admission.tiers import Tier
from bench.burst import jsonlines
from bench.burst.criteria import GOODPUT_BAR, VIP_RATIO_BAR
from bench.burst.expconfig import Settings
from bench.burst.experiment import planned
from bench.burst.fallback import (
    Frontier,
    arm_of,
    best_keeping_vip,
    cell_key,
    frontier,
    load_ideal,
    number,
    ok,
    slack,
    tally,
)
from bench.burst.idealpoint import POINTS, replay
from bench.burst.matrix import DEFAULT_SIZES, RESULTS, SCALES, Cell, cells
from bench.burst.matrix import render as matrix_render
from bench.burst.matrixplot import load_records, ordered
from bench.burst.mixes import MIXES
from bench.burst.mixfile import MixFileError, chosen_mixes, same_traffic
from bench.burst.workload import PlannedRequest, Schedule
from bench.common.gitrev import revision as git_revision
from bench.sim.config import SimConfig

RUNNING_CAPS = (64, 48, 32, 24, 16, 12, 8)
"""Normal and Batch sequences per node (on a whole node; scaled with the capacity) at which
the VIP frontier replays the ideal below the KV bar: what a short decode batch, the one lever
on VIP's first token once its prefill is first in line, costs in goodput."""


def vip_frontier(settings: Settings, schedule: Schedule) -> list[dict[str, Any]]:
    """The ideal below the KV bar at each of ``RUNNING_CAPS`` (scaled to the node)."""
    k = settings.capacity_scale
    caps = sorted({max(1, round(cap * k)) for cap in RUNNING_CAPS}, reverse=True)
    return [replay(settings, schedule, POINTS["under_bar"], cap) for cap in caps]


def least_seconds(prompt: int, output: int, config: SimConfig) -> float:
    """The least node time a request can cost on ``config``'s engine (bench.sim.timing's step
    model without its fixed part): its prompt's prefill, a sequence's place in a step per
    generated token, and the cached context each decode step after the first token reads."""
    costs, k = config.step_costs, config.capacity_scale
    reads = (output - 1) * prompt + (output - 1) * (output - 2) / 2 if output >= 2 else 0.0
    return (costs.per_prefill_token_s * prompt + costs.per_seq_s * output
            + costs.per_context_token_s * reads) / k


def deadline_load(settings: Settings, requests: Sequence[PlannedRequest]) -> float:
    """The work due by the Batch deadline, each request at its least cost, as a share of the
    nodes' time from the start to the deadline: the Batch requests planned before the burst's
    end, and every VIP and Normal request planned before the deadline (the tier order serves
    them first). Above 1, no schedule that keeps the tier order does the Batch work in time;
    below, the rest is what the steps' fixed cost and imperfect packing may take."""
    end = settings.profile.window("burst")[1] * settings.time_scale
    deadline = end + settings.drain_factor * settings.burst_sim_s
    config = settings.sim_config(0)
    due = sum(least_seconds(r.prompt_tokens, r.output_tokens, config) for r in requests
              if r.at * settings.time_scale < (end if r.tier is Tier.BATCH else deadline))
    return due / (settings.nodes * deadline)


def cell_record(cell: Cell, revision: str = "") -> dict[str, Any]:
    settings = cell.settings()
    schedule = planned(settings)
    record: dict[str, Any] = jsonlines.safe({
        "cell": dataclasses.asdict(cell),
        "code": revision,
        "points": {name: replay(settings, schedule, kv) for name, kv in POINTS.items()},
        "vip_frontier": vip_frontier(settings, schedule),
        "deadline_load": deadline_load(settings, schedule.requests),
    })
    return record


def merge(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with the cells of ``new`` replaced or added, in the matrix's order."""
    return ordered(list({cell_key(r): r for r in (*old, *new)}.values()))


def _pct(x: object) -> str:
    v = float(str(x))
    return "n/a" if math.isnan(v) else f"{v:.1%}"


def _batch(p: dict[str, Any], burst_sim_s: float) -> str:
    if p["batch_left"] is None:
        return "n/a"
    if int(p["batch_left"]):
        return f"{p['batch_left']} left"
    return f"+{float(p['last_batch_s']) / burst_sim_s:.2f}x"


def render(records: Sequence[dict[str, Any]], matrix: Sequence[dict[str, Any]],
           scale: str) -> str:
    by_cell = {cell_key(m): m for m in matrix}
    burst_sim_s = SCALES[scale].burst_sim_s
    margin = slack(records, matrix)
    rows: list[str] = []
    judged: list[tuple[dict[str, Any], Frontier, dict[str, Any] | None]] = []
    for r in records:
        m = by_cell.get(cell_key(r))
        whole, under = r["points"]["whole"], r["points"]["under_bar"]
        c = arm_of(m, "c")
        f = frontier(r, m, margin=margin)
        judged.append((r, f, c))
        others = [a for a in (m or {}).get("arms", []) if a["arm"] != "c" and a["valid"]]
        best = max(others, key=lambda a: number(a, "goodput"), default=None)
        vip = float(under["vip_p99_burst_ms"]) / float(under["vip_p99_base_ms"])
        cell = r["cell"]
        rows.append(
            f"| {cell['mix']} | {cell['size']} | {cell['seed']} "
            f"| {_pct(whole['goodput_ratio'])} | {_pct(under['goodput_ratio'])} "
            f"| {_batch(under, burst_sim_s)} | {_load(r)} | x{vip:.2f} | {_kept(r)} "
            f"| {_pct(number(c, 'goodput'))} "
            f"| {_mark(None if c is None else ok(c, 'vip_p99'), 'kept', 'missed')} "
            f"| {_pct(number(best, 'goodput'))}{'' if best is None else ' (' + best['arm'] + ')'} "
            f"| {_mark(f.passed, 'PASS', 'FAIL')} |")
    under_ratios = [float(r["points"]["under_bar"]["goodput_ratio"]) for r, _, _ in judged]
    shares = [number(c, "goodput") / float(r["points"]["under_bar"]["goodput_ratio"])
              for r, _, c in judged if c is not None]
    kvgate = tally(matrix, records, ["c"])["c"]
    summary = [
        f"- Cells: {len(judged)}. The ideal below the KV bar reaches {GOODPUT_BAR:.0%} of the "
        f"bound in {sum(1 for _, f, _ in judged if f.reachable)} (counting a cell as in reach "
        f"within {margin:.1%} of the bar: the most any arm's goodput was above the ideal's "
        "best point in its cell)."]
    if under_ratios:
        summary.append(f"- The ideal below the KV bar: median {statistics.median(under_ratios):.1%}"
                       f", range {min(under_ratios):.1%}-{max(under_ratios):.1%} of the bound.")
    if shares:
        summary.append(f"- kvgate's goodput as a share of that ideal's: median "
                       f"{statistics.median(shares):.1%}, range {min(shares):.1%}-"
                       f"{max(shares):.1%}.")
    summary += [
        f"- kvgate, goodput criterion with the fallback: {kvgate.goodput}/{kvgate.judged} "
        f"valid cells; all seven criteria with it: {kvgate.all_seven}/{kvgate.judged}.",
        f"- The ideal keeping its VIP P99 in the burst within {VIP_RATIO_BAR:.2f}x of its own "
        "calm P99 (its VIP frontier: Normal and Batch sequences per node capped): "
        f"{_kept_summary([r for r, _, _ in judged])}.",
        f"- Batch: the ideal, oldest Batch work first, leaves some past the deadline in "
        f"{sum(1 for r, _, _ in judged if r['points']['under_bar']['batch_left'])} of "
        f"{len(judged)} cells.",
        f"- The work due by the Batch deadline (the Batch requests planned before the burst's "
        "end, and every VIP and Normal request planned before the deadline), each at its least "
        "cost (no step's fixed part), as a share of the nodes' time up to the deadline: "
        f"{_spread([r.get('deadline_load') for r, _, _ in judged])} (there no schedule that "
        "keeps the tier order does the Batch work in time)."]
    return "\n".join([
        f"# The ideal admission in each matrix cell, {scale} scale", "",
        "`python -m bench.burst.ideal --scale " + scale + "` (bench/burst/ideal.py says how), "
        f"code {', '.join(sorted({str(r.get('code') or '?') for r in records}))}. "
        "Goodput as work against the same upper bound as the arms. Where the ideal below the "
        "KV bar falls short of the goodput bar, the criterion falls back on the best goodput "
        "that keeps the VIP bar: judged here as the arm keeping the VIP bar with no valid arm "
        "that keeps it ahead (the measured points are the four arms, not a sweep of settings). "
        "The ideal's own VIP frontier is shown beside it: its best goodput with Normal and "
        "Batch sequences capped per node so that its VIP P99 in the burst stays within the bar "
        "of its own calm P99 (no gateway's hop; documents placed wherever they fit, which a "
        "placement that keeps them from VIP beats in the article mix). The arms' figures are "
        "from cells/*.json.", "",
        "## Summary", "", *summary, "",
        "## Cells", "",
        "| mix | nodes | seed | ideal, whole cache | ideal, KV below the bar | its Batch "
        "| work due by the Batch deadline / node time | its VIP P99 burst / calm "
        "| its best goodput keeping the VIP bar (running cap) "
        "| kvgate goodput | kvgate VIP bar | best other arm "
        "| goodput criterion with the fallback |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|:-:|", *rows, ""])


def _kept(r: dict[str, Any]) -> str:
    if "vip_frontier" not in r:
        return "n/a"
    best = best_keeping_vip(r)
    if best is None:
        return "none"
    cap = best.get("running_cap")
    return f"{float(best['goodput_ratio']):.1%} ({'no cap' if cap is None else cap})"


def _kept_summary(records: Sequence[dict[str, Any]]) -> str:
    measured = [r for r in records if "vip_frontier" in r]
    best = [best_keeping_vip(r) for r in measured]
    goodputs = [float(b["goodput_ratio"]) for b in best if b is not None]
    if not measured:
        return "not measured"
    spread = (f"best goodput median {statistics.median(goodputs):.1%}, range "
              f"{min(goodputs):.1%}-{max(goodputs):.1%}" if goodputs else "")
    none = len(measured) - len(goodputs)
    return ", ".join(x for x in (f"in {len(goodputs)} of {len(measured)} cells", spread,
                                 f"at no point in {none}" if none else "") if x)


def _spread(values: Sequence[object]) -> str:
    xs = [float(str(v)) for v in values if v is not None]
    return (f"median {statistics.median(xs):.0%}, range {min(xs):.0%}-{max(xs):.0%}, above 100% "
            f"in {sum(1 for x in xs if x > 1)} cells" if xs else "not measured")


def _load(r: dict[str, Any]) -> str:
    load = r.get("deadline_load")
    return "n/a" if load is None else f"{float(load):.0%}"


def _mark(ok: bool | None, yes: str, no: str) -> str:
    return "n/a" if ok is None else (yes if ok else no)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.burst.ideal",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    p.add_argument("--seed", help='as the matrix: "3", "1-10", "1,4,7-9" (default: its seeds)')
    p.add_argument("--mix", help="comma-separated, as the matrix (default: the --mix-file's "
                                 "mixes, else the repository's)")
    p.add_argument("--mix-file", type=Path,
                   help="a TOML file of more mixes (bench.burst.mixfile), as the matrix ran")
    p.add_argument("--size", default=",".join(map(str, DEFAULT_SIZES)))
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="where ideal-<scale>.* go and the matrix's cells/ are read")
    p.add_argument("--tables-only", action="store_true",
                   help="replay nothing: write the tables again from the records in --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mixes = chosen_mixes(args.mix, args.mix_file)
    except MixFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    todo = [] if args.tables_only else cells(
        args.scale, mixes, [int(s) for s in args.size.split(",") if s.strip()], args.seed)
    ran = {cell_key(r): r.get("traffic") for r in load_records(args.out, args.scale)}
    for cell in todo:
        recorded = ran.get(cell_key({"cell": dataclasses.asdict(cell)}))
        if recorded is not None and not same_traffic(recorded, MIXES[cell.mix]):
            print(f"error: the matrix ran {cell.name} on another definition of mix "
                  f"{cell.mix!r} than the one given (its record's \"traffic\")", file=sys.stderr)
            return 2
    new, revision = [], git_revision()
    for n, cell in enumerate(todo, 1):
        print(f"cell {n}/{len(todo)}: {cell.name}", flush=True)
        new.append(cell_record(cell, revision))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ideal-{args.scale}.json"
    records = merge(load_ideal(path), new)
    path.write_text(json.dumps(records, indent=1))
    md = args.out / f"ideal-{args.scale}.md"
    matrix = load_records(args.out, args.scale)
    md.write_text(render(records, matrix, args.scale))
    written = [path, md]
    if matrix:  # the matrix's table judges goodput with the fallback from these records
        table = args.out / f"matrix-{args.scale}.md"
        table.write_text(matrix_render(matrix, args.scale, records))
        written.append(table)
    print("written: " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
