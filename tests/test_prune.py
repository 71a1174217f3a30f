"""`kvgate-prune` against a real Redis populated through the admission core's own calls.

The pool clock is frozen (`frozen_us`), so "idle for two days" is a clock setting, not a wait;
the command in this process honours it as the scripts do (`allow_frozen_clock`, conftest).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from admission import inspect, prune
from admission.config import ConfigError
from admission.inspect_fair import allowance_used, month_index
from admission.leadership import leadership
from admission.outcomes import AdmitOutcome
from admission.retire import is_spent
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, QuotaLevel, TenantQuota
from admission.tiers import Tier, Zone

POOL = "prn"
T0 = 10**15
S = 1_000_000
DAY = 86_400 * S
ENG = QuotaLevel("eng", rate=100, burst=100_000)
OLD = QuotaLevel("oldteam", rate=100, burst=100_000)
BUSY = QuotaLevel("busyteam", rate=100, burst=100_000)
MONTHLY = QuotaLevel("monthlyteam", rate=100, burst=100_000, monthly_tokens=1_000_000)


def quota(name: str, *levels: QuotaLevel) -> TenantQuota:
    return TenantQuota(name, rate=100, burst=10_000, max_queued=10, levels=levels)


ACME = quota("acme", ENG)
GONE = quota("gone", OLD)
INFLIGHT = quota("inflight", BUSY)
QUEUED = quota("queued")
RECENT = quota("recent")
PREPAID = TenantQuota("prepaid", rate=0, burst=10_000, max_queued=10, levels=(MONTHLY,))
"""A bucket that never refills (a prepaid balance), in a team with a monthly allowance."""


class World:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.store = PoolStore(client, register_scripts(client), POOL, PoolPolicy())
        self.keys = self.store.keys
        self.epoch = 0

    async def at(self, us: int) -> None:
        await self.client.hset(self.keys.clock, "frozen_us", us)

    async def admit(self, task: str, tenant: TenantQuota, tier: Tier = Tier.VIP) -> AdmitOutcome:
        result = await self.store.admit(
            task_id=task, tenant=tenant, tier=tier, prompt_tokens=100, max_tokens=100,
            gateway="gw-1", queue_timeout_ms=10 * DAY // 1000)
        return result.outcome

    async def state(self, zone: Zone) -> None:
        await self.store.publish_state(self.epoch, zone, {"gpu-0": 1_000_000}, {})


async def populate(client: Any) -> World:
    """At T0 + 2 days: acme (configured, team eng) and gone (removed, team oldteam) ended two
    days ago; inflight (removed, team busyteam) has a task running; queued (removed) has one
    queued; recent (removed) ended an hour ago; prepaid (removed, team monthlyteam) spent part
    of its balance and of its team's month two days ago (T0 + 2 days is in the same month)."""
    w = World(client)
    w.epoch = (await leadership(client, w.store.scripts, "sched-a", 60_000)).epoch
    await w.at(T0)
    await w.state(Zone.YELLOW)
    # gone's Normal task waits in the queue and the leader releases it: its fairness hash.
    assert await w.admit("g", GONE, Tier.NORMAL) is AdmitOutcome.QUEUED
    assert [t.task_id for t in await w.store.release(w.epoch, (0, 1, 0))] == ["g"]
    await w.state(Zone.GREEN)
    for task, tenant in (("a", ACME), ("i", INFLIGHT), ("p", PREPAID)):
        assert await w.admit(task, tenant) is AdmitOutcome.RELEASED
    for task in ("a", "g", "p"):
        await w.store.settle(task, 150)
    # A light view's entry, as the fast path leaves one in a busy tier.
    await client.zadd(w.keys.light(Tier.NORMAL), {"gone": T0})
    await w.at(T0 + 2 * DAY - 3600 * S)
    assert await w.admit("r", RECENT) is AdmitOutcome.RELEASED
    await w.store.settle("r", 150)
    await w.state(Zone.YELLOW)
    assert await w.admit("q", QUEUED, Tier.BATCH) is AdmitOutcome.QUEUED
    await w.at(T0 + 2 * DAY)
    return w


def write_config(path: Path, redis_url: str, tenants: bool = True,
                 cluster: bool = False) -> str:
    text = (f'[redis]\nurl = "{redis_url}"\ncluster = {str(cluster).lower()}\n\n'
            f'[[pools]]\nname = "{POOL}"\n'
            'backends = ["http://127.0.0.1:1"]\n\n'
            '[[teams]]\nname = "eng"\nrate = 100\nburst = 100000\n\n')
    if tenants:
        text += ('[[tenants]]\nname = "acme"\ntier = "vip"\nrate = 100\nburst = 10000\n'
                 'team = "eng"\n')
    path.write_text(text)
    return str(path)


async def run(config: str, *flags: str) -> tuple[int, dict[tuple[str, str], tuple[str, str]]]:
    """prune's run() in this process (so it sees the frozen clock), its JSON read back as
    (kind, name) -> (verdict, reason)."""
    args = prune.parse_args(["--config", config, "--json", *flags])
    out: list[str] = []
    code = await prune.run(args, {}, out.append)
    doc = json.loads("".join(out))
    return code, {(v["kind"], v["name"]): (v["verdict"], v["reason"]) for v in doc["verdicts"]}


async def key_names(client: Any) -> set[str]:
    return {k.decode() async for k in client.scan_iter(match="kvg:*")}


async def test_dry_run_judges_each_removed_name_and_deletes_nothing(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    w = await populate(redis_client)
    before = await key_names(redis_client)
    code, verdicts = await run(write_config(tmp_path / "c.toml", redis_url))
    assert code == 0
    assert verdicts == {
        ("tenant", "gone"): ("forgettable", ""),
        ("tenant", "inflight"): ("kept", "in_flight"),
        ("tenant", "queued"): ("kept", "queued"),
        ("tenant", "recent"): ("kept", "recent"),
        ("tenant", "prepaid"): ("kept", "spent"),
        ("team", "oldteam"): ("forgettable", ""),
        ("team", "busyteam"): ("kept", "held"),
        ("team", "monthlyteam"): ("kept", "spent"),
    }
    assert await key_names(redis_client) == before
    assert {w.keys.bucket_key("gone"), w.keys.tenant_key("gone"),
            w.keys.quota_key("oldteam")} <= before


async def test_apply_deletes_only_what_nothing_alive_needs(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    w = await populate(redis_client)
    config = write_config(tmp_path / "c.toml", redis_url)
    code, verdicts = await run(config, "--apply")
    assert code == 0
    assert verdicts[("tenant", "gone")] == ("forgotten", "")
    assert verdicts[("team", "oldteam")] == ("forgotten", "")
    names = await key_names(redis_client)
    k = w.keys
    assert not {k.bucket_key("gone"), k.tenant_key("gone"), k.quota_key("oldteam")} & names
    assert await redis_client.zscore(k.light(Tier.NORMAL), "gone") is None
    # The configured tenant and team, and every removed name with something alive, stay.
    assert {k.bucket_key("acme"), k.quota_key("eng"), k.bucket_key("inflight"),
            k.quota_key("busyteam"), k.bucket_key("queued"), k.bucket_key("recent")} <= names

    # Their ends write the buckets (refunds): kept as recent at first, gone once idle.
    await w.store.settle("i", 150)
    await w.store.cancel("q")
    code, verdicts = await run(config, "--apply", "--min-idle", "1")
    assert verdicts[("tenant", "inflight")] == ("kept", "recent")
    assert verdicts[("tenant", "recent")] == ("forgotten", "")  # ended an hour ago
    await w.at(T0 + 2 * DAY + 2 * S)
    code, verdicts = await run(config, "--apply", "--min-idle", "1")
    assert verdicts == {
        ("tenant", "inflight"): ("forgotten", ""),
        ("tenant", "queued"): ("forgotten", ""),
        ("team", "busyteam"): ("forgotten", ""),
        ("tenant", "prepaid"): ("kept", "spent"),
        ("team", "monthlyteam"): ("kept", "spent"),
    }
    left = {n.removeprefix(k.prefix) for n in await key_names(redis_client)
            if n.startswith((k.prefix + "bucket:", k.prefix + "tenant:", k.prefix + "quota:"))}
    assert left == {"bucket:acme", "quota:eng", "bucket:prepaid", "quota:monthlyteam"}
    # A spent balance and a month's allowance in use stay, unless --spent says otherwise.
    code, verdicts = await run(config, "--apply", "--min-idle", "0")
    assert verdicts == {("tenant", "prepaid"): ("kept", "spent"),
                        ("team", "monthlyteam"): ("kept", "spent")}
    code, verdicts = await run(config, "--apply", "--min-idle", "0", "--spent")
    assert verdicts == {("tenant", "prepaid"): ("forgotten", ""),
                        ("team", "monthlyteam"): ("forgotten", "")}
    # Nothing left to judge: a second run lists nothing.
    assert await run(config, "--apply") == (0, {})


async def test_a_name_configured_again_starts_with_a_full_bucket(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    w = await populate(redis_client)
    await run(write_config(tmp_path / "c.toml", redis_url), "--apply")
    await w.state(Zone.GREEN)
    assert await w.admit("g2", GONE) is AdmitOutcome.RELEASED
    bucket = await redis_client.hget(w.keys.bucket_key("gone"), "micro_tokens")
    assert bucket is not None and int(bucket) == (10_000 - 200) * S


async def test_a_task_ending_after_its_team_was_forgotten_leaves_no_key(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    """A task admitted before levels counted `held` (here its fields removed by hand) keeps its
    tenant (in flight) but not its team; ending against the team's absent hash, its refund
    writes nothing back (bucket_credit() in lua/_lib.lua needs the bucket's rate)."""
    w = await populate(redis_client)
    await redis_client.hdel(w.keys.bucket_key("inflight"), "held")
    await redis_client.hdel(w.keys.quota_key("busyteam"), "held")
    code, verdicts = await run(write_config(tmp_path / "c.toml", redis_url), "--apply")
    assert code == 0
    assert verdicts[("tenant", "inflight")] == ("kept", "in_flight")
    assert verdicts[("team", "busyteam")] == ("forgotten", "")
    assert (await w.store.settle("i", 150)).outcome == "settled"
    assert await redis_client.exists(w.keys.quota_key("busyteam")) == 0


async def test_a_file_without_tenants_is_refused(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    w = await populate(redis_client)
    before = await key_names(redis_client)
    config = write_config(tmp_path / "c.toml", redis_url, tenants=False)
    with pytest.raises(ConfigError, match="defines no"):
        await prune.run(prune.parse_args(["--config", config, "--apply", "--min-idle", "1"]), {})
    assert await key_names(redis_client) == before
    assert w.keys.bucket_key("acme") in before


def test_the_refusal_names_the_file(tmp_path: Path, redis_url: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "sched.toml", redis_url, tenants=False)
    assert prune.main(["--config", config]) == inspect.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"kvgate-prune: {config} defines no [[tenants]]" in err


def test_config_is_required_and_min_idle_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], *(["--config", "x.toml", "--min-idle", v]
                       for v in ("nan", "inf", "-1", "1e303", "x"))):
        with pytest.raises(SystemExit) as exited:
            prune.main(argv)
        assert exited.value.code == 2
    assert "--min-idle" in capsys.readouterr().err
    assert prune.parse_args(["--config", "x.toml", "--min-idle", "0"]).min_idle == 0


def test_idle_times_read_in_their_unit() -> None:
    assert [prune.idle_text(s) for s in (None, 0, 59.4, 150, 5400, 86_400 * 2, 86_400 * 30)] == [
        "-", "0 s", "59 s", "2.5 min", "1.5 h", "48.0 h", "30.0 d"]


async def test_table_says_what_would_be_deleted(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    await populate(redis_client)
    args = prune.parse_args(["--config", write_config(tmp_path / "c.toml", redis_url)])
    out: list[str] = []
    assert await prune.run(args, {}, out.append) == 0
    lines = "".join(out).splitlines()
    assert lines[0].split() == ["pool", "kind", "name", "verdict", "idle", "keys"]
    rows = {tuple(line.split()[1:3]): line for line in lines[1:-1]}
    assert "forgettable" in rows[("tenant", "gone")] and "48.0 h" in rows[("tenant", "gone")]
    assert "kept (spent)" in rows[("tenant", "prepaid")]
    assert "kept (in_flight)" in rows[("tenant", "inflight")]
    assert lines[-1] == "2 would be deleted with --apply, 6 kept"


async def test_hand_written_keys_are_named_and_the_run_goes_on(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A key whose name is no tenant's is never given to the script; one of a valid name that
    is no hash (`SET ... 1`) is kept as such; the names after both are judged as usual."""
    w = await populate(redis_client)
    await redis_client.hset(w.keys.prefix + "bucket:bad name", "x", 1)
    await redis_client.set(w.keys.bucket_key("mmm"), 1)
    args = prune.parse_args(["--config", write_config(tmp_path / "c.toml", redis_url),
                             "--apply", "--json"])
    out: list[str] = []
    assert await prune.run(args, {}, out.append) == 0
    doc = json.loads("".join(out))
    verdicts = {(v["kind"], v["name"]): (v["verdict"], v["reason"]) for v in doc["verdicts"]}
    assert ("tenant", "bad name") not in verdicts
    assert verdicts[("tenant", "mmm")] == ("kept", "wrong_type")
    assert verdicts[("tenant", "recent")] == ("kept", "recent")  # after "mmm"
    assert doc["foreign_keys"] == [w.keys.prefix + "bucket:bad name"] and doc["complete"]
    assert "bucket:bad name'" in capsys.readouterr().err
    assert await redis_client.exists(w.keys.prefix + "bucket:bad name",
                                     w.keys.bucket_key("mmm")) == 2


async def test_a_run_refused_part_way_reports_what_it_deleted(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Redis user that may delete the buckets of names starting with 'g' only (ACL key
    patterns): gone is deleted, the next deletion is refused; the table still lists gone, and
    the error says which permission is missing."""
    w = await populate(redis_client)
    await redis_client.hdel(w.keys.tenant_key("gone"), *await redis_client.hkeys(
        w.keys.tenant_key("gone")))  # gone's bucket alone, so one DEL pattern covers it
    k = w.keys
    # A script's declared keys need write access (EVALSHA may write them); what it deletes,
    # too. Everything else of the pool is readable.
    admin: Any = redis_client
    await admin.execute_command(
        "ACL", "SETUSER", "pruner", "on", ">pw", "+@all", f"~{k.prefix}bucket:g*",
        f"~{k.prefix}quota:o*", f"~{k.prefix}light:*", f"~{k.clock}", f"~{k.tenant_queued}",
        f"~{k.tenant_inflight}", f"%R~{k.prefix}*")
    url = redis_url.replace("redis://", "redis://pruner:pw@")
    args = prune.parse_args(["--config", write_config(tmp_path / "c.toml", url), "--apply",
                             "--min-idle", "1"])
    out: list[str] = []
    try:
        assert await prune.run(args, {}, out.append) == inspect.EXIT_REDIS
    finally:
        await admin.execute_command("ACL", "DELUSER", "pruner")
    table = "".join(out)
    assert "tenant  gone" in table and "forgotten" in table
    err = capsys.readouterr().err
    # gone, inflight (kept), prepaid (kept), queued (kept); then recent's DEL is refused.
    assert "stopped after 4 names" in err and "within scripts TYPE and DEL" in err
    # The name whose script was refused: a refusal is no lost reply, but the tool cannot
    # tell one from the other, and says so.
    assert "run again to see what is left" in err
    assert await redis_client.exists(k.bucket_key("gone")) == 0
    assert await redis_client.exists(k.bucket_key("recent")) == 1


async def test_a_reader_that_stops_early_ends_it_quietly(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    await populate(redis_client)
    config = write_config(tmp_path / "c.toml", redis_url)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "admission.prune", "--config", config, stdout=write,
            stderr=asyncio.subprocess.PIPE)
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"Broken pipe" not in err


async def test_on_a_redis_cluster(cluster_client: RedisCluster, tmp_path: Path) -> None:
    """Every key of a pool lives in one slot; SCAN finds them across the masters."""
    w = await populate(cluster_client)
    node = cluster_client.get_default_node()
    config = write_config(tmp_path / "c.toml", f"redis://{node.host}:{node.port}/0",
                          cluster=True)
    code, verdicts = await run(config, "--apply")
    assert code == 0 and verdicts[("tenant", "gone")] == ("forgotten", "")
    assert await cluster_client.exists(w.keys.bucket_key("gone")) == 0


async def retired_pool(client: Any, at_us: int, tenant: TenantQuota = GONE,
                       settle: bool = True) -> PoolStore:
    """A pool `old`, not in the configuration, where `tenant` was served at `at_us`; its clock
    is frozen at T0 + 2 days, as the configured pool's."""
    store = PoolStore(client, register_scripts(client), "old", PoolPolicy())
    await client.hset(store.keys.clock, "frozen_us", at_us)
    await store.publish_state(0, Zone.GREEN, {"gpu-9": 1_000_000}, {})
    assert (await store.admit(task_id="o1", tenant=tenant, tier=Tier.VIP, prompt_tokens=100,
                              max_tokens=100, gateway="gw-old",
                              queue_timeout_ms=60_000)).outcome is AdmitOutcome.RELEASED
    if settle:
        await store.settle("o1", 150)
    await client.hset(store.keys.clock, "frozen_us", T0 + 2 * DAY)
    return store


async def test_a_retired_pool_is_deleted_whole_when_asked(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    w = await populate(redis_client)
    old = await retired_pool(redis_client, T0)
    config = write_config(tmp_path / "c.toml", redis_url)
    # Unnamed, it is listed on stderr and left alone, with or without --apply.
    code, verdicts = await run(config, "--apply")
    assert code == 0 and not any(kind == "pool" for kind, _ in verdicts)
    assert "pools in Redis that" in capsys.readouterr().err
    assert await redis_client.exists(old.keys.state) == 1
    with pytest.raises(SystemExit):
        prune.parse_args(["--config", config, "--retired-pools"])  # which pool?
    named = ("--pool", POOL, "--pool", "old", "--retired-pools")
    code, verdicts = await run(config, *named)
    assert verdicts[("pool", "old")] == ("forgettable", "")
    code, verdicts = await run(config, *named, "--apply")
    assert verdicts[("pool", "old")] == ("forgotten", "")
    assert not [k async for k in redis_client.scan_iter(match="kvg:{old}:*")]
    # The configured pool's keys are its own, untouched.
    assert await redis_client.exists(w.keys.bucket_key("acme"), w.keys.quota_key("eng")) == 2


@pytest.mark.parametrize(("case", "flags", "expected"), [
    ("published", (), ("kept", "published")),
    ("leased", (), ("kept", "leased")),
    ("recent", ("--min-idle", "7200"), ("kept", "recent")),
    ("half_hour", ("--min-idle", "0"), ("kept", "recent")),  # a pool's floor: an hour
    ("spent", (), ("kept", "spent")),
    ("spent", ("--spent",), ("forgotten", "")),
])
async def test_a_retired_pool_is_kept_while_anything_needs_it(
        redis_client: aioredis.Redis, redis_url: str, tmp_path: Path, case: str,
        flags: tuple[str, ...], expected: tuple[str, str]) -> None:
    """A leader that still publishes it (its state carries the current epoch), a gateway
    holding a task there (its lease unexpired: written a second ago, with no settle), a write
    an hour ago against a least idle time of two, one half an hour ago against none, a prepaid
    balance spent."""
    w = await populate(redis_client)
    at = {"published": T0, "leased": T0 + 2 * DAY - S, "recent": T0 + 2 * DAY - 3600 * S,
          "half_hour": T0 + 2 * DAY - 1800 * S, "spent": T0}[case]
    old = await retired_pool(redis_client, at, PREPAID if case == "spent" else GONE,
                             settle=case != "leased")
    if case == "published":
        await old.publish_state(w.epoch, Zone.GREEN, {"gpu-9": 1_000_000}, {})
    _, verdicts = await run(write_config(tmp_path / "c.toml", redis_url), "--pool", "old",
                            "--retired-pools", "--apply", *flags)
    assert verdicts[("pool", "old")] == expected
    assert await redis_client.exists(old.keys.state) == (expected[0] == "kept")


def test_an_allowance_counts_in_the_later_period_after_the_clock_stepped_back() -> None:
    """As period_of() in lua/_quota.lua: a day stored one ahead of the clock's (the clock
    stepped back across midnight) is the one the scripts count in, so it is in use and spent;
    one stored two ahead, or behind, is not."""
    day = (T0 + 2 * DAY) // DAY
    now = T0 + 2 * DAY
    for stored, used in ((day, 5), (day + 1, 5), (day + 2, 0), (day - 1, 0)):
        h = {"day": str(stored), "day_used": "5"}
        assert allowance_used(h, now, month_index(now))[0] == used, stored
        assert is_spent(h, now) is (used > 0)
