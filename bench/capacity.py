"""The preemption-free maximum: what the same nodes deliver at the highest load that never
preempts, measured rather than assumed.

An oracle client drives each node directly with the burst's request mix (classes drawn in
proportion to their burst-phase rates, sizes from the same distributions). It knows every
request's exact size (prompt + forced output tokens) and keeps each node's reservations within
its KV capacity and its sequence limit, so no sequence can ever run out of blocks: the nodes stay
as full as they can be without preemption. It is closed loop on purpose (a new request goes the
moment room frees), which keeps the nodes saturated. After a warm-up the sims' counters give the
throughput: prompt plus generated tokens per second (recomputation after a preemption is not in
these counters, and the oracle verifies there were no preemptions anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from bench.monitor import NodeSample, parse_metrics
from bench.sim.config import SimConfig
from bench.sim.protocol import OUTPUT_TOKENS_HEADER
from bench.sim.tokens import BOS_TOKENS
from bench.workload import TrafficClass, prompt_text


@dataclass(frozen=True, slots=True)
class CapacityResult:
    total_tokens_per_s: float
    """Prompt + generated tokens per wall second, whole cluster."""
    generation_tokens_per_s: float
    preemptions: int
    kv_peak: float
    window_s: float

    def as_dict(self) -> dict[str, float]:
        return {"total_tokens_per_s": self.total_tokens_per_s,
                "generation_tokens_per_s": self.generation_tokens_per_s,
                "preemptions": self.preemptions, "kv_peak": self.kv_peak,
                "window_s": self.window_s}


class _Node:
    def __init__(self, url: str, config: SimConfig) -> None:
        self.url = url
        self.block_size = config.block_size
        self.capacity_blocks = config.usable_blocks
        self.max_seqs = config.effective_max_num_seqs
        self.reserved_blocks = 0
        self.inflight = 0
        self.room = asyncio.Event()
        self.room.set()

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, blocks: int) -> bool:
        return (self.inflight < self.max_seqs
                and self.reserved_blocks + blocks <= self.capacity_blocks)


async def _scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[NodeSample]:
    async def one(url: str) -> NodeSample:
        async with session.get(url + "/metrics") as resp:
            return parse_metrics((await resp.read()).decode())

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def measure_capacity(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    config: SimConfig,
    classes: Sequence[TrafficClass],
    burst_factor: float,
    *,
    warmup_s: float,
    measure_s: float,
    seed: int,
) -> CapacityResult:
    """Saturate the nodes without preemption for ``warmup_s + measure_s`` wall seconds."""
    weights = [c.rate * (burst_factor if c.burst else 1.0) for c in classes]
    rng = random.Random(f"capacity:{seed}")
    nodes = [_Node(u, config) for u in urls]
    tasks: set[asyncio.Task[None]] = set()

    async def send(node: _Node, klass: TrafficClass, prompt: int, output: int,
                   blocks: int) -> None:
        body = orjson.dumps({
            "model": config.model,
            "messages": [{"role": "user", "content": prompt_text(prompt)}],
            "max_tokens": output, "stream": False,
        })
        try:
            async with session.post(node.url + "/v1/chat/completions", data=body, headers={
                "Content-Type": "application/json", OUTPUT_TOKENS_HEADER: str(output),
            }) as resp:
                await resp.read()
        finally:
            node.reserved_blocks -= blocks
            node.inflight -= 1
            node.room.set()

    async def feed(node: _Node) -> None:
        while True:
            klass = rng.choices(classes, weights)[0]
            prompt, output = klass.prompt.draw(rng), klass.output.draw(rng)
            # The engine's own prompt count may exceed the plan by the BOS rounding; one
            # extra block of margin keeps the bound exact.
            blocks = node.blocks(prompt + output + BOS_TOKENS) + 1
            while not node.fits(blocks):
                node.room.clear()
                await node.room.wait()
            node.reserved_blocks += blocks
            node.inflight += 1
            task = asyncio.create_task(send(node, klass, prompt, output, blocks))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    feeders = [asyncio.create_task(feed(n)) for n in nodes]
    try:
        await asyncio.sleep(warmup_s)
        before = await _scrape(session, urls)
        start = time.perf_counter()
        await asyncio.sleep(measure_s)
        after = await _scrape(session, urls)
        window = time.perf_counter() - start
    finally:
        for task in [*feeders, *tasks]:
            task.cancel()
        for task in [*feeders, *list(tasks)]:
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
                await task
    gen = sum(a.generation_tokens - b.generation_tokens for a, b in zip(after, before,
                                                                        strict=True))
    prompt_tokens = sum(a.prompt_tokens - b.prompt_tokens for a, b in zip(after, before,
                                                                          strict=True))
    return CapacityResult(
        total_tokens_per_s=(gen + prompt_tokens) / window,
        generation_tokens_per_s=gen / window,
        preemptions=int(sum(a.preemptions for a in after)),
        kv_peak=max(a.kv_peak for a in after),
        window_s=window,
    )
