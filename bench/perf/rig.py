"""The rig of performance sections 2 and 3: one private redis-server, the instant backend as the
only node, and gateway processes started and stopped on them.

Its own module so that `bench.perf.scale` (section 2, which drives the rig) and
`bench.perf.redis_cost` (section 3, which measures Redis on it) both import it without importing
each other.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis

from admission.keys import PoolKeys
from bench.common.localredis import LocalRedis, start_redis
from bench.perf.gateway_overhead import POOL, gateway_config
from bench.perf.httpload import publish_state_once, start_server, stop_processes

BENCH_POOL = "rbench"  # redis-benchmark's admits go to a pool of their own
RENEW_INTERVAL_MS = 3_000
"""The gateways' lease renewal in these runs: background traffic, counted apart."""


class Rig:
    """The shared redis-server and backend, and the gateways started on them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        self.redis: LocalRedis = start_redis(workdir=workdir / "redis")
        self.client = redis.Redis.from_url(self.redis.url)
        try:
            self.backend, self.backend_port = start_server(
                [sys.executable, "-m", "bench.common.instant_backend", "--port", "0",
                 "--model", POOL],
                "listening on")
        except BaseException:
            self.redis.stop()
            raise
        self.config = workdir / "gateway.toml"
        self.config.write_text(gateway_config(
            self.redis.url, self.backend_port, f"renew_interval_ms = {RENEW_INTERVAL_MS}"))
        asyncio.run(publish_state_once(self.redis.url, [POOL, BENCH_POOL]))
        self.gateways: list[tuple[subprocess.Popen[str], int]] = []

    def start_gateways(self, n: int) -> list[int]:
        for _ in range(n):
            self.gateways.append(start_server(
                [sys.executable, "-m", "gateway", "--config", str(self.config), "--port", "0",
                 "--log-level", "WARNING"], "listening on"))
        return [port for _, port in self.gateways]

    def pids(self) -> dict[str, int]:
        pids = {f"gateway-{i + 1}": proc.pid for i, (proc, _) in enumerate(self.gateways)}
        return {**pids, "backend": self.backend.pid, "redis": self.redis.process.pid}

    def stop_gateways(self) -> None:
        for proc, _ in self.gateways:
            stop_processes([proc])
        self.gateways = []

    def stats(self) -> dict[str, int]:
        raw: dict[bytes, bytes] = self.client.hgetall(PoolKeys(POOL).stats)  # type: ignore[assignment]
        return {k.decode(): int(v) for k, v in raw.items()}

    def info(self, section: str) -> dict[str, Any]:
        info: dict[str, Any] = self.client.info(section)
        return info

    def close(self) -> None:
        self.stop_gateways()
        stop_processes([self.backend])
        self.client.close()
        self.redis.stop()
        shutil.rmtree(self.redis.workdir, ignore_errors=True)
