"""`[pools.control]`: the objectives of the leader's release control (scheduler/control.py).

The operator states a VIP time-to-first-token objective; the leader derives from it, per node
and every poll, how many prompt tokens of Normal and Batch work may wait for prefill there
(the window). The other keys are safety limits with safe defaults, not tuning knobs. The
fields declare each key's default and bounds (admission.configfields); admission.config reads
the table by them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from admission.configfields import ConfigError, KeyName, at_least, between


@dataclass(frozen=True, slots=True)
class ControlSettings:
    enabled: bool = True
    """Off: no prefill room is published, Normal and Batch are limited by KV only."""
    vip_slowdown: float = between(0.0, 100.0, 0.0)
    """The objective in a flood: VIP time to first token (from the dispatch to the node) at
    most this many times its P99 while the pool was calm, which the leader learns
    (scheduler/calm.py); 1.2 with `running_min` 8 is the setting measured in
    docs/design.md. 0 (the default): the absolute `vip_ttft_objective_ms` always."""
    vip_ttft_objective_ms: int = at_least(1, 250)
    """The objective until the calm P99 is learned (or always, with `vip_slowdown` 0). The
    window is sized for it: prompt tokens of other tiers allowed ahead of a VIP chat are those
    the node prefills in half the objective; measured VIP first tokens later than it shrink
    the window when it was at least half full. With `running_min` set, what it leaves over
    the calm P99 bounds the decode step time."""
    prefill_tokens_per_s: int = at_least(1, 15_000)
    """A node's prefill throughput until its `vllm:prompt_tokens_total` counter has been seen
    to move while it had work queued (then the measured rate is used)."""
    window_min_tokens: int = at_least(1, 512)
    """The window never goes below this (Normal chats keep flowing at a VIP miss)."""
    window_max_tokens: int = at_least(1, 65_536)
    """...nor above this (a node that measured a huge rate still queues a bounded backlog)."""
    max_engine_running: int = at_least(0, 0)
    """A node whose engine runs more sequences than this gets no Normal or Batch work until it
    runs fewer (0: no bound)."""
    running_min: int = at_least(0, 0)
    """The running limit never goes below this (0, the default: no running limit). A long
    decode batch slows every step, so every VIP first token, without queueing anything: the
    limit keeps each node's decode step time (vLLM's inter-token latency) within its calm step
    time plus a third of what the objective leaves over the learned calm VIP P99
    (scheduler/control.py). Off by default: with the learned objective it is stricter than
    the VIP bar wherever the gateway's own calm is faster than the engines' without it, and
    costs Normal and Batch throughput there (docs/design.md)."""
    quiet_nodes: int = at_least(0, 1)
    """Nodes kept quiet for VIP: a Normal or Batch prompt larger than a node's room whose
    prefill alone takes the whole objective (more than twice the window: a long document) goes
    to a node only while this many others stay quiet (at most half a window queued for
    prefill), and not to a node where a VIP chat was placed less than the VIP objective ago;
    VIP chats are steered to the quiet ones. At most all but one node of a pool is kept (a
    one-node pool still runs long prompts); 0: none."""
    lane_nodes: int = at_least(0, 0)
    """Nodes kept as VIP lanes, the first of the pool's usable shared nodes by name: Normal
    and Batch go to a lane only with a prompt of at most twice its window and while fewer of
    them are alive there than the lane's cap, which the leader sizes from the lane's decode
    step time (`lane_slowdown`); VIP is steered to the quiet node running the fewest
    sequences, which in a flood is a lane. At most all but one node of a pool; 0 (the
    default): none. Off by default: it shortens VIP's tail where a long decode batch holds
    it, and costs Normal and Batch throughput where VIP needed no help (docs/design.md)."""
    lane_slowdown: float = between(1.0, 100.0, 1.2)
    """A lane's cap keeps its decode step time within the shortest step read on it plus a
    third of what this many times the pool's calm VIP P99 leaves over that P99 (the
    configured objective stands in for the P99 until learned; the lane cap C of
    scheduler/control.py)."""
    lane_output: int = at_least(0, 0)
    """A lane takes a Normal or Batch task only if the output it declares (its `max_tokens`,
    or the default the gateway writes when it sends none) is at most this many tokens (0, the
    default: any). A long generation holds the lane's batch for minutes, so a lane whose cap
    closes in a flood would stay long until those already there end."""
    lane_on_miss: bool = False
    """The lane's cap holds only from a poll at which more than `vip_miss_target` of the
    pool's recent VIP first tokens were later than the objective, until the pool is calm again
    (for `signal_stale_ms`) with no such poll for `signal_stale_ms`; until then a lane takes
    Normal and Batch work as any node does (but long prompts and, with `lane_output`, long
    outputs). Off (the default): the cap always holds."""
    vip_miss_target: float = between(0.0, 1.0, 0.01)
    """Share of VIP first tokens that may be later than the objective (0.01: the objective is
    a P99) before the window shrinks."""
    signal_stale_ms: int = at_least(1, 10_000)
    """With no VIP first token reported on a node for this long, its window is the model's
    alone (gain 1): the measured correction only holds while it is fresh."""

    def check(self, key: KeyName) -> None:
        if 0 < self.vip_slowdown < 1:
            raise ConfigError(f"{key('vip_slowdown')}: must be 0 (off) or at least 1")
        if self.window_min_tokens > self.window_max_tokens:
            raise ConfigError(f"{key('window_min_tokens')}: must be at most "
                              f"{key('window_max_tokens')}")
        if 0 < self.max_engine_running < self.running_min:
            raise ConfigError(
                f"{key('running_min')}: must be at most {key('max_engine_running')} "
                f"({self.max_engine_running}), got {self.running_min}: the running limit is "
                "never below running_min, so a node would be bounded by max_engine_running "
                "before the limit ever applied")
        if not self.lane_nodes:
            # As [pools.dedicated] refuses its guests' bounds without guests: a setting that
            # does nothing is more likely a forgotten lane_nodes than an intent.
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name, what in (("lane_slowdown", "sizes the lanes' cap"),
                               ("lane_output", "bounds what a lane takes"),
                               ("lane_on_miss", "times the lanes' cap")):
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(f"{key(name)}: {what}, so it needs lane_nodes (0: no "
                                      "lanes)")
