"""Performance suite, section 6 part 1: Redis bytes per queued task.

A private redis-server's pool whose leader published zero capacity (every node full), so every
admit queues; `count` admits through the real script and the gateway's multiplexed connection,
ids made as the gateway makes them; `INFO memory` before and after, and `MEMORY USAGE` of each
kind of key to say which one holds what per task. Run by `bench.perf.memory`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import orjson

CLIENT_DEADLINE_EVERY = 20
"""One admit in this many carries a client deadline shorter than its tier's (indexed)."""
TENANTS = ["acme", "globex", "initech", "umbrella", "nightly-etl", "evals", "search-rerank",
           "support-bot"]


@dataclass
class QueueMemory:
    tasks: int
    queued: int
    used_before: int
    used_after: int
    seconds: float
    bytes_per_task: float
    redis_version: str
    breakdown: list[dict[str, Any]]
    """One row per kind of key: keys, encoding, bytes (MEMORY USAGE), bytes per task."""
    record: dict[str, str]
    """One task record as stored, to show what its fields and values cost."""


async def measure_queue_memory(redis_url: str, count: int, *, pool: str = "memq",
                               seed: int = 1, window: int = 2000) -> QueueMemory:
    """Admit `count` tasks that all queue, return used_memory per task and what holds it."""
    import redis.asyncio as aioredis

    from admission.config import RedisSettings
    from admission.outcomes import AdmitOutcome
    from admission.scripts import load_scripts, register_scripts
    from admission.store import PoolPolicy, PoolStore, TenantQuota
    from admission.tiers import Tier, Zone
    from gateway.admit import new_task_id
    from gateway.redismux import RedisMux, mux_scripts

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    # The gateway's multiplexed connection: thousands of admits in flight on one socket, so
    # 100,000 take seconds, through the same script and arguments as production.
    mux = RedisMux(RedisSettings(url=redis_url, socket_timeout_ms=30_000))
    try:
        scripts = register_scripts(client)
        await load_scripts(client, scripts)  # the script cache is not part of the figure
        policy = PoolPolicy(tier_queue_caps=(10**9, 10**9, 10**9))
        store = PoolStore(client, mux_scripts(scripts, mux), pool, policy)
        # What a leader publishes when every node is full: nothing fits, everything queues.
        await store.publish_state(1, Zone.GREEN, {"gpu-0": 0, "gpu-1": 0})
        rng = random.Random(seed)
        quotas = [TenantQuota(name, 10**6, 10**9, 10**9) for name in TENANTS]
        gateways = [f"gw-gateway-7d9f{i}-{1000 + i}-{rng.getrandbits(24):06x}" for i in (1, 2)]
        timeouts = {Tier.VIP: 30_000, Tier.NORMAL: 60_000, Tier.BATCH: 600_000}
        before = int((await client.info("memory"))["used_memory"])
        t0 = time.perf_counter()
        outcomes: dict[str, int] = {}
        for start in range(0, count, window):
            calls = []
            for i in range(start, min(count, start + window)):
                quota = quotas[i % len(quotas)]
                tier = Tier(i % len(quotas) % 3)
                # As the gateway admits: the tier's own timeout, except one request in 20
                # shortened by its client (X-Request-Timeout), which takes a deadlines entry.
                calls.append(store.admit(
                    task_id=new_task_id(), tenant=quota,
                    tier=tier, prompt_tokens=rng.randint(20, 4000),
                    max_tokens=rng.choice((256, 512, 1024, 2048)), gateway=gateways[i % 2],
                    queue_timeout_ms=timeouts[tier] if i % CLIENT_DEADLINE_EVERY else 10_000,
                    tier_timeout_ms=timeouts[tier]))
            for result in await asyncio.gather(*calls):
                outcomes[result.outcome.value] = outcomes.get(result.outcome.value, 0) + 1
        seconds = time.perf_counter() - t0
        if outcomes.get(AdmitOutcome.QUEUED.value, 0) != count:
            raise RuntimeError(f"not every admit queued: {outcomes}")
        after = int((await client.info("memory"))["used_memory"])
        k = store.keys
        queued = sum([int(await client.zcard(q)) for q in k.queues])
        rows: list[dict[str, Any]] = []

        async def row(what: str, names: list[str], holds: str) -> None:
            total = sum([int(await client.memory_usage(n, samples=0) or 0) for n in names])
            encoding = str(await client.object("encoding", names[0]))
            rows.append({"key": what, "keys": len(names), "encoding": encoding, "bytes": total,
                         "per_task": total / count, "holds": holds})

        task_ids = [str(m) for q in k.queues for m in await client.zrange(q, 0, -1)]
        sample = random.Random(seed).sample(task_ids, min(1000, len(task_ids)))
        per_record = sum([int(await client.memory_usage(k.task_key(t), samples=0) or 0)
                          for t in sample]) / max(1, len(sample))
        rows.append({"key": "task:<id>", "keys": len(task_ids), "bytes": int(per_record * count),
                     "encoding": str(await client.object("encoding", k.task_key(sample[0]))),
                     "per_task": per_record, "holds": "the task record (HASH), its key name"
                     " and dict entry"})
        await row("queue:vip/normal/batch", list(k.queues), "id -> enqueue µs (FIFO)")
        await row("deadlines", [k.deadlines], "id -> deadline µs, client-shortened ones only")
        await row("gateway:<gw>", [k.gateway_tasks_key(g) for g in gateways],
                  "the gateway's live task ids")
        await row("tenant_queued, leases, buckets, state, clock, stats",
                  [k.tenant_queued, k.leases, k.state, k.clock, k.stats,
                   *[k.bucket_key(q.name) for q in quotas]], "per pool / tenant, not per task")
        attributed = sum(r["bytes"] for r in rows)
        rows.append({"key": "(rest: keyspace hash table, allocator rounding)", "keys": 0,
                     "encoding": "", "bytes": after - before - attributed,
                     "per_task": (after - before - attributed) / count, "holds": ""})
        raw = await client.hgetall(k.task_key(sample[0]))
        record = {str(f): str(v) for f, v in raw.items()}
        version = str((await client.info("server"))["redis_version"])
        return QueueMemory(count, queued, before, after, seconds, (after - before) / count,
                           version, rows, record)
    finally:
        await mux.close()
        await client.aclose()


def queue_markdown(qm: QueueMemory) -> list[str]:
    rows = ["| key | keys | encoding | bytes | bytes per task | holds |",
            "|---|---:|---|---:|---:|---|"]
    rows += [f"| `{r['key']}` | {r['keys']:,} | {r['encoding']} | {r['bytes']:,} | "
             f"{r['per_task']:.1f} | {r['holds']} |" for r in qm.breakdown]
    names = sum(len(f) for f in qm.record)
    values = sum(len(v) for v in qm.record.values())
    return [
        f"### Redis bytes per queued task ({qm.tasks:,} tasks)",
        "",
        f"`INFO memory` used_memory {qm.used_before:,} B before, {qm.used_after:,} B after "
        f"{qm.tasks:,} admits that all queued ({qm.queued:,} in the queues; {qm.seconds:.1f} s "
        f"through the gateway's multiplexed connection): **{qm.bytes_per_task:.0f} B per "
        f"task**. Who holds them (`MEMORY USAGE ... SAMPLES 0`; task records: mean of 1,000):",
        "",
        *rows,
        "",
        f"A task record as stored: {len(qm.record)} fields, {names} bytes of field names and "
        f"{values} of values: `{orjson.dumps(qm.record).decode()}`.",
        "",
    ]
