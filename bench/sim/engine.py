"""vLLM V1's scheduler and KV-block accounting, without a GPU and without a clock.

The engine is synchronous and deterministic: ``schedule()`` decides a step (allocating blocks
and preempting as vLLM does), ``step_seconds()`` says how long it takes, and ``complete()``
applies its results at a simulated time the caller supplies. bench.sim.runner drives it in
real time; the tests drive it directly.

Scheduling follows vllm/v1/core/sched/scheduler.py:

1. Running requests first, in admission order: each asks for its remaining prefill (chunked to
   the step's token budget, and to ``long_prefill_token_threshold`` when set) or one decode
   token, and for the blocks that covers. When the pool cannot supply them, a victim is
   preempted (FCFS: the last of the running list, i.e. the most recently scheduled; priority:
   the worst ``(priority, arrival)``), its blocks are freed and it goes back to the front of the
   waiting queue to be recomputed from scratch, prompt and generated tokens alike. If the
   victim is the requester itself, the loop stops.
2. Only if nothing was preempted, waiting requests are admitted in queue order while a sequence
   slot, token budget and blocks for their first prefill chunk are available. Admission never
   preempts.

After the step each request whose computed tokens caught up with its length samples one token;
it finishes on EOS ("stop") or at ``max_tokens`` / ``max_model_len`` ("length").
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field

from bench.sim.config import SimConfig
from bench.sim.stats import EngineStats
from bench.sim.timing import StepShape, step_seconds


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One sequence in the engine. Identity, not value, makes two requests equal."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    eos_at: int | None = None
    """Output count at which the EOS is sampled (finish "stop"); None runs to max_tokens."""
    priority: int = 0
    arrival: float = 0.0
    seq: int = 0
    num_output: int = 0
    num_computed: int = 0
    blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    first_scheduled: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output


@dataclass(slots=True)
class StepPlan:
    scheduled: list[tuple[SimRequest, int]]
    preempted: list[SimRequest]
    shape: StepShape


@dataclass(slots=True)
class StepResult:
    emitted: list[SimRequest] = field(default_factory=list)
    """Requests that generated a token in this step (finished ones included)."""
    finished: list[SimRequest] = field(default_factory=list)


class BlockPool:
    """Counts free KV blocks; which block is which does not matter without prefix caching."""

    __slots__ = ("free", "usable")

    def __init__(self, usable: int) -> None:
        self.usable = usable
        self.free = usable

    @property
    def used(self) -> int:
        return self.usable - self.free

    @property
    def usage(self) -> float:
        return self.used / self.usable

    def take(self, n: int) -> None:
        if n > self.free:
            raise RuntimeError(f"allocating {n} blocks with {self.free} free")
        self.free -= n

    def give_back(self, n: int) -> None:
        if self.free + n > self.usable:
            raise RuntimeError(f"freeing {n} blocks would exceed the pool")
        self.free += n


class _FcfsQueue:
    def __init__(self) -> None:
        self._q: deque[SimRequest] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, req: SimRequest) -> None:
        self._q.append(req)

    def prepend(self, req: SimRequest) -> None:
        self._q.appendleft(req)

    def peek(self) -> SimRequest:
        return self._q[0]

    def pop(self) -> SimRequest:
        return self._q.popleft()

    def remove(self, req: SimRequest) -> None:
        self._q.remove(req)

    def drain(self) -> list[SimRequest]:
        out = list(self._q)
        self._q.clear()
        return out


class _PriorityQueue:
    """Lower ``(priority, arrival)`` first; removal is lazy (entries of finished requests)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, req: SimRequest) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival, req.seq, req))
        self._live += 1

    prepend = add

    def _top(self) -> SimRequest:
        while self._heap[0][3].status is not RequestStatus.WAITING:
            heapq.heappop(self._heap)
        return self._heap[0][3]

    def peek(self) -> SimRequest:
        return self._top()

    def pop(self) -> SimRequest:
        req = self._top()
        heapq.heappop(self._heap)
        self._live -= 1
        return req

    def remove(self, req: SimRequest) -> None:
        # The caller marks the request finished first, so _top() will skip its entry.
        self._live -= 1

    def drain(self) -> list[SimRequest]:
        out = [e[3] for e in sorted(self._heap) if e[3].status is RequestStatus.WAITING]
        self._heap.clear()
        self._live = 0
        return out


class Engine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        # Latency histograms hold what the node's clients measure, wall seconds: a node on a
        # clock `time_scale` times faster answers that much sooner (a leader compares its step
        # time with first tokens the gateways time on the wall clock).
        self.wall_per_sim = 1.0 / config.time_scale
        self.block_size = config.block_size
        self.max_num_seqs = config.effective_max_num_seqs
        self.max_num_batched_tokens = config.effective_max_num_batched_tokens
        self.long_prefill_token_threshold = config.effective_long_prefill_token_threshold
        self.max_model_len = config.max_model_len
        self.priority_policy = config.scheduling_policy == "priority"
        self.pool = BlockPool(config.usable_blocks)
        self.running: list[SimRequest] = []
        self.waiting: _FcfsQueue | _PriorityQueue = (
            _PriorityQueue() if self.priority_policy else _FcfsQueue()
        )
        self.stats = EngineStats()
        self._next_seq = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def check_invariants(self) -> None:
        """Raise if the block accounting is inconsistent (used by tests and debug runs)."""
        held = sum(r.blocks for r in self.running)
        if held != self.pool.used:
            raise AssertionError(f"running requests hold {held} blocks, pool says {self.pool.used}")
        for r in self.running:
            if r.blocks < self.blocks_for(r.num_computed):
                raise AssertionError(f"{r.request_id} computed beyond its blocks")

    # -- requests in and out -----------------------------------------------------------------

    def add(self, req: SimRequest, now: float) -> None:
        if req.prompt_tokens >= self.max_model_len:
            raise ValueError("prompt does not fit max_model_len")
        req.arrival = now
        req.seq = self._next_seq
        self._next_seq += 1
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def abort(self, req: SimRequest, now: float) -> bool:
        """Drop a request wherever it is; False if it had already finished."""
        if req.status is RequestStatus.FINISHED:
            return False
        was_waiting = req.status is RequestStatus.WAITING
        self._finish(req, "abort", now)
        if was_waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        return True

    def fail_all(self, now: float) -> list[SimRequest]:
        """The engine died: every live request ends, without counting as a finished request."""
        victims = self.running + self.waiting.drain()
        self.running = []
        for req in victims:
            self.pool.give_back(req.blocks)
            req.blocks = 0
            req.status = RequestStatus.FINISHED
            req.finish_reason = "error"
            req.finish_time = now
        return victims

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        self.pool.give_back(req.blocks)
        req.blocks = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self.stats.finished[reason] += 1
        if reason != "abort":
            self.stats.e2e.observe((now - req.arrival) * self.wall_per_sim)
            if req.first_scheduled is not None:
                self.stats.queue_time.observe(
                    (req.first_scheduled - req.arrival) * self.wall_per_sim)

    # -- one step ----------------------------------------------------------------------------

    def _preempt(self, victim: SimRequest) -> None:
        self.pool.give_back(victim.blocks)
        victim.blocks = 0
        victim.num_computed = 0
        victim.status = RequestStatus.WAITING
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.prepend(victim)

    def _pick_victim(self) -> SimRequest:
        if self.priority_policy:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival, r.seq))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _chunk(self, req: SimRequest) -> int:
        """Tokens ``req`` asks to compute this step before the budget: all it lacks, or at most
        ``long_prefill_token_threshold`` of them (vLLM V1 caps running and waiting requests
        alike, recomputation after a preemption included; a decode's one token is below any cap).
        """
        n = req.num_tokens - req.num_computed
        cap = self.long_prefill_token_threshold
        return cap if 0 < cap < n else n

    def schedule(self, now: float) -> StepPlan:
        budget = self.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        preempted: list[SimRequest] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._chunk(req), budget)
            need = self.blocks_for(req.num_computed + n) - req.blocks
            while need > self.pool.free:
                victim = self._pick_victim()
                if victim in scheduled:
                    # Only the priority policy can pick a request scheduled earlier this step.
                    budget += scheduled.pop(victim)
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            self.pool.take(need)
            req.blocks += need
            scheduled[req] = n
            budget -= n
            i += 1

        if not preempted:
            while len(self.waiting) > 0 and budget > 0:
                if len(self.running) >= self.max_num_seqs:
                    break
                req = self.waiting.peek()
                n = min(self._chunk(req), budget)
                need = self.blocks_for(req.num_computed + n) - req.blocks
                if need > self.pool.free:
                    break
                self.waiting.pop()
                self.pool.take(need)
                req.blocks += need
                req.status = RequestStatus.RUNNING
                if req.first_scheduled is None:
                    req.first_scheduled = now
                self.running.append(req)
                scheduled[req] = n
                budget -= n

        context = 0
        prefill = 0
        for req, n in scheduled.items():
            context += req.num_computed
            if not (n == 1 and req.num_output > 0 and req.num_tokens - req.num_computed == 1):
                prefill += n
        shape = StepShape(num_seqs=len(scheduled), context_tokens=context, prefill_tokens=prefill)
        return StepPlan(scheduled=list(scheduled.items()), preempted=preempted, shape=shape)

    def step_seconds(self, plan: StepPlan) -> float:
        return step_seconds(plan.shape, self.config.step_costs, self.config.capacity_scale)

    def complete(self, plan: StepPlan, now: float) -> StepResult:
        """Apply a step's results at simulated time ``now`` (the step's end)."""
        result = StepResult()
        stats = self.stats
        stats.steps += 1
        for req, n in plan.scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted (or the engine failed) while the step ran
            req.num_computed += n
            stats.computed_tokens += n
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk; no token yet
            req.num_output += 1
            stats.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                stats.prompt_tokens += req.prompt_tokens
                stats.ttft.observe((now - req.arrival) * self.wall_per_sim)
            else:
                assert req.last_token_time is not None
                stats.itl.observe((now - req.last_token_time) * self.wall_per_sim)
            req.last_token_time = now
            result.emitted.append(req)
            if req.eos_at is not None and req.num_output >= req.eos_at:
                self._finish(req, "stop", now)
                result.finished.append(req)
            elif req.num_output >= req.max_tokens or req.num_tokens >= self.max_model_len:
                self._finish(req, "length", now)
                result.finished.append(req)
        if result.finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return result
