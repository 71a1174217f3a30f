"""What the tests of a stuck engine share (test_scheduler_stuck, test_scheduler_frozen): a
pool scheduler over fake vLLM pages, ticked by the test on a clock it moves with the pool's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from aiohttp.typedefs import Handler

from tests.scheduler_stub import FakeClock, FakeVllm, make_config, pool_scheduler, serve_fake

STUCK_AFTER_MS = 5_000
SHORT_LEASE = {"lease_ttl_ms": 2_000, "renew_interval_ms": 500}
"""A dead gateway's tasks are reaped within 3 s (lease and reap interval): below 5 s."""


def busy(**kw: Any) -> FakeVllm:
    """A node with two requests running and its token counters on the page."""
    return FakeVllm(**{"usage": 0.3, "running": 2, "prompt_tokens": 1_000.0,
                       "generation_tokens": 400.0, "itl": (4.0, 398.0), **kw})


class PoolClock:
    """The test's clock and the pool's (Redis) clock, frozen and moved together."""

    def __init__(self, client: Any, store: Any) -> None:
        self.local = FakeClock()
        self.client, self.store = client, store
        self.us = 0

    async def start(self) -> None:
        seconds, micros = await self.client.time()
        self.us = seconds * 1_000_000 + micros
        await self.client.hset(self.store.keys.clock, "frozen_us", self.us)

    async def advance(self, seconds: float) -> None:
        self.local.advance(seconds)
        self.us += int(seconds * 1_000_000)
        await self.client.hset(self.store.keys.clock, "frozen_us", self.us)

    async def hold_task(self, node: str, task: str = "") -> None:
        """A task released to `node` now and not ended: the running index's member as the
        scripts write it ("node prompt max task"), scored by its release time. The same
        `task` again moves its release."""
        await self.client.zadd(self.store.keys.running,
                               {f"{node} 100 100 {task or 'held-' + node}": self.us})


@asynccontextmanager
async def stuck_pool(redis_client: Any, redis_url: str, fakes: dict[str, FakeVllm],
                     scheduler: dict[str, Any] | None = None,
                     completions: dict[str, Handler] | None = None,
                     pool_extra: dict[str, Any] | None = None
                     ) -> AsyncIterator[tuple[Any, PoolClock]]:
    """A pool scheduler over `fakes` (stuck_after_ms 5 s unless `scheduler` says otherwise),
    ticked by the test on a clock it moves with the pool's; `completions`: the
    POST /v1/completions handlers of some fakes."""
    async with AsyncExitStack() as stack:
        urls = {name: await stack.enter_async_context(
                    serve_fake(fake, completions=(completions or {}).get(name)))
                for name, fake in fakes.items()}
        config = make_config(redis_url, [{"name": n, "url": u} for n, u in urls.items()],
                             scheduler={"stuck_after_ms": STUCK_AFTER_MS, **(scheduler or {})},
                             gateway=SHORT_LEASE, pool_extra=pool_extra)
        clock = PoolClock(redis_client, None)
        ps = await stack.enter_async_context(
            pool_scheduler(redis_client, config, clock=clock.local))
        clock.store = ps.store
        await clock.start()
        yield ps, clock
