"""`[pools.control]`: the objectives of the leader's release control (scheduler/control.py).

The operator states a VIP time-to-first-token objective; the leader derives from it, per node
and every poll, how many prompt tokens of Normal and Batch work may wait for prefill there
(the window). The other keys are safety limits with safe defaults, not tuning knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ControlSettings:
    enabled: bool = True
    """Off: no prefill room is published, Normal and Batch are limited by KV only."""
    vip_ttft_objective_ms: int = 250
    """VIP time to first token (from the dispatch to the node) that the window is sized for:
    prompt tokens of other tiers allowed ahead of a VIP chat are those the node prefills in
    half this time; measured VIP first tokens later than it shrink the window."""
    prefill_tokens_per_s: int = 15_000
    """A node's prefill throughput until its `vllm:prompt_tokens_total` counter has been seen
    to move while it had work queued (then the measured rate is used)."""
    window_min_tokens: int = 512
    """The window never goes below this (Normal chats keep flowing at a VIP miss)."""
    window_max_tokens: int = 65_536
    """...nor above this (a node that measured a huge rate still queues a bounded backlog)."""
    max_engine_running: int = 0
    """A node whose engine runs more sequences than this gets no Normal or Batch work until it
    runs fewer (0: no bound)."""
    vip_miss_target: float = 0.01
    """Share of VIP first tokens that may be later than the objective (0.01: the objective is
    a P99) before the window shrinks."""
    signal_stale_ms: int = 10_000
    """With no VIP first token reported on a node for this long, its window is the model's
    alone (gain 1): the measured correction only holds while it is fresh."""


def parse_control(r: Any, error: type[ValueError]) -> ControlSettings:
    """`r` is admission.config's table reader for `[pools.control]`, `error` its ConfigError."""
    d = ControlSettings()
    c = ControlSettings(
        enabled=r.get("enabled", bool, d.enabled),
        vip_ttft_objective_ms=r.integer("vip_ttft_objective_ms", d.vip_ttft_objective_ms, 1),
        prefill_tokens_per_s=r.integer("prefill_tokens_per_s", d.prefill_tokens_per_s, 1),
        window_min_tokens=r.integer("window_min_tokens", d.window_min_tokens, 1),
        window_max_tokens=r.integer("window_max_tokens", d.window_max_tokens, 1),
        max_engine_running=r.integer("max_engine_running", d.max_engine_running, 0),
        vip_miss_target=r.number("vip_miss_target", d.vip_miss_target, 0.0, 1.0),
        signal_stale_ms=r.integer("signal_stale_ms", d.signal_stale_ms, 1),
    )
    if c.window_min_tokens > c.window_max_tokens:
        raise error(f"{r.key('window_min_tokens')}: must be at most "
                    f"{r.key('window_max_tokens')}")
    r.done()
    return c

