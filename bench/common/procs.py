"""Child processes of the experiment: started with a readiness check, stopped by their PID.

Every service here announces itself on stdout (a JSON line or a "listening on" line); the
runner reads that line with a deadline instead of sleeping, and stops exactly the processes it
started (SIGTERM, then SIGKILL after a grace period), never by name.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class StartupError(RuntimeError):
    pass


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_line: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit status."""
        proc = self.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def spawn(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    ready: re.Pattern[str] | None = None,
    timeout: float = 30.0,
) -> Child:
    """Start ``argv`` (stderr to ``log_dir/name.log``); with ``ready``, wait for a stdout line
    matching it. Raises StartupError with the log's tail if the child dies or is late."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT, env=dict(env or child_env()),
        )
    child = Child(name, proc, log_path)
    if ready is None:
        return child
    try:
        child.ready_line = _await_line(child, ready, time.monotonic() + timeout)
    except BaseException:
        child.stop(2.0)
        raise
    return child


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _await_line(child: Child, pattern: re.Pattern[str], deadline: float) -> str:
    proc = child.process
    assert proc.stdout is not None
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if pattern.search(text):
                    return text
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartupError(f"{child.name} did not report ready; log:\n{child.log_tail()}")
            if not selector.select(min(remaining, 0.5)):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                proc.wait()
                raise StartupError(
                    f"{child.name} exited with {proc.returncode}; log:\n{child.log_tail()}"
                )
            buffer += chunk


def wait_http_ok(url: str, child: Child, timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers 200 (bounded by ``timeout``); fail fast if the child dies."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if not child.alive():
            raise StartupError(f"{child.name} exited with {child.process.returncode}; log:\n"
                               f"{child.log_tail()}")
        if time.monotonic() > deadline:
            raise StartupError(f"{child.name} not healthy at {url}; log:\n{child.log_tail()}")
        time.sleep(0.05)
