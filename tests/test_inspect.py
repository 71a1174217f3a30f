"""The inspection CLI against a real Redis populated through the admission core's own calls.

The pool clock is frozen (`frozen_us`, as the core tests do) so that every wait, age and
bucket level the CLI reports can be checked to the microsecond against a hand computation.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from admission import inspect
from admission.config import TenantSettings
from admission.inspect_render import render_pool
from admission.keys import SchedulerKeys
from admission.leadership import leadership
from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.localredis import free_port, start_cluster

POOL = "insp"
T0 = 10**15
S = 1_000_000
ACME = TenantQuota("acme", rate=100, burst=10_000, max_queued=10)
ETL = TenantQuota("etl", rate=10, burst=50_000, max_queued=10)
IDLE = TenantSettings("idle", Tier.NORMAL, (), rate=5, burst=2_000, max_queued=1)
CAPS = {"gpu-0": 10_000, "gpu-1": 8_000}
EXTRA = {
    "usage:gpu-0": "0.5000", "projected:gpu-0": "0.6000", "nodes_out": "gpu-1:stale",
    "drain_0": "2.000", "drain_1": "1.000", "drain_2": "0.000", "pool_usage": "0.5000",
    "leader": "sched-a",
}


Client = aioredis.Redis | RedisCluster


class World:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.store = PoolStore(client, register_scripts(client), POOL, PoolPolicy())
        self.epoch = 0

    async def at(self, us: int) -> None:
        await self.client.hset(self.store.keys.clock, "frozen_us", us)

    async def admit(self, task: str, tenant: TenantQuota, tier: Tier, prompt: int, out: int,
                    gateway: str) -> AdmitOutcome:
        result = await self.store.admit(
            task_id=task, tenant=tenant, tier=tier, prompt_tokens=prompt, max_tokens=out,
            gateway=gateway, queue_timeout_ms=600_000)
        return result.outcome


EPOCH = 4_000_000_000_000_000
"""The leader's epoch in `populate` (exact in a Lua number: below 2^53)."""


async def populate(client: Client) -> World:
    """A pool in YELLOW at T0+5 s: one task in flight on gpu-0, two Batch tasks queued."""
    w = World(client)
    # A new leadership's epoch is at least Redis TIME in µs; a stored epoch above that (until
    # the year 2096) makes it EPOCH, so the figures stay exact.
    await client.set(SchedulerKeys().epoch, EPOCH - 1)
    lead = await leadership(client, w.store.scripts, "sched-a", 60_000)
    w.epoch = lead.epoch
    await w.at(T0)
    await w.store.publish_state(w.epoch, Zone.GREEN, CAPS, EXTRA)
    # Fast path to the node with most headroom; acme: 10000 - 1500 = 8500 at T0.
    assert await w.admit("a", ACME, Tier.VIP, 1000, 500, "gw-1") is AdmitOutcome.RELEASED
    await w.store.publish_state(w.epoch, Zone.YELLOW, CAPS, EXTRA)
    await w.at(T0 + 1 * S)
    # YELLOW queues Normal; acme: 8500 + 100 refilled - 500 = 8100 at T0+1s; gw-1 lease T0+11s.
    assert await w.admit("b", ACME, Tier.NORMAL, 200, 300, "gw-1") is AdmitOutcome.QUEUED
    await w.at(T0 + 2 * S)
    # etl: 50000 - 4000 - 1000 = 45000 at T0+2s; d is enqueued 1 µs after c (strict FIFO).
    assert await w.admit("c", ETL, Tier.BATCH, 3000, 1000, "gw-2") is AdmitOutcome.QUEUED
    assert await w.admit("d", ETL, Tier.BATCH, 500, 500, "gw-2") is AdmitOutcome.QUEUED
    await w.at(T0 + 3 * S)
    released = await w.store.release(w.epoch, (0, 1, 0))
    assert [(t.task_id, t.node) for t in released] == [("b", "gpu-0")]
    # a used 700 of 1500: acme gets 800 back at T0+3s: 8100 + 200 refilled + 800 = 9100.
    assert (await w.store.settle("a", 700)).refunded == 800
    await w.at(T0 + 5 * S)
    return w


def check_populated(snap: inspect.Snapshot) -> None:
    """The numbers `populate` leads to, computed by hand."""
    assert snap.scheduler.leader == "sched-a"
    assert snap.scheduler.epoch == EPOCH
    assert snap.scheduler.lease_left_ms is not None and 0 < snap.scheduler.lease_left_ms <= 60_000
    (p,) = snap.pools
    assert (p.now_us, p.clock, p.zone, p.epoch) == (T0 + 5 * S, "frozen", "YELLOW", EPOCH)
    assert (p.updated_us, p.state_age_us) == (T0, 5 * S)
    assert p.drain == [2.0, 1.0, 0.0]
    assert p.state == {"pool_usage": "0.5000", "leader": "sched-a"}
    assert [(n.node, n.capacity, n.reserved, n.headroom, n.usage, n.projected, n.out)
            for n in p.nodes] == [
        ("gpu-0", 10_000, 500, 9_500, 0.5, 0.6, None),
        ("gpu-1", 8_000, 0, 8_000, None, None, "stale"),
    ]
    assert [(q.tier, q.depth, q.oldest_task, q.oldest_wait_us) for q in p.queues] == [
        ("vip", 0, None, None), ("normal", 0, None, None), ("batch", 2, "c", 3 * S),
    ]
    assert (p.queued, p.in_flight_tasks, p.in_flight_tokens) == (2, 1, 500)
    assert [(g.gateway, g.lease_expiry_us, g.lease_left_us, g.live_tasks)
            for g in p.gateways] == [("gw-1", T0 + 11 * S, 6 * S, 1),
                                     ("gw-2", T0 + 12 * S, 7 * S, 2)]
    tenants = {t.tenant: t for t in p.tenants}
    assert list(tenants) == ["acme", "etl", "idle"]
    acme, etl, idle = tenants["acme"], tenants["etl"], tenants["idle"]
    # acme: 9100 at T0+3s + 2 s x 100/s; etl: 45000 at T0+2s + 3 s x 10/s.
    assert (acme.micro_tokens, acme.tokens, acme.percent, acme.queued) == (
        9_300 * S, 9_300.0, 93.0, 0)
    assert (etl.micro_tokens, etl.tokens, etl.percent, etl.queued, etl.rate, etl.burst) == (
        45_030 * S, 45_030.0, 90.06, 2, 10, 50_000)
    assert (idle.bucket, idle.tokens, idle.percent, idle.burst) == (False, 2_000.0, 100.0, 2_000)
    assert [t.configured for t in (acme, etl, idle)] == [False, False, True]
    assert p.stats == {"released_0": 1, "released_1": 1, "fast_path": 1, "settled": 1,
                       "settled_cost": 1500, "settled_usage": 700}
    # The JSON document carries the same numbers.
    doc = json.loads(snap.to_json())
    assert doc["pools"][0]["tenants"][0]["micro_tokens"] == 9_300 * S
    assert doc["pools"][0]["queues"][2]["oldest_wait_us"] == 3 * S


async def test_snapshot_numbers_are_exact(redis_client: aioredis.Redis) -> None:
    await populate(redis_client)
    check_populated(await inspect.snapshot(redis_client, [POOL], [IDLE]))


async def test_snapshot_on_a_redis_cluster() -> None:
    """Same numbers on a 3-master cluster: one slot per pool, SCAN across every master."""
    cluster = start_cluster(3)
    client = RedisCluster.from_url(cluster.url)
    try:
        await populate(client)
        check_populated(await inspect.snapshot(client, [POOL], [IDLE]))
        assert await inspect.discover_pools(client) == [POOL]
    finally:
        await client.aclose()
        cluster.stop()


async def test_bucket_refill_caps_at_burst_and_expired_lease_then_reap(
    redis_client: aioredis.Redis,
) -> None:
    w = await populate(redis_client)
    await w.at(T0 + 100 * S)
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    acme = next(t for t in p.tenants if t.tenant == "acme")
    assert (acme.micro_tokens, acme.percent) == (10_000 * S, 100.0)
    assert [(g.gateway, g.lease_left_us) for g in p.gateways] == [
        ("gw-1", -89 * S), ("gw-2", -88 * S)]
    assert "EXPIRED" in inspect.render(await inspect.snapshot(redis_client, [POOL]))
    # The reaper returns what the dead gateways held; the CLI shows the pool empty again.
    await w.store.reap()
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    assert (p.queued, p.in_flight_tasks, p.in_flight_tokens, p.gateways) == (0, 0, 0, [])
    assert [n.headroom for n in p.nodes] == [10_000, 8_000]
    # An idle gateway holds no lease: the table says so, lest a running one look dead.
    assert ("  no gateway holds a lease (a gateway holds one only while it has requests)"
            in inspect.render(await inspect.snapshot(redis_client, [POOL])).splitlines())


async def test_guests_of_a_dedicated_node_are_shown(redis_client: aioredis.Redis) -> None:
    w = World(redis_client)
    await w.at(T0)
    await w.store.publish_state(1, Zone.GREEN, CAPS, {
        "dedicated_nodes": "gpu-1", "dedicated_tiers": 1, "dedicated_guest_prompt": 500,
        "dedicated_guest_cap": 4, "prefill_room:gpu-0": 300, "prefill_window:gpu-0": 1000,
        "prefill_backlog:gpu-0": 700, "prefill_rate:gpu-0": "8000",
        "prefill_gain:gpu-0": "0.900", "running_limit:gpu-0": "24", "running_limit:gpu-1": "",
        "decode_step_ms:gpu-0": "21.50", "calm_step_ms:gpu-0": "15.00"})
    assert await w.admit("g", ACME, Tier.NORMAL, 100, 100, "gw-1") is AdmitOutcome.RELEASED
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    assert [(n.node, n.guests) for n in p.nodes] == [("gpu-0", 0), ("gpu-1", 1)]
    assert [(n.dedicated, n.guests_closed) for n in p.nodes] == [(False, False), (True, False)]
    text = inspect.render(await inspect.snapshot(redis_client, [POOL]))
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("gpu-1"))
    assert row[6:9] == ["-", "yes", "1"]
    # The release control's room, window, backlog, rate and gain, running limit and step
    # times, where the leader published them.
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("gpu-0"))
    assert " ".join(row[6:18]) == ("300/1000 (queued 700, 8000/s, gain 0.900, running limit 24, "
                                   "step 21.50/15.00 ms)")
    # A lane: its Normal and Batch tasks are its guests, up to the cap the leader publishes.
    await w.store.publish_state(1, Zone.GREEN, CAPS, {"lane_cap:gpu-0": 3})
    text = inspect.render(await inspect.snapshot(redis_client, [POOL]))
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("gpu-0"))
    assert row[7:10] == ["lane,", "cap", "3"]
    # The leader closes the dedicated node to guests while it runs above its bound.
    await w.store.publish_state(1, Zone.GREEN, CAPS, {
        "dedicated_nodes": "gpu-1", "dedicated_tiers": 1, "dedicated_guests_closed": "gpu-1"})
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    assert [(n.dedicated, n.guests_closed) for n in p.nodes] == [(False, False), (True, True)]
    assert "closed to guests" in inspect.render(await inspect.snapshot(redis_client, [POOL]))


async def test_each_tiers_budget_and_headroom_are_shown(redis_client: aioredis.Redis) -> None:
    """Normal and Batch are placed against budgets of their own (`node_capacity:normal`,
    `:batch`), below VIP's: a Batch queue held by `kv` beside a large VIP headroom must not
    read as a node with room to spare."""
    w = World(redis_client)
    await w.at(T0)
    await w.store.publish_state(1, Zone.GREEN, {"gpu-0": (10_000, 6_000, 2_000)})
    # 1900 of Batch's 2000 reserved; the next Batch task (1000) fits VIP's and Normal's room.
    assert await w.admit("big", ETL, Tier.BATCH, 1_500, 400, "gw-1") is AdmitOutcome.RELEASED
    assert await w.admit("next", ETL, Tier.BATCH, 500, 500, "gw-1") is AdmitOutcome.QUEUED
    snap = await inspect.snapshot(redis_client, [POOL])
    (node,) = snap.pools[0].nodes
    assert (node.capacity, node.reserved, node.headroom) == (10_000, 1_900, 8_100)
    assert node.tier_capacity == [10_000, 6_000, 2_000]
    assert node.tier_headroom == [8_100, 4_100, 100]
    text = inspect.render(snap)
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("gpu-0"))
    assert row[1:4] == ["10000/6000/2000", "1900", "8100/4100/100"]
    assert any(line.split()[:4] == ["node", "capacity", "v/n/b", "reserved"]
               for line in text.splitlines())
    doc = json.loads(snap.to_json())["pools"][0]["nodes"][0]
    assert (doc["tier_capacity"], doc["tier_headroom"]) == ([10_000, 6_000, 2_000],
                                                            [8_100, 4_100, 100])


async def test_fields_that_are_no_finite_number_read_as_unknown(
    redis_client: aioredis.Redis,
) -> None:
    """Fields written by hand (redis-cli) or by a broken writer that are no finite number must
    neither end the read (int() of 1e999 raised OverflowError) nor make the JSON document of
    --json and the admin API invalid (float() of "nan" and "inf" printed NaN and Infinity,
    which jq and JSON.parse refuse)."""
    w = await populate(redis_client)
    keys = w.store.keys
    await redis_client.hset(keys.state, mapping={
        "drain_1": "nan", "usage:gpu-0": "inf", "projected:gpu-0": "-inf"})
    await redis_client.hset(keys.node_capacity, "gpu-1", "1e999")
    await redis_client.hset(keys.stats, "settled", "1E999")
    await redis_client.hset(keys.tenant_queued, "etl", "two")
    snap = await inspect.snapshot(redis_client, [POOL])
    (p,) = snap.pools
    assert p.drain == [2.0, None, 0.0]
    gpu0, gpu1 = p.nodes
    assert (gpu0.usage, gpu0.projected) == (None, None)
    assert (gpu1.capacity, gpu1.headroom) == (0, 0)
    assert "settled" not in p.stats and p.stats["settled_cost"] == 1500
    assert next(t for t in p.tenants if t.tenant == "etl").queued == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    json.loads(snap.to_json(), parse_constant=refuse)
    assert "pool insp  zone YELLOW" in inspect.render(snap)

    # Scores too: int() of +inf ended the read (kvgate-inspect's traceback, the admin API's 500).
    await redis_client.zadd(keys.leases, {"gw-hand": float("inf")})
    await redis_client.zadd(keys.queue(Tier.VIP), {"t-hand": float("-inf")})
    snap = await inspect.snapshot(redis_client, [POOL])
    (p,) = snap.pools
    assert next(g for g in p.gateways if g.gateway == "gw-hand").lease_left_us is None
    assert (p.queues[0].oldest_task, p.queues[0].oldest_wait_us) == ("t-hand", None)
    json.loads(snap.to_json(), parse_constant=refuse)
    assert "gw-hand" in inspect.render(snap)


async def test_a_key_of_another_type_is_named_and_the_other_pools_still_shown(
    redis_client: aioredis.Redis,
) -> None:
    """A pool key overwritten by hand with another type (`SET kvg:{p}:stats oops`) made the
    pool's MULTI fail with WRONGTYPE, and kvgate-inspect showed no pool at all and said Redis
    could not be read. The key is read as empty and named; every other pool is shown."""
    await populate(redis_client)
    other = PoolStore(redis_client, register_scripts(redis_client), "other", PoolPolicy())
    await redis_client.hset(other.keys.state, "zone", "GREEN")
    await redis_client.set(other.keys.stats, "oops")
    await redis_client.set(other.keys.queue(Tier.BATCH), "oops")
    await redis_client.set(other.keys.vtime, "oops")
    await redis_client.set(other.keys.flows(Tier.VIP), "oops")
    await redis_client.zadd(other.keys.flows(Tier.NORMAL), {"t": float("inf")})
    await redis_client.zadd(other.keys.leases, {"gw-x": 10**18})
    await redis_client.set(other.keys.gateway_tasks_key("gw-x"), "oops")
    snap = await inspect.snapshot(redis_client, [POOL, "other"])
    mine, broken = snap.pools
    assert mine.wrong_type_keys == [] and mine.nodes == (
        await inspect.snapshot(redis_client, [POOL])).pools[0].nodes
    assert broken.wrong_type_keys == [
        other.keys.queue(Tier.BATCH), other.keys.stats, other.keys.gateway_tasks_key("gw-x"),
        other.keys.flows(Tier.VIP), other.keys.vtime]
    assert [(g.gateway, g.live_tasks) for g in broken.gateways] == [("gw-x", 0)]
    assert broken.zone == "GREEN" and broken.stats == {} and broken.queues[2].depth == 0
    text = inspect.render(snap)
    assert "read as empty: " + other.keys.queue(Tier.BATCH) in text
    assert [q.depth for q in mine.queues] == [q.depth for q in (
        await inspect.snapshot(redis_client, [POOL])).pools[0].queues]


async def test_the_light_tenants_yellow_credit_is_shown(redis_client: aioredis.Redis) -> None:
    w = World(redis_client)
    await w.at(T0)
    await w.store.publish_state(1, Zone.YELLOW, CAPS)
    text = inspect.render(await inspect.snapshot(redis_client, [POOL]))
    assert "YELLOW credit" not in text  # none set: a pool without fair release's headroom
    await redis_client.hset(w.store.keys.stats, mapping={"normal_credit": 7, "credit_used": 3})
    text = inspect.render(await inspect.snapshot(redis_client, [POOL]))
    assert ("  light tenants' YELLOW credit: 7 Normal tasks (3 taken on the fast path so far)"
            in text.splitlines())


async def test_buckets_found_by_scan_across_pages(redis_client: aioredis.Redis) -> None:
    """More buckets than one SCAN step and one pipeline chunk return; other pools' do not."""
    n = inspect.SCAN_COUNT * 2 + 7
    async with redis_client.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.hset(f"kvg:{{{POOL}}}:bucket:t{i:04d}", mapping={
                "micro_tokens": i * S, "updated_us": T0, "rate": 0, "burst": 10_000})
        pipe.hset("kvg:{other}:bucket:t0000", mapping={
            "micro_tokens": 1, "updated_us": T0, "rate": 0, "burst": 1})
        await pipe.execute()
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    assert len(p.tenants) == n
    assert [t.micro_tokens for t in p.tenants] == [i * S for i in range(n)]
    assert p.zone is None and p.nodes == [] and p.state_age_us is None
    assert await inspect.discover_pools(redis_client) == [POOL, "other"]


async def test_real_redis_time_when_not_frozen(redis_client: aioredis.Redis) -> None:
    w = World(redis_client)
    lead = await leadership(redis_client, w.store.scripts, "s", 5_000)
    written = await w.store.publish_state(lead.epoch, Zone.GREEN, CAPS)
    (p,) = (await inspect.snapshot(redis_client, [POOL])).pools
    assert p.clock == "redis"
    assert p.updated_us == written
    assert p.state_age_us is not None and 0 <= p.state_age_us < 5 * S
    assert "STALE" not in render_pool(p)[0]  # a leader's fresh state is not flagged


async def test_table_renders_every_section(redis_client: aioredis.Redis) -> None:
    await populate(redis_client)
    text = inspect.render(await inspect.snapshot(redis_client, [POOL], [IDLE]))
    lines = text.splitlines()
    assert lines[0].startswith(f"scheduler leader sched-a  epoch {EPOCH}  lease left ")
    # Five seconds without a publish: no leader is keeping the state, and the reader is told.
    assert any(line.startswith(f"pool insp  zone YELLOW  epoch {EPOCH}  state age 5.0 s")
               and line.endswith("STALE: no leader has published for over 2 s "
                                 "(is a scheduler leading?)") for line in lines)

    def row(first: str) -> list[str]:
        """The line starting with `first` in the node, queue, gateway and bucket tables (a
        tenant has a second line in the fairness table, after them)."""
        found = [line.split() for line in lines if line.split()[:1] == [first]]
        assert 1 <= len(found) <= 2, found
        return found[0]

    assert row("gpu-0") == ["gpu-0", "10000/10000/10000", "500", "9500/9500/9500", "0.5000",
                            "0.6000", "-", "-", "0"]
    assert row("gpu-1") == ["gpu-1", "8000/8000/8000", "0", "8000/8000/8000", "-", "-", "-",
                            "-", "0", "stale"]
    assert row("batch") == ["batch", "2", "3.0", "s", "c", "-"]
    assert row("gw-2") == ["gw-2", "2", "7.0", "s"]
    # Read with IDLE alone as the configuration: acme's and etl's keys are a removed tenant's.
    assert row("acme") == ["acme", "*", "9300.0", "10000", "93.0", "100", "0", "-", "-"]
    assert row("idle") == ["idle", "2000.0", "2000", "100.0", "5", "0", "-", "-"]
    assert ("  * not in the configuration read: its keys stay until kvgate-prune deletes them"
            in lines)
    assert "  in flight: 1 tasks, 500 tokens reserved; queued: 2" in lines


async def _run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admission.inspect", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_subprocess_json_watch_and_config(
    redis_client: aioredis.Redis, redis_url: str, tmp_path: Path,
) -> None:
    await populate(redis_client)
    code, out, err = await _run_cli("--redis-url", redis_url, "--pool", POOL, "--json",
                                    "--watch", "0.05", "--count", "2")
    assert code == 0, err
    docs: list[dict[str, Any]] = [json.loads(line) for line in out.splitlines()]
    assert len(docs) == 2
    assert docs[1]["pools"][0]["in_flight_tokens"] == 500
    # The CLI is a product process: it reads Redis TIME, never a test's frozen clock, and by
    # that clock etl's bucket, frozen in the past at 10 tokens/s, refilled to its burst long ago.
    assert docs[1]["pools"][0]["tenants"][1]["micro_tokens"] == 50_000 * S

    config = tmp_path / "kvgate.toml"
    config.write_text(
        f'[redis]\nurl = "{redis_url}"\n\n[[pools]]\nname = "{POOL}"\n'
        'backends = ["http://127.0.0.1:1"]\n\n'
        '[[tenants]]\nname = "idle"\ntier = "normal"\nrate = 5\nburst = 2000\n')
    code, out, err = await _run_cli("--config", str(config))
    assert code == 0, err
    assert "pool insp  zone YELLOW" in out
    assert any(line.split()[:3] == ["idle", "2000.0", "2000"] for line in out.splitlines())


def test_cli_errors_exit_nonzero_with_a_message(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    assert inspect.main(["--redis-url", f"redis://:hunter2@127.0.0.1:{port}/0",
                         "--pool", POOL]) == 1
    err = capsys.readouterr().err
    assert "kvgate-inspect: cannot read Redis at" in err and "hunter2" not in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[[pools]]\nname = 'x'\nbogus = 1\n")
    assert inspect.main(["--config", str(bad)]) == 2
    assert "pools[0].bogus: unknown key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        inspect.main(["--pool", "bad name"])


@pytest.mark.parametrize("seconds", ["nan", "NaN", "inf", "-inf", "1e400", "0", "-1", "x"])
def test_watch_needs_a_finite_positive_interval(
        seconds: str, capsys: pytest.CaptureFixture[str]) -> None:
    # float() takes nan and inf, and asyncio.sleep of either never returns: one frame, then a
    # hang. Refused by argparse before any Redis is read.
    with pytest.raises(SystemExit) as exited:
        inspect.main(["--redis-url", f"redis://127.0.0.1:{free_port()}/0", f"--watch={seconds}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert (f"kvgate-inspect: error: argument --watch: must be a positive number of seconds, "
            f"got {seconds!r}") in err
    assert inspect.parse_args(["--watch", "0.05"]).watch == 0.05
    assert inspect.parse_args(["--watch"]).watch == 2.0
