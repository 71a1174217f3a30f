"""A placement reads its pool's nodes in a fixed number of Redis calls, however many nodes the
pool has: the admit script runs inside Redis, which is single-threaded, so a call per node
made every gateway's every request (and every task of a release) cost time in proportion to
the pool, and a long prompt's check for quiet nodes in proportion to its square. Counted with
the server's own statistics (INFO commandstats counts the calls a script makes)."""

from __future__ import annotations

import redis.asyncio as aioredis

from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone

TENANT = TenantQuota("t", rate=0, burst=10**9, max_queued=10_000)
READS = ("hget", "hmget", "hgetall")


async def _reads_of_one_admit(client: aioredis.Redis, nodes: int, tier: Tier,
                              prompt: int) -> int:
    await client.flushdb()
    store = PoolStore(client, register_scripts(client), f"p{nodes}", PoolPolicy())
    names = [f"node-{i:03d}" for i in range(nodes)]
    await client.hset(store.keys.clock, "frozen_us", 10**15)  # the scripts' clock stands still
    # Every node with room for the task, a prefill room published, one quiet node kept (so a
    # long prompt looks for quiet others): the placement weighs every node.
    await store.publish_state(1, Zone.GREEN, dict.fromkeys(names, 10**9),
                              {"prefill_quiet": 1, "vip_ttft_objective_ms": 250},
                              prefill={n: (3_000, 4_000) for n in names})
    await client.config_resetstat()
    got = await store.admit(task_id="t1", tenant=TENANT, tier=tier, prompt_tokens=prompt,
                            max_tokens=10, gateway="gw", queue_timeout_ms=60_000)
    assert got.outcome.value == "released", (nodes, tier, prompt, got)
    stats = await client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in READS)


async def test_an_admit_reads_a_pool_of_any_size_in_the_same_number_of_calls(
        redis_client: aioredis.Redis) -> None:
    for tier, prompt in ((Tier.VIP, 300), (Tier.NORMAL, 300), (Tier.NORMAL, 9_000)):
        small = await _reads_of_one_admit(redis_client, 4, tier, prompt)
        large = await _reads_of_one_admit(redis_client, 64, tier, prompt)
        assert large == small, (tier, prompt, small, large)
