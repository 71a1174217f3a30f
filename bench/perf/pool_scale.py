"""How the scripts' Redis time grows with the size of a pool: nodes, tenants, queued tasks.

    python -m bench.perf.pool_scale [--nodes 16,64,256] [--queued 0,2000,20000]
                                    [--tenants 10,1000,5000] [--samples 200]

A private redis-server, one pool, no gateway and no scheduler process: the scripts are called
directly through `PoolStore`, and each call's own Redis time is read from SLOWLOG (logging every
command, so the figure is the script's run inside Redis, without the round trip or the client).
Redis runs one script at a time: a script's µs is taken from every other request of every
gateway of every pool sharing the server.

Sections (medians of `--samples` calls, µs):

- admit vs nodes: the fast path of VIP without prefill rooms, of Normal with a room published
  for every node, of a long Normal prompt while quiet nodes are kept (`prefill_quiet`: the
  placement counts the quiet nodes beside each candidate), and of VIP with rooms (its
  least-queued steering);
- admit vs queue: a Normal admit that queues (YELLOW) and a VIP fast path, with that many tasks
  queued over that many tenants;
- release vs nodes: one leader call releasing `--batch` Normal tasks, per call and per task;
- release, bounded: a release of `--bounded` tasks at the largest node count in calls of
  `--call-ms` (the leader's `release_call_ms`): how many calls, the longest one, their sum;
- release, capped tenants: every backlogged tenant at its cap on in-flight tokens, so that one
  call passes over each of them (fair order reads each once per call);
- memory: Redis bytes per queued task and per tenant (used_memory deltas).

Prints a markdown table; writes nothing. The figures are only comparable within one run on a
quiet machine: say what else ran beside it when quoting them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from admission.scripts import load_scripts, register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.localredis import running_redis

CAP = 10**12
WINDOW = 1_000
BIG = dict(rate=10**8, burst=10**9, max_queued=10**6)


def tenant(name: str, **kw: Any) -> TenantQuota:
    return TenantQuota(name, **{**BIG, **kw})


class Slowlog:
    """Every command's Redis time, read back per batch (script calls only)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def start(self) -> None:
        await self.client.config_set("slowlog-log-slower-than", 0)
        await self.client.config_set("slowlog-max-len", 100_000)
        await self.client.slowlog_reset()

    async def script_us(self) -> list[int]:
        rows = await self.client.slowlog_get(100_000)
        await self.client.slowlog_reset()
        out = []
        for row in rows:
            cmd = row["command"]
            name = cmd.split(b" ", 1)[0] if isinstance(cmd, bytes) else str(cmd).split(" ")[0]
            if name.lower() in (b"evalsha", "evalsha"):
                out.append(int(row["duration"]))
        return out


async def timed(log: Slowlog, calls: int, one: Callable[[int], Awaitable[Any]],
                between: Callable[[], Awaitable[Any]] | None = None) -> float:
    """Median Redis µs of `calls` script calls made by `one`; `between` runs plain commands
    (not timed) after each."""
    await log.client.slowlog_reset()
    for i in range(calls):
        await one(i)
        if between is not None:
            await between()
    samples = await log.script_us()
    return statistics.median(samples) if samples else float("nan")


async def fresh_pool(client: aioredis.Redis, scripts: Any, name: str, nodes: int, *,
                     zone: Zone = Zone.GREEN, rooms: bool = False, quiet: int = 0,
                     window: int = WINDOW, policy: PoolPolicy | None = None) -> PoolStore:
    store = PoolStore(client, scripts, name,
                      policy or PoolPolicy(fair=True, tier_queue_caps=(10**6,) * 3))
    caps = {f"node-{i:03d}": CAP for i in range(nodes)}
    prefill = ({n: (window, window, 0, 8 + i % 5, -2) for i, n in enumerate(caps)}
               if rooms else None)
    extra = {"prefill_quiet": quiet} if quiet else None
    await store.publish_state(1, zone, caps, extra=extra, prefill=prefill, refill_ms=0)
    return store


async def admit(store: PoolStore, tid: str, who: TenantQuota, tier: Tier, prompt: int,
                out: int = 100) -> str:
    r = await store.admit(task_id=tid, tenant=who, tier=tier, prompt_tokens=prompt,
                          max_tokens=out, gateway="gw", queue_timeout_ms=600_000)
    return str(r.outcome)


async def admit_vs_nodes(client: aioredis.Redis, scripts: Any, log: Slowlog,
                         nodes: Sequence[int], samples: int) -> list[tuple[str, int, float]]:
    rows: list[tuple[str, int, float]] = []
    who = tenant("t0")
    for n in nodes:
        cases: list[tuple[str, dict[str, Any], Tier, int]] = [
            ("VIP, no rooms", {}, Tier.VIP, 200),
            ("Normal, rooms", {"rooms": True}, Tier.NORMAL, 200),
            ("Normal long prompt, rooms, quiet=1", {"rooms": True, "quiet": 1}, Tier.NORMAL,
             3 * WINDOW),
            ("VIP, rooms", {"rooms": True}, Tier.VIP, 200),
        ]
        for label, kw, tier, prompt in cases:
            pool = f"an{n}-{len(rows)}"
            store = await fresh_pool(client, scripts, pool, n, **kw)
            released = store.keys.node_prefill_released

            async def reset(key: str = released) -> None:
                # Each placement takes a room; the next call must find the same pool.
                await client.delete(key)

            async def one(i: int, s: PoolStore = store, t: Tier = tier, p: int = prompt) -> None:
                outcome = await admit(s, f"a{i}", who, t, p)
                assert outcome == "released", outcome

            rows.append((label, n, await timed(log, samples, one, reset)))
    return rows


async def fill(store: PoolStore, queued: int, tenants: int, tier: Tier = Tier.NORMAL,
               **kw: Any) -> None:
    """`queued` tasks of `tier` over `tenants` tenants (the pool must not release them)."""
    quotas = [tenant(f"t{j}", **kw) for j in range(tenants)]
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            outcome = await admit(store, f"q{i}", quotas[i % tenants], tier, 200)
            assert outcome == "queued", outcome

    await asyncio.gather(*(one(i) for i in range(queued)))


async def admit_vs_queue(client: aioredis.Redis, scripts: Any, log: Slowlog,
                         queued: Sequence[int], tenants: Sequence[int],
                         samples: int) -> list[tuple[str, int, int, float]]:
    rows = []
    for q in queued:
        for t in tenants:
            if t > max(q, 1):
                continue
            store = await fresh_pool(client, scripts, f"aq{q}-{t}", 64, zone=Zone.YELLOW)
            await log.client.config_set("slowlog-log-slower-than", -1)
            await fill(store, q, t)
            await log.client.config_set("slowlog-log-slower-than", 0)
            who = tenant("probe")

            async def queue_one(i: int, s: PoolStore = store, w: TenantQuota = who) -> None:
                await admit(s, f"p{i}", w, Tier.NORMAL, 200)

            async def vip_one(i: int, s: PoolStore = store, w: TenantQuota = who) -> None:
                await admit(s, f"v{i}", w, Tier.VIP, 200)

            rows.append(("Normal admit, queues", q, t, await timed(log, samples, queue_one)))
            rows.append(("VIP admit, fast path", q, t, await timed(log, samples, vip_one)))
    return rows


async def release_vs_nodes(client: aioredis.Redis, scripts: Any, log: Slowlog,
                           nodes: Sequence[int], tenants: int, calls: int,
                           per_call: int) -> list[tuple[str, int, float, float]]:
    rows: list[tuple[str, int, float, float]] = []
    for n in nodes:
        # Rooms wide enough for the whole batch: what is timed is the walk, not a full pool.
        cases: tuple[tuple[str, dict[str, Any]], ...] = (
            ("Normal, no rooms", {}),
            ("Normal, rooms", {"rooms": True, "window": 10**9}))
        for label, kw in cases:
            store = await fresh_pool(client, scripts, f"rn{n}-{len(rows)}", n, zone=Zone.YELLOW,
                                     **kw)
            await log.client.config_set("slowlog-log-slower-than", -1)
            await fill(store, per_call * calls, tenants)
            await log.client.config_set("slowlog-log-slower-than", 0)
            released = store.keys.node_prefill_released

            async def one(i: int, s: PoolStore = store) -> None:
                got = await s.release(1, (0, per_call, 0))
                assert len(got) == per_call, len(got)

            async def reset(key: str = released) -> None:
                await client.delete(key)

            us = await timed(log, calls, one, reset)
            rows.append((label, n, us, us / per_call))
    return rows


async def release_bounded(client: aioredis.Redis, scripts: Any, log: Slowlog, n: int,
                          tasks: int, call_ms: int) -> tuple[int, int, float, float]:
    """One release of `tasks` Normal tasks on `n` nodes with rooms, in calls bounded to
    `call_ms` (the leader's release_call_ms): tasks released, calls, longest and total µs."""
    store = await fresh_pool(client, scripts, f"rb{n}", n, zone=Zone.YELLOW, rooms=True,
                             window=10**9)
    await log.client.config_set("slowlog-log-slower-than", -1)
    await fill(store, tasks, 100)
    await log.client.config_set("slowlog-log-slower-than", 0)
    await log.client.slowlog_reset()
    got = await store.release(1, (0, tasks, 0), call_ms=call_ms)
    samples = await log.script_us()
    return len(got), got.calls, float(max(samples)), float(sum(samples))


async def release_capped(client: aioredis.Redis, scripts: Any, log: Slowlog,
                         tenants: Sequence[int]) -> list[tuple[int, float]]:
    """Every tenant at its in-flight cap with one task queued: a release passes over all."""
    rows = []
    for t in tenants:
        store = await fresh_pool(client, scripts, f"rc{t}", 16)
        quotas = [tenant(f"c{j}", max_inflight_tokens=300) for j in range(t)]
        await log.client.config_set("slowlog-log-slower-than", -1)
        for j, who in enumerate(quotas):
            assert await admit(store, f"run{j}", who, Tier.NORMAL, 200) == "released"
        await store.publish_state(1, Zone.YELLOW, {f"node-{i:03d}": CAP for i in range(16)})
        for j, who in enumerate(quotas):
            assert await admit(store, f"wait{j}", who, Tier.NORMAL, 200) == "queued"
        await store.publish_state(1, Zone.GREEN, {f"node-{i:03d}": CAP for i in range(16)})
        await log.client.config_set("slowlog-log-slower-than", 0)

        async def one(i: int, s: PoolStore = store) -> None:
            assert len(await s.release(1, (0, 64, 0))) == 0

        rows.append((t, await timed(log, 3, one)))
    return rows


async def memory(client: aioredis.Redis, scripts: Any) -> list[tuple[str, float]]:
    store = await fresh_pool(client, scripts, "mem", 16, zone=Zone.YELLOW)
    rows = []
    before = int((await client.info("memory"))["used_memory"])
    await fill(store, 10_000, 10)
    after = int((await client.info("memory"))["used_memory"])
    rows.append(("per queued task (10 tenants)", (after - before) / 10_000))
    one_task = await client.memory_usage(store.keys.task_key("q0"))
    rows.append(("task record alone (MEMORY USAGE)", float(one_task or 0)))
    store = await fresh_pool(client, scripts, "mem2", 16, zone=Zone.YELLOW)
    before = int((await client.info("memory"))["used_memory"])
    await fill(store, 5_000, 5_000)
    after = int((await client.info("memory"))["used_memory"])
    rows.append(("per tenant with one task queued (5000 tenants)", (after - before) / 5_000))
    # What stays once the tenant's work is over: bucket and tenant hashes.
    tkey = store.keys.tenant_key("t1")
    bkey = store.keys.bucket_key("t1")
    rows.append(("tenant hash left after its work (never deleted)",
                 float(await client.memory_usage(tkey) or 0)))
    rows.append(("bucket hash left after its work (never deleted)",
                 float(await client.memory_usage(bkey) or 0)))
    return rows


async def run(args: argparse.Namespace) -> str:
    nodes = [int(x) for x in args.nodes.split(",")]
    queued = [int(x) for x in args.queued.split(",")]
    tenants = [int(x) for x in args.tenants.split(",")]
    out = ["| measure | size | Redis µs (median) |", "|---|---|---:|"]
    with running_redis() as server:
        # A release of thousands of tasks over hundreds of nodes runs for seconds.
        client = aioredis.Redis.from_url(server.url, max_connections=128, socket_timeout=120)
        scripts = register_scripts(client)
        await load_scripts(client, scripts)
        log = Slowlog(client)
        await log.start()
        for label, n, us in await admit_vs_nodes(client, scripts, log, nodes, args.samples):
            out.append(f"| admit: {label} | {n} nodes | {us:.0f} |")
        for label, q, t, us in await admit_vs_queue(client, scripts, log, queued, tenants,
                                                    args.samples):
            out.append(f"| admit: {label} | {q} queued, {t} tenants | {us:.0f} |")
        for label, n, us, per in await release_vs_nodes(client, scripts, log, nodes, 100,
                                                        args.calls, args.batch):
            out.append(f"| release {args.batch}: {label} | {n} nodes | {us:.0f} "
                       f"({per:.0f} per task) |")
        if args.call_ms > 0:
            n = nodes[-1]
            got, calls, longest, total = await release_bounded(client, scripts, log, n,
                                                               args.bounded, args.call_ms)
            out.append(f"| release {args.bounded} in calls of {args.call_ms} ms: {got} released "
                       f"in {calls} calls, total {total / 1000:.0f} ms | {n} nodes | "
                       f"{longest:.0f} (longest call) |")
        for t, us in await release_capped(client, scripts, log, args.capped):
            out.append(f"| release, all tenants capped | {t} tenants | {us:.0f} |")
        await client.config_set("slowlog-log-slower-than", 10_000)
        out += ["", "| Redis memory | bytes |", "|---|---:|"]
        for label, b in await memory(client, scripts):
            out.append(f"| {label} | {b:.0f} |")
        await client.aclose()
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="16,64,256")
    parser.add_argument("--queued", default="0,2000,20000")
    parser.add_argument("--tenants", default="10,1000,5000")
    parser.add_argument("--capped", type=lambda s: [int(x) for x in s.split(",")],
                        default=[100, 500, 2000])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64,
                        help="tasks one release call pops (the leader's release_batch: 2000)")
    parser.add_argument("--calls", type=int, default=10, help="release calls timed per size")
    parser.add_argument("--bounded", type=int, default=2000,
                        help="tasks of the bounded release (at the largest --nodes)")
    parser.add_argument("--call-ms", type=int, default=20,
                        help="its bound per call (the leader's release_call_ms; 0: skip it)")
    print(asyncio.run(run(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
