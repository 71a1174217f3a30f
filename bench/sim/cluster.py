"""Run simulated nodes: as child processes (one core-hungry event loop each) or in-process.

Child processes are what an experiment wants: each node gets its own interpreter, so four nodes
on two cores do not share one event loop. Each child binds a free port itself (``--port 0``) and
reports it on stdout, which avoids the race of picking a port here and binding it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import orjson
from aiohttp import web

from bench.sim.app import SIM_RUNNER, create_app
from bench.sim.cli import READY_KEY, config_to_argv
from bench.sim.config import SimConfig
from bench.sim.runner import NodeRunner

_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class SimNode:
    config: SimConfig
    port: int
    url: str
    """Base URL, e.g. ``http://127.0.0.1:40123`` (append ``/v1/...``, ``/metrics``)."""
    process: subprocess.Popen[bytes]
    log_path: Path


class SimCluster:
    """N simulated nodes as child processes. Use as a context manager, or call ``stop()``."""

    def __init__(self, nodes: list[SimNode]) -> None:
        self.nodes = nodes
        procs = [n.process for n in nodes]
        # Children must not outlive a test or runner that forgot to stop them.
        self._finalizer = weakref.finalize(self, _terminate, procs, 2.0)

    @classmethod
    def start(
        cls,
        configs: Sequence[SimConfig],
        *,
        host: str = "127.0.0.1",
        startup_timeout: float = 30.0,
        log_dir: Path | None = None,
        crash_exit: bool = False,
        trace: bool = False,
        python: str = sys.executable,
    ) -> SimCluster:
        """Start one process per config; return when every node answers ``/health`` 200.
        With ``trace``, node ``i`` writes ``node{i}-trace.jsonl`` beside its log."""
        logs = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-sim-"))
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        started: list[tuple[SimConfig, subprocess.Popen[bytes], Path]] = []
        try:
            for i, config in enumerate(configs):
                log_path = logs / f"node{i}.log"
                argv = [python, "-m", "bench.sim", "--host", host, "--port", "0",
                        *config_to_argv(config)]
                if crash_exit:
                    argv.append("--crash-exit")
                if trace:
                    argv += ["--trace", str(logs / f"node{i}-trace.jsonl")]
                with log_path.open("wb") as log_file:
                    proc = subprocess.Popen(
                        argv, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                        cwd=_REPO_ROOT, env=env,
                    )
                started.append((config, proc, log_path))
            deadline = time.monotonic() + startup_timeout
            nodes = []
            for config, proc, log_path in started:
                port = _read_ready_port(proc, log_path, deadline)
                url = f"http://{host}:{port}"
                _wait_healthy(url, proc, log_path, deadline)
                nodes.append(SimNode(config, port, url, proc, log_path))
        except BaseException:
            _terminate([p for _, p, _ in started], 2.0)
            raise
        return cls(nodes)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def kill(self, index: int) -> None:
        """SIGKILL one node (what the OOM killer does)."""
        proc = self.nodes[index].process
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        _terminate([n.process for n in self.nodes], timeout)
        self._finalizer.detach()

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> SimCluster:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)


async def start_cluster(
    configs: Sequence[SimConfig],
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 30.0,
    log_dir: Path | None = None,
    crash_exit: bool = False,
) -> SimCluster:
    """``SimCluster.start`` without blocking the caller's event loop."""
    return await asyncio.to_thread(
        SimCluster.start,
        configs,
        host=host,
        startup_timeout=startup_timeout,
        log_dir=log_dir,
        crash_exit=crash_exit,
    )


def _terminate(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _startup_error(what: str, log_path: Path) -> RuntimeError:
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    return RuntimeError(f"simulated node {what}; log {log_path}:\n{tail}")


def _read_ready_port(proc: subprocess.Popen[bytes], log_path: Path, deadline: float) -> int:
    assert proc.stdout is not None
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _startup_error("did not report ready in time", log_path)
            if not selector.select(remaining):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                proc.wait()
                raise _startup_error(f"exited with status {proc.returncode}", log_path)
            buffer += chunk
    line = buffer.split(b"\n", 1)[0]
    message = orjson.loads(line)
    if not isinstance(message, dict) or message.get(READY_KEY) is not True:
        raise _startup_error(f"printed an unexpected line {line!r}", log_path)
    return int(message["port"])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise _startup_error(f"exited with status {proc.returncode}", log_path)
        if time.monotonic() > deadline:
            raise _startup_error("never became healthy", log_path)
        time.sleep(0.05)


@dataclass(slots=True)
class LocalNode:
    url: str
    runner: NodeRunner
    app: web.Application


@contextlib.asynccontextmanager
async def serve_node(
    config: SimConfig, *, host: str = "127.0.0.1", port: int = 0, trace: Path | None = None
) -> AsyncIterator[LocalNode]:
    """One node inside the current event loop, on a real socket (tests, small demos)."""
    app = create_app(config, trace)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        yield LocalNode(url=f"http://{host}:{bound}", runner=app[SIM_RUNNER], app=app)
    finally:
        await runner.cleanup()
