"""A stand-in vLLM server for the scheduler's tests: real HTTP, vLLM-format ``/metrics`` whose
values the test sets (V1 or V0 names, with or without ``cache_config_info``), plus a histogram
and other lines the scheduler must skip, as a real page has them."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from admission.config import Config, parse_config
from admission.outcomes import AdmitOutcome, AdmitResult
from admission.scripts import register_scripts
from admission.store import PoolStore, TenantQuota
from admission.tiers import Tier
from scheduler.metrics import SchedulerMetrics
from scheduler.pool import PoolScheduler
from scheduler.scrape import Poller

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class FakeVllm:
    usage: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    num_gpu_blocks: int | None = 6_250
    """6,250 blocks x 16 = 100,000 tokens; None: no cache_config_info on the page."""
    block_size: int = 16
    v0: bool = False
    status: int = 200
    delay_s: float = 0.0
    scrapes: int = 0
    prompt_tokens: float | None = None
    """vllm:prompt_tokens_total; None: not on the page."""
    itl: tuple[float, float] | None = None
    """(sum, count) of vllm:inter_token_latency_seconds; None: not on the page."""
    generation_tokens: float | None = None
    """vllm:generation_tokens_total; None: not on the page."""
    body: bytes | None = None
    """Served as the page instead of `render()` (malformed or odd pages), as UTF-8 text."""

    def render(self) -> str:
        labels = f'model_name="{MODEL}"' if self.v0 else f'engine="0",model_name="{MODEL}"'
        usage_name = "vllm:gpu_cache_usage_perc" if self.v0 else "vllm:kv_cache_usage_perc"
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}",
            f"# HELP {usage_name} KV-cache usage. 1 means 100 percent usage.",
            f"# TYPE {usage_name} gauge",
            f"{usage_name}{{{labels}}} {self.usage}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        for b in _BUCKETS:
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{b}"}} 3.0')
        lines += [
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 3.0',
            f"vllm:time_to_first_token_seconds_count{{{labels}}} 3.0",
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} 0.12",
        ]
        if self.itl is not None:
            name = "vllm:inter_token_latency_seconds"
            lines += [f"# TYPE {name} histogram",
                      f'{name}_bucket{{{labels},le="+Inf"}} {self.itl[1]}',
                      f"{name}_count{{{labels}}} {self.itl[1]}",
                      f"{name}_sum{{{labels}}} {self.itl[0]}"]
        if self.prompt_tokens is not None:
            lines += ["# HELP vllm:prompt_tokens Number of prefill tokens processed.",
                      "# TYPE vllm:prompt_tokens counter",
                      f"vllm:prompt_tokens_total{{{labels}}} {self.prompt_tokens}"]
        if self.generation_tokens is not None:
            lines += ["# HELP vllm:generation_tokens Number of generation tokens processed.",
                      "# TYPE vllm:generation_tokens counter",
                      f"vllm:generation_tokens_total{{{labels}}} {self.generation_tokens}"]
        if self.num_gpu_blocks is not None:
            engine = "" if self.v0 else 'engine="0",'
            lines += [
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
                f'enable_prefix_caching="True",{engine}gpu_memory_utilization="0.9",'
                f'num_cpu_blocks="None",num_gpu_blocks="{self.num_gpu_blocks}",'
                f'sliding_window="None"}} 1.0',
            ]
        return "\n".join(lines) + "\n"


@asynccontextmanager
async def serve_fake(fake: FakeVllm, tls: ssl.SSLContext | None = None,
                     completions: Handler | None = None) -> AsyncIterator[str]:
    """Serve `fake` on a free loopback port (https with `tls`), and `completions` as its
    POST /v1/completions if given; yields the base URL."""

    async def handler(request: web.Request) -> web.Response:
        fake.scrapes += 1
        if fake.delay_s:
            await asyncio.sleep(fake.delay_s)
        if fake.status != 200:
            return web.Response(status=fake.status, text="engine dead")
        if fake.body is not None:
            return web.Response(body=fake.body, content_type="text/plain", charset="utf-8")
        return web.Response(text=fake.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    if completions is not None:
        app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


# --- building a scheduler against stubs ------------------------------------------------------


class FakeClock:
    """Monotonic time the test moves by hand (token buckets, cool-downs, learning decay)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@asynccontextmanager
async def one_node_poller(fake: FakeVllm, *, timeout_s: float, eject_after: int
                          ) -> AsyncIterator[tuple[Poller, list[str | None]]]:
    """A Poller over one fake node (`n1` of pool `p`, stale after 5 s), and the list its
    scrapes append their error to (None: a good scrape); closed on exit."""
    errors: list[str | None] = []
    async with serve_fake(fake) as url, aiohttp.ClientSession() as session:
        config = make_config("redis://x", [{"name": "n1", "url": url}])
        poller = Poller(config.pools["p"].backends, session, timeout_s=timeout_s,
                        stale_after_s=5.0, eject_after=eject_after,
                        on_scrape=lambda node, seconds, error: errors.append(error))
        try:
            yield poller, errors
        finally:
            await poller.close()


def make_config(
    redis_url: str,
    backends: Sequence[Mapping[str, Any]],
    *,
    pool: str = "p",
    zones: Mapping[str, Any] | None = None,
    scheduler: Mapping[str, Any] | None = None,
    dedicated: Mapping[str, Any] | None = None,
    pool_extra: Mapping[str, Any] | None = None,
    control: Mapping[str, Any] | None = None,
    gateway: Mapping[str, Any] | None = None,
) -> Config:
    """A one-pool configuration. The release control is off unless `control` is given: the
    tests using this stub are about KV budgets, zones and order, and their tasks' prompts are
    sized for KV, not for a compute window (tests/test_scheduler_control.py tests it)."""
    return parse_config(
        {
            "redis": {"url": redis_url},
            "gateway": dict(gateway or {}),
            "scheduler": dict(scheduler or {}),
            "pools": [{"name": pool, "backends": list(backends), "zones": dict(zones or {}),
                       "dedicated": dict(dedicated or {}),
                       "control": dict(control) if control is not None else {"enabled": False},
                       **(pool_extra or {})}],
        },
        env={},
    )


SCRAPE_WAIT_S = 2.0
"""How long a test's tick waits for its scrape. The service waits 25 ms and goes on with the last
reading; a test sets the fake's usage and expects the very next tick to see it, which a loaded
CI machine's loopback scrape can miss by that margin (it made a zone test read 0.68 for 0.66)."""


@asynccontextmanager
async def pool_scheduler(
    client: Any, config: Config, *, clock: Callable[[], float] | None = None
) -> AsyncIterator[PoolScheduler]:
    """One pool's scheduler, ticked by the test itself (no service loop)."""
    clock = clock or time.monotonic
    settings = config.scheduler
    pool = next(iter(config.pools.values()))
    async with aiohttp.ClientSession() as session:
        poller = Poller(
            pool.backends, session,
            timeout_s=SCRAPE_WAIT_S,
            stale_after_s=(settings.scrape_timeout_ms + settings.poll_interval_ms) / 1000,
            eject_after=settings.eject_after_failures,
            stuck_after_s=settings.stuck_after_ms / 1000, clock=clock,
        )
        store = PoolStore(client, register_scripts(client), pool.name,
                          config.pool_policy(pool.name))
        scheduler = PoolScheduler(store, pool, settings, poller, SchedulerMetrics(), me="test",
                                  clock=clock)
        scheduler.wait_s = scheduler.first_wait_s = SCRAPE_WAIT_S
        try:
            yield scheduler
        finally:
            await poller.close()


def always() -> bool:
    return True


TENANT = TenantQuota("t", rate=1_000_000, burst=1_000_000_000, max_queued=1_000_000)


async def admit(
    store: PoolStore, task_id: str, tier: Tier, cost: int, *, gateway: str = "gw"
) -> AdmitResult:
    return await store.admit(task_id=task_id, tenant=TENANT, tier=tier, prompt_tokens=cost // 2,
                             max_tokens=cost - cost // 2, gateway=gateway,
                             queue_timeout_ms=600_000)


async def queue_tasks(store: PoolStore, spec: Sequence[tuple[str, Tier, int]]) -> None:
    """Queue tasks for sure: with no node capacity published the fast path cannot fire."""
    await store.client.delete(*store.keys.tier_capacities)
    for task_id, tier, cost in spec:
        result = await admit(store, task_id, tier, cost)
        assert result.outcome is AdmitOutcome.QUEUED, result


async def reserved(store: PoolStore) -> dict[str, int]:
    raw = await store.client.hgetall(store.keys.node_reserved)
    return {k.decode(): int(v) for k, v in raw.items()}


async def state(store: PoolStore) -> dict[str, str]:
    raw = await store.client.hgetall(store.keys.state)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def next_message(pubsub: Any, timeout_s: float = 3.0) -> Any:
    """The next published message, skipping subscribe confirmations; None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
        if message is not None:
            return message
    return None


async def eventually(condition: Callable[[], bool], timeout_s: float = 3.0) -> float:
    """Poll `condition` (another loop's doing) until true; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - start
