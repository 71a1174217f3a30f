"""Settings of the burst experiment, its presets, and the TOML file arm (c) runs with.

Every arm runs the same engines: ``Settings.sim_config`` is the one engine configuration (vLLM's
priority scheduling policy, chunked prefill within ``max_num_batched_tokens``, the same batching
limits and the same number of nodes), whatever the arm. Only what stands in front differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from admission.config import EngineSettings
from admission.configschema import DEFAULT_TIERS
from admission.controlconfig import ControlSettings
from admission.tiers import Tier
from bench.burst.workload import (
    DEFAULT_CLASSES,
    EXACT_MAX_TOKENS,
    MaxTokensMix,
    Profile,
    Scale,
    TrafficClass,
    burst_profile,
)
from bench.sim.config import DEFAULT_MODEL, SimConfig

ARMS = ("a", "b", "c", "d")
ARM_TITLES = {
    "a": "(a) no gateway",
    "b": "(b) FIFO limit",
    "c": "(c) kvgate",
    "d": "(d) vLLM priority",
}
POOL = "llama-3-8b"
"""The model name clients ask the gateway for; the nodes serve DEFAULT_MODEL."""


@dataclass(frozen=True, slots=True)
class Settings:
    nodes: int = 4
    capacity_scale: float = 1.0
    time_scale: float = 1.0
    baseline_sim_s: float = 120.0
    burst_sim_s: float = 240.0
    burst_factor: float = 4.0
    drain_factor: float = 2.0
    """The arm observes up to this many burst durations after the burst (the bar's window)."""
    min_after_sim_s: float = 60.0
    """...and at least this long, even when every Batch request is done sooner."""
    seed: int = 20_240_531
    max_model_len: int = 16_384
    crash_after_full_sim_s: float | None = 60.0
    """A node that stays full (KV >= 99% or preempting) this long dies like an OOM kill."""
    fifo_max_inflight: int = 128
    """Arm (b): requests in flight per node at real scale (scaled by capacity_scale). A count
    limit must pick between starving the cache and overfilling it: over thirteen draws of this
    traffic (bench.burst.baseline_replay, bench/results/baseline-replay.md) 64 never preempts but
    holds KV at 55-70% and queues VIP behind everything, 128 preempts on 11 of them (the full
    preset's own draw is one of the two that peak just under the cache)."""
    gateways: int = 2
    schedulers: int = 2
    pass_priority: bool = True
    """Arm (c)'s pool declares what its engines run (the priority policy, as in every arm): the
    gateway forwards the tier as vLLM's ``priority``."""
    vip_nodes: int = 0
    """Arm (c): nodes dedicated to VIP (`[pools.dedicated]`), the first ones; 0 = all shared."""
    guest_prompt: int = 0
    """Arm (c), with vip_nodes: `guest_max_prompt_tokens` of the dedicated nodes (0: no guests)."""
    max_guests: int | None = None
    """Arm (c), with guests: `max_guests_per_node`; None = the project's default."""
    guest_rate: int = 0
    """Arm (c), with guests: `guest_prompt_tokens_per_s` (0: unpaced)."""
    guest_output: int = 0
    """Arm (c), with guests: `guest_max_output_tokens` (0: no bound)."""
    guest_running: int = 0
    """Arm (c), with guests: `guest_max_running` (0: no bound)."""
    projection: str | None = None
    """Arm (c): `zones.projection` of the pool; None = the project's default."""
    max_engine_waiting: int | None = None
    """Arm (c): `zones.max_engine_waiting` of the pool; None = the project's default."""
    max_engine_running: int | None = None
    """Arm (c): `control.max_engine_running` of the pool at real scale (a k-slice node gets k
    times as many, rounded, at least 1); None = the project's default (no bound)."""
    vip_ttft_objective_ms: int | None = None
    """Arm (c): `control.vip_ttft_objective_ms` of the pool at real scale (converted to the lab
    clock as the default is); None = the project's default."""
    running_min: int | None = None
    """Arm (c): `control.running_min` of the pool at real scale (converted as the default is;
    0: no running limit); None = the project's default."""
    vip_slowdown: float | None = None
    """Arm (c): `control.vip_slowdown` of the pool (0: the absolute objective); None = the
    project's default."""
    lane_nodes: int | None = None
    """Arm (c): `control.lane_nodes` of the pool (0: no lane); None = the project's default."""
    quiet_nodes: int | None = None
    """Arm (c): `control.quiet_nodes` of the pool (0: long prefills go to any node); None = the
    project's default."""
    lane_slowdown: float | None = None
    """Arm (c): `control.lane_slowdown` of the pool; None = the project's default."""
    lane_output: int | None = None
    """Arm (c): `control.lane_output` of the pool (tokens, 0: any); None = the project's
    default."""
    lane_on_miss: bool | None = None
    """Arm (c): `control.lane_on_miss` of the pool; None = the project's default."""
    batch_ceiling: float | None = None
    """Arm (c): `zones.batch_ceiling` of the pool; None = the project's default."""
    vip_ceiling: float | None = None
    """Arm (c): `zones.vip_ceiling` of the pool; None = the project's default."""
    yellow: float | None = None
    """Arm (c): `zones.yellow` of the pool; None = the project's default."""
    kv_target: float | None = None
    """Arm (c): `zones.kv_target` of the pool; None = the project's default."""
    max_loop_lag_ms: float = 50.0
    """A run whose simulator event loops lagged more than this (wall ms) is flagged invalid."""
    max_send_lag_ms: float = 50.0
    """...as is one whose load generator sent a request later than this after its time."""
    sample_interval_s: float = 0.25
    classes: tuple[TrafficClass, ...] = DEFAULT_CLASSES
    max_tokens: MaxTokensMix = EXACT_MAX_TOKENS
    """What clients declare as ``max_tokens`` (bench.burst.workload.MaxTokensMix)."""
    mix: str = "article"
    """The traffic mix's name (bench.burst.mixes), for reports."""

    def wall(self, sim_s: float) -> float:
        return sim_s / self.time_scale

    @property
    def scale(self) -> Scale:
        return Scale(self.nodes, self.capacity_scale, self.time_scale)

    @property
    def profile(self) -> Profile:
        after = self.wall(self.drain_factor * self.burst_sim_s)
        return burst_profile(self.wall(self.baseline_sim_s), self.wall(self.burst_sim_s), after,
                             self.burst_factor)

    @property
    def fifo_slots(self) -> int:
        return max(1, round(self.fifo_max_inflight * self.capacity_scale))

    def sim_config(self, index: int, *, priority: bool = True) -> SimConfig:
        """Node ``index``'s engine. The arms all take the default (the priority policy; a
        request without ``priority`` is 0, so with no priorities sent it serves arrivals in
        order, as FCFS does); ``priority=False`` is for offline analyses of FCFS nodes."""
        return SimConfig(
            model=DEFAULT_MODEL,
            max_model_len=self.max_model_len,
            scheduling_policy="priority" if priority else "fcfs",
            time_scale=self.time_scale,
            capacity_scale=self.capacity_scale,
            engine_index=0,
            seed=self.seed + index,
            crash_after_full_s=self.crash_after_full_sim_s,
            lag_window_s=2.0,
        )


PRESETS: dict[str, Settings] = {
    # The reference run: real-scale nodes, the simulation in real time, arm (c) on kvgate's
    # shipped defaults (no dedicated node, no guest or zone settings: those are CLI overrides for
    # exploration). A 300 s baseline: the VIP P99 the burst is compared with needs a few
    # thousand chats.
    "full": Settings(baseline_sim_s=300.0),
    # `make demo`: three arms in under three minutes on two cores. Quarter-size nodes and the
    # clock eight times faster: the same shape, coarser (see bench/results/README notes).
    "short": Settings(capacity_scale=0.25, time_scale=8.0, baseline_sim_s=64.0,
                      burst_sim_s=96.0, min_after_sim_s=48.0, max_loop_lag_ms=25.0,
                      max_send_lag_ms=25.0),
    # The CI smoke test: arms (a) and (c) only, a burst hard enough to fill (a) in seconds.
    "smoke": Settings(capacity_scale=0.25, time_scale=8.0, baseline_sim_s=40.0,
                      burst_sim_s=80.0, burst_factor=8.0, drain_factor=0.2,
                      min_after_sim_s=16.0, crash_after_full_sim_s=None,
                      max_loop_lag_ms=25.0, max_send_lag_ms=25.0),
}


def api_key(klass: str) -> str:
    return f"sk-bench-{klass}"


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def zone_overrides(settings: Settings) -> list[str]:
    """Arm (c)'s `[pools.zones]` lines that differ from the project's defaults (the config file
    and the report's description both read them here)."""
    values = (("projection", settings.projection or None),
              ("max_engine_waiting", settings.max_engine_waiting),
              ("kv_target", settings.kv_target),
              ("yellow", settings.yellow),
              ("batch_ceiling", settings.batch_ceiling),
              ("vip_ceiling", settings.vip_ceiling))
    return [f"{name} = {_toml_str(value) if isinstance(value, str) else repr(value)}"
            for name, value in values if value is not None]


def default_max_tokens(settings: Settings) -> int:
    """Arm (c)'s pool ``default_max_tokens``: what the context leaves after the longest prompt
    the mix can draw (kvgate_toml says why), at least the longest output it can draw."""
    room = settings.max_model_len - max(c.prompt.hi for c in settings.classes)
    return max(room, max(c.output.hi for c in settings.classes))


def unscaled_control(settings: Settings) -> list[str]:
    """Arm (c)'s `[pools.control]` lines, explored away from the defaults, whose values need
    no change of units on the lab clock (multiples, counts of nodes and tokens, switches)."""
    values = (("vip_slowdown", settings.vip_slowdown), ("lane_nodes", settings.lane_nodes),
              ("lane_slowdown", settings.lane_slowdown), ("lane_output", settings.lane_output),
              ("lane_on_miss", settings.lane_on_miss), ("quiet_nodes", settings.quiet_nodes))
    return [f"{name} = {str(value).lower() if isinstance(value, bool) else repr(value)}"
            for name, value in values if value is not None]


def control_on_the_lab_clock(settings: Settings) -> list[str]:
    """Arm (c)'s `[pools.control]` and `[pools.engine]`: the shipped defaults, converted to the
    simulation's units.

    The gateways time first tokens and the leader measures rates on the wall clock, while a
    reduced-scale node runs `time_scale` times faster than real time and has `capacity_scale`
    of a real node's throughput. A real deployment's 250 ms objective is therefore 250 /
    time_scale wall milliseconds here, and the fallback prefill rate is the real one times
    capacity_scale x time_scale, and a window of tokens is capacity_scale times as many. This is
    a change of units, not a tuning: at scale 1 (the full
    preset) nothing is written and the services run the defaults as shipped."""
    d, e = ControlSettings(), EngineSettings()
    # Exploration settings (never set by the matrix), at real scale like the defaults.
    explored = []
    if settings.max_engine_running is not None:
        running = max(1, round(settings.max_engine_running * settings.capacity_scale))
        explored = [f"max_engine_running = {running if settings.max_engine_running else 0}"]
    explored += unscaled_control(settings)
    objective = settings.vip_ttft_objective_ms
    speed = settings.time_scale
    running_min = d.running_min if settings.running_min is None else settings.running_min
    if speed == 1.0 and settings.capacity_scale == 1.0:
        if objective is not None:
            explored.append(f"vip_ttft_objective_ms = {objective}")
        if settings.running_min is not None:
            explored.append(f"running_min = {running_min}")
        return ["[pools.control]", *explored, ""] if explored else []
    return [
        "[pools.control]",
        *explored,
        f"vip_ttft_objective_ms = "
        f"{max(1, round((d.vip_ttft_objective_ms if objective is None else objective) / speed))}",
        f"prefill_tokens_per_s = "
        f"{max(1, round(d.prefill_tokens_per_s * settings.capacity_scale * speed))}",
        f"signal_stale_ms = {max(1, round(d.signal_stale_ms / speed))}",
        # Windows are prompt tokens a node prefills in a given time: a k-slice prefills k times
        # fewer, so the same time ahead of a VIP chat is k times fewer tokens.
        f"window_min_tokens = {max(1, round(d.window_min_tokens * settings.capacity_scale))}",
        f"window_max_tokens = {max(1, round(d.window_max_tokens * settings.capacity_scale))}",
        # Sequences: a k-slice's engine runs a k-th of a real node's batch for the same step
        # time (bench/sim/timing.py divides the per-sequence cost by k).
        f"running_min = "
        f"{max(1, round(running_min * settings.capacity_scale)) if running_min else 0}",
        "",
        # The projection's prefill allowance is wall time a prompt token may take: a k-slice on a
        # clock `time_scale` times faster prefills a token in 1 / (k x time_scale) of a real
        # node's wall time. The dispatch allowance is the gateways' wall-clock hop: unchanged.
        "[pools.engine]",
        f"prefill_us_per_token = "
        f"{max(1, round(e.prefill_us_per_token / (settings.capacity_scale * speed)))}",
        "",
    ]


def kvgate_toml(
    settings: Settings,
    redis_url: str,
    node_urls: Sequence[str],
    scheduler_port: int,
    queue_window_s: float,
) -> str:
    """The configuration both services read in arm (c).

    Quotas are generous on purpose: the experiment tests KV-aware admission, not tenant rate
    limits, so each tenant's bucket holds ten times what its class offers at the burst's peak.
    Zones and the scheduler run with the project's defaults.
    """
    scale = settings.scale
    lines = [
        "[redis]",
        f"url = {_toml_str(redis_url)}",
        "max_connections = 256",
        "",
        "[gateway]",
        'host = "127.0.0.1"',
        "port = 0",
        "access_log = false",
        "",
        "[scheduler]",
        'host = "127.0.0.1"',
        f"port = {scheduler_port}",
        "",
        # VIP and Normal keep the shipped queue timeouts, on the lab's clock (a wall second
        # is `time_scale` simulated ones): a request held longer would be refused at a real
        # scale. Batch may wait the whole observation window: deferred, not dropped.
        *(line for tier in (Tier.VIP, Tier.NORMAL) for line in (
            f"[tiers.{tier.label}]",
            f"queue_timeout_ms = "
            f"{max(1, round(DEFAULT_TIERS[tier].queue_timeout_ms / settings.time_scale))}",
            "")),
        "[tiers.batch]",
        f"queue_timeout_ms = {int(queue_window_s * 1000)}",
        "",
        "[[pools]]",
        f"name = {_toml_str(POOL)}",
        f"served_model_name = {_toml_str(DEFAULT_MODEL)}",
        f"context_length = {settings.max_model_len}",
        # The pool is declared like the engines behind it: a request may ask for up to the
        # context (the shipped 8,192 would refuse the clients' larger caps in (c) only), and one
        # that asks for nothing may generate more than any real output (the shipped 1,024 would
        # cut long generations short in (c) only). Not "the rest of the context", vLLM's own
        # default: the gateway counts a prompt with its ChatML template, a few tokens under
        # the engine's count, and an engine refuses a request whose max_tokens the gateway
        # filled in up to the context by its own count.
        f"default_max_tokens = {default_max_tokens(settings)}",
        f"max_max_tokens = {settings.max_model_len}",
        f"pass_priority = {'true' if settings.pass_priority else 'false'}",
        "backends = [",
        *(f"    {{ name = \"node-{i}\", url = {_toml_str(u)} }}," for i, u in enumerate(node_urls)),
        "]",
        "",
    ]
    zones = zone_overrides(settings)
    if zones:
        lines += ["[pools.zones]", *zones, ""]
    lines += control_on_the_lab_clock(settings)
    if settings.vip_nodes:
        lines += [
            "[pools.dedicated]",
            "nodes = [" + ", ".join(f'"node-{i}"' for i in range(settings.vip_nodes)) + "]",
            'tiers = ["vip"]',
            *([f"guest_max_prompt_tokens = {settings.guest_prompt}"]
              if settings.guest_prompt else []),
            *([f"max_guests_per_node = {settings.max_guests}"]
              if settings.guest_prompt and settings.max_guests is not None else []),
            *([f"guest_prompt_tokens_per_s = {settings.guest_rate}"]
              if settings.guest_prompt and settings.guest_rate else []),
            *([f"guest_max_output_tokens = {settings.guest_output}"]
              if settings.guest_prompt and settings.guest_output else []),
            *([f"guest_max_running = {settings.guest_running}"]
              if settings.guest_prompt and settings.guest_running else []),
            "",
        ]
    for klass in settings.classes:
        peak = klass.rate * (settings.burst_factor if klass.burst else 1.0)
        tokens_per_s = scale.wall_rate(peak) * (klass.prompt.hi + klass.output.hi)
        lines += [
            "[[tenants]]",
            f"name = {_toml_str(klass.name)}",
            f"tier = {_toml_str(klass.tier.label)}",
            f"key_sha256 = [{_toml_str(key_sha256(api_key(klass.name)))}]",
            f"rate = {max(1000, int(10 * tokens_per_s))}",
            f"burst = {min(10**9, max(100_000, int(600 * tokens_per_s)))}",
            f"max_queued = {100_000 if klass.tier is Tier.BATCH else 10_000}",
            "",
        ]
    return "\n".join(lines)


def with_overrides(settings: Settings, **changes: Any) -> Settings:
    """``dataclasses.replace`` that ignores None values (unset CLI flags)."""
    return dataclasses.replace(settings, **{k: v for k, v in changes.items() if v is not None})
