"""The experiment's timeline: the nodes' /metrics, queue depths and the pool's zone, sampled.

Each sample reads every simulated node's ``/metrics`` (vLLM names plus the simulator's own
``sim:*`` gauges) and, depending on the arm, the Redis queues of the pool (``ZCARD`` of each
tier's sorted set, the scheduler's zone) or the FIFO proxy's ``/stats``. A node that does not
answer is recorded as down; its counters keep their last scraped values for the totals.
In the kvgate arm each sample also keeps what the leader published (its state hash: measured
and projected usage per node, the learned usage ratio, nodes held back and why), each node's
budget and reservations, the pool's release and settle counters and why its queues waited
(``bench.burst.held`` reads those), so that a release can be read against its projection after
the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson
import redis.asyncio as aioredis

from admission.keys import PoolKeys
from admission.tiers import Tier

# Metric name (as exposed) -> NodeSample field.
_WANTED = {
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "sim:loop_lag_seconds": "loop_lag",
    "sim:kv_cache_usage_peak": "kv_peak",
    "sim:computed_tokens_total": "computed_tokens",
    "sim:clock_seconds": "clock",
}


def scrape_timeout_s(interval_s: float) -> float:
    """How long a sample waits for a node's /metrics (wall s): its answer may reflect any
    moment up to this long after the sample's time."""
    return max(0.5, interval_s * 4)


@dataclass(slots=True)
class NodeSample:
    up: bool = True
    kv: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    loop_lag: float = 0.0
    kv_peak: float = 0.0
    computed_tokens: float = 0.0
    clock: float = 0.0
    """The node's simulated clock when it answered (pairs with the counters above)."""


@dataclass(slots=True)
class Sample:
    t: float
    nodes: list[NodeSample]
    queues: dict[str, int] = field(default_factory=dict)
    """Requests queued in front of the engines, by tier label (or "all")."""
    zone: str | None = None
    scheduler: dict[str, str] = field(default_factory=dict)
    """The pool's state hash, plus ``budget:<node>``, ``reserved:<node>``, the pool's
    counters as ``stats:<name>`` and why its queues wait as ``held_by:<field>`` (kvgate only)."""


def parse_metrics(text: str) -> NodeSample:
    """The few series the experiment needs, from Prometheus text (values summed over labels)."""
    sample = NodeSample()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = line.find("{")
        if cut < 0:
            cut = line.find(" ")
        name = line[:cut]
        attr = _WANTED.get(name)
        if attr is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        setattr(sample, attr, getattr(sample, attr) + value)
    return sample


@dataclass(slots=True)
class QueueReading:
    queues: dict[str, int]
    zone: str | None = None
    scheduler: dict[str, str] = field(default_factory=dict)


QueueSource = Callable[[], Awaitable[QueueReading]]


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def redis_queues(client: aioredis.Redis, pool: str) -> QueueSource:
    keys = PoolKeys(pool)

    async def read() -> QueueReading:
        async with client.pipeline(transaction=False) as pipe:
            for tier in Tier:
                pipe.zcard(keys.queue(tier))
            pipe.hgetall(keys.state)
            pipe.hgetall(keys.node_capacity)
            pipe.hgetall(keys.node_reserved)
            pipe.hgetall(keys.stats)
            pipe.hgetall(keys.held_by)
            *depths, state, budgets, reserved, stats, held = await pipe.execute()
        out = {tier.label: int(d) for tier, d in zip(Tier, depths, strict=True)}
        published = {_text(k): _text(v) for k, v in state.items()}
        published.update({f"budget:{_text(k)}": _text(v) for k, v in budgets.items()})
        published.update({f"reserved:{_text(k)}": _text(v) for k, v in reserved.items()})
        published.update({f"stats:{_text(k)}": _text(v) for k, v in stats.items()})
        published.update({f"held_by:{_text(k)}": _text(v) for k, v in held.items()})
        return QueueReading(out, published.get("zone"), published)

    return read


def proxy_queues(session: aiohttp.ClientSession, url: str) -> QueueSource:
    async def read() -> QueueReading:
        async with session.get(url + "/stats") as resp:
            stats = orjson.loads(await resp.read())
        by_tier = stats.get("queued_by_tier") or {}
        return QueueReading({t.label: int(by_tier.get(t.label, 0)) for t in Tier})

    return read


class Monitor:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        node_urls: Sequence[str],
        *,
        interval_s: float = 0.25,
        queues: QueueSource | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.session = session
        self.node_urls = list(node_urls)
        self.interval_s = interval_s
        self.queues = queues
        self.samples: list[Sample] = []
        self.last_good: list[NodeSample] = [NodeSample(up=False) for _ in node_urls]
        self.ever_down = [False] * len(node_urls)
        self.max_lag = 0.0
        self._clock = clock
        self._t0 = 0.0
        self._timeout = aiohttp.ClientTimeout(total=scrape_timeout_s(interval_s))

    async def _node(self, i: int) -> NodeSample:
        try:
            async with self.session.get(self.node_urls[i] + "/metrics",
                                        timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                sample = parse_metrics((await resp.read()).decode())
        except (TimeoutError, aiohttp.ClientError, OSError):
            self.ever_down[i] = True
            down = NodeSample(up=False)
            last = self.last_good[i]
            # Counters and peaks stay at their last known values; gauges read as zero.
            down.preemptions, down.kv_peak = last.preemptions, last.kv_peak
            down.prompt_tokens, down.generation_tokens = last.prompt_tokens, last.generation_tokens
            down.computed_tokens, down.clock = last.computed_tokens, last.clock
            return down
        self.last_good[i] = sample
        self.max_lag = max(self.max_lag, sample.loop_lag)
        return sample

    async def sample_once(self) -> Sample:
        nodes = await asyncio.gather(*(self._node(i) for i in range(len(self.node_urls))))
        reading = QueueReading({})
        if self.queues is not None:
            with contextlib.suppress(Exception):
                reading = await self.queues()
        sample = Sample(self._clock() - self._t0, list(nodes), reading.queues, reading.zone,
                        reading.scheduler)
        self.samples.append(sample)
        return sample

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        """Sample every ``interval_s`` (on a fixed grid from ``t0``) until ``stop`` is set."""
        self._t0 = t0
        tick = 0
        while not stop.is_set():
            await self.sample_once()
            tick += 1
            delay = t0 + tick * self.interval_s - self._clock()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None
