"""From an arm's raw results to the table's figures, the bar's verdicts, and markdown.

Units: times and rates are reported in *simulated* time (wall time x time scale), the clock the
engines' calibration speaks, so figures read like a real fleet's at any time scale. Token rates
are for the simulated cluster as configured (nodes x capacity scale).

Definitions (also printed under the table):

* success: answered in full (every forced output token, ``[DONE]`` for streams) over requests
  with a known outcome. Requests still in flight when the arm stops count as failures if they
  were sent before the burst ended, or, VIP and Normal streams, if they have waited for their
  first token as long as their tier's shipped queue timeout (simulated: 30 s and 60 s; a
  request held that long would be refused by kvgate at a real scale, and has failed its
  client in any arm); those sent after the burst are otherwise left out ("censored": being
  served, a Batch request, which the lab lets wait the whole window, or younger than that):
  the arms stop at different times, and a queue that holds requests past the end must not
  read as success.
* TTFT: intended send time to the first content chunk, streaming VIP requests. A VIP request
  that never got a first token counts as infinitely slow (a failure is not a fast answer), so a
  P99 over a phase with more than 1% failures reads "inf".
* last Batch: when the last Batch request sent before the burst's end completed, in seconds
  after the burst's end (the bar: at most twice the burst's duration, and all of them).
* goodput: prompt + generated tokens the engines processed during the burst (the vLLM counters:
  recomputation after preemption is not in them), per second; judged as work (each token
  valued at the least node time its kind costs) against a true upper bound
  (bench.burst.goodput): the smaller of the work offered (every engine-bound attempt planned
  before the window's end, less what was already counted at its start) and what the nodes'
  time allows at the step-time model's least cost per token, fixed and attention costs
  included, plus the window's edges. The same with every token counting one is shown beside
  it. No arm can exceed either bound; the report asserts so. When measured, the ideal replay
  (bench.burst.capacity: the same requests, offline, behind an omniscient admission
  controller) is shown as a reference, not a bound.
* valid: the simulators' event loops lagged past the threshold (wall ms; lag shifts the
  simulated clock) for at most 5% of the samples, at most 5% of requests left later than the
  threshold after their intended time, and the load generator's own loop lagged past the
  threshold in at most 5% of the seconds (bench.common.openloop.LoopLag), and, in arm (c),
  the gateways' loops ran more than 5 ms late in at most 5% of their probes in each phase
  (bench.burst.phaseload). The VIP requests
  that waited for their first token in such a second are counted, and the VIP P99s are also
  taken without them, so that bench.burst.criteria can tell a verdict the stalls decide.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from admission.configschema import DEFAULT_TIERS
from admission.tiers import Tier
from bench.burst.arm import ArmResult
from bench.burst.capacity import CapacityResult
from bench.burst.expconfig import ARM_TITLES, Settings
from bench.burst.goodput import TOKENS, Bound, Offer, Value, Work, check, upper_bound, work_value
from bench.burst.loadgen import OK, Outcome
from bench.burst.monitor import Sample, scrape_timeout_s
from bench.burst.phaseload import LATE_S
from bench.common.stats import bootstrap_ratio_range, percentile


@dataclass(slots=True)
class ArmSummary:
    arm: str
    kv_peak: float
    preemptions: int
    crashed_nodes: int
    success: dict[Tier, float]
    counted: dict[Tier, int]
    vip_ttft_base: tuple[float, float]
    """P50, P99 in simulated ms."""
    vip_ttft_burst: tuple[float, float]
    last_batch_s: float | None
    """Simulated seconds after the burst's end; None if some never completed."""
    batch_unfinished: int
    goodput: float
    """Tokens per simulated second during the burst."""
    goodput_ratio: float | None
    """Work counted in the burst window (node-seconds: each token at the least time its kind
    costs) over its upper bound (bench.burst.goodput); <= 1. The criterion."""
    goodput_bound: dict[str, float | str] | None = None
    """The bound's terms (``Bound.as_dict``)."""
    token_ratio: float | None = None
    """Tokens counted in the burst window over their upper bound, every token counting one
    (shown beside the criterion)."""
    token_bound: dict[str, float | str] | None = None
    ideal_ratio: float | None = None
    """Goodput over the ideal replay's throughput (a reference, not a bound), when measured."""
    invalid: list[str] = field(default_factory=list)
    errors: list[tuple[str, int]] = field(default_factory=list)
    """The most common reasons requests did not succeed, with counts."""
    lag_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Share of samples with simulator loop lag above the threshold, its max (wall ms); share
    of requests sent later than the threshold, the latest (wall ms)."""
    client_lag_ms: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)
    """The load generator's own loop: share of seconds it lagged past the send-lag threshold,
    its worst lag (wall ms), how many of the counted VIP requests (calm and burst) waited for
    their first token during such a second, and how many were counted."""
    vip_p99_steady: tuple[float, float] = (math.nan, math.nan)
    """VIP P99 TTFT (simulated ms) at calm and in the burst without the VIP requests that
    waited across a stall of the load generator (bench.burst.criteria checks that the VIP
    verdict does not turn on them)."""
    running: tuple[float, float] = (0.0, 0.0)
    """Mean running sequences per node, baseline and burst."""
    vip_p99_ratio_range: tuple[float, float] = (math.nan, math.nan)
    """90% bootstrap range of the VIP P99 TTFT ratio, burst / baseline: how much of the ratio
    is the sampling of a few hundred requests."""
    vip_engine_base: tuple[float, float] = (math.nan, math.nan)
    """P50, P99 (simulated ms) of the engine's part of the VIP TTFTs at calm: from the
    request's arrival at its node to its first token, by the node's trace (nan: no traces)."""
    vip_engine_burst: tuple[float, float] = (math.nan, math.nan)
    vip_front_burst: tuple[float, float] = (math.nan, math.nan)
    """P50, P99 (simulated ms) of the rest of each burst VIP TTFT: the way to the node and the
    first token's way back (the gateway's hop; at a reduced scale a wall millisecond there is
    `time_scale` simulated ones)."""
    phase_load: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase (calm, burst): cores used by kind of process and, in arm (c), how late the
    gateways' event loops ran (bench.burst.phaseload): the lab's share of the hop's time."""
    vip_samples: tuple[int, int] = (0, 0)
    """How many VIP chats the calm and the burst P99 are taken over: under 100, the nearest
    rank's P99 is the largest of them, one request's time (0, 0: not recorded)."""


def _censored(o: Outcome, burst_end: float, stopped_at: float, ts: float) -> bool:
    """In flight at the stop, sent after the burst, and not yet a failure: served (a stream
    with its first token, or a whole answer, which may be), Batch (which the lab lets wait
    the whole window), or waiting for its first token for less than its tier's shipped queue
    timeout (simulated). Its outcome is not known yet."""
    if o.finished or o.req.at < burst_end:
        return False
    if o.req.tier is Tier.BATCH or not o.req.stream or o.ttft is not None:
        # Batch: the lab lets it wait the whole window (deferred, not failed). A stream with
        # its first token is being served (a long answer on a busy node decodes for longer
        # than any queue timeout); a whole answer's client cannot tell queued from served.
        return True
    waited_ms = (stopped_at - o.req.at) * ts * 1000
    return waited_ms < DEFAULT_TIERS[o.req.tier].queue_timeout_ms


def _vip_counted(outcomes: Sequence[Outcome], lo: float, hi: float,
                 burst_end: float) -> list[Outcome]:
    """The streamed VIP requests whose TTFT counts in [lo, hi), a window that ends by the
    burst's end (none of them is censored: `_censored`)."""
    assert hi <= burst_end
    return [o for o in outcomes
            if o.req.tier is Tier.VIP and o.req.stream and lo <= o.req.at < hi]


def _ttft_values(outcomes: Sequence[Outcome], lo: float, hi: float, ts: float,
                 burst_end: float, leave_out: Set[int] = frozenset()) -> list[float]:
    """`leave_out`: ids of outcomes not to count."""
    values = []
    for o in _vip_counted(outcomes, lo, hi, burst_end):
        if id(o) in leave_out:
            continue
        # A first token is a first token even if the stream broke later (that shows in the
        # success rate); no first token at all counts as infinitely slow.
        values.append(o.ttft * ts * 1000 if o.ttft is not None else math.inf)
    return values


def _engine_split(outcomes: Sequence[Outcome], traces: Mapping[str, Mapping[str, object]],
                  lo: float, hi: float, ts: float, burst_end: float
                  ) -> tuple[list[float], list[float]]:
    """The engine's part (node arrival to first token) and the rest of each VIP TTFT counted
    in [lo, hi), in simulated ms, for the requests the nodes traced."""
    engine, front = [], []
    for o in _vip_counted(outcomes, lo, hi, burst_end):
        if o.ttft is None or o.request_id is None:
            continue
        rec = traces.get(o.request_id)
        arrival, first = (rec.get("arr"), rec.get("first")) if rec else (None, None)
        if not isinstance(arrival, float) or not isinstance(first, float):
            continue
        engine.append((first - arrival) * 1000)
        front.append(o.ttft * ts * 1000 - engine[-1])
    return engine, front


def _p50_p99(values: Sequence[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 99)


def _at(samples: Sequence[Sample], t: float) -> Sample:
    return min(samples, key=lambda s: abs(s.t - t))


def summarize(result: ArmResult, capacity: CapacityResult | None,
              traces: Mapping[str, Mapping[str, object]] | None = None) -> ArmSummary:
    """`traces`: the nodes' request records by request id (bench.burst.ttft.load_traces), for
    the engine's part of VIP TTFTs."""
    s = result.settings
    ts = s.time_scale
    profile = s.profile
    b0, b1 = profile.window("burst")
    outcomes = result.outcomes
    success: dict[Tier, float] = {}
    counted: dict[Tier, int] = {}
    for tier in Tier:
        mine = [o for o in outcomes if o.req.tier is tier
                and not _censored(o, b1, result.stopped_at, ts)
                and o.req.at < result.stopped_at]
        counted[tier] = len(mine)
        success[tier] = sum(o.status == OK for o in mine) / len(mine) if mine else math.nan
    batch = [o for o in outcomes if o.req.tier is Tier.BATCH and o.req.at < b1]
    unfinished = sum(o.status != OK for o in batch)
    last = max((o.done_at for o in batch if o.done_at is not None), default=b1)
    samples = result.samples
    final = samples[-1]
    goodput = math.nan
    ratio = token_ratio = None
    bound = token_bound = None
    if samples:
        first, last_sample = _at(samples, b0), _at(samples, b1)
        span = last_sample.t - first.t
        if span > 0:
            done = Work(sum(n1.prompt_tokens - n0.prompt_tokens for n0, n1
                            in zip(first.nodes, last_sample.nodes, strict=True)),
                        sum(n1.generation_tokens - n0.generation_tokens for n0, n1
                            in zip(first.nodes, last_sample.nodes, strict=True)))
            goodput = done.total / span / ts
            worth, bound, token_bound = window_bounds(s, outcomes, first, last_sample)
            ratio = check(worth.of(done), bound)
            token_ratio = check(done.total, token_bound)
    ideal = None
    if capacity is not None and capacity.total_tokens_per_s > 0:
        ideal = goodput / capacity.total_tokens_per_s
    # Validity: the share of the run during which the simulators lagged (or the load generator
    # sent late) beyond the threshold, not the single worst moment, so that one hiccup of a
    # shared machine does not void a long run while lag that lasts (an overloaded simulator)
    # does. The nodes' lag gauge is a maximum over the last second or two, so one spike shows
    # in several consecutive samples.
    loop_lags = sim_loop_lags(samples, result.stopped_at)
    send_lags = [(o.sent_at - o.req.at) * 1000 for o in outcomes if o.sent_at is not None]
    lag = (_share_above(loop_lags, s.max_loop_lag_ms), max(loop_lags, default=math.nan),
           _share_above(send_lags, s.max_send_lag_ms), max(send_lags, default=math.nan))
    stalled, client = _client_lag(result, _vip_counted(outcomes, 0.0, b1, b1),
                                  s.max_send_lag_ms)
    invalid = []
    if lag[0] > MAX_LAGGING_SHARE:
        invalid.append(f"simulator loop lag above {s.max_loop_lag_ms:.0f} ms "
                       f"{lag[0]:.1%} of the time")
    if lag[2] > MAX_LAGGING_SHARE:
        invalid.append(f"{lag[2]:.1%} of requests sent more than {s.max_send_lag_ms:.0f} ms late")
    if client[0] > MAX_LAGGING_SHARE:
        invalid.append(f"the load generator's loop lagged more than {s.max_send_lag_ms:.0f} ms "
                       f"in {client[0]:.1%} of the seconds")
    invalid += late_gateways(result.phase_load)
    running = (_mean_running(samples, 0.0, b0), _mean_running(samples, b0, b1))
    base_ttft = _ttft_values(outcomes, 0.0, b0, ts, b1)
    burst_ttft = _ttft_values(outcomes, b0, b1, ts, b1)
    steady = (percentile(_ttft_values(outcomes, 0.0, b0, ts, b1, stalled), 99),
              percentile(_ttft_values(outcomes, b0, b1, ts, b1, stalled), 99))
    engine_base, _ = _engine_split(outcomes, traces or {}, 0.0, b0, ts, b1)
    engine_burst, front_burst = _engine_split(outcomes, traces or {}, b0, b1, ts, b1)
    reasons = Counter(_reason(o, result.stopped_at) for o in outcomes
                      if o.status != OK and not _censored(o, b1, result.stopped_at, ts)
                      and o.req.at < result.stopped_at)
    return ArmSummary(
        arm=result.arm,
        kv_peak=max(n.kv_peak for n in final.nodes) if samples else math.nan,
        preemptions=int(sum(n.preemptions for n in final.nodes)) if samples else 0,
        crashed_nodes=result.crashed_nodes,
        success=success,
        counted=counted,
        vip_ttft_base=_p50_p99(base_ttft),
        vip_ttft_burst=_p50_p99(burst_ttft),
        vip_samples=(len(base_ttft), len(burst_ttft)),
        last_batch_s=None if unfinished else (last - b1) * ts,
        batch_unfinished=unfinished,
        goodput=goodput,
        goodput_ratio=ratio,
        goodput_bound=bound.as_dict() if bound is not None else None,
        token_ratio=token_ratio,
        token_bound=token_bound.as_dict() if token_bound is not None else None,
        ideal_ratio=ideal,
        invalid=invalid,
        errors=reasons.most_common(6),
        lag_ms=lag,
        client_lag_ms=client,
        vip_p99_steady=steady,
        running=running,
        vip_p99_ratio_range=bootstrap_ratio_range(burst_ttft, base_ttft, 99),
        vip_engine_base=_p50_p99(engine_base),
        vip_engine_burst=_p50_p99(engine_burst),
        vip_front_burst=_p50_p99(front_burst),
        phase_load=result.phase_load,
    )


def window_bounds(settings: Settings, outcomes: Sequence[Outcome], first: Sample,
                  last: Sample) -> tuple[Value, Bound, Bound]:
    """bench.burst.goodput's bounds for the work counted between two samples: the work value
    of a token of each kind, the bound in that unit and the bound in tokens."""
    # A request planned up to one scrape timeout after the closing sample may still have been
    # counted by a node that answered that scrape late.
    horizon = last.t + scrape_timeout_s(settings.sample_interval_s)
    offers = [Offer(o.req.prompt_tokens, o.req.output_tokens)
              for o in outcomes if o.req.at < horizon
              for _ in range(max(0, o.attempts - o.rejections))]  # a 429 never reached an engine
    before = Work(sum(n.prompt_tokens for n in first.nodes),
                  sum(n.generation_tokens for n in first.nodes))
    spans = [n1.clock - n0.clock for n0, n1 in zip(first.nodes, last.nodes, strict=True)]
    configs = [settings.sim_config(i) for i in range(len(first.nodes))]
    worth = work_value(configs)
    return (worth, upper_bound(configs, spans, offers, before, worth),
            upper_bound(configs, spans, offers, before, TOKENS))


def sim_loop_lags(samples: Sequence[Sample], stopped_at: float) -> list[float]:
    """The simulators' worst loop lag (wall ms) in each sample taken up to the load's end:
    after it the arm cancels what is left, thousands of requests at once, and that burst of
    aborts is not the load the run measured (the final sample, taken after it, included)."""
    return [max((n.loop_lag for n in smp.nodes if n.up), default=0.0) * 1000
            for smp in samples if smp.t <= stopped_at]


MAX_LAGGING_SHARE = 0.05
"""A run is invalid when its simulators lagged, or its requests left late, beyond the
thresholds for more than this share of the time (of the requests)."""


def _client_lag(result: ArmResult, vip: Sequence[Outcome], threshold_ms: float
                ) -> tuple[set[int], tuple[float, float, int, int]]:
    """The VIP outcomes (by id) that waited for their first token in a second the load
    generator lagged past the threshold, and the figures of ``ArmSummary.client_lag_ms``."""
    # Up to the load's end: what the loop does after (cancelling) delays no measured request.
    per_second = [lag * 1000 for lag in result.client_lag[:math.ceil(result.stopped_at)]]
    stalls = {sec for sec, lag in enumerate(per_second) if lag > threshold_ms}
    touched = set()
    for o in vip:
        end = o.req.at + (o.ttft if o.ttft is not None else 0.0)
        if any(sec in stalls for sec in range(int(o.req.at), int(end) + 1)):
            touched.add(id(o))
    return touched, (_share_above(per_second, threshold_ms), max(per_second, default=0.0),
                     len(touched), len(vip))


def _share_above(values: Sequence[float], threshold: float) -> float:
    return sum(v > threshold for v in values) / len(values) if values else 0.0


def _mean_running(samples: Sequence[Sample], lo: float, hi: float) -> float:
    values = [sum(n.running for n in smp.nodes) / len(smp.nodes)
              for smp in samples if lo <= smp.t < hi]
    return sum(values) / len(values) if values else math.nan


def _reason(o: Outcome, stopped_at: float) -> str:
    if not o.finished:
        return f"{o.req.tier.label}: still in flight when the arm stopped"
    # Numbers (token counts, ids) would make every reason unique; group by the words.
    text = re.sub(r"\d+", "N", o.error or o.status)[:90]
    return f"{o.req.tier.label}: {text}"


def _times(a: float, b: float) -> float:
    if b <= 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def _ratio(a: float, b: float) -> str:
    r = _times(a, b)
    return "inf" if math.isinf(r) else f"x{r:.2f}"


def _range(bounds: tuple[float, float]) -> str:
    low, high = bounds
    if math.isnan(low) or math.isnan(high):
        return "n/a"
    return f"{_ratio(low, 1.0)}-{_ratio(high, 1.0)}"


def _pct(x: float | None, decimals: int = 0) -> str:
    # Goodput sits near its 90% bar: a whole-percent "90%" beside a MISS would hide 89.6%.
    return "n/a" if x is None or math.isnan(x) else f"{x:.{decimals}%}"


def _ms(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return "n/a" if math.isnan(x) else f"{x:,.0f}"


def _binding(b: Mapping[str, float | str] | None) -> str:
    if not b:
        return "n/a"
    return f"{b['binding']}: {float(b['ceiling']):,.0f} {b['unit']}"


def _last_batch(s: ArmSummary, burst_sim_s: float) -> str:
    if s.last_batch_s is None:
        return f"{s.batch_unfinished} not completed"
    return f"+{s.last_batch_s:,.0f} s ({s.last_batch_s / burst_sim_s:.2f}x the burst)"


def markdown_table(summaries: Sequence[ArmSummary], capacity: CapacityResult | None,
                   burst_sim_s: float) -> str:
    head = "| | " + " | ".join(ARM_TITLES[s.arm] for s in summaries) + " |"
    rule = "|---|" + "---:|" * len(summaries)
    rows: list[tuple[str, list[str]]] = [
        ("KV-cache peak (max over nodes)", [f"{s.kv_peak:.1%}" for s in summaries]),
        ("preemptions", [f"{s.preemptions:,}" for s in summaries]),
        ("crashed nodes", [str(s.crashed_nodes) for s in summaries]),
    ]
    for tier in Tier:
        rows.append((f"{tier.label} success", [
            f"{s.success[tier]:.2%} of {s.counted[tier]:,}" for s in summaries]))
    rows += [
        ("VIP TTFT P50 / P99, baseline (ms)",
         [f"{_ms(s.vip_ttft_base[0])} / {_ms(s.vip_ttft_base[1])}" for s in summaries]),
        ("VIP TTFT P50 / P99, burst (ms)",
         [f"{_ms(s.vip_ttft_burst[0])} / {_ms(s.vip_ttft_burst[1])}" for s in summaries]),
        ("VIP P99 TTFT burst / baseline (90% bootstrap range)",
         [f"{_ratio(s.vip_ttft_burst[1], s.vip_ttft_base[1])} ({_range(s.vip_p99_ratio_range)})"
          for s in summaries]),
        ("last Batch request done, after burst end",
         [_last_batch(s, burst_sim_s) for s in summaries]),
        ("running sequences per node, mean, baseline / burst",
         [f"{s.running[0]:.1f} / {s.running[1]:.1f}" for s in summaries]),
        ("goodput during the burst (tok/s)", [f"{s.goodput:,.0f}" for s in summaries]),
        ("goodput: work done / upper bound (bench.burst.goodput; the binding term)",
         [f"{_pct(s.goodput_ratio, 1)} ({_binding(s.goodput_bound)})" for s in summaries]),
        ("tokens counted / their upper bound (every token counting one)",
         [f"{_pct(s.token_ratio, 1)} ({_binding(s.token_bound)})" for s in summaries]),
        *([("goodput / ideal replay (a reference, not a bound)",
            [_pct(s.ideal_ratio, 1) for s in summaries])] if capacity is not None else []),
        ("valid run (share of time sims lagged past the threshold, worst lag; share of requests "
         "sent late, latest)",
         [("yes" if not s.invalid else "NO: " + "; ".join(s.invalid))
          + f" ({s.lag_ms[0]:.1%}, {s.lag_ms[1]:.0f} ms; {s.lag_ms[2]:.1%}, {s.lag_ms[3]:.0f} ms)"
          for s in summaries]),
        ("load generator's loop (share of seconds past the send-lag threshold, worst lag; "
         "VIP TTFTs spanning such a second)",
         [f"{s.client_lag_ms[0]:.1%}, {s.client_lag_ms[1]:.0f} ms; "
          f"{s.client_lag_ms[2]} of {s.client_lag_ms[3]}" for s in summaries]),
    ]
    lines = [head, rule] + [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    if capacity is not None:
        lines.append("")
        lines.append(
            f"Ideal replay during the burst (bench.burst.capacity: the same requests at the "
            f"same times, replayed offline on the simulator's engine behind an ideal admission "
            f"controller that admits whatever cannot cause a preemption): "
            f"{capacity.total_tokens_per_s:,.0f} tok/s prompt + generated "
            f"({capacity.generation_tokens_per_s:,.0f} generated), "
            f"{capacity.preemptions} preemptions, KV peak {capacity.kv_peak:.1%}, "
            f"{capacity.mean_running:.1f} running sequences per node. That ideal puts VIP first "
            f"(and the nodes run the priority policy); its VIP TTFT P50 / P99 is "
            f"{_ms(capacity.vip_ttft_base[0])} / {_ms(capacity.vip_ttft_base[1])} ms at baseline "
            f"and {_ms(capacity.vip_ttft_burst[0])} / {_ms(capacity.vip_ttft_burst[1])} ms in the "
            f"burst (P99 {_ratio(capacity.vip_ttft_burst[1], capacity.vip_ttft_base[1])}): what "
            f"an omniscient admission controller reaches on these nodes at full throughput.")
        alt = capacity.alternative
        if alt is not None and capacity.total_tokens_per_s > 0:
            lines.append("")
            lines.append(
                f"The same ideal with {alt.vip_nodes} node dedicated to VIP "
                f"(`[pools.dedicated]`: no Normal or Batch work there, VIP there first): "
                f"VIP TTFT P50 / P99 "
                f"{_ms(alt.vip_ttft_base[0])} / {_ms(alt.vip_ttft_base[1])} ms at baseline and "
                f"{_ms(alt.vip_ttft_burst[0])} / {_ms(alt.vip_ttft_burst[1])} ms in the burst "
                f"(P99 {_ratio(alt.vip_ttft_burst[1], alt.vip_ttft_base[1])}) at "
                f"{alt.total_tokens_per_s:,.0f} tok/s, "
                f"{alt.total_tokens_per_s / capacity.total_tokens_per_s:.0%} of the maximum: "
                f"no long prefill ahead of a VIP chat, at the price of the throughput the "
                f"dedicated node does not give to Batch.")
    return "\n".join(lines)


def late_gateways(phase_load: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Why a run is invalid for its gateways (none: valid): their loops ran more than
    `LATE_S` late on more than `MAX_LAGGING_SHARE` of their probes in a phase. The gateways'
    wall milliseconds count time_scale times in every TTFT, so their loops running late is the
    machine's, not the design's, as much as a lagging simulator."""
    return [f"the gateways' loops ran over {LATE_S * 1000:.0f} ms late in "
            f"{load['gateway_late_share']:.1%} of their probes ({phase})"
            for phase, load in phase_load.items()
            if load.get("gateway_late_share", 0.0) > MAX_LAGGING_SHARE]

