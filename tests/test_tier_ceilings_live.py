"""Tier ceilings seen from outside, with the shipped defaults: real processes over loopback (a
private redis-server, two vLLM stand-ins whose reported KV usage the test sets at run time, the
scheduler and two gateways), requests sent through both gateways.

The configuration names only Redis, the pool's nodes and the tenants: zones, ceilings, rates
and timeouts are the shipped defaults (YELLOW at 0.70, RED at 0.85, hysteresis 0.03; VIP's
ceiling the RED line, Normal's `kv_target` 0.78, Batch's the YELLOW line; Normal at 20/s in
YELLOW). Both nodes are held at the same usage, so the pool's zone is that usage's zone.

What each line of the zone table promises, checked where it is decided:

- VIP is served in under 1 s at 0.72, 0.78 and 0.84 (YELLOW, up to the RED line);
- Normal is served at 0.72, and queued, never rejected, at 0.78 and 0.84 (its ceiling is
  `kv_target`): still queued after several scheduler ticks, served once usage falls;
- Batch is served below the YELLOW line and held (queued, not rejected) from it up;
- at 0.90 (RED) Normal and Batch get the 429 protocol at once, VIP is queued and served within
  1 s of the usage falling, whether the pool then stays RED (0.83: hysteresis) or leaves it;
- the same lines when the nodes also report the running sequences that hold their cache (363
  chats of 1,000 tokens at 0.84), none sent through the gateways: the projection is the
  measured usage, not a block per sequence more.

"Queued" is read in Redis (the tier's queue) and "still queued after the scheduler looked" is
the queue unchanged across ticks the leader published (`updated_us` of the state hash), not a
sleep. With KVGATE_CEILINGS_REPORT=<file> every measured latency is appended as a JSON line.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from multidict import CIMultiDict

from admission.config import GatewaySettings, SchedulerSettings, ZoneSettings, parse_config
from admission.keys import PoolKeys
from admission.tiers import Tier
from bench.common.localredis import LocalRedis, start_redis
from tests.gateway_harness import KEYS, POOL, sha
from tests.live import Processes

pytestmark = pytest.mark.slow

K = PoolKeys(POOL)
NODES = ("node-0", "node-1")
YELLOW_LEVELS = (0.72, 0.78, 0.84)
RED_LEVEL = 0.90
SERVE_BAR_S = 1.0
"""The bar of the zone table's promise for VIP: served within 1 s (on arrival, or of the usage
falling when it had to queue)."""
TICKS = 5
"""Scheduler publishes a queued request must outlive to count as held (50 ms polls by default:
about a quarter of a second)."""
EVENT_S = 15.0
"""Deadline for anything awaited (a loaded 2-core machine; each wait ends at its event)."""
REPORT_ENV = "KVGATE_CEILINGS_REPORT"


def shipped_config(redis_url: str, nodes: list[str]) -> dict[str, Any]:
    """Only what a deployment must name: Redis, the pool and its nodes, the tenants."""
    return {
        "redis": {"url": redis_url},
        "pools": [{"name": POOL, "backends": [
            {"name": name, "url": url} for name, url in zip(NODES, nodes, strict=True)]}],
        "tenants": [{"name": tier, "tier": tier, "key_sha256": [sha(KEYS[tier])]}
                    for tier in ("vip", "normal", "batch")],
    }


@dataclass
class Stack:
    gateways: dict[str, str]
    """Gateway id -> base URL."""
    nodes: list[str]
    server: LocalRedis
    config: dict[str, Any]
    procs: Processes


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    server = start_redis()
    procs = Processes()
    try:
        nodes = [procs.instant_backend(name, model=POOL, settable_metrics=True)[1]
                 for name in NODES]
        data = shipped_config(server.url, nodes)
        path = procs.write_config(data)
        procs.scheduler(path, "sched")
        gateways = {g.id: g.url for g in (procs.gateway(path, "gw-a"), procs.gateway(path, "gw-b"))}
        yield Stack(gateways, nodes, server, data, procs)
        for child in procs.children:
            assert child.alive(), f"{child.name} died: {child.log_tail()}"
    finally:
        procs.cleanup()
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Live:
    stack: Stack
    redis: aioredis.Redis
    http: aiohttp.ClientSession

    async def set_kv(self, level: float, running: int = 0) -> float:
        """Both nodes report `level` and `running` sequences from now on; returns when both
        have it (monotonic s)."""
        for node in self.stack.nodes:
            async with self.http.put(node + "/lab/metrics",
                                     json={"kv_usage": level, "running": running}) as r:
                assert r.status == 200, await r.text()
        return time.monotonic()

    async def state(self) -> dict[str, str]:
        raw = await self.redis.hgetall(K.state)
        return {_text(k): _text(v) for k, v in raw.items()}

    async def observed(self, level: float, zone: str) -> dict[str, str]:
        """Until the leader has published both nodes at `level` and the pool in `zone`."""
        deadline = time.monotonic() + EVENT_S
        while True:
            state = await self.state()
            if (state.get("zone") == zone
                    and all(state.get(f"usage:{n}") == f"{level:.4f}" for n in NODES)):
                return state
            assert time.monotonic() < deadline, (level, zone, state)
            await asyncio.sleep(0.01)

    async def hold(self, level: float, zone: str, running: int = 0) -> float:
        """Set `level` and wait until the leader saw it; returns when it was set."""
        set_at = await self.set_kv(level, running)
        await self.observed(level, zone)
        return set_at

    async def depth(self, tier: Tier) -> int:
        return int(await self.redis.zcard(K.queues[tier]))

    async def queued(self, tier: Tier, n: int) -> None:
        """Until `n` requests of `tier` sit in its queue."""
        deadline = time.monotonic() + EVENT_S
        while (depth := await self.depth(tier)) < n:
            assert time.monotonic() < deadline, (tier, depth, n)
            await asyncio.sleep(0.01)

    async def ticks(self, n: int = TICKS) -> None:
        """Until the leader has published `n` more times (each publish is one poll and one
        release call)."""
        seen = {(await self.state()).get("updated_us")}
        deadline = time.monotonic() + EVENT_S
        while len(seen) <= n:
            assert time.monotonic() < deadline, f"only {len(seen) - 1} ticks"
            await asyncio.sleep(0.01)
            seen.add((await self.state()).get("updated_us"))

    async def calm(self) -> None:
        """Back to an empty GREEN pool, whatever the previous test left."""
        await self.hold(0.0, "GREEN")
        deadline = time.monotonic() + EVENT_S
        while sum([await self.depth(t) for t in Tier]):
            assert time.monotonic() < deadline, "queues did not drain"
            await asyncio.sleep(0.01)


@pytest.fixture
async def live(stack: Stack) -> AsyncIterator[Live]:
    redis = aioredis.Redis.from_url(stack.server.url)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        env = Live(stack, redis, http)
        try:
            await env.calm()
            yield env
        finally:
            await redis.aclose()


@dataclass
class Answer:
    status: int
    seconds: float
    ended: float
    """time.monotonic() at the answer."""
    headers: CIMultiDict[str]
    body: dict[str, Any]


async def chat(http: aiohttp.ClientSession, url: str, who: str, *,
               max_tokens: int | None = 8, within_s: float = 90.0) -> Answer:
    """A short chat: a few prompt tokens and 8 output tokens (None: no max_tokens, so the
    pool's default of 1,024 is reserved, as for a client that does not say). The answer comes
    within `within_s` or the test fails there (a VIP wrongly queued would otherwise wait out
    its 30 s queue timeout)."""
    body: dict[str, Any] = {"model": POOL, "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    started = time.monotonic()
    async with asyncio.timeout(within_s), http.post(
            url + "/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {KEYS[who]}"}) as response:
        payload = await response.read()
        ended = time.monotonic()
        return Answer(response.status, ended - started, ended, CIMultiDict(response.headers),
                      json.loads(payload))


def report(line: str, **figures: Any) -> None:
    """Prints the figures (pytest -s) and appends them to $KVGATE_CEILINGS_REPORT if set."""
    print(line, figures)
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"line": line, **figures}) + "\n")


def send_all(live: Live, who: str) -> list[asyncio.Task[Answer]]:
    """One chat of `who` through each gateway, in the background."""
    return [asyncio.ensure_future(chat(live.http, url, who))
            for url in live.stack.gateways.values()]


async def assert_held(live: Live, tier: Tier, pending: list[asyncio.Task[Answer]]) -> None:
    """The requests sit in `tier`'s queue and are still there, unanswered, after the leader
    ticked several times."""
    await live.queued(tier, len(pending))
    await live.ticks()
    assert not any(t.done() for t in pending), [t.result() for t in pending if t.done()]
    assert await live.depth(tier) == len(pending)


# --- the configuration is the shipped one ----------------------------------------------------


async def test_the_stack_runs_the_shipped_ceilings(live: Live) -> None:
    config = parse_config(live.stack.config, env={})
    zones = config.pools[POOL].zones
    assert zones == ZoneSettings()
    assert config.scheduler == SchedulerSettings()
    assert config.gateway == GatewaySettings()
    vip, normal, batch = zones.ceilings()
    assert (vip, normal, batch) == (zones.red, zones.kv_target, zones.yellow)
    assert zones.yellow < min(YELLOW_LEVELS) and max(YELLOW_LEVELS) < zones.red < RED_LEVEL
    state = await live.state()
    assert (state["ceiling_vip"], state["ceiling_normal"], state["ceiling_batch"]) == (
        f"{vip:.4f}", f"{normal:.4f}", f"{batch:.4f}")


# --- VIP: served in under 1 s in YELLOW ------------------------------------------------------


async def vip_round(live: Live) -> dict[str, list[float]]:
    """Short chats and chats of the default size through each gateway, one at a time, each
    served in under a second; returns their latencies by gateway."""
    answers: dict[str, list[float]] = {}
    for gateway, url in live.stack.gateways.items():
        for max_tokens in (8, None, 8, None):
            answer = await chat(live.http, url, "vip", max_tokens=max_tokens,
                                within_s=5 * SERVE_BAR_S)
            assert answer.status == 200, answer.body
            answers.setdefault(gateway, []).append(round(answer.seconds, 4))
    assert max(s for seconds in answers.values() for s in seconds) < SERVE_BAR_S, answers
    return answers


@pytest.mark.parametrize("level", YELLOW_LEVELS)
async def test_vip_is_served_within_a_second_in_yellow(live: Live, level: float) -> None:
    await live.hold(level, "YELLOW")
    report(f"VIP at KV {level}", seconds=await vip_round(live))


# --- Normal: served at 0.72, queued (never rejected) above its ceiling -----------------------


async def test_normal_is_served_at_072(live: Live) -> None:
    await live.hold(0.72, "YELLOW")
    answers = await asyncio.gather(*send_all(live, "normal"))
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]
    report("Normal at KV 0.72", seconds=[round(a.seconds, 4) for a in answers])


@pytest.mark.parametrize("level", [0.78, 0.84])
async def test_normal_is_queued_not_rejected_above_its_ceiling(live: Live, level: float) -> None:
    await live.hold(level, "YELLOW")
    pending = send_all(live, "normal")
    await assert_held(live, Tier.NORMAL, pending)
    # The room above Normal's ceiling is VIP's: VIP passes the queued Normal work. A VIP chat
    # that ends between the leader's publish and its release call frees its reservation in
    # the capacity just published, which the usage pinned here does not show falling: a
    # Normal request may be served then (its KV would be free on a real node), never refused.
    vip = await vip_round(live)
    assert all(t.result().status == 200 for t in pending if t.done()), [
        t.result() for t in pending if t.done()]
    fell = await live.set_kv(0.72)
    answers = await asyncio.gather(*pending)
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]
    report(f"Normal held at KV {level}, served after the fall to 0.72", vip_meanwhile=vip,
           seconds_after_fall=[round(a.ended - fell, 4) for a in answers])


# --- Batch: held from the YELLOW line --------------------------------------------------------


async def test_batch_is_served_below_the_yellow_line(live: Live) -> None:
    await live.hold(0.66, "GREEN")
    answers = await asyncio.gather(*send_all(live, "batch"))
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]
    report("Batch at KV 0.66", seconds=[round(a.seconds, 4) for a in answers])


async def test_batch_is_held_from_the_yellow_line(live: Live) -> None:
    await live.hold(0.70, "YELLOW")
    pending = send_all(live, "batch")
    await assert_held(live, Tier.BATCH, pending)
    for level in YELLOW_LEVELS:
        await live.hold(level, "YELLOW")
        await live.ticks()
        await vip_round(live)  # Batch held in its queue holds no VIP back
        assert not any(t.done() for t in pending), [t.result() for t in pending if t.done()]
        assert await live.depth(Tier.BATCH) == len(pending)
    fell = await live.set_kv(0.60)
    answers = await asyncio.gather(*pending)
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]
    report("Batch held at KV 0.70-0.84, served after the fall to 0.60",
           seconds_after_fall=[round(a.ended - fell, 4) for a in answers])


# --- RED: Normal and Batch get the 429 protocol, VIP queues and is served as usage falls ----


def assert_capacity_429(answer: Answer) -> int:
    """The backpressure protocol of a capacity rejection in RED; returns the hint (ms)."""
    assert answer.status == 429, answer.body
    error = answer.body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert error["code"] == "capacity_exceeded" and error["type"] == "rate_limit_error", error
    hint_ms = int(answer.headers["retry-after-ms"])
    assert 1_000 <= hint_ms <= 60_000, hint_ms
    assert error["retry_after_ms"] == hint_ms
    assert answer.headers["Retry-After"] == str(math.ceil(hint_ms / 1000))
    assert answer.headers.get("x-should-retry", "true") == "true"
    assert answer.headers["X-RateLimit-Backpressure-Level"] == "RED"
    return hint_ms


@pytest.mark.parametrize("fall_to, zone_after", [(0.83, "RED"), (0.70, "YELLOW")])
async def test_red_rejects_normal_and_batch_and_queues_vip(live: Live, fall_to: float,
                                                           zone_after: str) -> None:
    await live.hold(RED_LEVEL, "RED")
    rejected = await asyncio.gather(*send_all(live, "normal"), *send_all(live, "batch"))
    hints = [assert_capacity_429(a) for a in rejected]
    assert sum([await live.depth(t) for t in Tier]) == 0
    pending = send_all(live, "vip")
    await assert_held(live, Tier.VIP, pending)
    fell = await live.set_kv(fall_to)
    answers = await asyncio.gather(*pending)
    after_fall = [round(a.ended - fell, 4) for a in answers]
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]
    state = await live.observed(fall_to, zone_after)
    report(f"RED {RED_LEVEL}: Normal/Batch 429, VIP queued, served after the fall to {fall_to}",
           rejected_seconds=[round(a.seconds, 4) for a in rejected], hints_ms=hints,
           vip_seconds_after_fall=after_fall, zone_after=state["zone"])
    assert max(after_fall) < SERVE_BAR_S, after_fall
    if zone_after == "RED":
        # Still RED: the room VIP was served in is VIP's alone, nothing else gets in.
        again = await asyncio.gather(*send_all(live, "normal"), *send_all(live, "batch"))
        for answer in again:
            assert_capacity_429(answer)


# --- the same lines when sequences fill the cache --------------------------------------------

NODE_TOKENS = 27_000 * 16
"""The instant backend's KV capacity (its cache_config_info: 27,000 blocks of 16 tokens)."""
CHAT_TOKENS = 1_000
"""Size of the sequences that hold the nodes' KV below: a chat's prompt and answer."""


@pytest.mark.parametrize("level", YELLOW_LEVELS)
async def test_the_lines_hold_when_running_sequences_fill_the_cache(live: Live,
                                                                    level: float) -> None:
    """A cache at `level` is held by running sequences (a node at 0.84 runs 363 chats of
    1,000 tokens), none of them sent through the gateways: their partial blocks are already in
    the measured usage, so VIP, Normal and the zone see the same lines as above."""
    running = round(level * NODE_TOKENS / CHAT_TOKENS)
    await live.hold(level, "YELLOW", running)
    projected = [(await live.state())[f"projected:{n}"] for n in NODES]
    assert projected == [f"{level:.4f}"] * len(NODES)  # what the sequences hold is measured
    vip = await vip_round(live)
    pending = send_all(live, "normal")
    if level < ZoneSettings().kv_target:
        answers = await asyncio.gather(*pending)
        normal = [round(a.seconds, 4) for a in answers]
    else:
        await assert_held(live, Tier.NORMAL, pending)
        fell = await live.set_kv(0.72, round(0.72 * NODE_TOKENS / CHAT_TOKENS))
        answers = await asyncio.gather(*pending)
        normal = [round(a.ended - fell, 4) for a in answers]
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]
    report(f"KV {level} held by {running} running sequences", projected=projected,
           vip_seconds=vip, normal_seconds_served_or_after_fall=normal)
