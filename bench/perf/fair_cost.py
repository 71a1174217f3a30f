"""What fair release, per-tenant caps and quota levels add to the hot path, against another
revision's scripts (by default `BEFORE_FAIRNESS`, the last one without them) in the same run,
on the same private redis-server.

    python -m bench.perf.fair_cost [--baseline REV] [--seconds 4] [--rounds 3]

The same `PoolStore` drives both: the scripts of this checkout, and those of `--baseline`
read with `git show` (the store only appends arguments the older scripts ignore). Rounds
alternate the two so that drift on a shared machine falls on both. Per scenario and scripts:

- **round trips** per admit and per settle, counted on the client's transport (every EVALSHA
  or SCRIPT LOAD it sends): must stay one each;
- **Redis commands** each script call runs inside (INFO commandstats, every command but the
  script call itself) and **Redis µs per call** (the script call's own usec);
- **admit+settle pairs/s**, 64 concurrent from one process (closed loop).

Scenarios: `fast path` (admit released at once, then settle: the common case);
`fast path, team`: the same tenant under a team and an organisation (three buckets per
request); `queued + release` (admits into a busy tier, the leader's release, settles: the fair
bookkeeping's whole cycle; the release's µs per task released is reported beside it). Writes
bench/results/fair_cost.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import subprocess
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from admission.scripts import LIBRARY, SCRIPT_NAMES, Script, Scripts, script_source
from admission.store import PoolPolicy, PoolStore, QuotaLevel, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.localredis import running_redis

RESULTS = Path(__file__).resolve().parents[1] / "results" / "fair_cost.md"
TENANT = TenantQuota("bench", rate=10**8, burst=10**9, max_queued=10**6)
TEAM = TenantQuota("member", rate=10**8, burst=10**9, max_queued=10**6,
                   levels=(QuotaLevel("team", 10**8, 10**9), QuotaLevel("org", 10**8, 10**9)))
SCRIPT_CALLS = ("evalsha", "eval")
BEFORE_FAIRNESS = "02b80a6"
"""The last revision whose scripts have no fair release, tenant caps or quota levels."""


class CountingTransport:
    """A redis-py client's script commands, counted: the round trips of script calls."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.calls = 0

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]:
        self.calls += 1
        reply: Awaitable[Any] = self.client.evalsha(sha, numkeys, *keys_and_args)
        return reply

    def script_load(self, script: str) -> Awaitable[Any]:
        self.calls += 1
        reply: Awaitable[Any] = self.client.script_load(script)
        return reply


def sources_at(revision: str | None) -> dict[str, str]:
    """Each script's full source (the library and its own file) at `revision` (None: this
    checkout)."""
    if revision is None:
        return {name: script_source(name) for name in SCRIPT_NAMES}

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True,
                              text=True, check=True).stdout

    # As admission.scripts.script_source builds a service's scripts: the clock flag off (an
    # unused local for a revision that predates it), the library files (a revision before
    # the library was split into them has only the first), the script.
    present = set(subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "lua/"], capture_output=True, text=True,
        check=True).stdout.split())
    lib = "local TEST_CLOCK = false\n" + "\n".join(
        show(f"lua/{part}.lua") for part in LIBRARY if f"lua/{part}.lua" in present)
    # A script the revision does not have (added later) is never run by the benchmark's
    # calls; it gets a body that says so if it were.
    absent = "return redis.error_reply('no such script at this revision')"
    return {name: lib + "\n" + (show(f"lua/{name}.lua") if f"lua/{name}.lua" in present
                                else absent) for name in SCRIPT_NAMES}


def scripts_of(sources: dict[str, str], transport: Any) -> Scripts:
    return Scripts(**{name: Script(name, src, transport) for name, src in sources.items()})


@dataclass
class Figures:
    round_trips_admit: float = 0.0
    round_trips_settle: float = 0.0
    inner_per_call: float = 0.0
    usec_per_call: float = 0.0
    pairs_per_s: float = 0.0
    release_usec_per_task: float = float("nan")


async def _stats(client: aioredis.Redis) -> dict[str, tuple[int, float]]:
    info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
            for k, v in info.items()}


def _delta(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]
           ) -> dict[str, tuple[int, float]]:
    return {k: (after[k][0] - before.get(k, (0, 0.0))[0], after[k][1] - before.get(k, (0, 0.0))[1])
            for k in after}


async def scenario(client: aioredis.Redis, sources: dict[str, str], name: str, pool: str,
                   seconds: float) -> Figures:
    transport = CountingTransport(client)
    queued = name.startswith("queued")
    store = PoolStore(client, scripts_of(sources, transport), pool,
                      PoolPolicy(tier_queue_caps=(10**6, 10**6, 10**6)))
    tenant = TEAM if name.endswith("team") else TENANT
    await store.publish_state(1, Zone.YELLOW if queued else Zone.GREEN, {"n": 10**12})
    figures = Figures()
    ids = itertools.count()
    # Round trips and Redis work of single calls (warm: scripts loaded by a first call).
    await store.admit(task_id="warm", tenant=tenant, tier=Tier.NORMAL, prompt_tokens=500,
                      max_tokens=500, gateway="gw", queue_timeout_ms=60_000)
    n = 500
    before, calls = await _stats(client), transport.calls
    tids = [f"r{next(ids)}" for _ in range(n)]
    for i, tid in enumerate(tids):
        await store.admit(task_id=tid, tenant=tenant if i % 2 else TENANT, tier=Tier.NORMAL,
                          prompt_tokens=500, max_tokens=500, gateway="gw",
                          queue_timeout_ms=60_000)
    figures.round_trips_admit = (transport.calls - calls) / n
    admits = _delta(before, await _stats(client))
    if queued:
        queue = store.keys.queue(Tier.NORMAL)
        waiting = await client.zcard(queue)
        t0 = time.perf_counter()
        # An older revision's release script answers in an older shape, which this checkout's
        # store cannot read; the script has run, and the queue tells what it released.
        with contextlib.suppress(ValueError):
            await store.release(1, (0, n, 0))
        spent = time.perf_counter() - t0
        released = waiting - await client.zcard(queue)
        if released > 0:
            figures.release_usec_per_task = spent * 1e6 / released
    before, calls = await _stats(client), transport.calls
    for tid in tids:
        await store.settle(tid, 900)
    figures.round_trips_settle = (transport.calls - calls) / n
    settles = _delta(before, await _stats(client))
    script_calls = sum(admits.get(k, (0, 0))[0] + settles.get(k, (0, 0))[0] for k in SCRIPT_CALLS)
    inner = sum(c for k, (c, _) in admits.items() if k not in SCRIPT_CALLS) + sum(
        c for k, (c, _) in settles.items() if k not in SCRIPT_CALLS)
    usec = sum(admits.get(k, (0, 0))[1] + settles.get(k, (0, 0))[1] for k in SCRIPT_CALLS)
    figures.inner_per_call = inner / max(1, script_calls)
    figures.usec_per_call = usec / max(1, script_calls)
    if not queued:
        figures.pairs_per_s = await _pairs(store, tenant, seconds, ids)
    return figures


async def _pairs(store: PoolStore, tenant: TenantQuota, seconds: float,
                 ids: itertools.count[int]) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            tid = f"p{next(ids)}"
            await store.admit(task_id=tid, tenant=tenant, tier=Tier.NORMAL, prompt_tokens=500,
                              max_tokens=500, gateway="gw", queue_timeout_ms=60_000)
            await store.settle(tid, 900)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(64)))
    return done / (time.perf_counter() - started)


SCENARIOS = ("fast path", "fast path, team", "queued + release")


async def run(baseline: str, seconds: float, rounds: int) -> dict[str, dict[str, list[Figures]]]:
    arms = {"this checkout": sources_at(None), f"baseline ({baseline})": sources_at(baseline)}
    out: dict[str, dict[str, list[Figures]]] = {s: {a: [] for a in arms} for s in SCENARIOS}
    with running_redis() as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            for r in range(rounds):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for arm in order:
                    for s in SCENARIOS:
                        await client.flushdb()
                        out[s][arm].append(await scenario(client, arms[arm], s, f"p{r}", seconds))
        finally:
            await client.aclose()
    return out


def _median(xs: Sequence[float]) -> float:
    data = sorted(xs)
    return data[len(data) // 2]


def markdown(results: dict[str, dict[str, list[Figures]]], command: str) -> str:
    lines = [
        "# Hot-path cost of fairness, caps and quota levels",
        "",
        f"`{command}`, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} at the end. Medians over rounds (rounds alternate the "
        "two script sets on one private redis-server).",
        "",
        "| scenario | scripts | round trips per admit | per settle | Redis commands per "
        "script call | Redis µs per script call | admit+settle pairs/s | release µs per "
        "task |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, arms in results.items():
        for arm, figs in arms.items():
            m = {f: _median([getattr(x, f) for x in figs]) for f in (
                "round_trips_admit", "round_trips_settle", "inner_per_call", "usec_per_call",
                "pairs_per_s", "release_usec_per_task")}
            pairs = f"{m['pairs_per_s']:,.0f}" if m["pairs_per_s"] else "-"
            release = (f"{m['release_usec_per_task']:.0f}"
                       if m["release_usec_per_task"] == m["release_usec_per_task"] else "-")
            lines.append(f"| {s} | {arm} | {m['round_trips_admit']:.2f} | "
                         f"{m['round_trips_settle']:.2f} | {m['inner_per_call']:.1f} | "
                         f"{m['usec_per_call']:.1f} | {pairs} | {release} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.fair_cost")
    p.add_argument("--baseline", default=BEFORE_FAIRNESS,
                   help="git revision of the other scripts (default: the last without fairness)")
    p.add_argument("--seconds", type=float, default=4.0, help="closed-loop seconds per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    base = subprocess.run(["git", "rev-parse", "--short", args.baseline], capture_output=True,
                          text=True, check=False).stdout.strip()
    command = (f"python -m bench.perf.fair_cost --baseline {args.baseline} --seconds "
               f"{args.seconds:g} --rounds {args.rounds}` on `{head}` against `{base}")
    md = markdown(asyncio.run(run(args.baseline, args.seconds, args.rounds)), command)
    args.out.write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
