"""What the prefill tests share (tests/test_core_prefill_room.py, tests/test_core_prefill_vip.py
and tests/test_core_prefill_control.py): a pool store on a real Redis the tests started, the
scripts' clock stood still at `FROZEN_US` plus a test's milliseconds, a fast-path admit for one
tenant whose quota never binds, KV budgets that never bind (`BIG`), and the scripts' counts read
back."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier

NODES = ("node-a", "node-b", "node-c")
TENANT = TenantQuota("t", rate=0, burst=10**9, max_queued=10_000)
BIG = 10**9
"""KV budgets that never bind: these tests are about the prefill room alone."""
FROZEN_US = 10**15
"""Where tests stop the scripts' clock (µs)."""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _count(client: aioredis.Redis, key: str, field: str) -> int:
    value = await client.hget(key, field)
    assert value is not None, (key, field)
    return int(value)


async def _store(client: aioredis.Redis, pool: str = "pf") -> PoolStore:
    return PoolStore(client, register_scripts(client), pool, PoolPolicy())


async def _at_ms(client: aioredis.Redis, store: PoolStore, ms: int) -> None:
    """Stand the scripts' clock still at FROZEN_US + `ms`."""
    await client.hset(store.keys.clock, "frozen_us", FROZEN_US + ms * 1000)


async def _admit(store: PoolStore, task_id: str, tier: Tier, prompt: int) -> tuple[str, str | None]:
    got = await store.admit(task_id=task_id, tenant=TENANT, tier=tier, prompt_tokens=prompt,
                            max_tokens=10, gateway="gw", queue_timeout_ms=60_000)
    return got.outcome.value, got.node
