"""The admission core on a real 3-master Redis Cluster: one slot per pool, pools on different
shards, sharded pub/sub for wake-ups."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from admission.keys import PoolKeys, SchedulerKeys
from admission.leadership import leadership
from admission.outcomes import AdmitOutcome, ReleasedTask
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone

# These two names hash to slots owned by different primaries of a 3-way split.
POOLS = ("llama", "qwen")


@pytest.fixture
def client(cluster_client: RedisCluster) -> RedisCluster:
    return cluster_client


def _owner(client: RedisCluster, key: str) -> ClusterNode:
    node = client.get_node_from_key(key)
    assert node is not None
    return node


def test_every_key_of_a_pool_shares_one_slot() -> None:
    keys = PoolKeys("llama")
    names = [
        keys.state, keys.clock, keys.node_capacity, keys.node_reserved, *keys.queues,
        keys.deadlines, keys.leases, keys.tenant_queued, keys.stats, keys.task_key("t"),
        keys.bucket_key("acme"), keys.gateway_tasks_key("gw"), keys.wake_channel("gw"),
        keys.running, keys.node_guests, keys.node_guest_pace,
    ]
    assert len({key_slot(n.encode()) for n in names}) == 1
    sched = SchedulerKeys()
    assert key_slot(sched.leader.encode()) == key_slot(sched.epoch.encode())


async def test_two_pools_on_different_shards(client: RedisCluster) -> None:
    owners = {_owner(client, PoolKeys(p).state).port for p in POOLS}
    assert len(owners) == 2, "the test pools must land on different primaries"
    scripts = register_scripts(client)
    lead = await leadership(client, scripts, "sched-1", 5_000)
    assert lead.leading
    tenant = TenantQuota("acme", rate=0, burst=10_000, max_queued=10)
    for pool in POOLS:
        store = PoolStore(client, scripts, pool, PoolPolicy())
        await store.publish_state(lead.epoch, Zone.GREEN, {"gpu-0": 300})
        fast = await store.admit(task_id="a", tenant=tenant, tier=Tier.VIP, prompt_tokens=100,
                                 max_tokens=100, gateway="gw", queue_timeout_ms=10_000)
        queued = await store.admit(task_id="b", tenant=tenant, tier=Tier.NORMAL,
                                   prompt_tokens=100, max_tokens=100, gateway="gw",
                                   queue_timeout_ms=10_000)
        assert (fast.outcome, queued.outcome) == (AdmitOutcome.RELEASED, AdmitOutcome.QUEUED)
        assert await store.release(lead.epoch, (9, 9, 9)) == []  # 100 tokens of room left
        await client.script_flush()  # every primary forgets the scripts
        assert (await store.settle("a", 150)).outcome == "settled"
        [released] = await store.release(lead.epoch, (9, 9, 9))
        assert (released.task_id, released.node) == ("b", "gpu-0")
        assert (await store.settle("b", 200)).refunded == 0
        assert await client.hgetall(store.keys.node_reserved) == {}
        # Buckets are per pool: each pool's bucket saw only its own two requests.
        level = await client.hget(store.keys.bucket_key("acme"), "micro_tokens")
        assert level is not None and int(level) == (10_000 - 150 - 200) * 1_000_000


async def test_sharded_wakeup_reaches_the_subscriber(client: RedisCluster) -> None:
    store = PoolStore(client, register_scripts(client), "qwen", PoolPolicy())
    channel = store.keys.wake_channel("gw-1")
    owner = _owner(client, channel)
    subscriber = aioredis.Redis(host=owner.host, port=int(owner.port))
    pubsub = subscriber.pubsub()
    try:
        await pubsub.ssubscribe(channel)
        confirm = await pubsub.get_message(timeout=2)
        assert confirm is not None and confirm["type"] == "ssubscribe"
        await store.notify([ReleasedTask("t-9", "gw-1", "gpu-3", Tier.VIP)], sharded=True)
        message = await pubsub.get_message(timeout=2)
        assert message is not None
        assert (message["type"], message["data"]) == ("smessage", b"t-9 gpu-3")
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
        await subscriber.aclose()


async def _time_calls(node: ClusterNode) -> int:
    direct = aioredis.Redis(host=node.host, port=int(node.port))
    try:
        stats = await direct.info("commandstats")
    finally:
        await direct.aclose()
    return int(stats.get("cmdstat_time", {}).get("calls", 0))


async def test_the_pool_clock_is_read_on_the_server_that_runs_its_scripts(
        client: RedisCluster) -> None:
    # TIME names no key: sent as is, the cluster client picks any node, whose clock may be
    # skewed against the one the pool's scripts stamp its records with.
    nodes = client.get_primaries()
    for pool in POOLS:
        store = PoolStore(client, register_scripts(client), pool, PoolPolicy())
        before = {n.name: await _time_calls(n) for n in nodes}
        for _ in range(5):
            assert await store.redis_time_us() > 0
        grown = {n.name: await _time_calls(n) - before[n.name] for n in nodes}
        assert grown == {n.name: 5 if n.name == _owner(client, store.keys.state).name else 0
                         for n in nodes}
