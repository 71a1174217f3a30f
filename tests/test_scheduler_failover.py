"""Failover with real processes: two `python -m scheduler` replicas, the leader SIGKILLed while
tasks are queued and being released. The standby leads once the dead leader's lease expires,
releases all the work the dead leader left, no task is released twice and none is lost, the
dead leader's epoch is refused, and SIGTERM hands over at once.

The premise holds by construction, not by timing: the stand-in gateway settles only the first
SETTLE_BEFORE_KILL tasks and holds every other released task (its reservation stays on the
node) until the standby leads. The node's budget bounds what can be released and not settled
(MAX_OUTSTANDING), so whatever the machine's load, the dead leader can have released at most
SETTLE_BEFORE_KILL + MAX_OUTSTANDING of the TASKS, and the standby must release the rest.
The test waits for conditions (polling Redis or its own counters with deadlines), never for
a guessed time."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp

from admission.config import ZoneSettings
from admission.errors import FencedError
from admission.keys import SchedulerKeys
from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore
from admission.tiers import Tier
from bench.common.localredis import free_port
from tests.scheduler_stub import FakeVllm, admit, reserved, serve_fake

ROOT = Path(__file__).resolve().parent.parent
TASKS = 400
COST = 2_000  # 39 fit in the 78,000-token budget at a time without overcommit
HOLD_S = 0.05
LEADER_TTL_MS = 1_000
SETTLE_BEFORE_KILL = 100
_fake, _zones = FakeVllm(), ZoneSettings()
assert _fake.num_gpu_blocks is not None
MAX_OUTSTANDING = math.ceil(_fake.num_gpu_blocks * _fake.block_size * _zones.kv_target
                            * _zones.max_overcommit) // COST
"""Released and not settled, at most, whatever the learned usage: the node's budget never
exceeds kv_target x max_overcommit of its KV (scheduler.budget). 117 tasks here, so with
SETTLE_BEFORE_KILL settled at most 217 of the TASKS can be released before the takeover."""
assert SETTLE_BEFORE_KILL + MAX_OUTSTANDING < TASKS
DEADLINE_S = 30.0
"""Only a bound on waiting for a condition that must come (a failure, not a premise)."""


def write_config(path: Path, redis_url: str, backend: str) -> None:
    path.write_text(
        f'[redis]\nurl = "{redis_url}"\n\n'
        f"[scheduler]\npoll_interval_ms = 20\nleader_ttl_ms = {LEADER_TTL_MS}\n"
        "reap_interval_ms = 200\n\n"
        f'[[pools]]\nname = "p"\n\n[[pools.backends]]\nname = "n1"\nurl = "{backend}"\n'
    )


def spawn(config: Path, replica: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    # stderr to a file, not a pipe nobody reads: a full pipe would stall the replica.
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "scheduler", "--config", str(config), "--id", replica,
             "--port", str(port), "--log-level", "WARNING"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
        )


async def until(condition: Callable[[], Awaitable[bool]], what: str,
                timeout_s: float = DEADLINE_S) -> float:
    """Poll `condition` until true; returns the seconds it took, fails after `timeout_s`."""
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def healthy(session: aiohttp.ClientSession, port: int) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
            return r.status == 200
    return False


async def holder(client: Any) -> str | None:
    raw = await client.get(SchedulerKeys().leader)
    return raw.decode() if raw else None


class Gateway:
    """Plays the gateway: hears wake-ups, falls back to the task records, renews its lease,
    and holds each released task for HOLD_S (the request running on the GPU) before settling
    it. Only the first `early` tasks settle before `gate` opens; the others hold their
    reservation until then, so the pool's budget stays used up."""

    def __init__(self, store: PoolStore, early: int) -> None:
        self.store = store
        self.early = early
        self.gate = asyncio.Event()
        self.notified: collections.Counter[str] = collections.Counter()
        self.done: set[str] = set()
        self.settling: set[str] = set()
        self.settled: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.errors: list[BaseException] = []
        self.closing = False

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.errors.append(error)

    def check(self) -> None:
        """Fail with what went wrong in the gateway's own tasks, not with a timeout later."""
        if self.errors:
            raise AssertionError(f"gateway task failed: {self.errors[0]!r}") from self.errors[0]

    async def close(self) -> None:
        """Stop every task. The loops also end by themselves once `closing` is set, because
        a cancel() can be lost: on Python 3.11 asyncio.wait_for returns the result instead of
        raising when its inner future finishes at the same time (CPython gh-86296), and
        redis-py uses it in the handshake of every new pooled connection. The fallback loop
        went on polling after cancel(), and the test hung in its teardown."""
        self.closing = True
        self.gate.set()
        while self.tasks:
            for task in list(self.tasks):
                task.cancel()
            await asyncio.wait(list(self.tasks), timeout=1.0)

    async def finish(self, task_id: str) -> None:
        if task_id not in self.done:
            self.done.add(task_id)
            self.start(self._settle(task_id))

    async def _settle(self, task_id: str) -> None:
        await asyncio.sleep(HOLD_S)
        if not self.gate.is_set() and len(self.settling) >= self.early:
            await self.gate.wait()
            if self.closing:
                return
        self.settling.add(task_id)
        result = await self.store.settle(task_id, COST // 2)
        assert result.previous == "released", (task_id, result)
        self.settled.add(task_id)

    async def listen(self, pubsub: Any) -> None:
        while not self.closing:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                task_id, node = message["data"].decode().split(" ")
                assert node == "n1"
                self.notified[task_id] += 1
                await self.finish(task_id)

    async def fallback(self) -> None:
        """What a gateway does when a wake-up is lost: read the record of what it waits for."""
        while not self.closing:
            await asyncio.sleep(0.1)
            for raw in await self.store.client.smembers(self.store.keys.gateway_tasks_key("gw")):
                task_id = raw.decode()
                if (await self.store.task(task_id) or {}).get("state") == "released":
                    await self.finish(task_id)

    async def renew(self) -> None:
        """A live gateway renews its lease: however slow the run, the reaper takes nothing."""
        while not self.closing:
            await self.store.renew("gw")
            await asyncio.sleep(self.store.policy.lease_ttl_ms / 1000 / 4)


async def test_sigkill_leader_standby_takes_over_without_loss_or_duplicates(
    redis_client: Any, redis_url: str, tmp_path: Path
) -> None:
    keys = SchedulerKeys()
    async with serve_fake(FakeVllm()) as backend:
        config = tmp_path / "kvgate.toml"
        write_config(config, redis_url, backend)
        ports = {"a": free_port(), "b": free_port()}
        logs = {name: tmp_path / f"scheduler-{name}.log" for name in ports}
        procs = {name: spawn(config, name, port, logs[name]) for name, port in ports.items()}
        store = PoolStore(redis_client, register_scripts(redis_client), "p", PoolPolicy())
        gateway = Gateway(store, SETTLE_BEFORE_KILL)
        wakeups = redis_client.pubsub()
        await wakeups.subscribe(store.keys.wake_channel("gw"))  # before any release
        handover = redis_client.pubsub()
        await handover.subscribe(keys.handover)
        gateway.start(gateway.listen(wakeups))
        gateway.start(gateway.fallback())
        try:
            async with aiohttp.ClientSession() as session:
                for port in ports.values():
                    await until(functools.partial(healthy, session, port), f"replica on {port}")

            async def someone_leads() -> bool:
                return await holder(redis_client) is not None

            await until(someone_leads, "a leader")
            fast = 0
            for i in range(TASKS):
                result = await admit(store, f"t{i:03d}", Tier.NORMAL, COST)
                if result.outcome is AdmitOutcome.RELEASED:  # the fast path: no wake-up
                    fast += 1
                    await gateway.finish(f"t{i:03d}")
                else:
                    assert result.outcome is AdmitOutcome.QUEUED
            gateway.start(gateway.renew())
            assert fast < SETTLE_BEFORE_KILL  # so more released than that is the leader's

            async def released() -> int:
                return int(await redis_client.hget(store.keys.stats, "released_1") or 0)

            # Releases are under way: the early settles are done and the leader has released
            # from the queue since (more than the fast path and the early settles account
            # for). Everything else released stays held, so the leader is now stuck at the
            # budget with most of the queue left.
            async def leader_released_after_settles() -> bool:
                gateway.check()
                return (len(gateway.settled) == SETTLE_BEFORE_KILL
                        and await released() > SETTLE_BEFORE_KILL)

            await until(leader_released_after_settles, "releases under way")

            # SIGKILL whoever holds the lease right now (under load it may have changed hands
            # since the start); after its death the lease still names it with the same epoch,
            # which proves it held the lease, unbroken, when it was killed.
            async with redis_client.pipeline(transaction=True) as pipe:
                pipe.get(keys.leader)
                pipe.get(keys.epoch)
                leader_raw, epoch_raw = await pipe.execute()
            assert leader_raw is not None, "nobody leads"
            leader = leader_raw.decode()
            standby = "b" if leader == "a" else "a"
            old_epoch = int(epoch_raw)
            procs[leader].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            assert procs[leader].wait(timeout=DEADLINE_S) == -signal.SIGKILL
            async with redis_client.pipeline(transaction=True) as pipe:
                pipe.get(keys.leader)
                pipe.get(keys.epoch)
                pipe.pttl(keys.leader)
                after_raw, epoch_after, lease_left_ms = await pipe.execute()
            assert after_raw is not None and after_raw.decode() == leader, (
                f"the lease changed hands before the kill took effect: {after_raw!r}")
            assert int(epoch_after) == old_epoch
            assert lease_left_ms > 0
            assert procs[standby].poll() is None

            async def standby_leads() -> bool:
                return await holder(redis_client) == standby

            await until(standby_leads, "the standby to lead")
            took = time.monotonic() - killed_at
            new_epoch = int(await redis_client.get(keys.epoch))
            assert new_epoch > old_epoch

            # Nothing settled beyond the early ones, so nothing more could be released than
            # the budget holds: the dead leader left work that only the standby can release.
            async with redis_client.pipeline(transaction=True) as pipe:
                pipe.hget(store.keys.stats, "released_1")
                pipe.zcard(store.keys.queue(Tier.NORMAL))
                released_raw, queued = await pipe.execute()
            released_at_takeover = int(released_raw)
            assert len(gateway.settled) == SETTLE_BEFORE_KILL
            assert SETTLE_BEFORE_KILL < released_at_takeover <= (
                SETTLE_BEFORE_KILL + MAX_OUTSTANDING)
            assert queued == TASKS - released_at_takeover > 0
            gateway.gate.set()  # capacity comes back only now, under the new leader

            async def all_settled() -> bool:
                gateway.check()
                return len(gateway.settled) == TASKS

            await until(all_settled, f"all settled (only {len(gateway.done)} released)")

            gateway.check()
            assert gateway.done == {f"t{i:03d}" for i in range(TASKS)}  # none lost
            state_leader = await redis_client.hget(store.keys.state, "leader")
            assert state_leader is not None and state_leader.decode() == standby
            assert max(gateway.notified.values()) == 1  # none woken twice
            assert await released() == TASKS  # none released twice
            assert await redis_client.zcard(store.keys.queue(Tier.NORMAL)) == 0
            assert await reserved(store) == {}
            try:
                await store.release(old_epoch, (10, 10, 10))
            except FencedError as exc:
                assert exc.current >= new_epoch
            else:
                raise AssertionError("a release with the dead leader's epoch was accepted")
            # The standby could not lead before the lease ran out, and took over about one
            # retry after it did (it retries when the lease is due to end, or every ttl/3).
            assert took * 1000 >= lease_left_ms - 5  # PTTL is rounded to ms
            assert took < LEADER_TTL_MS / 1000 + 1.5, f"standby led {took:.2f} s after"
            print(f"standby led {took * 1000:.0f} ms after the SIGKILL (lease left "
                  f"{lease_left_ms} ms) and released at least "
                  f"{TASKS - released_at_takeover} tasks")

            # SIGTERM: the new leader resigns before anything else: the lease is freed and
            # the handover announced, not left to expire.
            await until(standby_leads, "the standby to lead before SIGTERM")
            procs[standby].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + DEADLINE_S
            message = None
            while message is None:
                assert time.monotonic() < deadline, "SIGTERM did not announce a handover"
                message = await handover.get_message(ignore_subscribe_messages=True,
                                                     timeout=1.0)
            assert message["data"].decode() == standby
            assert await holder(redis_client) is None
            assert procs[standby].wait(timeout=DEADLINE_S) == 0
        finally:
            await gateway.close()
            for pubsub in (wakeups, handover):
                await pubsub.aclose()
            for name, proc in procs.items():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=5)
                text = logs[name].read_text(errors="replace").strip()
                if text:
                    print(f"--- scheduler {name} stderr:\n{text}")
