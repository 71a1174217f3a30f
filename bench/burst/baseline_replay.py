"""Arms (a) and (b) replayed offline: how often does a request-count limit preempt?

One live run of arm (b) is one draw of the traffic; whether its nodes run out of blocks depends
on how many 8k-token documents happen to be in flight together. This replays the experiment's
planned schedule, for many seeds and limits in seconds each, on the simulator's own engine (the
code and calibration the live nodes run) in simulated time, in front of:

- ``rr``: arm (a), clients straight to the nodes, round robin, no limit;
- ``fifo=N``: arm (b) as bench.burst.fifo_proxy does it: one FIFO queue, at most ``N`` requests in
  flight per node, each to the node with the fewest in flight.

Nodes run vLLM's FCFS policy (as in both arms). It is the live arm minus HTTP, client retries,
wall-clock jitter and the OOM stand-in (nodes never crash here), so preemption counts can
differ from a live run of the same seed (bench/results/baseline-replay.md compares them); the
share of seeds that preempt, and how far the VIP tail moves, are what it is for.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from admission.tiers import Tier
from bench.burst import jsonlines
from bench.burst.capacity import vip_ttft_ms
from bench.burst.workload import PlannedRequest
from bench.sim.config import SimConfig
from bench.sim.engine import Engine, SimRequest, StepPlan


@dataclass(frozen=True, slots=True)
class BaselineResult:
    policy: str
    preemptions: int
    kv_peak: float
    vip_ttft_base: tuple[float, float]
    """VIP TTFT P50, P99 (simulated ms, from the intended send time) before the burst."""
    vip_ttft_burst: tuple[float, float]

    @property
    def vip_p99_ratio(self) -> float:
        return self.vip_ttft_burst[1] / self.vip_ttft_base[1]


class _Fleet:
    def __init__(self, config: SimConfig, nodes: int) -> None:
        self.engines = [Engine(config) for _ in range(nodes)]
        self.plans: list[StepPlan | None] = [None] * nodes
        self.inflight = [0] * nodes


def replay_baseline(config: SimConfig, nodes: int, requests: Sequence[PlannedRequest],
                    time_scale: float, burst: tuple[float, float],
                    max_inflight: int | None) -> BaselineResult:
    """Replay ``requests`` (times in wall seconds of the arm) until every one has finished.

    ``max_inflight`` None is arm (a) (round robin, no limit); a number is arm (b)'s limit per
    node. ``burst`` is the burst's window in wall seconds (VIP TTFT before it is the baseline).
    """
    config = dataclasses.replace(config, scheduling_policy="fcfs")
    fleet = _Fleet(config, nodes)
    lo, hi = burst[0] * time_scale, burst[1] * time_scale
    arrivals = sorted(((r.at * time_scale, r) for r in requests), key=lambda x: x[0])
    queue: collections.deque[tuple[float, PlannedRequest]] = collections.deque()
    steps: list[tuple[float, int]] = []  # (step end, node index), a heap
    vips: list[tuple[float, SimRequest]] = []
    ids = itertools.count()
    round_robin = itertools.cycle(range(nodes))
    peak = 0.0
    next_arrival = 0
    now = 0.0

    def free_node() -> int | None:
        if max_inflight is None:
            return next(round_robin)
        best = min(range(nodes), key=lambda i: fleet.inflight[i])
        return best if fleet.inflight[best] < max_inflight else None

    def dispatch() -> None:
        while queue:
            index = free_node()
            if index is None:
                return
            arrived, planned = queue.popleft()
            req = SimRequest(request_id=str(next(ids)), prompt_tokens=planned.prompt_tokens,
                             max_tokens=planned.output_tokens)
            fleet.engines[index].add(req, now)
            fleet.inflight[index] += 1
            if planned.tier is Tier.VIP:
                vips.append((arrived, req))

    while next_arrival < len(arrivals) or steps or queue:
        t_arrival = arrivals[next_arrival][0] if next_arrival < len(arrivals) else math.inf
        t_step = steps[0][0] if steps else math.inf
        if t_step <= t_arrival:
            now, index = heapq.heappop(steps)
            engine, plan = fleet.engines[index], fleet.plans[index]
            assert plan is not None
            fleet.inflight[index] -= len(engine.complete(plan, now).finished)
            fleet.plans[index] = None
        else:
            now = t_arrival
            queue.append(arrivals[next_arrival])
            next_arrival += 1
        dispatch()
        for index, engine in enumerate(fleet.engines):
            if fleet.plans[index] is None and engine.has_work():
                plan = engine.schedule(now)
                fleet.plans[index] = plan
                heapq.heappush(steps, (now + engine.step_seconds(plan), index))
                peak = max(peak, engine.kv_usage)
    policy = "rr" if max_inflight is None else f"fifo={max_inflight}"
    return BaselineResult(
        policy=policy,
        preemptions=sum(e.stats.preemptions for e in fleet.engines),
        kv_peak=peak,
        vip_ttft_base=vip_ttft_ms(vips, 0.0, lo),
        vip_ttft_burst=vip_ttft_ms(vips, lo, hi),
    )


def replay_seed(preset: str, policy: str, seed: int | None = None,
                baseline_sim_s: float | None = None) -> dict[str, object]:
    """Arm (a) (``policy`` "rr") or (b) ("fifo=N") on ``preset``'s schedule drawn from ``seed``
    (None: the preset's own) with a baseline of ``baseline_sim_s`` (None: the preset's), with
    the preset's limit when ``policy`` is plain "fifo"."""
    from bench.burst.expconfig import PRESETS
    from bench.burst.workload import plan

    settings = PRESETS[preset]
    if seed is not None:
        settings = dataclasses.replace(settings, seed=seed)
    if baseline_sim_s is not None:
        settings = dataclasses.replace(settings, baseline_sim_s=baseline_sim_s)
    if policy == "rr":
        limit = None
    elif policy == "fifo":
        limit = settings.fifo_slots
    elif policy.startswith("fifo="):
        limit = int(policy.removeprefix("fifo="))
    else:
        raise ValueError(f"policy must be rr, fifo or fifo=N, not {policy!r}")
    schedule = plan(settings.profile, settings.classes, settings.scale, settings.seed)
    result = replay_baseline(settings.sim_config(0, priority=False), settings.nodes,
                             schedule.requests, settings.time_scale,
                             settings.profile.window("burst"), limit)
    return {"preset": preset, "seed": settings.seed, "baseline_sim_s": settings.baseline_sim_s,
            "policy": result.policy,
            "preemptions": result.preemptions, "kv_peak": result.kv_peak,
            "vip_ttft_base_p99": result.vip_ttft_base[1],
            "vip_ttft_burst_p99": result.vip_ttft_burst[1],
            "vip_ttft_burst_p50": result.vip_ttft_burst[0],
            "vip_p99_ratio": result.vip_p99_ratio}


def summary_table(rows: Sequence[Mapping[str, object]]) -> str:
    """Markdown: per policy (and baseline length), how many draws preempted and the spread of
    the KV peak and of the VIP P99 ratio; then one line per draw."""
    groups: dict[tuple[str, float], list[Mapping[str, object]]] = {}
    for r in rows:
        groups.setdefault((str(r["policy"]), float(str(r["baseline_sim_s"]))), []).append(r)
    lines = ["| policy | baseline (s) | draws | draws that preempted | preemptions min / median / "
             "max | KV peak min / max | VIP P99 ratio min / median / max |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for (policy, baseline), group in groups.items():
        pre = sorted(int(str(r["preemptions"])) for r in group)
        kv = [float(str(r["kv_peak"])) for r in group]
        ratio = sorted(float(str(r["vip_p99_ratio"])) for r in group)
        lines.append(f"| {policy} | {baseline:g} | {len(group)} | {sum(1 for p in pre if p)} | "
                     f"{pre[0]} / {statistics.median(pre):g} / {pre[-1]} | "
                     f"{min(kv):.1%} / {max(kv):.1%} | x{ratio[0]:.0f} / "
                     f"x{statistics.median(ratio):.0f} / x{ratio[-1]:.0f} |")
    lines += ["", "| policy | baseline (s) | seed | preemptions | KV peak | "
              "VIP P99 base / burst (ms) | ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {float(str(r['baseline_sim_s'])):g} | {r['seed']} | "
                     f"{r['preemptions']} | {float(str(r['kv_peak'])):.1%} | "
                     f"{float(str(r['vip_ttft_base_p99'])):,.0f} / "
                     f"{float(str(r['vip_ttft_burst_p99'])):,.0f} | "
                     f"x{float(str(r['vip_p99_ratio'])):.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m bench.burst.baseline_replay",
        description="Arms (a) and (b) replayed offline over many draws of a preset's schedule: "
                    "preemptions, KV peak and the VIP tail per seed (JSON lines).")
    p.add_argument("policies", nargs="*", help="rr (arm a), fifo (arm b at the preset's "
                   "limit) or fifo=N (N in flight per node)")
    p.add_argument("--preset", default="full")
    p.add_argument("--seeds", default="", help="comma-separated seeds (empty: the preset's)")
    p.add_argument("--baseline", type=float, dest="baseline_sim_s",
                   help="simulated seconds of 1x traffic before the burst (default: the preset's)")
    p.add_argument("--jsonl", type=Path, help="append each draw's figures to this file")
    p.add_argument("--table", type=Path, help="print the markdown summary of this JSON lines file")
    args = p.parse_args(argv)
    if args.table:
        print(summary_table(jsonlines.read(args.table)))
        return 0
    seeds: list[int | None] = [int(s) for s in args.seeds.split(",") if s] or [None]
    for policy in args.policies:
        for seed in seeds:
            jsonlines.emit(replay_seed(args.preset, policy, seed, args.baseline_sim_s),
                           args.jsonl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
