"""Real processes for the abuse and chaos tests: `python -m gateway`, `python -m scheduler`,
`python -m bench.common.instant_backend`, each started with a readiness check and stopped by its PID
(SIGTERM, then SIGKILL), plus the configuration they share written as TOML."""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common.localredis import free_port
from bench.common.procs import Child, child_env, python_module, spawn, wait_http_ok

GATEWAY_READY = re.compile(r"kvgate gateway (\S+) listening on (http://\S+)")
BACKEND_READY = re.compile(r"instant backend listening on (http://\S+)")


def to_toml(data: dict[str, Any]) -> str:
    """A configuration as parsed TOML (`tests.gateway_harness.config_data`'s shape) back to
    TOML text: tables for the sections, arrays of tables for pools and tenants."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    lines: list[str] = []
    for section in ("redis", "gateway", "scheduler"):
        if section in data:
            lines.append(f"[{section}]")
            lines += [f"{k} = {value(v)}" for k, v in data[section].items()]
    for tier, settings in data.get("tiers", {}).items():
        lines.append(f"[tiers.{tier}]")
        lines += [f"{k} = {value(v)}" for k, v in settings.items()]
    for table in ("pools", "tenants"):
        for entry in data.get(table, []):
            lines.append(f"[[{table}]]")
            lines += [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


@dataclass
class Gateway:
    child: Child
    id: str
    url: str


@dataclass
class Scheduler:
    child: Child
    id: str
    port: int

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"


@dataclass
class Processes:
    """Children of one test; `stop_all` stops every one still running, by PID."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvgate-live-")))
    children: list[Child] = field(default_factory=list)

    def write_config(self, data: dict[str, Any], name: str = "kvgate.toml") -> Path:
        path = self.workdir / name
        path.write_text(to_toml(data))
        return path

    def gateway(self, config: Path, name: str, *, redis_url: str | None = None,
                log_level: str = "WARNING") -> Gateway:
        env = child_env({"REDIS_URL": redis_url} if redis_url else None)
        if not redis_url:
            env.pop("REDIS_URL", None)
        child = spawn(name, python_module("gateway", "--config", str(config), "--port", "0",
                                          "--id", name, "--log-level", log_level,
                                          "--shutdown-timeout", "2"),
                      self.workdir, env=env, ready=GATEWAY_READY, timeout=60)
        self.children.append(child)
        match = GATEWAY_READY.search(child.ready_line)
        assert match is not None
        return Gateway(child, match.group(1), match.group(2))

    def scheduler(self, config: Path, name: str, *, log_level: str = "INFO") -> Scheduler:
        env = child_env()
        env.pop("REDIS_URL", None)
        port = free_port()
        child = spawn(name, python_module("scheduler", "--config", str(config), "--id", name,
                                          "--port", str(port), "--log-level", log_level),
                      self.workdir, env=env)
        self.children.append(child)
        wait_http_ok(f"http://127.0.0.1:{port}/healthz", child, timeout=60)
        return Scheduler(child, name, port)

    def instant_backend(self, name: str, *, model: str = "demo",
                        output_tokens: int | None = None,
                        settable_metrics: bool = False) -> tuple[Child, str]:
        """`bench.common.instant_backend`; `settable_metrics`: the KV usage and sequence counts it
        reports can be set at run time (``PUT /lab/metrics``)."""
        argv = python_module("bench.common.instant_backend", "--port", "0", "--model", model)
        if output_tokens is not None:
            argv += ["--output-tokens", str(output_tokens)]
        if settable_metrics:
            argv.append("--settable-metrics")
        child = spawn(name, argv, self.workdir, ready=BACKEND_READY, timeout=60)
        self.children.append(child)
        match = BACKEND_READY.search(child.ready_line)
        assert match is not None
        return child, match.group(1)

    def chaos_backend(self, name: str, *, delay_ms: float = 0.0,
                      hold_after: int | None = None, model: str = "demo") -> tuple[Child, str]:
        """`tests.chaos_backend`: the instant backend with a delay and held streams."""
        argv = python_module("tests.chaos_backend", "--port", "0", "--model", model,
                             "--delay-ms", str(delay_ms))
        if hold_after is not None:
            argv += ["--hold-after", str(hold_after)]
        child = spawn(name, argv, self.workdir, ready=BACKEND_READY, timeout=60)
        self.children.append(child)
        match = BACKEND_READY.search(child.ready_line)
        assert match is not None
        return child, match.group(1)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop(timeout=5.0)
        self.children.clear()

    def cleanup(self) -> None:
        self.stop_all()
        shutil.rmtree(self.workdir, ignore_errors=True)


def sigkill(child: Child) -> None:
    """What the OOM killer does: no handler runs."""
    if child.alive():
        child.process.send_signal(signal.SIGKILL)
        child.process.wait(timeout=5)
