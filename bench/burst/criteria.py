"""The seven criteria of the burst experiment, judged for every arm, and the table of one cell.

The VIP latency criterion compares each arm's VIP P99 TTFT during the burst with arm (a)'s
VIP P99 at calm: the system without any gateway, on the same draw, is the reference for
"slower" (an arm's own calm would hide a VIP that is slower at all times). Each arm's ratio to
its own calm is reported beside it. Without arm (a) in the run, or with arm (a) invalid (left
out for lag or for stalls), the reference is missing and the criterion reads n/a (not a pass).

Goodput is judged as work done (bench.burst.goodput: each token at the least node time its
kind costs); the same counters with every token counting one are shown, not judged.

Besides the seven, the table shows whether the arm's calm VIP P50 and P99 stay within 1.10x of
(a)'s (the price of the arm at calm), and the VIP criterion on the engine's part of the TTFT
alone (arrival at the node to first token, from the nodes' traces, against (a)'s calm engine
P99), with the rest of the burst TTFT (the way to the node and back) beside it. At a reduced
scale the nodes run `time_scale` times faster than the wall clock while a gateway's hop does
not, so every wall millisecond in front of the engine counts `time_scale` simulated ones: the
split shows how much of a miss is the engine's queue and batch, and how much is the hop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from admission.tiers import Tier
from bench.burst.expconfig import ARM_TITLES
from bench.burst.phaseload import LATE_S
from bench.burst.report import ArmSummary, late_gateways

KV_BAR = 0.80
VIP_SUCCESS_BAR = 0.9999
VIP_RATIO_BAR = 1.20
"""Burst VIP P99 TTFT over (a)'s calm VIP P99, at most (the goal is 1.10)."""
CALM_BAR = 1.10
GOODPUT_BAR = 0.90

CRITERIA = ("kv_peak", "preemptions", "crashes", "vip_success", "vip_p99", "batch_done",
            "goodput")
EXTRA = ("calm", "vip_engine", "goodput_tokens")
"""Judged and shown, not among the seven."""
LABELS = {
    "kv_peak": f"KV peak < {KV_BAR:.0%}",
    "preemptions": "zero preemptions",
    "crashes": "zero crashed nodes",
    "vip_success": f"VIP success >= {VIP_SUCCESS_BAR:.2%}",
    "vip_p99": f"VIP P99 burst <= {VIP_RATIO_BAR:.2f}x (a)'s calm P99",
    "batch_done": "every Batch done within 2x the burst",
    "goodput": f"goodput (work done) >= {GOODPUT_BAR:.0%} of its upper bound",
    "calm": f"calm VIP P50 and P99 <= {CALM_BAR:.2f}x (a)'s (not one of the seven)",
    "vip_engine": f"VIP P99 burst in the engine <= {VIP_RATIO_BAR:.2f}x (a)'s calm engine P99; "
                  "the rest, P50 / P99 (not one of the seven)",
    "goodput_tokens": f"goodput as tokens, each counting one, >= {GOODPUT_BAR:.0%} of their "
                      "upper bound (not one of the seven)",
}


@dataclass(frozen=True, slots=True)
class Verdict:
    key: str
    value: str
    ok: bool | None
    """None: cannot be judged (a reference or figure is missing)."""
    number: float = math.nan
    """The figure judged, for aggregates (ratio, share or count)."""

    @property
    def mark(self) -> str:
        return {True: "PASS", False: "FAIL", None: "n/a"}[self.ok]


def _ratio(a: float, b: float) -> float:
    if b <= 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def _x(r: float) -> str:
    return "n/a" if math.isnan(r) else ("inf" if math.isinf(r) else f"x{r:.2f}")


def reference(summaries: Sequence[ArmSummary]) -> tuple[float, float] | None:
    """Arm (a)'s calm VIP P50 and P99 (ms), or None without a valid arm (a): a figure from a
    run left out for lag cannot be what another arm passes against."""
    for s in summaries:
        if s.arm == "a":
            return None if s.invalid else s.vip_ttft_base
    return None


def engine_reference(summaries: Sequence[ArmSummary]) -> float:
    """Arm (a)'s calm VIP P99 in the engine (ms); nan without a valid arm (a) or its traces."""
    return next((s.vip_engine_base[1] for s in summaries if s.arm == "a" and not s.invalid),
                math.nan)


REFERENCED = ("vip_p99", "calm", "vip_engine")
"""The verdicts judged against arm (a)'s calm figures."""


def apply_validity(record: dict[str, Any]) -> dict[str, Any]:
    """A matrix cell record with each arm judged by the validity rules of this code where its
    stored figures allow (a record written before a rule holds the figures, not the verdict):
    an arm whose gateways ran late (`report.late_gateways`) is invalid."""
    for arm in record["arms"]:
        why = late_gateways(arm.get("summary", {}).get("phase_load") or {})
        if why and arm["valid"]:
            arm["valid"] = False
            figures = arm["validity"].removeprefix("yes (")
            arm["validity"] = "**INVALID**: " + "; ".join(why) + " (" + figures
    return record


def void_invalid_reference(record: dict[str, Any]) -> dict[str, Any]:
    """A matrix cell record (bench.burst.matrix.cell_record) with the verdicts judged against
    an invalid arm (a) read n/a, as ``judge_all`` judges them: a record may hold marks judged
    against such an arm, and the tables are written from the records."""
    if all(a["valid"] for a in record["arms"] if a["arm"] == "a"):
        return record
    for arm in record["arms"]:
        arm["verdicts"] = [
            {**v, "value": "n/a: (a) invalid", "ok": None} if v["key"] in REFERENCED else v
            for v in arm["verdicts"]]
    return record


def judge(s: ArmSummary, ref: tuple[float, float] | None, burst_sim_s: float,
          drain_factor: float, engine_ref: float = math.nan) -> list[Verdict]:
    """The seven criteria for one arm, in ``CRITERIA`` order, then the ``EXTRA`` checks."""
    out = [
        Verdict("kv_peak", f"{s.kv_peak:.1%}", s.kv_peak < KV_BAR, s.kv_peak),
        Verdict("preemptions", f"{s.preemptions:,}", s.preemptions == 0, s.preemptions),
        Verdict("crashes", str(s.crashed_nodes), s.crashed_nodes == 0, s.crashed_nodes),
    ]
    vip = s.success.get(Tier.VIP, math.nan)
    out.append(Verdict("vip_success", f"{vip:.2%}", None if math.isnan(vip)
                       else vip >= VIP_SUCCESS_BAR, vip))
    own = _ratio(s.vip_ttft_burst[1], s.vip_ttft_base[1])
    vs_a = _ratio(s.vip_ttft_burst[1], ref[1]) if ref is not None else math.nan
    calm_n, burst_n = s.vip_samples
    # Under 100 chats the P99 is the largest one: the table says how few there were.
    few = (f" (P99s over {calm_n} calm, {burst_n} burst VIP chats)"
           if 0 < min(calm_n, burst_n) < 100 else "")
    out.append(Verdict("vip_p99", f"{_x(vs_a)} of (a) calm, {_x(own)} of own calm{few}",
                       None if math.isnan(vs_a) else vs_a <= VIP_RATIO_BAR, vs_a))
    limit = drain_factor * burst_sim_s
    if s.last_batch_s is None:
        out.append(Verdict("batch_done", f"{s.batch_unfinished} not done", False, math.inf))
    else:
        out.append(Verdict("batch_done", f"+{s.last_batch_s / burst_sim_s:.2f}x the burst",
                           s.last_batch_s <= limit, s.last_batch_s / burst_sim_s))
    out.append(_goodput("goodput", s.goodput_ratio))
    if ref is None:
        out.append(Verdict("calm", "n/a", None))
    else:
        p50, p99 = _ratio(s.vip_ttft_base[0], ref[0]), _ratio(s.vip_ttft_base[1], ref[1])
        ok = None if math.isnan(p50) or math.isnan(p99) else max(p50, p99) <= CALM_BAR
        out.append(Verdict("calm", f"P50 {_x(p50)}, P99 {_x(p99)}", ok, max(p50, p99)))
    engine = _ratio(s.vip_engine_burst[1], engine_ref)
    front = s.vip_front_burst
    rest = ("n/a" if math.isnan(front[0])
            else f"{front[0]:.0f} / {front[1]:.0f} ms")
    out.append(Verdict("vip_engine", f"{_x(engine)}; rest {rest}",
                       None if math.isnan(engine) else engine <= VIP_RATIO_BAR, engine))
    out.append(_goodput("goodput_tokens", s.token_ratio))
    return out


def _goodput(key: str, ratio: float | None) -> Verdict:
    if ratio is None:
        return Verdict(key, "n/a", None)
    return Verdict(key, f"{ratio:.1%}", ratio >= GOODPUT_BAR, ratio)


def passed(verdicts: Sequence[Verdict]) -> int:
    """How many of the seven criteria pass."""
    return sum(1 for v in verdicts if v.key in CRITERIA and v.ok)


def judge_all(summaries: Sequence[ArmSummary], burst_sim_s: float, drain_factor: float
              ) -> list[list[Verdict]]:
    """Every arm's verdicts. An arm whose VIP verdict turns on its load generator's own
    stalls (see ``stall_dependence``) is marked invalid here, once; the reference is taken
    after that, so an arm (a) marked so is no reference either. Where the stalls of (a)'s calm
    decide another arm's VIP verdict (``reference_stalled``), that arm's verdicts against (a)
    read n/a: the run is sound, its reference is not."""
    for s in sorted(summaries, key=lambda s: s.arm != "a"):
        reason = stall_dependence(s, summaries)
        if reason is not None and reason not in s.invalid:
            s.invalid.append(reason)
    ref, engine_ref = reference(summaries), engine_reference(summaries)
    return [judge(s, None, burst_sim_s, drain_factor) if reference_stalled(s, summaries)
            else judge(s, ref, burst_sim_s, drain_factor, engine_ref) for s in summaries]


def stall_dependence(s: ArmSummary, summaries: Sequence[ArmSummary]) -> str | None:
    """Why the arm's VIP verdict cannot be trusted, or None.

    A stall of the load generator (its own event loop held, by a collection or a starved CPU)
    delays every timestamp it takes meanwhile, so a VIP request waiting for its first token
    across one carries the stall in its TTFT. The verdict is judged again without this arm's
    own such requests (for arm (a), the reference, without them in its calm too); if it
    changes, its stalls decide it. (a)'s stalls are not this arm's: ``reference_stalled``."""
    ref = reference(summaries)
    if ref is None:
        return None
    steady_ref = s.vip_p99_steady[0] if s.arm == "a" else ref[1]
    with_all = _ratio(s.vip_ttft_burst[1], ref[1])
    without = _ratio(s.vip_p99_steady[1], steady_ref)
    if math.isnan(with_all) or math.isnan(without):
        return None
    if (with_all <= VIP_RATIO_BAR) == (without <= VIP_RATIO_BAR):
        return None
    return (f"the VIP verdict turns on the load generator's stalls: {_x(with_all)} of (a)'s "
            f"calm, {_x(without)} without the VIP requests waiting across one")


def reference_stalled(s: ArmSummary, summaries: Sequence[ArmSummary]) -> bool:
    """Whether the stalls of (a)'s load generator in its calm decide this arm's VIP verdict:
    judged against (a)'s calm P99 without the VIP requests that waited across one, it changes.
    Never for (a) itself, whose own stalls make it invalid (``stall_dependence``)."""
    ref = reference(summaries)
    if s.arm == "a" or ref is None:
        return False
    steady_ref = next((a.vip_p99_steady[0] for a in summaries if a.arm == "a"), math.nan)
    with_all = _ratio(s.vip_ttft_burst[1], ref[1])
    without = _ratio(s.vip_ttft_burst[1], steady_ref)
    if math.isnan(with_all) or math.isnan(without):
        return False
    return (with_all <= VIP_RATIO_BAR) != (without <= VIP_RATIO_BAR)


def _burst_load(s: ArmSummary) -> str:
    """How busy the machine was in the burst, when the run recorded it (bench.burst.phaseload):
    the lab's share of the time outside the engine."""
    load = s.phase_load.get("burst")
    if not load:
        return ""
    cores = sum(v for k, v in load.items() if k.startswith("cores:"))
    text = f"; {cores:.2f} cores busy in the burst"
    if "gateway_late_share" in load:
        text += (f", gateways' loops late by over {LATE_S * 1000:.0f} ms in "
                 f"{load['gateway_late_share']:.1%} of their probes")
    return text


def validity(s: ArmSummary) -> str:
    """The run's validity with the lag figures it rests on (share of samples over the
    threshold, worst simulator loop lag; share of requests sent late, latest send; the load
    generator's worst loop lag and the VIP requests that waited across one of its stalls)."""
    lag = (f"sims over the lag bound {s.lag_ms[0]:.1%} of the time, worst {s.lag_ms[1]:.0f} "
           f"ms; {s.lag_ms[2]:.1%} sent late, latest {s.lag_ms[3]:.0f} ms; client loop worst "
           f"{s.client_lag_ms[1]:.0f} ms, {s.client_lag_ms[2]} VIP across a stall"
           + _burst_load(s))
    return (f"yes ({lag})" if not s.invalid
            else "**INVALID**: " + "; ".join(s.invalid) + f" ({lag})")


def cell_table(arms: Sequence[str], judged: Sequence[Sequence[Verdict]],
               valid: Sequence[str]) -> str:
    """One markdown table: a row per criterion, a column per arm, value and PASS/FAIL."""
    lines = ["| criterion | " + " | ".join(ARM_TITLES[a] for a in arms) + " |",
             "|---|" + "---|" * len(arms)]
    for key in (*CRITERIA, *EXTRA):
        cells = [next((x for x in v if x.key == key), None) for v in judged]
        lines.append(f"| {LABELS[key]} | " + " | ".join(
            "not measured" if x is None else f"{x.value} **{x.mark}**" for x in cells) + " |")
    lines.append("| criteria met (of 7) | " + " | ".join(str(passed(v)) for v in judged) + " |")
    lines.append("| valid run | " + " | ".join(valid) + " |")
    return "\n".join(lines)
