"""The ideal admission's replay of one schedule, valued exactly as an arm is.

bench.burst.capacity.ideal_replay runs the simulator's own engine, in simulated time, behind an
admission that knows every request's exact size and starts whatever fits below a KV ceiling.
Here its burst is valued against the same upper bound as the arms' (bench.burst.goodput), so
its goodput ratio is comparable with theirs. bench.burst.ideal records these points for every
matrix cell; bench.burst.experiment replays the point below the KV bar for its one draw, to
judge the goodput criterion with its fallback (bench.burst.fallback).
"""

from __future__ import annotations

from typing import Any

from bench.burst.capacity import CapacityResult, ideal_replay
from bench.burst.criteria import KV_BAR
from bench.burst.expconfig import Settings
from bench.burst.goodput import Offer, Work, check, upper_bound, work_value
from bench.burst.workload import Schedule

POINTS = {"whole": 1.0, "under_bar": KV_BAR - 1e-9}
"""The ideal's KV ceilings: the whole cache, and just below the KV bar (a peak of exactly the
bar would fail "below")."""


def replay(settings: Settings, schedule: Schedule, kv_ceiling: float,
           running_cap: int | None = None) -> dict[str, Any]:
    """The ideal replay of a cell's schedule held to ``kv_ceiling`` (and ``running_cap``
    Normal and Batch sequences per node), valued like an arm."""
    lo, hi = settings.profile.window("burst")
    result = ideal_replay(settings.sim_config(0), settings.nodes, schedule.requests,
                          settings.time_scale, (lo, hi), kv_ceiling=kv_ceiling,
                          drain_s=settings.drain_factor * settings.burst_sim_s,
                          running_cap=running_cap)
    configs = [settings.sim_config(i) for i in range(settings.nodes)]
    worth = work_value(configs)
    span = (hi - lo) * settings.time_scale
    # Every request planned before the window's end, once: the ideal never turns one away.
    offers = [Offer(r.prompt_tokens, r.output_tokens) for r in schedule.requests if r.at < hi]
    bound = upper_bound(configs, [span] * settings.nodes, offers,
                        Work(*result.counted_before), worth)
    ratio = check(worth.of(Work(*result.counted)), bound)
    return {**point_record(kv_ceiling, result, ratio, bound.as_dict()),
            "running_cap": running_cap}


def point_record(kv_ceiling: float, result: CapacityResult, ratio: float,
                 bound: dict[str, float | str]) -> dict[str, Any]:
    base, burst = result.vip_ttft_base[1], result.vip_ttft_burst[1]
    return {"kv_ceiling": kv_ceiling, "goodput_ratio": ratio, "goodput_bound": bound,
            "kv_peak": result.kv_peak, "preemptions": result.preemptions,
            "batch_left": result.batch_left, "last_batch_s": result.last_batch_s,
            "vip_p99_base_ms": base, "vip_p99_burst_ms": burst,
            "mean_running": result.mean_running}
