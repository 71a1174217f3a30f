"""Failover with real processes: two `python -m scheduler` replicas, the leader SIGKILLed while
tasks are queued and being released. The standby leads within 2 s, no task is released twice
and none is lost, the dead leader's epoch is refused, and SIGTERM hands over at once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from admission.errors import FencedError
from admission.keys import SchedulerKeys
from admission.localredis import free_port
from admission.scripts import register_scripts
from admission.store import AdmitOutcome, PoolPolicy, PoolStore
from admission.tiers import Tier
from tests.scheduler_stub import FakeVllm, admit, reserved, serve_fake

ROOT = Path(__file__).resolve().parent.parent
TASKS = 400
COST = 2_000  # 39 fit in the 78,000-token budget at a time
HOLD_S = 0.05


def write_config(path: Path, redis_url: str, backend: str) -> None:
    path.write_text(
        f'[redis]\nurl = "{redis_url}"\n\n'
        "[scheduler]\npoll_interval_ms = 20\nleader_ttl_ms = 1000\nreap_interval_ms = 200\n\n"
        f'[[pools]]\nname = "p"\n\n[[pools.backends]]\nname = "n1"\nurl = "{backend}"\n'
    )


def spawn(config: Path, replica: str, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.Popen(
        [sys.executable, "-m", "scheduler", "--config", str(config), "--id", replica,
         "--port", str(port), "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


async def wait_healthy(port: int, deadline: float) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
                    if r.status == 200:
                        return
            assert time.monotonic() < deadline, f"replica on {port} never answered"
            await asyncio.sleep(0.02)


async def holder(client: Any) -> str | None:
    raw = await client.get(SchedulerKeys().leader)
    return raw.decode() if raw else None


class Gateway:
    """Plays the gateway: hears wake-ups, falls back to the task records, and holds each
    released task for HOLD_S (the request running on the GPU) before settling it."""

    def __init__(self, store: PoolStore) -> None:
        self.store = store
        self.notified: collections.Counter[str] = collections.Counter()
        self.done: set[str] = set()
        self.settled: set[str] = set()
        self.running: set[asyncio.Task[None]] = set()

    async def finish(self, task_id: str) -> None:
        if task_id not in self.done:
            self.done.add(task_id)
            task = asyncio.create_task(self._settle(task_id))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _settle(self, task_id: str) -> None:
        await asyncio.sleep(HOLD_S)
        result = await self.store.settle(task_id, COST // 2)
        assert result.previous == "released", (task_id, result)
        self.settled.add(task_id)

    async def listen(self) -> None:
        pubsub = self.store.client.pubsub()
        await pubsub.subscribe(self.store.keys.wake_channel("gw"))
        try:
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None:
                    task_id, node = message["data"].decode().split(" ")
                    assert node == "n1"
                    self.notified[task_id] += 1
                    await self.finish(task_id)
        finally:
            await pubsub.aclose()

    async def fallback(self) -> None:
        """What a gateway does when a wake-up is lost: read the record of what it waits for."""
        while True:
            await asyncio.sleep(0.1)
            for raw in await self.store.client.smembers(self.store.keys.gateway_tasks_key("gw")):
                task_id = raw.decode()
                if (await self.store.task(task_id) or {}).get("state") == "released":
                    await self.finish(task_id)


async def test_sigkill_leader_standby_takes_over_without_loss_or_duplicates(
    redis_client: Any, redis_url: str, tmp_path: Path
) -> None:
    async with serve_fake(FakeVllm()) as backend:
        config = tmp_path / "kvgate.toml"
        write_config(config, redis_url, backend)
        ports = {"a": free_port(), "b": free_port()}
        procs = {name: spawn(config, name, port) for name, port in ports.items()}
        store = PoolStore(redis_client, register_scripts(redis_client), "p", PoolPolicy())
        gateway = Gateway(store)
        workers = [asyncio.create_task(gateway.listen()), asyncio.create_task(gateway.fallback())]
        try:
            start_deadline = time.monotonic() + 20
            for port in ports.values():
                await wait_healthy(port, start_deadline)
            while await holder(redis_client) is None:
                assert time.monotonic() < start_deadline
                await asyncio.sleep(0.01)
            leader = await holder(redis_client)
            assert leader is not None
            standby = "b" if leader == "a" else "a"
            for i in range(TASKS):
                result = await admit(store, f"t{i:03d}", Tier.NORMAL, COST)
                if result.outcome is AdmitOutcome.RELEASED:  # the fast path: no wake-up
                    await gateway.finish(f"t{i:03d}")
                else:
                    assert result.outcome is AdmitOutcome.QUEUED
            old_epoch = int(await redis_client.get(SchedulerKeys().epoch))

            while len(gateway.done) < 100:  # releases are under way
                assert time.monotonic() < start_deadline
                await asyncio.sleep(0.002)
            procs[leader].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            assert await redis_client.zcard(store.keys.queue(Tier.NORMAL)) > 0

            while await holder(redis_client) != standby:
                assert time.monotonic() - killed_at < 2.0, "standby did not lead within 2 s"
                await asyncio.sleep(0.01)
            took = time.monotonic() - killed_at

            while len(gateway.settled) < TASKS:
                assert time.monotonic() - killed_at < 15.0, f"only {len(gateway.done)} released"
                await asyncio.sleep(0.01)

            assert gateway.done == {f"t{i:03d}" for i in range(TASKS)}  # none lost
            assert (await redis_client.hget(store.keys.state, "leader")).decode() == standby
            assert max(gateway.notified.values()) == 1  # none woken twice
            stats = await redis_client.hgetall(store.keys.stats)
            assert int(stats[b"released_1"]) == TASKS  # none released twice
            assert await reserved(store) == {}
            new_epoch = int(await redis_client.get(SchedulerKeys().epoch))
            assert new_epoch > old_epoch
            try:
                await store.release(old_epoch, (10, 10, 10))
            except FencedError as exc:
                assert exc.current == new_epoch
            else:
                raise AssertionError("a release with the dead leader's epoch was accepted")
            assert took < 2.0
            print(f"standby led {took * 1000:.0f} ms after the SIGKILL")

            # SIGTERM: the new leader resigns before anything else; the lease is free at once.
            procs[standby].send_signal(signal.SIGTERM)
            termed_at = time.monotonic()
            while await holder(redis_client) is not None:
                assert time.monotonic() - termed_at < 0.5, "SIGTERM did not free the lease"
                await asyncio.sleep(0.005)
            assert procs[standby].wait(timeout=5) == 0
        finally:
            pending = [*workers, *gateway.running]
            for worker in pending:
                worker.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=5)
                if proc.stderr is not None:
                    proc.stderr.close()
