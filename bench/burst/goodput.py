"""A true upper bound on the tokens an arm's engines can count during the burst.

Goodput is what the vLLM counters say the engines did between the samples nearest the burst's
start and end: prompt tokens (counted once per request, when its prefill completes) plus
generated tokens (one per sequence per step; recomputation after a preemption is in neither).
Its bound is the smaller of two ceilings, each of which no schedule can break:

* **offered**: the work that existed. Every request planned to arrive before the window ends,
  once per attempt that was not answered 429 (an attempt the gateway turned away never reaches
  an engine; one that failed later may have), minus what the arm's engines had already counted
  when the window began. Each token of a request is counted at most once per engine run, so the
  window cannot count more than this.
* **capacity**: the work the nodes' time allows, from the simulator's step-time model
  (bench.sim.timing). A step on a node at capacity scale ``k`` costs at least ``per_seq / k``
  per sequence in it, and each sequence emits at most one token, so a generated token costs at
  least ``per_seq / k``; a prompt token costs at least ``per_prefill_token / k``. The fixed and
  attention costs are left out, which only loosens the bound. With ``S`` simulated seconds of
  node time (the nodes' own clocks between the two scrapes, summed over nodes), the most tokens
  are counted by spending the time on the cheaper kind first: all available prompt tokens, then
  generated tokens with what is left (a fractional knapsack; arrival order, KV room and the
  decode-after-prefill order are relaxed, which again only loosens it).
  Two edges are added per node: the step that straddles the window's start (at most one step's
  worth: ``max_num_batched_tokens`` prompt tokens and ``max_num_seqs`` generated ones) and the
  prefill in progress at the start, whose earlier chunks were computed before the window but
  are counted in it (vLLM schedules running requests before waiting ones, so at most one
  request per node is part-way through its prefill: at most ``max_model_len`` tokens).

No arm can exceed the bound; ``check`` asserts it wherever a ratio is computed. The bound is not
reachable (the relaxations above), so an arm's ratio says how close it came to a ceiling, not
that it lost the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.config import SimConfig


@dataclass(frozen=True, slots=True)
class Work:
    """Tokens of work, split by kind (their costs differ)."""

    prompt: float = 0.0
    generated: float = 0.0

    @property
    def total(self) -> float:
        return self.prompt + self.generated


@dataclass(frozen=True, slots=True)
class Bound:
    tokens: float
    """The upper bound on tokens counted in the window (the smaller ceiling)."""
    offered: float
    """The offered-work ceiling."""
    capacity: float
    """The capacity ceiling, edges included."""
    node_seconds: float
    """Simulated node time the capacity ceiling is computed over."""

    @property
    def binding(self) -> str:
        return "offered" if self.offered <= self.capacity else "capacity"

    def as_dict(self) -> dict[str, float | str]:
        return {"tokens": self.tokens, "offered": self.offered, "capacity": self.capacity,
                "node_seconds": self.node_seconds, "binding": self.binding}


def token_costs(config: SimConfig) -> tuple[float, float]:
    """The least simulated seconds one prompt token and one generated token can cost."""
    k = config.capacity_scale
    costs = config.step_costs
    return costs.per_prefill_token_s / k, costs.per_seq_s / k


def edge_tokens(config: SimConfig) -> int:
    """Tokens one node may count in the window for work done before it (module docstring)."""
    return (config.max_model_len + config.effective_max_num_batched_tokens
            + config.effective_max_num_seqs)


def capacity_tokens(configs: Sequence[SimConfig], node_seconds: Sequence[float],
                    available: Work) -> float:
    """The capacity ceiling: the most tokens ``node_seconds`` of each node can count, taking
    from ``available`` the cheaper kind first, plus the edges."""
    if len(configs) != len(node_seconds):
        raise ValueError("one span per node")
    # Every node runs the same engine in the experiment; with different ones, take each node's
    # cheapest costs so the pooled time stays an upper bound.
    prompt_cost = min(token_costs(c)[0] for c in configs)
    gen_cost = min(token_costs(c)[1] for c in configs)
    time_left = sum(max(0.0, s) for s in node_seconds)
    tokens = 0.0
    for amount, cost in sorted(((available.prompt, prompt_cost),
                                (available.generated, gen_cost)), key=lambda x: x[1]):
        take = min(max(0.0, amount), time_left / cost)
        tokens += take
        time_left -= take * cost
    return tokens + sum(edge_tokens(c) for c in configs)


def upper_bound(configs: Sequence[SimConfig], node_seconds: Sequence[float], offered: Work,
                counted_before: Work) -> Bound:
    """The bound on tokens counted in a window: ``offered`` is the work of every engine-bound
    attempt that could have started before the window's end, ``counted_before`` what the
    engines had counted at its start."""
    available = Work(max(0.0, offered.prompt - counted_before.prompt),
                     max(0.0, offered.generated - counted_before.generated))
    capacity = capacity_tokens(configs, node_seconds, available)
    return Bound(tokens=min(available.total, capacity), offered=available.total,
                 capacity=capacity, node_seconds=sum(node_seconds))


def check(counted: float, bound: Bound) -> float:
    """The goodput ratio, asserting the bound holds (a ratio above 1 is a bug in the bound or
    in the counting, never a result)."""
    assert counted <= bound.tokens * (1.0 + 1e-9), (
        f"goodput {counted:,.0f} tokens exceeds its upper bound {bound.tokens:,.0f} "
        f"(offered {bound.offered:,.0f}, capacity {bound.capacity:,.0f})")
    return counted / bound.tokens if bound.tokens > 0 else 0.0
