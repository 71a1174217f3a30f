"""One arm's services for the fairness experiment: simulated vLLM nodes, a private Redis, two
schedulers (one leads, one stands by) and two gateways, all child processes stopped by PID.

Every arm gets fresh nodes and a fresh Redis, and the same engine and pool configuration; only
`[pools.fairness] enabled` and the tenants (who sends, with which weight) differ between arms.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from admission.config import ControlSettings, EngineSettings
from admission.keys import PoolKeys, SchedulerKeys
from bench.burst.monitor import parse_metrics
from bench.common.localredis import LocalRedis, free_port, start_redis
from bench.common.procs import Child, python_module, spawn, wait_http_ok
from bench.sim.cluster import SimCluster
from bench.sim.config import DEFAULT_MODEL, SimConfig

POOL = "fair"
_GATEWAY_READY = re.compile(r"listening on (http://\S+)")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class LabSettings:
    nodes: int = 2
    capacity_scale: float = 0.25
    """Quarter-size nodes (27k x 0.25 blocks of 16 tokens each)..."""
    time_scale: float = 8.0
    """...whose clock runs 8x faster than the wall: the reduced scale of the burst lab."""
    max_model_len: int = 4_096
    queue_timeout_ms: int = 30_000
    """Normal's queue timeout (wall ms)."""
    leader_ttl_ms: int = 1_500
    """The shipped default: a standby takes over at most this long after the leader dies."""

    def sim_config(self, index: int) -> SimConfig:
        return SimConfig(model=DEFAULT_MODEL, max_model_len=self.max_model_len,
                         time_scale=self.time_scale, capacity_scale=self.capacity_scale,
                         seed=index, lag_window_s=2.0)


def api_key(tenant: str) -> str:
    return f"sk-fair-{tenant}"


def kvgate_toml(lab: LabSettings, redis_url: str, nodes: Sequence[str],
                tenants: Sequence[Tenant], fair: bool, scheduler_port: int) -> str:
    """Both services' configuration: shipped defaults converted to the lab clock's units (as
    the burst lab converts them: bench.burst.expconfig.control_on_the_lab_clock), generous
    buckets (quotas are not what is measured), and `fair` as the release order."""
    speed, k = lab.time_scale, lab.capacity_scale
    c, e = ControlSettings(), EngineSettings()
    lines = [
        "[redis]", f'url = "{redis_url}"', "max_connections = 256", "",
        "[gateway]", 'host = "127.0.0.1"', "port = 0", "access_log = false",
        "retention_s = 3600", "",
        "[scheduler]", 'host = "127.0.0.1"', f"port = {scheduler_port}",
        f"leader_ttl_ms = {lab.leader_ttl_ms}", "",
        "[tiers.normal]", f"queue_timeout_ms = {lab.queue_timeout_ms}", "",
        "[[pools]]", f'name = "{POOL}"', f'served_model_name = "{DEFAULT_MODEL}"',
        f"context_length = {lab.max_model_len}", f"max_max_tokens = {lab.max_model_len}",
        "backends = [",
        *(f'    {{ name = "node-{i}", url = "{u}" }},' for i, u in enumerate(nodes)),
        "]", "",
        "[pools.fairness]", f"enabled = {'true' if fair else 'false'}", "",
        "[pools.control]",
        f"vip_ttft_objective_ms = {max(1, round(c.vip_ttft_objective_ms / speed))}",
        f"prefill_tokens_per_s = {max(1, round(c.prefill_tokens_per_s * k * speed))}",
        f"signal_stale_ms = {max(1, round(c.signal_stale_ms / speed))}",
        f"window_min_tokens = {max(1, round(c.window_min_tokens * k))}",
        f"window_max_tokens = {max(1, round(c.window_max_tokens * k))}",
        f"running_min = {max(1, round(c.running_min * k)) if c.running_min else 0}", "",
        "[pools.engine]",
        f"prefill_us_per_token = {max(1, round(e.prefill_us_per_token / (k * speed)))}", "",
    ]
    for t in tenants:
        digest = hashlib.sha256(api_key(t.name).encode()).hexdigest()
        lines += ["[[tenants]]", f'name = "{t.name}"', 'tier = "normal"',
                  f'key_sha256 = ["{digest}"]', "rate = 100000000", "burst = 100000000",
                  f"weight = {t.weight}", ""]
    return "\n".join(lines)


@dataclass
class Lab:
    """The running services of one arm."""

    lab: LabSettings
    log_dir: Path
    cluster: SimCluster | None = None
    redis: LocalRedis | None = None
    schedulers: list[Child] = field(default_factory=list)
    gateways: list[Child] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)
    client: aioredis.Redis | None = None

    @property
    def keys(self) -> PoolKeys:
        return PoolKeys(POOL)

    async def start(self, tenants: Sequence[Tenant], fair: bool) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        configs = [self.lab.sim_config(i) for i in range(self.lab.nodes)]
        self.cluster = await asyncio.to_thread(SimCluster.start, configs,
                                               log_dir=self.log_dir / "nodes")
        self.redis = await asyncio.to_thread(start_redis)
        ports = [free_port() for _ in range(2)]
        config = self.log_dir / "kvgate.toml"
        config.write_text(kvgate_toml(self.lab, self.redis.url, self.cluster.urls, tenants,
                                      fair, ports[0]))
        for i, port in enumerate(ports):
            child = spawn(f"scheduler-{i}", python_module(
                "scheduler", "--config", str(config), "--id", f"sched-{i}", "--port", str(port),
                "--log-level", "WARNING"), self.log_dir)
            self.schedulers.append(child)
            await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{port}/healthz", child)
        for i in range(2):
            child = await asyncio.to_thread(spawn, f"gateway-{i}", python_module(
                "gateway", "--config", str(config), "--id", f"gw-{i}", "--port", "0",
                "--log-level", "WARNING"), self.log_dir, ready=_GATEWAY_READY, timeout=60.0)
            self.gateways.append(child)
            match = _GATEWAY_READY.search(child.ready_line)
            assert match is not None
            self.gateway_urls.append(match.group(1))
            await asyncio.to_thread(wait_http_ok, self.gateway_urls[-1] + "/readyz", child)
        self.client = aioredis.Redis.from_url(self.redis.url)
        await self._wait_state()

    async def _wait_state(self, limit_s: float = 30.0) -> None:
        assert self.client is not None
        deadline = time.monotonic() + limit_s
        while await self.client.hlen(self.keys.node_capacity) < self.lab.nodes:
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler published no capacity for every node")
            await asyncio.sleep(0.1)

    async def redis_now_us(self) -> int:
        assert self.client is not None
        seconds, micros = await self.client.time()
        return int(seconds) * 1_000_000 + int(micros)

    async def kill_leader(self) -> str:
        """SIGKILL the scheduler that holds the lease (a crash: no resignation); its id."""
        assert self.client is not None
        raw = await self.client.get(SchedulerKeys().leader)
        leader = raw.decode() if isinstance(raw, bytes) else str(raw)
        index = int(leader.rsplit("-", 1)[1])
        self.schedulers[index].process.kill()
        return leader

    async def engine_tokens(self) -> float:
        """Prompt plus generated tokens every node's engine has computed so far (the vLLM
        counters): the work the pool did, whether or not its requests have completed yet."""
        assert self.cluster is not None
        total = 0.0
        async with aiohttp.ClientSession() as session:
            for url in self.cluster.urls:
                async with session.get(url + "/metrics") as r:
                    sample = parse_metrics(await r.text())
                total += sample.prompt_tokens + sample.generation_tokens
        return total

    async def task_records(self) -> list[dict[str, str]]:
        """Every task record of the pool (retention 1 h: all of the arm's)."""
        assert self.client is not None
        out = []
        pattern = self.keys.task_key("*")
        names = [k async for k in self.client.scan_iter(match=pattern, count=1000)]
        for start in range(0, len(names), 500):
            async with self.client.pipeline(transaction=False) as pipe:
                for name in names[start:start + 500]:
                    pipe.hgetall(name)
                for raw in await pipe.execute():
                    out.append({k.decode(): v.decode() for k, v in raw.items()})
        return out

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        for child in reversed(self.gateways + self.schedulers):
            await asyncio.to_thread(child.stop)
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
        if self.redis is not None:
            await asyncio.to_thread(self.redis.stop)
            shutil.rmtree(self.redis.workdir, ignore_errors=True)
