"""The 400% burst, against (a) no gateway, (b) a FIFO concurrency limit, (c) kvgate, (d) vLLM's
priority scheduling with clients sending their tier.

    python -m bench.burst.experiment            # the reference run (about an hour)
    python -m bench.burst.experiment --short --mix article   # `make demo`: the same, minutes
    python -m bench.burst.experiment --arms a,c --burst 120 --mix chat

N simulated vLLM nodes (bench.sim), the same engine configuration in every arm, take the same
seeded open-loop traffic (bench.burst.workload, bench.burst.loadgen): 1x baseline, then 4x the
mix's burst classes, then 1x while the deferred work drains. Goodput is judged against a true upper
bound (bench.burst.goodput); with ``--ideal`` bench.burst.capacity also replays the same requests
offline behind an ideal admission controller, shown as a reference. Many draws, mixes and
cluster sizes: bench.burst.matrix. Progress prints once per second; the table (<name>.md),
the timeline plot (<name>.png) and raw figures (<name>.json) are written at the end to `--out`
(default bench/results/tmp/, untracked: one draw is not a record, the matrix is) and the table
is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.burst import jsonlines
from bench.burst.arm import ArmResult, flush_print, run_arm
from bench.burst.capacity import CapacityResult, ideal_replay
from bench.burst.criteria import GOODPUT_BAR, Verdict, cell_table, judge_all, passed, validity
from bench.burst.expconfig import (
    ARM_TITLES,
    ARMS,
    PRESETS,
    Settings,
    unscaled_control,
    with_overrides,
    zone_overrides,
)
from bench.burst.fallback import one_draw
from bench.burst.idealpoint import POINTS
from bench.burst.idealpoint import replay as ideal_replay_valued
from bench.burst.mixes import MIXES, with_mix
from bench.burst.mixfile import MixFileError, one_mix, use_mix_file
from bench.burst.phaseload import describe as describe_load
from bench.burst.plot import plot
from bench.burst.report import ArmSummary, markdown_table, summarize
from bench.burst.ttft import load_traces
from bench.burst.workload import Schedule, plan
from bench.common.gitrev import revision

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.burst.experiment",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--short", action="store_const", const="short", dest="preset",
                   help="the <3 minute demo (same as --preset short)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of a,b,c,d")
    p.add_argument("--mix",
                   help=f"a traffic mix ({', '.join(MIXES)}, or one of --mix-file), with its "
                        "max_tokens mix (default: the article's classes, clients sending exact "
                        "max_tokens)")
    p.add_argument("--mix-file", type=Path,
                   help="a TOML file of more mixes (bench.burst.mixfile)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "tmp",
                   help="results directory (default: bench/results/tmp, untracked)")
    p.add_argument("--name", help="file name stem (default: burst, or burst-<preset>)")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temporary directory)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--capacity-scale", type=float)
    p.add_argument("--time-scale", type=float)
    p.add_argument("--baseline", type=float, dest="baseline_sim_s", help="simulated seconds")
    p.add_argument("--burst", type=float, dest="burst_sim_s", help="simulated seconds")
    p.add_argument("--burst-factor", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--gateways", type=int)
    p.add_argument("--fifo-slots", type=int, dest="fifo_max_inflight",
                   help="arm (b): requests in flight per node at real scale (default 128)")
    p.add_argument("--vip-nodes", type=int, dest="vip_nodes",
                   help="arm (c): how many nodes to keep for VIP ([pools.dedicated])")
    p.add_argument("--guest-prompt", type=int, dest="guest_prompt",
                   help="arm (c), with --vip-nodes: Normal and Batch work with prompts up to "
                        "this many tokens may join the dedicated nodes as guests")
    p.add_argument("--max-guests", type=int, dest="max_guests",
                   help="arm (c), with --guest-prompt: most guests alive per dedicated node "
                        "(default: the project's)")
    p.add_argument("--guest-rate", type=int, dest="guest_rate",
                   help="arm (c), with --guest-prompt: pace guests at this many prompt tokens "
                        "per second per dedicated node (guest_prompt_tokens_per_s; default: "
                        "unpaced)")
    p.add_argument("--guest-output", type=int, dest="guest_output",
                   help="arm (c), with --guest-prompt: guests must also ask for at most this "
                        "many output tokens (guest_max_output_tokens; default: no bound)")
    p.add_argument("--guest-running", type=int, dest="guest_running",
                   help="arm (c), with --guest-prompt: no new guests while a dedicated node runs "
                        "more sequences than this (guest_max_running; default: no bound)")
    p.add_argument("--batch-ceiling", type=float, dest="batch_ceiling",
                   help="arm (c): the pool's zones.batch_ceiling (default: the project's)")
    p.add_argument("--vip-ceiling", type=float, dest="vip_ceiling",
                   help="arm (c): the pool's zones.vip_ceiling (default: the project's)")
    p.add_argument("--kv-target", type=float, dest="kv_target",
                   help="arm (c): the pool's zones.kv_target, the projected usage each node's "
                        "budget keeps under (default: the project's)")
    p.add_argument("--yellow", type=float,
                   help="arm (c): the pool's zones.yellow, where YELLOW starts holding Batch "
                        "(default: the project's)")
    p.add_argument("--projection", choices=("final", "peak"),
                   help="arm (c): the pool's zones.projection (default: the project's)")
    p.add_argument("--max-engine-waiting", type=int, dest="max_engine_waiting",
                   help="arm (c): the pool's zones.max_engine_waiting (default: the project's)")
    p.add_argument("--max-engine-running", type=int, dest="max_engine_running",
                   help="arm (c): the pool's control.max_engine_running at real scale "
                        "(default: the project's, no bound)")
    p.add_argument("--vip-objective-ms", type=int, dest="vip_ttft_objective_ms",
                   help="arm (c): the pool's control.vip_ttft_objective_ms at real scale "
                        "(default: the project's)")
    p.add_argument("--ideal", action="store_true",
                   help="also replay the requests offline behind an ideal admission controller "
                        "(bench.burst.capacity; a reference, minutes at full scale)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = PRESETS[args.preset]
    if args.mix:
        base = with_mix(base, args.mix)
    return with_overrides(
        base, nodes=args.nodes, capacity_scale=args.capacity_scale,
        time_scale=args.time_scale, baseline_sim_s=args.baseline_sim_s,
        burst_sim_s=args.burst_sim_s, burst_factor=args.burst_factor, seed=args.seed,
        gateways=args.gateways, fifo_max_inflight=args.fifo_max_inflight,
        vip_nodes=args.vip_nodes, guest_prompt=args.guest_prompt, max_guests=args.max_guests,
        guest_rate=args.guest_rate, guest_output=args.guest_output,
        guest_running=args.guest_running, projection=args.projection,
        batch_ceiling=args.batch_ceiling, vip_ceiling=args.vip_ceiling, yellow=args.yellow,
        kv_target=args.kv_target,
        max_engine_waiting=args.max_engine_waiting,
        max_engine_running=args.max_engine_running,
        vip_ttft_objective_ms=args.vip_ttft_objective_ms,
    )


def run_capacity(settings: Settings, schedule: Schedule) -> CapacityResult:
    """The ideal replay; with more than one node, also the same ideal with one node dedicated to
    VIP (what `[pools.dedicated]` trades: VIP TTFT against throughput)."""
    def replay(vip_nodes: int) -> CapacityResult:
        return ideal_replay(settings.sim_config(0), settings.nodes,
                            schedule.requests, settings.time_scale,
                            settings.profile.window("burst"), vip_nodes=vip_nodes)

    best = replay(0)
    if settings.nodes < 2:
        return best
    return dataclasses.replace(best, alternative=replay(1))


def dump_raw(result: ArmResult, directory: Path) -> None:
    """Every request's outcome and every timeline sample, one JSON object per line, and the
    load generator's worst loop lag per second, so that a run can be analysed after the fact
    (they stay in the log directory, not in results/)."""
    with (directory / "requests.jsonl").open("w") as f:
        for o in result.outcomes:
            row = {"index": o.req.index, "class": o.req.klass, "tier": o.req.tier.label,
                   "at": o.req.at, "prompt": o.req.prompt_tokens, "output": o.req.output_tokens,
                   "stream": o.req.stream, "status": o.status, "finished": o.finished,
                   "attempts": o.attempts, "rejections": o.rejections, "sent_at": o.sent_at,
                   "ttft": o.ttft, "done_at": o.done_at, "error": o.error,
                   "request_id": o.request_id}
            f.write(json.dumps(row) + "\n")
    with (directory / "samples.jsonl").open("w") as f:
        for smp in result.samples:
            f.write(json.dumps({"t": smp.t, "queues": smp.queues, "zone": smp.zone,
                                "scheduler": smp.scheduler,
                                "nodes": [dataclasses.asdict(n) for n in smp.nodes]}) + "\n")
    (directory / "client_lag.json").write_text(json.dumps(result.client_lag))


def planned(settings: Settings) -> Schedule:
    """The schedule every arm replays: drawn from the seed, nothing else from it."""
    return plan(settings.profile, settings.classes, settings.scale, settings.seed,
                settings.max_tokens, settings.max_model_len)


def describe(settings: Settings, schedule: Schedule) -> list[str]:
    prof = settings.profile
    counts = Counter(r.klass for r in schedule.requests)
    return [
        f"traffic mix {settings.mix}; clients' max_tokens: {settings.max_tokens.describe()}",
        f"{settings.nodes} simulated nodes, capacity scale {settings.capacity_scale:g}, "
        f"time scale {settings.time_scale:g} (simulated s per wall s); seed {settings.seed}",
        f"profile (simulated s): baseline {settings.baseline_sim_s:g}, burst "
        f"{settings.burst_sim_s:g} at {settings.burst_factor:g}x the burst classes, then 1x "
        f"for up to {settings.drain_factor:g}x the burst; {prof.duration_s:.0f} wall s at most "
        "per arm",
        "planned requests: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
    ]


async def run_experiment(
    settings: Settings,
    arms: Sequence[str],
    log_dir: Path,
    *,
    capacity: bool = False,
    progress: bool = True,
) -> tuple[CapacityResult | None, list[ArmResult], list[ArmSummary]]:
    say = flush_print if progress else (lambda _line: None)
    schedule = planned(settings)
    for line in describe(settings, schedule):
        say(line)
    cap = None
    if capacity:
        say("replaying the requests offline behind an ideal admission controller...")
        cap = await asyncio.to_thread(run_capacity, settings, schedule)
        say(f"  {cap.total_tokens_per_s:,.0f} tok/s during the burst, {cap.preemptions} "
            f"preemptions, KV peak {cap.kv_peak:.1%}")
    say("progress columns: tier sent/ok/429/failed, KV usage per node, queued by tier, "
        "engines' waiting, zone, simulator loop lag")
    results: list[ArmResult] = []
    summaries: list[ArmSummary] = []
    for arm in arms:
        say(f"--- arm {ARM_TITLES[arm]} ---")
        started = time.monotonic()
        result = await run_arm(arm, settings, schedule, log_dir / f"arm-{arm}", progress=say)
        await asyncio.to_thread(dump_raw, result, log_dir / f"arm-{arm}")
        traced, _ = await asyncio.to_thread(load_traces, log_dir / f"arm-{arm}" / "nodes")
        summary = summarize(result, cap, {rid: rec for rid, (_, rec) in traced.items()})
        results.append(result)
        summaries.append(summary)
        say(f"    done in {time.monotonic() - started:.0f} s: KV peak {summary.kv_peak:.1%}, "
            f"{summary.preemptions} preemptions, {summary.crashed_nodes} crashed, goodput "
            f"{summary.goodput_ratio or 0:.1%} of its bound; cores used: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(result.cpu.items())))
        for line in describe_load(result.phase_load):
            say(f"    {line}")
    return cap, results, summaries


def report_markdown(settings: Settings, schedule_lines: list[str], cap: CapacityResult | None,
                    summaries: Sequence[ArmSummary], command: str,
                    ideal: dict[str, Any] | None = None) -> str:
    from bench.burst import report
    # Judged first: judging marks an arm whose verdicts its load generator's stalls decide as
    # invalid, and the first table's "valid run" row must say so too.
    judged = judge_all(summaries, settings.burst_sim_s, settings.drain_factor)
    parts = [
        f"# The {settings.burst_factor:.0%} burst, {settings.mix} mix",
        "",
        f"`{command}`",
        "",
        *[f"- {line}" for line in schedule_lines],
        "",
        markdown_table(summaries, cap, settings.burst_sim_s),
        "",
    ]
    parts += ["## The seven criteria, every arm", "",
              cell_table([s.arm for s in summaries], judged, [validity(s) for s in summaries]),
              ""]
    parts += fallback_section(summaries, judged, ideal)
    for s in summaries:
        if s.errors:
            parts.append(f"{ARM_TITLES[s.arm]}, why requests did not succeed: " + "; ".join(
                f"{reason} ({count})" for reason, count in s.errors))
            parts.append("")
    parts += setup_section(settings)
    doc = report.__doc__ or ""
    parts += ["## Definitions", "", doc.split("Definitions (also printed under the table):")[-1]
              .strip(), ""]
    return "\n".join(parts)


def fallback_section(summaries: Sequence[ArmSummary], judged: Sequence[Sequence[Verdict]],
                     ideal: dict[str, Any] | None) -> list[str]:
    """The goodput criterion judged with its fallback on this draw (bench.burst.fallback): the
    ideal admission below the KV bar on the same schedule is the frontier's top. `judged`:
    the arms' verdicts (criteria.judge_all)."""
    if ideal is None:
        return []
    arms = [{"arm": s.arm, "valid": not s.invalid,
             "verdicts": [dataclasses.asdict(v) for v in verdicts]}
            for s, verdicts in zip(summaries, judged, strict=True)]
    margin, verdicts = one_draw(ideal, arms)
    reach = float(ideal["goodput_ratio"])
    above = (f" (an arm did {margin:.1%} of the bound more, and a greedy ideal is not a bound: "
             "it is counted that much higher)" if margin > 0 else "")
    reachable = next(iter(verdicts.values())).reachable if verdicts else True
    rule = (f"{GOODPUT_BAR:.0%} is within its reach, so the bar stands." if reachable else
            f"{GOODPUT_BAR:.0%} is out of its reach on this draw, so an arm passes the goodput "
            "criterion if it keeps the VIP bar and reaches the ideal's goodput where the ideal "
            "keeps the VIP bar too, or, where it does not, if no valid arm that keeps it has "
            "more goodput.")
    lines = ["## Goodput with the criterion's fallback", "",
             "The ideal admission (bench.burst.idealpoint: the same requests replayed offline "
             "behind an admission that knows every request's size, held below the KV bar, "
             f"valued against the same bound) reaches {reach:.1%} of the goodput bound{above}: "
             + rule, "",
             "| | " + " | ".join(ARM_TITLES[s.arm] for s in summaries) + " |",
             "|---|" + "---|" * len(summaries)]
    row, met = [], []
    for s, v in zip(summaries, judged, strict=True):
        f = verdicts[s.arm]
        goodput = next(x for x in v if x.key == "goodput")
        if f.passed is None:
            row.append(f"{goodput.value}, not judged (invalid run)")
            met.append("n/a")
            continue
        row.append(f"{goodput.value} **{'PASS' if f.passed else 'FAIL'}**")
        met.append(str(passed(v) - bool(goodput.ok) + f.passed))
    lines += ["| goodput (work done), with the fallback | " + " | ".join(row) + " |",
              "| criteria met (of 7), goodput with the fallback | " + " | ".join(met) + " |",
              ""]
    return lines


def _dedicated_nodes(settings: Settings) -> str:
    """The end of arm (c)'s setup line: the nodes dedicated to VIP and their guests, if any."""
    if not settings.vip_nodes:
        return "."
    dedicated = (f", the first {settings.vip_nodes} node(s) dedicated to VIP "
                 "(`[pools.dedicated]`: VIP tries them first, then the shared nodes; ")
    if not settings.guest_prompt:
        return dedicated + "no Normal or Batch work there)."
    pace = (f", paced at {settings.guest_rate:,} prompt tokens/s" if settings.guest_rate
            else "")
    outputs = (f" and outputs up to {settings.guest_output}" if settings.guest_output else "")
    running = (f"; none while the node runs more than {settings.guest_running} sequences"
               if settings.guest_running else "")
    return (dedicated + f"Normal and Batch only as guests, prompts up to {settings.guest_prompt} "
            f"tokens{outputs}, at most {settings.max_guests or 'the default number of'} alive "
            f"per dedicated node{pace}{running}).")


def setup_section(settings: Settings) -> list[str]:
    """What ran: the traffic classes and the three arms, from the settings themselves."""
    k = settings.capacity_scale
    lines = [
        "## Setup",
        "",
        ("Traffic per node (the simulated nodes are real-scale)" if k == 1 else
         f"Traffic per real-scale node (each simulated node is {k:g} of one and takes {k:g} of "
         "this traffic)")
        + ", Poisson arrivals, output lengths forced (`X-Sim-Output-Tokens`), clients' "
        f"`max_tokens`: {settings.max_tokens.describe()}:",
        "",
        "| tenant | tier | requests/s at 1x | prompt tokens | output tokens | streaming | burst |",
        "|---|---|---:|---|---|---|---|",
    ]
    for c in settings.classes:
        size = "log-uniform" if c.prompt.log else "uniform"
        out = "log-uniform" if c.output.log else "uniform"
        lines.append(
            f"| {c.name} | {c.tier.label} | {c.rate:g} | {c.prompt.lo:,}-{c.prompt.hi:,} ({size})"
            f" | {c.output.lo:,}-{c.output.hi:,} ({out}) | {'yes' if c.stream else 'no'} | "
            f"{f'x{settings.burst_factor:g}' if c.burst else 'x1'} |")
    lines += [
        "",
        "VIP clients do not retry; Normal clients retry 429/503 with the kvgate SDK's policy "
        "(full jitter, never sooner than `retry-after-ms`, 3 attempts, retry budget); Batch "
        "clients with the same policy but 6 attempts and a deadline as long as the run.",
        "",
        f"- Every arm: {settings.nodes} nodes with the same engine configuration (vLLM's "
        "`--scheduling-policy priority`, chunked prefill within `max_num_batched_tokens`, the "
        "same batching limits).",
        f"- (a) clients round robin over the {settings.nodes} nodes, no `priority` sent (every "
        "request 0: served in arrival order).",
        "- (b) `bench.burst.fifo_proxy`: one FIFO queue, at most "
        f"{settings.fifo_slots} requests in flight per node ({settings.fifo_max_inflight} at real "
        "scale), no tiers, no KV awareness.",
        f"- (c) kvgate: {settings.gateways} gateway processes (clients round robin over them), "
        f"{settings.schedulers} scheduler processes (one leader, the others standing by), a "
        "private Redis, the project's default zones and scheduler settings"
        + _zone_overrides(settings)
        + (", tiers forwarded as vLLM `priority` to nodes run with `--scheduling-policy "
           "priority`" if settings.pass_priority else "")
        + _dedicated_nodes(settings),
        "- (d) clients round robin over the nodes like (a), each sending its tier as vLLM's "
        "`priority` (VIP 0, Normal 1, Batch 2).",
        f"- Every arm gets fresh nodes; a node that stays full (KV >= 99% or preempting, step "
        f"after step) for {settings.crash_after_full_sim_s or 0:g} simulated seconds dies like "
        "an OOM-killed one." if settings.crash_after_full_sim_s
        else "- Every arm gets fresh nodes; nodes never crash in this preset.",
        "",
    ]
    return lines


def _zone_overrides(settings: Settings) -> str:
    named = [f"`zones.{line}`" for line in zone_overrides(settings)]
    if settings.max_engine_running is not None:
        named.append(f"`control.max_engine_running = {settings.max_engine_running}` (real scale)")
    if settings.vip_ttft_objective_ms is not None:
        named.append(f"`control.vip_ttft_objective_ms = {settings.vip_ttft_objective_ms}` "
                     "(real scale)")
    if settings.running_min is not None:
        named.append(f"`control.running_min = {settings.running_min}` (real scale)")
    named += [f"`control.{line}`" for line in unscaled_control(settings)]
    return " except " + ", ".join(named) if named else ""


def _summary_json(settings: Settings, cap: CapacityResult | None,
                  summaries: Sequence[ArmSummary], ideal: dict[str, Any] | None) -> str:
    data = {
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "classes"},
        "capacity": cap.as_dict() if cap else None,
        "ideal_under_bar": ideal,
        "arms": [jsonlines.safe(dataclasses.asdict(s)) for s in summaries],
    }
    return json.dumps(jsonlines.safe(data), indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.mix is None:
            use_mix_file(args.mix_file)
        else:
            one_mix(args.mix, args.mix_file)
    except MixFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"error: unknown arm(s) {unknown}; choose from a, b, c, d", file=sys.stderr)
        return 2
    name = args.name or ("burst" if args.preset == "full" else f"burst-{args.preset}")
    started = time.monotonic()
    code = revision()  # now: the code that runs, whatever is committed meanwhile
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvgate-burst-"))
    print(f"logs: {log_dir}", flush=True)
    coro = run_experiment(settings, arms, log_dir, capacity=args.ideal)
    try:
        import uvloop
    except ImportError:
        cap, results, summaries = asyncio.run(coro)
    else:
        cap, results, summaries = uvloop.run(coro)
    schedule = planned(settings)
    print("replaying the requests offline behind the ideal admission, below the KV bar "
          "(the goodput criterion's fallback)...", flush=True)
    ideal = ideal_replay_valued(settings, schedule, POINTS["under_bar"])
    given = argv if argv is not None else sys.argv[1:]
    command = "python -m bench.burst.experiment " + " ".join(given)
    lines = [*describe(settings, schedule),
             f"code {code}, {time.strftime('%Y-%m-%d %H:%M')} local time, "
             f"{(time.monotonic() - started) / 60:.0f} minutes on {os.cpu_count()} cores "
             f"(load average at the end {os.getloadavg()[0]:.1f}: other work shares this machine)"]
    md = report_markdown(settings, lines, cap, summaries, command.strip(), ideal)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(md)
    (args.out / f"{name}.json").write_text(_summary_json(settings, cap, summaries, ideal))
    plot(results, args.out / f"{name}.png")
    print()
    print(md)
    print(f"written: {args.out / (name + '.md')}, {args.out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
