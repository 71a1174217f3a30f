"""A true upper bound on the work an arm's engines can count during the burst.

Goodput is what the vLLM counters say the engines did between the samples nearest the burst's
start and end: prompt tokens (counted once per request, when its prefill completes) and
generated tokens (one per sequence per step; recomputation after a preemption is in neither).
It is valued two ways (``Value``):

* **work** (the criterion): each token counts the least node time its kind costs,
  ``per_prefill_token / k`` for a prompt token and ``per_seq / k`` for a generated one (the
  step-time model of bench.sim.timing, on a node at capacity scale ``k``), so goodput is the
  node time spent on work that counts. Recomputation after a preemption, idle engines and the
  fixed cost of small batches are what it leaves out.
* **tokens** (shown beside it): every token counts one. A prompt token costs about an
  eighteenth of a generated one, so over a window this rewards starting requests (prefilling
  them) over finishing them: an arm that admits everything at once counts more than one that
  defers work, with engines equally busy.

The bound, in either unit, is the smaller of two ceilings, each of which no schedule can break:

* **offered**: the work that existed. Every request planned to arrive before the window ends,
  once per attempt that was not answered 429 (an attempt the gateway turned away never reaches
  an engine; one that failed later may have), minus what the arm's engines had already counted
  when the window began. Each token of a request is counted at most once per engine run, so the
  window cannot count more than this.
* **capacity**: the work the nodes' time allows, from the step-time model, ``step = fixed +
  (per_seq * seqs + per_context_token * context + per_prefill_token * prefill) / k``. Every
  token gets the least time any schedule must spend on it:

  - a prompt token: ``per_prefill_token / k``;
  - a request's first generated token comes out of its last prefill chunk, where the request
    takes a sequence's place in the step: ``per_seq / k``;
  - its ``j``-th generated token (``j >= 2``) needs a decode step of its own that reads the
    ``prompt + j - 2`` tokens already cached: ``(per_seq + per_context_token * (prompt + j -
    2)) / k``;
  - and a share of the steps' fixed cost. A step holds at most ``max_num_seqs`` sequences,
    at most ``max_num_batched_tokens`` tokens, and decodes sequences whose cached tokens fit
    in the KV cache together (``kv`` tokens). So for any weights ``l1 + l2 + l3 = 1`` the
    shares ``l1 / max_num_seqs + l2 * context / kv + l3 / max_num_batched_tokens`` of a
    decode token, ``l1 / max_num_seqs`` of a first token and ``l3 / max_num_batched_tokens``
    of a prompt token sum to at most one per step: ``fixed`` times that share is a lower
    bound on the fixed time per token.

  With ``S`` simulated seconds of node time (the nodes' own clocks between the two scrapes,
  summed over nodes), the most value is counted by spending the time on the tokens with the
  most value per second first (a fractional knapsack; arrival order, the decode-after-prefill
  order and which requests run together are relaxed, which only loosens the bound). Every
  choice of weights gives a bound; the tightest of a grid of them is taken. The tokens the
  engines had counted before the window are taken off the most expensive end, which again only
  loosens it. Two edges are added per node: the step that straddles the window's start (at most
  one step's worth: ``max_num_batched_tokens`` prompt tokens and ``max_num_seqs`` generated
  ones) and the prefill in progress at the start, whose earlier chunks were computed before the
  window but are counted in it (vLLM schedules running requests before waiting ones, so at most
  one request per node is part-way through its prefill: at most the largest offered prompt, and
  at most ``max_model_len`` tokens).

No arm can exceed the bound; ``check`` asserts it wherever a ratio is computed, and
tests/test_bench_goodput.py checks it against the simulator's own engine. The bound is not
reachable (the relaxations above), so an arm's ratio says how close it came to a ceiling, not
that it lost the rest.
"""

from __future__ import annotations

import math
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
class Value:
    """What one token of each kind is worth in a goodput's unit."""

    prompt: float
    generated: float
    unit: str

    def of(self, work: Work) -> float:
        return work.prompt * self.prompt + work.generated * self.generated


TOKENS = Value(1.0, 1.0, "tokens")
"""Every token counts one, whatever it cost."""


def work_value(configs: Sequence[SimConfig]) -> Value:
    """Every token counts the least node time its kind can cost (per_prefill_token / k for a
    prompt token, per_seq / k for a generated one): goodput in node-seconds of work done."""
    lim = _Limits.of(configs)
    return Value(lim.per_prompt, lim.per_seq, "node-seconds")


@dataclass(frozen=True, slots=True)
class Bound:
    ceiling: float
    """The upper bound on the value counted in the window (the smaller ceiling)."""
    offered: float
    """The offered-work ceiling."""
    capacity: float
    """The capacity ceiling, edges included."""
    node_seconds: float
    """Simulated node time the capacity ceiling is computed over."""
    unit: str = "tokens"

    @property
    def binding(self) -> str:
        return "offered" if self.offered <= self.capacity else "capacity"

    def as_dict(self) -> dict[str, float | str]:
        return {"ceiling": self.ceiling, "offered": self.offered, "capacity": self.capacity,
                "node_seconds": self.node_seconds, "binding": self.binding, "unit": self.unit}


CONTEXT_BIN = 16
"""Generated tokens are grouped by their context rounded down to a multiple of this (cheaper, so
still a bound), which keeps the knapsack to a few thousand groups."""

WEIGHT_STEPS = 4
"""The grid of fixed-cost weights (l1, l2, l3) has steps of 1/WEIGHT_STEPS."""


@dataclass(frozen=True, slots=True)
class Offer:
    """One engine run of a request: its prompt and the tokens it generates."""

    prompt: int
    output: int


def offered_work(offers: Sequence[Offer]) -> Work:
    return Work(sum(o.prompt for o in offers), sum(max(0, o.output) for o in offers))


def edge_work(config: SimConfig, largest_prompt: int) -> Work:
    """Work one node may count in the window that was done before it (module docstring): the
    prefill in progress and the step that straddles the window's start."""
    return Work(min(config.max_model_len, largest_prompt)
                + config.effective_max_num_batched_tokens, config.effective_max_num_seqs)


@dataclass(frozen=True, slots=True)
class _Limits:
    """The cheapest costs and the largest step limits over the nodes, so pooled time stays a
    bound when nodes differ (in the experiment they are all the same engine)."""

    fixed: float
    per_seq: float
    per_context: float
    per_prompt: float
    seqs: int
    batched: int
    kv: int
    max_model_len: int

    @classmethod
    def of(cls, configs: Sequence[SimConfig]) -> _Limits:
        return cls(
            fixed=min(c.step_costs.fixed_s for c in configs),
            per_seq=min(c.step_costs.per_seq_s / c.capacity_scale for c in configs),
            per_context=min(c.step_costs.per_context_token_s / c.capacity_scale
                            for c in configs),
            per_prompt=min(c.step_costs.per_prefill_token_s / c.capacity_scale
                           for c in configs),
            seqs=max(c.effective_max_num_seqs for c in configs),
            batched=max(c.effective_max_num_batched_tokens for c in configs),
            kv=max(c.usable_blocks * c.block_size for c in configs),
            max_model_len=max(c.max_model_len for c in configs))


def _decode_groups(offers: Sequence[Offer], max_model_len: int,
                   drop: float) -> tuple[float, list[tuple[int, float]]]:
    """The first generated tokens and the later ones as (context rounded down to CONTEXT_BIN,
    count) in ascending context, after taking ``drop`` tokens off the most expensive end."""
    bins = max_model_len // CONTEXT_BIN + 1
    diff = [0] * (bins + 1)
    first = 0
    for o in offers:
        if o.output <= 0:
            continue
        first += 1
        lo, hi = o.prompt, min(o.prompt + o.output - 2, max_model_len)
        # Contexts lo..hi, one token each, spread over the bins they fall in.
        c = lo
        while c <= hi:
            b = c // CONTEXT_BIN
            end = min(hi, (b + 1) * CONTEXT_BIN - 1)
            diff[b] += end - c + 1
            diff[b + 1] -= end - c + 1
            c = end + 1
    counts: list[float] = []
    running = 0
    for b in range(bins):
        running += diff[b]
        counts.append(float(running))
    for b in range(bins - 1, -1, -1):
        if drop <= 0:
            break
        take = min(drop, counts[b])
        counts[b] -= take
        drop -= take
    return max(0.0, first - drop), [(b * CONTEXT_BIN, n) for b, n in enumerate(counts) if n > 0]


def _knapsack(lim: _Limits, seconds: float, value: Value, prompt: float, first: float,
              groups: Sequence[tuple[int, float]], l1: float, l2: float, l3: float) -> float:
    """The most value ``seconds`` of node time can count with the fixed-cost weights (l1, l2,
    l3): the tokens with the most value per second first."""
    prompt_cost = lim.per_prompt + lim.fixed * l3 / lim.batched
    # A first token costs its sequence's place in the step that ends its prefill.
    first_cost = lim.per_seq + lim.fixed * l1 / lim.seqs
    base = lim.per_seq + lim.fixed * (l1 / lim.seqs + l3 / lim.batched)
    slope = lim.per_context + lim.fixed * l2 / lim.kv
    items = [(prompt, value.prompt, prompt_cost), (first, value.generated, first_cost)]
    items += [(count, value.generated, base + slope * context) for context, count in groups]
    items.sort(key=lambda item: item[2] / item[1])
    total, time_left = 0.0, seconds
    for count, worth, cost in items:
        take = min(count, time_left / cost)
        total += take * worth
        time_left -= take * cost
        if time_left <= 0:
            break
    return total


def capacity_ceiling(configs: Sequence[SimConfig], node_seconds: Sequence[float],
                     offers: Sequence[Offer], counted_before: Work,
                     value: Value = TOKENS) -> float:
    """The capacity ceiling: the most value ``node_seconds`` of each node can count from the
    work ``offers`` left after ``counted_before``, plus the edges."""
    if len(configs) != len(node_seconds):
        raise ValueError("one span per node")
    lim = _Limits.of(configs)
    total = offered_work(offers)
    prompt = max(0.0, total.prompt - counted_before.prompt)
    first, groups = _decode_groups(offers, lim.max_model_len, counted_before.generated)
    seconds = sum(max(0.0, s) for s in node_seconds)
    best = math.inf
    n = WEIGHT_STEPS
    for i in range(n + 1):
        for j in range(n + 1 - i):
            best = min(best, _knapsack(lim, seconds, value, prompt, first, groups,
                                       i / n, j / n, (n - i - j) / n))
    largest = max((o.prompt for o in offers), default=0)
    return best + sum(value.of(edge_work(c, largest)) for c in configs)


def upper_bound(configs: Sequence[SimConfig], node_seconds: Sequence[float],
                offers: Sequence[Offer], counted_before: Work,
                value: Value = TOKENS) -> Bound:
    """The bound on the value counted in a window: ``offers`` is every engine-bound attempt
    that could have started before the window's end, ``counted_before`` what the engines had
    counted at its start."""
    offered = offered_work(offers)
    available = Work(max(0.0, offered.prompt - counted_before.prompt),
                     max(0.0, offered.generated - counted_before.generated))
    capacity = capacity_ceiling(configs, node_seconds, offers, counted_before, value)
    worth = value.of(available)
    return Bound(ceiling=min(worth, capacity), offered=worth, capacity=capacity,
                 node_seconds=sum(node_seconds), unit=value.unit)


class BoundExceeded(RuntimeError):
    """Goodput above its upper bound: a bug in the bound or in the counting, never a result."""


def check(counted: float, bound: Bound) -> float:
    """The goodput ratio; raises `BoundExceeded` if the bound does not hold (a check that
    `python -O` would drop, were it an assert, and a ratio above 1 would be recorded)."""
    if counted > bound.ceiling * (1.0 + 1e-9):
        raise BoundExceeded(
            f"goodput {counted:,.6g} {bound.unit} exceeds its upper bound {bound.ceiling:,.6g} "
            f"(offered {bound.offered:,.6g}, capacity {bound.capacity:,.6g})")
    return counted / bound.ceiling if bound.ceiling > 0 else 0.0
