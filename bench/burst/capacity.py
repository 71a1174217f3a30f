"""The preemption-free maximum: what the same nodes deliver, on the same traffic, when nothing
is held back that could run without risking a preemption.

Derived, not assumed: the simulator's own engine (bench.sim.engine, the same code and
calibration the nodes run) is driven offline in simulated time with the experiment's planned
schedule, the same requests at the same times, on the same number of nodes. An ideal admission
controller stands in front: it knows every request's exact size (prompt and output tokens) and
each sequence's progress, and admits any queued request (oldest first, a request that does not
fit yet does not block smaller ones behind it) to the node where it fits, whenever the KV peak
projected for that node stays within its cache. No tiers, no margins beyond the exact bound.

The projection is exact for the engine's decode lockstep: every running sequence grows by one
token per step until it ends, so the node's total ``t`` steps from now is the sum, over
requests with more than ``t`` tokens left, of their current tokens plus ``t`` (rounded up to
blocks, one block of margin each). A request that is waiting or prefilling grows later than
that, never sooner, so the projection is an upper bound and preemption cannot happen (the
result reports the count anyway).

Throughput is counted as in the arms: prompt plus generated tokens (the vLLM counters) per
simulated second over the burst window. Same arrivals and same window make the comparison
fair to the mix: a system that defers 8k-token documents is compared with an ideal that saw the
same documents arrive.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from admission.tiers import Tier
from bench.burst.workload import PlannedRequest
from bench.common.stats import percentile
from bench.sim.config import SimConfig
from bench.sim.engine import Engine, RequestStatus, SimRequest, StepPlan

_SCAN_LIMIT = 64
"""Queued requests examined per admission pass (oldest first): bounds the cost of one pass
while the queue is thousands long, at the price of a slightly less than ideal packing."""
_VIP_GRACE_S = 300.0
"""Simulated seconds the replay may run past the burst for its VIP requests' first tokens."""


@dataclass(frozen=True, slots=True)
class CapacityResult:
    total_tokens_per_s: float
    """Prompt + generated tokens per simulated second over the burst, whole cluster."""
    generation_tokens_per_s: float
    preemptions: int
    kv_peak: float
    mean_running: float
    """Mean running sequences per node during the burst."""
    vip_ttft_base: tuple[float, float] = (math.nan, math.nan)
    """VIP TTFT P50, P99 in simulated ms before the burst (arrival to first token)."""
    vip_ttft_burst: tuple[float, float] = (math.nan, math.nan)
    vip_nodes: int = 0
    """Nodes the ideal dedicated to VIP (as `[pools.dedicated]` does): 0 = all shared."""
    alternative: CapacityResult | None = None
    """The same replay with one node dedicated to VIP, when measured: the placement's price."""
    counted_before: tuple[int, int] = (0, 0)
    """Prompt and generated tokens the engines had counted when the burst began."""
    counted: tuple[int, int] = (0, 0)
    """Prompt and generated tokens the engines counted during the burst (what goodput counts)."""
    batch_left: int | None = None
    """Batch requests planned before the burst's end and not done ``drain_s`` after it (None:
    not measured)."""
    last_batch_s: float | None = None
    """Simulated seconds from the burst's end to the last of those finishing (None: some were
    left, or not measured)."""

    def as_dict(self) -> dict[str, float]:
        return {"vip_nodes": self.vip_nodes, "total_tokens_per_s": self.total_tokens_per_s,
                "generation_tokens_per_s": self.generation_tokens_per_s,
                "preemptions": self.preemptions, "kv_peak": self.kv_peak,
                "mean_running": self.mean_running,
                "vip_ttft_base_p50": self.vip_ttft_base[0],
                "vip_ttft_base_p99": self.vip_ttft_base[1],
                "vip_ttft_burst_p50": self.vip_ttft_burst[0],
                "vip_ttft_burst_p99": self.vip_ttft_burst[1]}


def projected_peak_blocks(requests: Sequence[tuple[int, int]], block_size: int) -> int:
    """Peak blocks of requests given as (current tokens, tokens still to generate), if each
    grows one token per step and frees its blocks when done."""
    if not requests:
        return 0
    ordered = sorted(requests, key=lambda r: r[1])
    n = len(ordered)
    suffix = 0
    suffix_tokens = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix += ordered[i][0]
        suffix_tokens[i] = suffix
    peak = 0
    for j, (_, left) in enumerate(ordered):
        if j > 0 and ordered[j - 1][1] == left:
            continue  # the same step as the previous candidate, already counted
        t = max(0, left - 1)  # the last step before request j frees its blocks
        alive = n - j
        peak = max(peak, -(-(suffix_tokens[j] + alive * t) // block_size) + alive)
    return peak


class _Node:
    def __init__(self, config: SimConfig, kv_ceiling: float = 1.0) -> None:
        self.engine = Engine(config)
        self.capacity = math.floor(config.usable_blocks * kv_ceiling)
        """Blocks the admission may fill (the engine itself still has them all)."""
        self.block = config.block_size
        self.live: list[SimRequest] = []
        self.plan: StepPlan | None = None
        """The step in progress (None: idle)."""
        self.guests = 0
        """Live non-VIP sequences (what a dedicated node's guest cap counts)."""
        self.paced_at = 0.0
        """When a dedicated node paced by ``guest_rate`` may take its next guest (simulated s)."""
        self._lefts: list[int] = []
        self._suffix: list[int] = []
        self._now_blocks = 0
        self._peak = 0

    def refresh(self) -> None:
        """Recompute the projection from the sequences' actual progress."""
        self.guests = sum(1 for r in self.live if r.priority != int(Tier.VIP))
        shape = sorted(((r.prompt_tokens + r.num_output, r.max_tokens - r.num_output)
                        for r in self.live), key=lambda x: x[1])
        self._lefts = [left for _, left in shape]
        self._suffix = [0] * (len(shape) + 1)
        for i in range(len(shape) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + shape[i][0]
        self._now_blocks = -(-self._suffix[0] // self.block) + len(shape)
        self._peak = projected_peak_blocks(shape, self.block)

    def fits(self, prompt: int, output: int) -> bool:
        """Whether the projected peak with one more request stays within the cache."""
        if len(self.live) >= self.engine.max_num_seqs:
            return False
        # Cheap bounds first, both exact consequences of the full check below: with the request
        # the total right now is at least this (so it cannot fit)...
        if self._now_blocks + prompt // self.block + 1 > self.capacity:
            return False
        # ...and no future total grows by more than the request's largest size (so it fits).
        if self._peak + (prompt + output) // self.block + 2 <= self.capacity:
            return True
        lefts, suffix, n = self._lefts, self._suffix, len(self._lefts)
        peak = 0
        for j in range(n):
            if j and lefts[j - 1] == lefts[j]:
                continue
            t = max(0, lefts[j] - 1)
            tokens, alive = suffix[j] + (n - j) * t, n - j
            if output > t:
                tokens, alive = tokens + prompt + t, alive + 1
            peak = max(peak, -(-tokens // self.block) + alive)
        t0 = max(0, output - 1)
        k = bisect.bisect_right(lefts, t0)
        tokens = suffix[k] + (n - k) * t0 + prompt + t0
        peak = max(peak, -(-tokens // self.block) + n - k + 1)
        return peak <= self.capacity


def ideal_replay(
    config: SimConfig,
    nodes: int,
    requests: Sequence[PlannedRequest],
    time_scale: float,
    window: tuple[float, float],
    *,
    vip_nodes: int = 0,
    guest_prompt_max: int | None = None,
    guest_cap: int | None = None,
    guest_output_max: int | None = None,
    guests_dedicated_first: bool = True,
    kv_ceiling: float = 1.0,
    strict_order: bool = False,
    guest_rate: float | None = None,
    guest_running: int | None = None,
    dedicated_threshold: int = 0,
    drain_s: float | None = None,
    running_cap: int | None = None,
) -> CapacityResult:
    """Replay ``requests`` (times in wall seconds of the arm) on ``nodes`` ideal-admitted
    engines; measure over ``window`` (wall seconds, converted to simulated time).

    The ideal is tier-aware like kvgate: VIP before Normal before Batch (FIFO within a tier),
    and the engines run vLLM's priority policy with the tier as ``priority``. The VIP TTFT it
    reaches (from arrival, its own queueing included) is the best any admission controller
    can do on these nodes with this traffic while keeping their throughput at the maximum.

    With ``vip_nodes`` > 0 the first nodes are dedicated to VIP, as ``[pools.dedicated]`` keeps
    them: VIP tries them first, then the others; the other tiers never use them. It prices the
    trade of that placement: VIP TTFT against throughput.

    Guests (all off by default): with ``guest_prompt_max`` set, Normal and Batch requests whose
    prompt is at most that many tokens may also use the dedicated nodes (short chats, long
    generations with short prompts: no long prefill for a VIP to wait behind), at most
    ``guest_cap`` of them per dedicated node at once (None: no cap beyond the cache), trying the
    dedicated nodes before the shared ones (``guests_dedicated_first``) or only when no shared
    node fits.
    ``guest_output_max`` also keeps requests of longer outputs off the dedicated nodes.
    ``guest_rate`` paces a dedicated node's guests by their prompts: after a guest of ``p`` prompt
    tokens the node takes no other guest for ``p / guest_rate`` simulated seconds, so the
    prefill work guests bring to it is the same whenever guest demand exceeds that rate (at 1x
    and in the burst alike). ``guest_running`` closes a dedicated node to guests while it runs more
    sequences than that (kvgate's ``guest_max_running``, read there from the node's metrics).
    The engine option ``long_prefill_token_threshold`` comes with ``config``;
    ``dedicated_threshold`` (> 0) sets it on the dedicated nodes alone (a separate deployment
    may run other engine flags).

    ``kv_ceiling`` < 1 admits only while the projected peak stays within that fraction of each
    node's cache: the ideal held to the same KV bar as the live system (below 80%).
    ``strict_order`` admits in kvgate's release order: at the first queued request of a tier
    that fits nowhere it may go, nothing of that tier or below is admitted in that pass (the
    default lets later, smaller requests of any tier go past it, which packs better).

    ``running_cap`` keeps every node at most that many Normal and Batch sequences (VIP goes
    past it): the price in throughput of a short decode batch for VIP's first tokens.

    ``drain_s`` (simulated seconds) runs the replay on after the burst, with the traffic that
    follows it, until every Batch request planned before the burst's end is done or ``drain_s``
    has passed: the Batch criterion's deadline, met or not by an admission that takes the oldest
    Batch work first and knows every request's size.
    """
    config = dataclasses.replace(config, scheduling_policy="priority")
    lo, hi = window[0] * time_scale, window[1] * time_scale
    dedicated_config = (
        dataclasses.replace(config, long_prefill_token_threshold=dedicated_threshold)
        if dedicated_threshold else config)
    fleet = [_Node(dedicated_config if i < vip_nodes else config, kv_ceiling) for i in range(nodes)]
    dedicated_nodes, shared_nodes = fleet[:vip_nodes], fleet[vip_nodes:]
    # Where a request may go, groups in order of preference.
    vip_groups = [g for g in (dedicated_nodes, shared_nodes) if g]
    other_groups = [shared_nodes]  # Normal and Batch alike
    guest_groups = [g for g in ((dedicated_nodes, shared_nodes) if guests_dedicated_first
                                else (shared_nodes, dedicated_nodes)) if g]
    dedicated_ids = {id(n) for n in dedicated_nodes}

    def room(node: _Node, tier: Tier) -> bool:
        """Whether a guest's tier cap lets ``node`` take one more (VIP: always; shared: up to
        ``running_cap``)."""
        if tier is Tier.VIP:
            return True
        if running_cap is not None and node.guests >= running_cap:
            return False
        if id(node) not in dedicated_ids:
            return True
        return ((guest_cap is None or node.guests < guest_cap)
                and (guest_rate is None or now >= node.paced_at)
                and (guest_running is None or node.engine.num_running <= guest_running))
    arrivals = sorted(((r.at * time_scale, r) for r in requests), key=lambda x: x[0])
    queues: dict[Tier, list[tuple[float, PlannedRequest]]] = {t: [] for t in Tier}
    steps: list[tuple[float, int]] = []  # (step end, node index), a heap
    vips: list[tuple[float, SimRequest]] = []
    batch: list[SimRequest] = []  # admitted Batch requests planned before the burst's end
    batch_planned = sum(1 for r in requests if r.tier is Tier.BATCH and r.at * time_scale < hi)
    deadline = hi + drain_s if drain_s is not None else -math.inf
    ids = itertools.count()
    next_arrival = 0
    now = 0.0
    start_counts: tuple[int, int] | None = None
    end_counts: tuple[int, int] | None = None
    peak, running_sum, samples = 0.0, 0, 0

    def counts() -> tuple[int, int]:
        return (sum(n.engine.stats.prompt_tokens for n in fleet),
                sum(n.engine.stats.generation_tokens for n in fleet))

    def admit() -> None:
        for n in fleet:
            n.refresh()
        scanned = 0
        blocked = False
        for tier in Tier:
            if blocked:
                break
            still_queued: list[tuple[float, PlannedRequest]] = []
            queue = queues[tier]
            for i, (arrived, req) in enumerate(queue):
                if scanned >= _SCAN_LIMIT:
                    still_queued.extend(queue[i:])
                    break
                scanned += 1
                node = None
                if tier is Tier.VIP:
                    options = vip_groups
                elif (guest_prompt_max is not None and req.prompt_tokens <= guest_prompt_max
                      and (guest_output_max is None or req.output_tokens <= guest_output_max)):
                    options = guest_groups
                else:
                    options = other_groups
                for group in options:
                    node = min((n for n in group if room(n, tier)
                                and n.fits(req.prompt_tokens, req.output_tokens)),
                               key=lambda n: len(n.live), default=None)
                    if node is not None:
                        break
                if node is None:
                    if strict_order:
                        blocked = True
                        still_queued.extend(queue[i:])
                        break
                    still_queued.append((arrived, req))
                    continue
                sim_req = SimRequest(request_id=str(next(ids)), prompt_tokens=req.prompt_tokens,
                                     max_tokens=req.output_tokens, priority=int(req.tier))
                node.engine.add(sim_req, now)
                node.live.append(sim_req)
                node.refresh()
                if guest_rate is not None and tier is not Tier.VIP and id(node) in dedicated_ids:
                    node.paced_at = max(node.paced_at, now) + req.prompt_tokens / guest_rate
                if tier is Tier.VIP:
                    vips.append((arrived, sim_req))
                elif tier is Tier.BATCH and arrived < hi:
                    batch.append(sim_req)
            queues[tier] = still_queued

    def start_steps() -> None:
        nonlocal peak, running_sum, samples
        for index, node in enumerate(fleet):
            if node.plan is None and node.engine.has_work():
                node.plan = node.engine.schedule(now)
                heapq.heappush(steps, (now + node.engine.step_seconds(node.plan), index))
                if lo <= now < hi:
                    # Usage right after scheduling is the step's peak (finished ones free later).
                    peak = max(peak, node.engine.kv_usage)
                    running_sum += node.engine.num_running
                    samples += 1

    # Past the window only until the burst's VIP requests have their first tokens.
    def vips_served() -> bool:
        return not queues[Tier.VIP] and all(r.first_token_time is not None for _, r in vips)

    def batch_done() -> bool:
        return now >= deadline or (
            len(batch) == batch_planned and all(r.finish_time is not None for r in batch))

    while next_arrival < len(arrivals) or steps:
        t_arrival = arrivals[next_arrival][0] if next_arrival < len(arrivals) else math.inf
        t_step = steps[0][0] if steps else math.inf
        t_paced = min((n.paced_at for n in dedicated_nodes if n.paced_at > now), default=math.inf)
        now = min(t_arrival, t_step, t_paced)
        if start_counts is None and now >= lo:
            start_counts = counts()
        if end_counts is None and now >= hi:
            end_counts = counts()
        if end_counts is not None and batch_done() and (
                vips_served() or now >= max(hi + _VIP_GRACE_S, deadline)):
            break
        if t_paced < min(t_step, t_arrival):
            changed = True  # a paced dedicated node may take a guest again
        elif t_step <= t_arrival:
            _, index = heapq.heappop(steps)
            node = fleet[index]
            assert node.plan is not None
            result = node.engine.complete(node.plan, now)
            node.plan = None
            changed = bool(result.finished)
            if changed:
                node.live = [r for r in node.live if r.status is not RequestStatus.FINISHED]
        else:
            arrived, req = arrivals[next_arrival]
            next_arrival += 1
            # After the window only VIP traffic matters (for the burst's last VIP answers),
            # unless Batch work is drained: then what follows the burst competes with it.
            if arrived < max(hi, deadline) or req.tier is Tier.VIP:
                queues[req.tier].append((arrived, req))
            changed = True
        # Between finishes a node's projection does not move (decode lockstep keeps every
        # future total in place), so only an arrival or a finish can let something in.
        if changed:
            admit()
        start_steps()
    start_counts = start_counts or counts()
    end_counts = end_counts or counts()
    span = hi - lo
    prompt = end_counts[0] - start_counts[0]
    generated = end_counts[1] - start_counts[1]
    finished = [r.finish_time for r in batch
                if r.finish_time is not None and r.finish_time <= deadline]
    batch_left = None if drain_s is None else batch_planned - len(finished)
    return CapacityResult(
        total_tokens_per_s=(prompt + generated) / span,
        generation_tokens_per_s=generated / span,
        preemptions=sum(n.engine.stats.preemptions for n in fleet),
        kv_peak=peak,
        mean_running=running_sum / max(1, samples),
        vip_ttft_base=vip_ttft_ms(vips, 0.0, lo),
        vip_ttft_burst=vip_ttft_ms(vips, lo, hi),
        vip_nodes=vip_nodes,
        counted_before=start_counts,
        counted=(prompt, generated),
        batch_left=batch_left,
        last_batch_s=(max(finished, default=hi) - hi) if batch_left == 0 else None,
    )


def vip_ttft_ms(vips: Sequence[tuple[float, SimRequest]], lo: float, hi: float
                ) -> tuple[float, float]:
    """P50 and P99 of the first-token times (ms, from arrival) of the VIP requests that
    arrived in [lo, hi); one that never got its first token counts as infinite."""
    values = [(r.first_token_time - arrived) * 1000 if r.first_token_time is not None
              else math.inf for arrived, r in vips if lo <= arrived < hi]
    return percentile(values, 50), percentile(values, 99)
