"""What the chaos scenarios share: their configuration (short leases and intervals), a paced
load generator that records a terminal answer (or the error) for every request it sends, the
budget-conservation check read from Redis, a delaying TCP proxy, and the results table."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from admission.keys import PoolKeys
from admission.store import MICRO
from tests.gateway_harness import KEYS, POOL, config_data

LEASE_TTL_MS = 1000
RENEW_MS = 300
REAP_MS = 200
LEADER_TTL_MS = 1000
POLL_MS = 50
FALLBACK_MS = 200
UPSTREAM_TIMEOUT_MS = 1500
UPSTREAM_MS_PER_OUTPUT_TOKEN = 25
SCRAPE_TIMEOUT_MS = 100
EJECT_AFTER = 3


def chaos_config(redis_url: str, backends: list[str], *, capacity_tokens: int | None = None,
                 gateway: dict[str, Any] | None = None,
                 scheduler: dict[str, Any] | None = None,
                 redis: dict[str, Any] | None = None) -> dict[str, Any]:
    data = config_data(redis_url, backends, **{
        "lease_ttl_ms": LEASE_TTL_MS, "renew_interval_ms": RENEW_MS,
        "wake_fallback_ms": FALLBACK_MS, "upstream_timeout_ms": UPSTREAM_TIMEOUT_MS,
        "upstream_ms_per_output_token": UPSTREAM_MS_PER_OUTPUT_TOKEN, "access_log": False,
        **(gateway or {})})
    data["redis"].update(redis or {})
    data["scheduler"] = {
        "poll_interval_ms": POLL_MS, "leader_ttl_ms": LEADER_TTL_MS,
        "reap_interval_ms": REAP_MS, "scrape_timeout_ms": SCRAPE_TIMEOUT_MS,
        "eject_after_failures": EJECT_AFTER, **(scheduler or {}),
    }
    pool = data["pools"][0]
    pool["stale_after_ms"] = 2000
    if capacity_tokens is not None:
        for backend in pool["backends"]:
            backend["capacity_tokens"] = capacity_tokens
    return data


# --- load ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    tag: str
    started: float
    """time.monotonic() when sent."""
    ended: float
    wall_ended: float
    """time.time() at the answer (comparable with Redis TIME on this machine)."""
    status: int | None
    """None: no HTTP answer (connection error or client timeout, see `error`)."""
    error: str | None = None
    code: str | None = None
    task_id: str | None = None
    retry_after: str | None = None
    should_retry: str | None = None
    """The answer's `x-should-retry` header, if any."""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Load:
    """`workers` loops, each sending one request at a time every `pace_s` until `stop`."""

    url: str
    who: str
    tag: str
    workers: int = 2
    pace_s: float = 0.05
    max_tokens: int = 8
    timeout_s: float = 15.0
    results: list[Outcome] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"model": POOL, "messages": [{"role": "user", "content": "chaos"}],
                "max_tokens": self.max_tokens}

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._worker(http, stop) for _ in range(self.workers)))

    async def _worker(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.results.append(await send(http, self.url, self.who, self.body(), self.tag))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.pace_s)

    def statuses(self) -> Counter[int | None]:
        return Counter(r.status for r in self.results)


async def send(http: aiohttp.ClientSession, url: str, who: str, body: dict[str, Any],
               tag: str) -> Outcome:
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {KEYS.get(who, who)}"}
    try:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers=headers) as response:
            payload = await response.read()
            code = None
            if response.status >= 400:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code = json.loads(payload)["error"]["code"]
            return Outcome(tag, started, time.monotonic(), time.time(), response.status,
                           code=code, task_id=response.headers.get("X-Request-Id"),
                           retry_after=response.headers.get("Retry-After"),
                           should_retry=response.headers.get("x-should-retry"))
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(tag, started, time.monotonic(), time.time(), None,
                       error=type(exc).__name__)


async def run_for(loads: list[Load], seconds: float, stop: asyncio.Event | None = None
                  ) -> asyncio.Task[Any]:
    """Start `loads` in the background; they stop after `seconds` (or when `stop` is set)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_later(seconds, stop.set)
    return asyncio.ensure_future(asyncio.gather(*(load.run(stop) for load in loads)))


async def until(check: Callable[[], Any], within_s: float, interval_s: float = 0.02) -> float:
    """Until the awaitable `check()` is true; returns the seconds it took."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > within_s:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


def answered(results: list[Outcome]) -> bool:
    """Every request got an HTTP answer (none left hanging, none timed out client-side)."""
    return all(r.status is not None for r in results)


# --- Redis: conservation ---------------------------------------------------------------------


async def task_records(redis: Any, pool: str = POOL) -> dict[str, dict[str, str]]:
    keys = PoolKeys(pool)
    names = [k async for k in redis.scan_iter(match=keys.task_key("*"), count=1000)]
    records: dict[str, dict[str, str]] = {}
    for start in range(0, len(names), 500):
        chunk = names[start:start + 500]
        async with redis.pipeline(transaction=False) as pipe:
            for name in chunk:
                pipe.hgetall(name)
            replies = await pipe.execute()
        for name, raw in zip(chunk, replies, strict=True):
            text = name.decode() if isinstance(name, bytes) else name
            records[text.rsplit(":", 1)[1]] = {k.decode(): v.decode() for k, v in raw.items()}
    return records


async def settled(redis: Any, within_s: float, pool: str = POOL) -> dict[str, dict[str, str]]:
    """Until no task is queued or released (every one settled, cancelled, reaped or expired);
    returns the records."""
    deadline = time.monotonic() + within_s
    while True:
        records = await task_records(redis, pool)
        live = [r for r in records.values() if r.get("state") in ("queued", "released")]
        if not live:
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(live)} tasks still live: {live[:3]}")
        await asyncio.sleep(0.05)


async def assert_conserved(redis: Any, pool: str = POOL) -> dict[str, int]:
    """Budget conservation, read in one MULTI: node_reserved is exactly the sum of the costs of
    the released (unfinished) task records per node; queue and tenant counts match the queued
    records; every bucket is within 0..burst. Returns the count of records per state."""
    keys = PoolKeys(pool)
    records = await task_records(redis, pool)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.node_reserved)
        pipe.hgetall(keys.tenant_queued)
        for queue in keys.queues:
            pipe.zrange(queue, 0, -1)
        replies = await pipe.execute()
    reserved = {k.decode(): int(v) for k, v in replies[0].items()}
    expected: Counter[str] = Counter()
    queued_by_tenant: Counter[str] = Counter()
    for record in records.values():
        if record.get("state") == "released":
            expected[record["node"]] += int(record["cost"])
        if record.get("state") == "queued":
            queued_by_tenant[record["tenant"]] += 1
    assert reserved == {n: c for n, c in expected.items() if c}, (reserved, expected)
    assert all(v >= 0 for v in reserved.values())
    tenant_queued = {k.decode(): int(v) for k, v in replies[1].items()}
    assert tenant_queued == dict(queued_by_tenant), (tenant_queued, queued_by_tenant)
    in_queues = {m.decode() for q in replies[2:] for m in q}
    queued_ids = {i for i, r in records.items() if r.get("state") == "queued"}
    assert in_queues == queued_ids
    async for name in redis.scan_iter(match=keys.bucket_key("*"), count=1000):
        level, burst = await redis.hmget(name, "micro_tokens", "burst")
        assert 0 <= int(level) <= int(burst) * MICRO, (name, level, burst)
    return dict(Counter(r.get("state", "?") for r in records.values()))


async def stats(redis: Any, pool: str = POOL) -> dict[str, int]:
    raw = await redis.hgetall(PoolKeys(pool).stats)
    return {k.decode(): int(v) for k, v in raw.items()}


# --- process metrics -------------------------------------------------------------------------


async def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these labels) on a Prometheus page."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, (
        f"{name} is not on {url}/metrics")
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# --- a TCP proxy that makes Redis slow -------------------------------------------------------


class DelayProxy:
    """Forwards loopback TCP to `target_port`, holding every chunk `delay_s` (changeable at any
    time) before passing it on, in order, in both directions."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer)),
                 asyncio.ensure_future(self._pump(up_reader, writer))]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            w.close()
            self._writers.discard(w)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            sender.cancel()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self._writers):
            w.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


# --- results table ---------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    load: str
    outcome: str
    figures: dict[str, Any]


REPORT_ENV = "KVGATE_CHAOS_REPORT"


def report(row: Row) -> None:
    """Appends the row to the JSON-lines file named by $KVGATE_CHAOS_REPORT, if set (the
    table of docs/reliability.md is made from it)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
