"""Section 6 of the performance suite: memory, in Redis and in a gateway process.

    python -m bench.perf.memory [--quick] [--soak-s 600] [--output FILE]

1. Redis bytes per queued task: a private redis-server, a pool whose leader published zero
   capacity (every node full), so every admit queues; 100,000 admits through the real script
   (ids made as the gateway makes them, `gateway.admit.new_task_id`; eight tenants over the
   three tiers, two gateways, one request in 20 with a client deadline shorter than its
   tier's), `INFO memory` before and after, and `MEMORY USAGE` of every kind of key to say
   which one holds what per task.
2. Gateway RSS with 2,000 streams in flight: one gateway process in front of the instant
   backend spacing each stream's tokens (`--token-interval-ms`); VmRSS before the load and
   once every stream has received its first chunk and none has ended.
3. Soak: a fresh gateway at about 200 RPS for `soak_s` seconds (VIP non-streaming from the
   open-loop generator process, VIP streams, a Normal tenant whose bucket runs dry (429) and
   Batch requests that queue in a YELLOW pool until their timeout (429)), sampling gateway RSS
   and Redis `used_memory`; flat = the regression slope over the second half is under 1 MB
   per 10 minutes, and after the load (and the finished records' retention) Redis holds the
   same keys and about the same memory as before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.perf.httpload import publish_state_once, run_phase, start_server, stop_processes
from bench.perf.perfreport import Check, PerfOptions, Section, save_figure
from bench.perf.queue_memory import QueueMemory, measure_queue_memory, queue_markdown

ROOT = Path(__file__).resolve().parents[2]
POOL = "demo"
KEYS = {"vip": "sk-bench-memory-vip", "normal": "sk-bench-memory-normal",
        "batch": "sk-bench-memory-batch"}
CHAT = {"model": POOL, "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}
MAX_BYTES_PER_TASK = 512
MAX_RSS_MB = 300.0
MAX_SLOPE_MB_PER_10MIN = 1.0
REDIS_BACK_TOLERANCE = 128 * 1024
"""Bytes of `used_memory` the end of the soak may differ from its start (client buffers and
hash-table sizes move by a few KB; a leak at 200 RPS for 10 minutes would be megabytes)."""


# -- processes ------------------------------------------------------------------------------

def _config(redis_url: str, backend_port: int, retention_s: int) -> str:
    tenants = ""
    for tier, key in KEYS.items():
        # The Normal tenant's bucket refills slower than it is used: part of its requests get
        # 429 rate_limit_exceeded, the rest queue (YELLOW) like the Batch ones.
        rate, burst = (1_000, 5_000) if tier == "normal" else (1_000_000_000, 1_000_000_000)
        tenants += (f'\n[[tenants]]\nname = "bench-{tier}"\ntier = "{tier}"\n'
                    f'key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n'
                    f"rate = {rate}\nburst = {burst}\nmax_queued = 100000\n")
    return f"""
[redis]
url = "{redis_url}"

[gateway]
access_log = false
retention_s = {retention_s}

[tiers.normal]
queue_timeout_ms = 1000

[tiers.batch]
queue_timeout_ms = 1000

[[pools]]
name = "{POOL}"
stale_after_ms = 0
backends = [{{ name = "node-0", url = "http://127.0.0.1:{backend_port}" }}]
{tenants}"""


@dataclass
class Stack:
    redis_url: str
    redis_pid: int
    gateway_pid: int
    gateway_port: int


@contextmanager
def stack(workdir: Path, zone: str, token_interval_ms: float, retention_s: int
          ) -> Iterator[Stack]:
    """redis-server, instant backend and one gateway, primed as a scheduler's first tick would."""
    from bench.common.localredis import start_redis

    redis = start_redis()
    procs: list[subprocess.Popen[str]] = []
    try:
        backend, backend_port = start_server(
            [sys.executable, "-m", "bench.common.instant_backend", "--port", "0", "--model", POOL,
             "--token-interval-ms", str(token_interval_ms)], "listening on")
        procs.append(backend)
        config = workdir / f"gateway-{zone.lower()}.toml"
        config.write_text(_config(redis.url, backend_port, retention_s))
        asyncio.run(publish_state_once(redis.url, [POOL], zone))
        gateway, port = start_server(
            [sys.executable, "-m", "gateway", "--config", str(config), "--port", "0",
             "--log-level", "WARNING"], "listening on")
        procs.append(gateway)
        yield Stack(redis.url, redis.process.pid, gateway.pid, port)
    finally:
        stop_processes(procs, timeout_s=15)
        redis.stop()
        shutil.rmtree(redis.workdir, ignore_errors=True)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def request(session: aiohttp.ClientSession, port: int, tier: str, *, stream: bool,
                  max_tokens: int = 16, first: asyncio.Event | None = None) -> str:
    """One chat completion: its status ('429 <code>' for a 429), 'done' for a stream read to
    its [DONE], or the client error's name."""
    body = {**CHAT, "max_tokens": max_tokens, "stream": stream}
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                data=orjson.dumps(body), headers={
                                    "Authorization": f"Bearer {KEYS[tier]}",
                                    "Content-Type": "application/json"}) as resp:
            if not stream or resp.status != 200:
                data = await resp.read()
                if resp.status != 429:
                    return str(resp.status)
                try:  # which 429: the bucket (rate_limit_exceeded) or the queue's timeout
                    return f"429 {orjson.loads(data)['error']['code']}"
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    return "429"
            done = False
            async for chunk in resp.content.iter_any():
                if first is not None and not first.is_set():
                    first.set()
                done = done or b"[DONE]" in chunk
            return "done" if done else "cut"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return type(exc).__name__


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=120))


# -- 2. gateway RSS with N streams in flight --------------------------------------------------

async def streams_rss(s: Stack, streams: int, interval_ms: float, stream_s: float
                      ) -> dict[str, Any]:
    async with _session() as session:
        # Warm-up: tokenizer, caches, connection pools, metric children all exist before the
        # baseline, so the difference is what the streams themselves hold.
        for _ in range(4):
            await asyncio.gather(*[request(session, s.gateway_port, "vip", stream=i % 2 == 0,
                                           max_tokens=2) for i in range(50)])
        await asyncio.sleep(2)
        baseline = rss_bytes(s.gateway_pid)
        # Far longer than the ramp may take on a loaded machine; the clients leave after the
        # reading.
        tokens = int(stream_s * 1000 / interval_ms)
        firsts = [asyncio.Event() for _ in range(streams)]
        retries: list[str] = []

        async def hold(first: asyncio.Event) -> str:
            # A client whose stream failed before its first chunk opens it again, as an SDK
            # would: the reading is taken with every one of the streams in flight.
            for _ in range(5):
                got = await request(session, s.gateway_port, "vip", stream=True,
                                    max_tokens=tokens, first=first)
                if first.is_set():
                    return got
                retries.append(got)
                await asyncio.sleep(0.5)
            return got

        t0 = time.perf_counter()
        tasks = []
        for i, ev in enumerate(firsts):
            tasks.append(asyncio.create_task(hold(ev)))
            if i % 50 == 49:
                # About 250 opens per second: on this shared 2-CPU machine a faster ramp
                # overflows the backend's accept queue now and then (the kernel counts
                # ListenOverflows), and the gateway answers those few streams 502.
                await asyncio.sleep(0.2)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in firsts]), 90)
        ramp_s = time.perf_counter() - t0
        started = sum(e.is_set() for e in firsts)
        await asyncio.sleep(2)
        samples = []
        for _ in range(3):
            samples.append(rss_bytes(s.gateway_pid))
            await asyncio.sleep(1)
        ended_before = sum(t.done() for t in tasks)
        # The clients leave mid-stream, as users do: no need to wait for the streams' ends.
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(5)  # the gateway cancels and settles what the clients left
    after = rss_bytes(s.gateway_pid)
    loaded = max(samples)
    outcome: dict[str, int] = {}
    for r in results:
        name = "left mid-stream" if isinstance(r, BaseException) else r
        outcome[name] = outcome.get(name, 0) + 1
    return {"streams": streams, "started": started, "ended_before_sample": ended_before,
            "ramp_s": ramp_s, "baseline": baseline, "loaded": loaded, "samples": samples,
            "after": after, "per_stream": (loaded - baseline) / streams, "outcomes": outcome,
            "tokens_per_stream": tokens, "token_interval_ms": interval_ms,
            "retried": {r: retries.count(r) for r in sorted(set(retries))}}


# -- 3. soak -------------------------------------------------------------------------------

SLICES = (("vip-stream", "vip", True, 0.15, 8), ("normal-429", "normal", False, 0.05, 1000),
          ("batch-queue", "batch", False, 0.05, 16))
"""The in-process slices of the soak (name, tier, streaming, share of the rate, max_tokens);
the rest, VIP non-streaming, comes from the open-loop generator process. Normal asks for 1,000
tokens a request so that its bucket (1,000 tokens/s, burst 5,000) runs dry."""


async def _open_loop(session: aiohttp.ClientSession, port: int, tier: str, stream: bool,
                     max_tokens: int, rate: float, seconds: float, counts: dict[str, int]
                     ) -> None:
    pending: set[asyncio.Task[str]] = set()

    def tally(task: asyncio.Task[str]) -> None:
        pending.discard(task)
        counts[task.result()] = counts.get(task.result(), 0) + 1

    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        wait = start + i / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        task = asyncio.create_task(
            request(session, port, tier, stream=stream, max_tokens=max_tokens))
        pending.add(task)
        task.add_done_callback(tally)
    if pending:
        await asyncio.wait(pending, timeout=60)


async def _redis_probe(client: Any) -> tuple[int, int]:
    return int((await client.info("memory"))["used_memory"]), int(await client.dbsize())


async def _redis_clients(client: Any) -> tuple[int, int]:
    """Memory of client connections (buffers) and how many there are: a gateway's pool opens
    connections under load and keeps them, which moves used_memory without any key."""
    memory, clients = await client.info("memory"), await client.info("clients")
    return int(memory["mem_clients_normal"]), int(clients["connected_clients"])


async def soak(s: Stack, rate: float, seconds: float, retention_s: int, sample_s: float
               ) -> dict[str, Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(s.redis_url, decode_responses=True)
    samples: list[tuple[float, int, int, int]] = []
    t0 = time.perf_counter()
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            used, keys = await _redis_probe(client)
            samples.append((time.perf_counter() - t0, rss_bytes(s.gateway_pid), used, keys))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), sample_s)

    async def load(duration: float, counts: dict[str, dict[str, int]], phases: list[Any]
                   ) -> None:
        async with _session() as session:
            drivers = [_open_loop(session, s.gateway_port, tier, stream, tokens,
                                  rate * part, duration, counts.setdefault(name, {}))
                       for name, tier, stream, part, tokens in SLICES]
            share = 1 - sum(x[3] for x in SLICES)

            async def generator() -> None:
                left = duration
                while left > 0.5:  # one generator process per minute: bounded result files
                    chunk = min(60.0, left)
                    phases.append(await asyncio.to_thread(
                        run_phase, "vip", [s.gateway_port], rate * share, chunk, False,
                        {"gateway": s.gateway_pid}, key=KEYS["vip"], body=CHAT))
                    left -= chunk

            await asyncio.gather(generator(), *drivers)

    sampling = asyncio.create_task(sampler())
    try:
        # A short run first creates what stays by design (buckets, counters, the lease), then
        # the finished records expire: the baseline every later figure is compared with.
        await load(min(10.0, seconds / 4), {}, [])
        await asyncio.sleep(retention_s + 10)
        base_used, base_keys = await _redis_probe(client)
        base_names = sorted(await client.keys("*"))
        base_clients = await _redis_clients(client)
        load_start = time.perf_counter() - t0
        counts: dict[str, dict[str, int]] = {}
        phases: list[Any] = []
        await load(seconds, counts, phases)
        load_end = time.perf_counter() - t0
        await asyncio.sleep(retention_s + 10)
        end_used, end_keys = await _redis_probe(client)
        end_names = sorted(await client.keys("*"))
        end_clients = await _redis_clients(client)
    finally:
        stop.set()
        await sampling
        await client.aclose()
    during = [x for x in samples if load_start <= x[0] <= load_end]
    half = [x for x in during if x[0] >= (load_start + load_end) / 2]
    counts["vip (generator)"] = {
        "200": sum(p.completed for p in phases),
        **{k: v for p in phases for k, v in p.errors.items()}}
    return {
        "rate": rate, "seconds": seconds, "retention_s": retention_s, "samples": samples,
        "load_start": load_start, "load_end": load_end, "counts": counts,
        "gateway_slope": _slope([(t, r) for t, r, _, _ in half]),
        "redis_slope": _slope([(t, u) for t, _, u, _ in half]),
        "gateway_first": during[0][1] if during else 0, "gateway_last": during[-1][1] if during
        else 0, "gateway_max": max((x[1] for x in during), default=0),
        "redis_base": base_used, "redis_end": end_used, "clients_base": base_clients,
        "clients_end": end_clients, "redis_max": max(
            (x[2] for x in during), default=0), "keys_base": base_keys, "keys_end": end_keys,
        "keys_left": sorted(set(end_names) - set(base_names)),
        "keys_gone": sorted(set(base_names) - set(end_names)),
        "p99_ms": [round(p.p99, 2) for p in phases],
    }


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares slope in MB per 10 minutes (0 with fewer than 3 points)."""
    if len(points) < 3:
        return 0.0
    fit = statistics.linear_regression([t for t, _ in points], [v for _, v in points])
    return fit.slope * 600 / 1e6


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x[0] for x in result["samples"]]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot(t, [x[1] / 1e6 for x in result["samples"]], color="tab:blue")
    a.set_ylabel("gateway RSS (MB)")
    b.plot(t, [x[2] / 1e6 for x in result["samples"]], color="tab:red")
    b.set_ylabel("Redis used_memory (MB)")
    b.set_xlabel("seconds")
    for ax in (a, b):
        ax.axvspan(result["load_start"], result["load_end"], color="0.9", label="soak load")
        ax.grid(alpha=0.3)
    a.legend(loc="lower right")
    a.set_title(f"Soak: {result['rate']:.0f} RPS for {result['seconds']:.0f} s "
                f"(records kept {result['retention_s']} s)")
    save_figure(fig, path)


# -- the section ----------------------------------------------------------------------------

def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def run(options: PerfOptions) -> Section:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # each stream holds two sockets in the gateway and one here
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from bench.common.localredis import start_redis

    quick = options.quick
    tasks, streams = (5_000, 200) if quick else (100_000, 2_000)
    soak_s = min(options.soak_s, 20.0) if quick else options.soak_s
    retention_s = 3 if quick else 20
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    print(f"memory: {tasks} queued tasks", flush=True)
    server = start_redis()
    try:
        qm = asyncio.run(measure_queue_memory(server.url, tasks))
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
    print(f"  {qm.bytes_per_task:.0f} B/task in {qm.seconds:.1f} s; {streams} streams", flush=True)
    # One token every 2 s keeps the streams open with few chunks to move (1,000 per second
    # for 2,000 streams), so the reading measures what is held, not the traffic.
    with stack(options.workdir, "GREEN", 2000, retention_s) as s:
        sr = asyncio.run(streams_rss(s, streams, 2000, 300))
    print(f"  RSS {_mb(sr['baseline'])} -> {_mb(sr['loaded'])}; soak {soak_s:.0f} s", flush=True)
    with stack(options.workdir, "YELLOW", 100, retention_s) as s:
        so = asyncio.run(soak(s, 200, soak_s, retention_s, 1.0 if quick else 5.0))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    options.results_dir.mkdir(parents=True, exist_ok=True)
    png = options.results_dir / "performance-memory.png"
    chart(so, png)

    data_delta = (so["redis_end"] - so["clients_end"][0]) - (so["redis_base"]
                                                             - so["clients_base"][0])
    so["data_delta"] = data_delta
    redis_back = abs(data_delta) <= REDIS_BACK_TOLERANCE
    keys_back = so["keys_end"] == so["keys_base"] and not so["keys_left"]
    checks = [
        Check("Redis bytes per queued task", f"<= {MAX_BYTES_PER_TASK} B",
              f"{qm.bytes_per_task:.0f} B", qm.bytes_per_task <= MAX_BYTES_PER_TASK),
        Check(f"gateway RSS with {streams:,} streams in flight", f"<= {MAX_RSS_MB:.0f} MB",
              _mb(sr["loaded"]), sr["loaded"] <= MAX_RSS_MB * 1e6
              and sr["started"] == streams and sr["ended_before_sample"] == 0),
        Check("gateway RSS flat over the soak", f"slope < {MAX_SLOPE_MB_PER_10MIN} MB/10 min",
              f"{so['gateway_slope']:+.2f} MB/10 min",
              abs(so["gateway_slope"]) < MAX_SLOPE_MB_PER_10MIN),
        Check("Redis back to its start after the soak",
              f"same keys; used_memory less client buffers within "
              f"{REDIS_BACK_TOLERANCE // 1024} KB", f"keys {so['keys_base']} -> "
              f"{so['keys_end']}; {data_delta:+,} B", redis_back and keys_back),
    ]
    md = _markdown(qm, sr, so, load_before, load_after, quick)
    data = {"queue": asdict(qm), "streams": sr,
            "soak": {k: v for k, v in so.items() if k != "samples"},
            "soak_samples": so["samples"], "loadavg": [load_before, load_after]}
    return Section("Memory", md, checks, [png], data)


def _markdown(qm: QueueMemory, sr: dict[str, Any], so: dict[str, Any], load_before: list[str],
              load_after: list[str], quick: bool) -> str:
    counts = ["| traffic | answers |", "|---|---|"] + [
        f"| {name} | {', '.join(f'{k}: {v:,}' for k, v in sorted(c.items()))} |"
        for name, c in so["counts"].items()]
    minutes = [x for x in so["samples"] if so["load_start"] <= x[0] <= so["load_end"]]
    step = max(1, len(minutes) // 10)
    trace = ["| t (s) | gateway RSS | Redis used_memory | keys |", "|---:|---:|---:|---:|"] + [
        f"| {t:.0f} | {_mb(r)} | {_mb(u)} | {k:,} |" for t, r, u, k in minutes[::step]]
    return "\n".join([
        *(["**Quick run: small counts and a short soak; the figures are not the targets'.**",
           ""] if quick else []),
        f"Load average (1, 5, 15 min) before: {' '.join(load_before)}, after: "
        f"{' '.join(load_after)}. Redis {qm.redis_version}.",
        "",
        *queue_markdown(qm),
        f"### Gateway RSS with {sr['streams']:,} streams in flight",
        "",
        f"Each stream: {sr['tokens_per_stream']} tokens, one every "
        f"{sr['token_interval_ms']:.0f} ms (instant backend `--token-interval-ms`), VIP, fast "
        f"path. All first chunks after {sr['ramp_s']:.1f} s ({sr['started']:,} of "
        f"{sr['streams']:,}); streams ended before the reading: {sr['ended_before_sample']}; "
        f"opens retried after a failure before the first chunk: {sr['retried'] or 'none'}. "
        f"VmRSS before the load (warm) **{_mb(sr['baseline'])}**, with every stream in "
        f"flight **{_mb(sr['loaded'])}** (readings {', '.join(_mb(x) for x in sr['samples'])})"
        f", so **{sr['per_stream'] / 1e3:.1f} KB per stream**; {_mb(sr['after'])} 5 s after they "
        f"were left (CPython keeps freed arenas). Outcomes: {sr['outcomes']}.",
        "",
        f"### Soak: {so['rate']:.0f} RPS for {so['seconds']:.0f} s",
        "",
        "A fresh gateway, pool YELLOW (VIP takes the fast path; Normal and Batch queue and, "
        "with no scheduler releasing them, leave with 429 after their 1 s queue timeout); "
        f"finished records kept {so['retention_s']} s (`retention_s`) so the steady state is "
        "reached within the run. VIP non-streaming from `bench.perf.httpload` (one process per "
        "minute), the rest from this process:",
        "",
        *counts,
        "",
        f"Generator p99 per minute (ms): {so['p99_ms']}.",
        "",
        f"Gateway RSS: first {_mb(so['gateway_first'])}, last {_mb(so['gateway_last'])}, max "
        f"{_mb(so['gateway_max'])}; slope over the second half **{so['gateway_slope']:+.2f} "
        f"MB per 10 min**. Redis used_memory: peak {_mb(so['redis_max'])}, slope over the "
        f"second half **{so['redis_slope']:+.2f} MB per 10 min**; before the soak "
        f"{so['redis_base']:,} B and {so['keys_base']} keys, after it (and {so['retention_s']}"
        f" s of retention) {so['redis_end']:,} B and {so['keys_end']} keys; keys left: "
        f"{so['keys_left'] or 'none'}; keys gone: {so['keys_gone'] or 'none'}. Client "
        f"connections (`connected_clients`, `mem_clients_normal`): {so['clients_base'][1]} "
        f"holding {so['clients_base'][0]:,} B before, {so['clients_end'][1]} holding "
        f"{so['clients_end'][0]:,} B after (the gateway's pool keeps what it opened under "
        "load), so used_memory less client buffers moved by "
        f"**{so['data_delta']:+,} B**. The second-half slope of Redis is that of the finished "
        f"records kept {so['retention_s']} s, which follow the load's own swings.",
        "",
        *trace,
        "",
        "![memory over the soak](performance-memory.png)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.memory",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--soak-s", type=float, default=600.0)
    p.add_argument("--output", default=str(ROOT / "bench/results/perf-memory-draft.md"))
    args = p.parse_args(argv)
    output = Path(args.output)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-memory-"))
    try:
        section = run(PerfOptions(output.parent, workdir, quick=args.quick,
                                  soak_s=args.soak_s))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    checks = ["| check | target | measured | met |", "|---|---|---|---|"] + [
        f"| {c.name} | {c.target} | {c.value} | {'yes' if c.met else 'NO'} |"
        for c in section.checks]
    text = "\n".join([f"# {section.title}", "", f"`python -m bench.perf.memory` on "
                      f"{time.strftime('%Y-%m-%d %H:%M')}.", "", *checks, "",
                      section.markdown, ""])
    output.write_text(text)
    print(text)
    return 0 if all(c.met for c in section.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
