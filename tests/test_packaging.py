"""What ships: the wheel and the container image hold the services and their Lua scripts, never
the lab (`bench/`: simulator, experiments, benchmarks) or the tests; installed alone, the wheel's
gateway and scheduler start against a real Redis."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from bench.common.localredis import LocalRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"admission", "gateway", "scheduler", "lua"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info/ next to the sources.
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    out = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    # The build is clean: no deprecation (license table, setup.cfg) or packaging warnings.
    assert "warning" not in (built.stdout + built.stderr).lower(), built.stdout + built.stderr
    return next(out.glob("kvgate-*.whl"))


def test_the_wheel_holds_the_services_and_not_the_lab(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(
        ".dist-info")}
    assert tops == SHIPPED
    assert "lua/admit.lua" in names
    assert not [n for n in names if n.startswith(("bench/", "tests/"))]
    # The redis-server harness is test scaffolding: it lives in bench/common, not in admission/.
    assert not [n for n in names if "localredis" in n]
    # Apache-2.0 asks that the licence travel with the code.
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_image_copies_the_services_and_not_the_lab() -> None:
    copied = re.findall(r"^COPY\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert {c for c in copied if "." not in c} == SHIPPED
    assert "bench" not in copied and "tests" not in copied
    # The build context leaves out what a working tree holds besides (a venv of hundreds of
    # MB, git history, the lab), and keeps what the image copies.
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "bench", "tests"} <= ignored
    assert not ignored & (SHIPPED | {"pyproject.toml", "README.md", "LICENSE"})


async def _first_line(stream: asyncio.StreamReader, *patterns: str, deadline_s: float = 30.0
                      ) -> str:
    """Reads `stream` until each of `patterns` was in a line; returns the first pattern's."""
    async def scan() -> str:
        found: dict[str, str] = {}
        while line := (await stream.readline()).decode():
            found.update({p: line for p in patterns if p in line and p not in found})
            if len(found) == len(patterns):
                return found[patterns[0]]
        raise AssertionError(f"the stream ended before lines with {patterns!r}")
    return await asyncio.wait_for(scan(), deadline_s)


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel alone, installed into an empty directory (its dependencies come from the
    environment, as in the image)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    return target


def test_started_from_outside_the_checkout_the_installed_copy_is_what_runs(
        installed: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [sys.executable, "-c", "import gateway, scheduler, admission, lua; "
         "print(gateway.__file__, scheduler.__file__, admission.__file__, lua.__file__)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(installed)}, capture_output=True,
        text=True, check=True)
    assert all(p.startswith(str(installed)) for p in where.stdout.split()), where.stdout


async def test_the_installed_wheel_starts_the_gateway_and_the_scheduler(
        installed: Path, redis_factory: Callable[..., LocalRedis], tmp_path: Path) -> None:
    """What the image runs, from the wheel alone, started from outside the checkout: both
    services come up against a real Redis and answer. The Redis is the test's own: on a shared
    one another test's scheduler may still hold the lease, and this one would only stand by."""
    redis_url = redis_factory().url
    scheduler_port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f"""
[redis]
url = "redis://127.0.0.1:1/0"   # REDIS_URL below wins

[scheduler]
port = {scheduler_port}

[[pools]]
name = "wheel"
backends = [{{ name = "node-0", url = "http://127.0.0.1:{free_port()}" }}]

[[tenants]]
name = "t"
tier = "normal"
key_sha256 = ["{'0' * 64}"]
""")
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(installed)}
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--config", str(config), "--port", "0",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    scheduler = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler", "--config", str(config),
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert gateway.stdout is not None and scheduler.stderr is not None
        line = await _first_line(gateway.stdout, "listening on http://")
        # Leading runs the wheel's leader.lua against the real Redis.
        await _first_line(scheduler.stderr, "leads with epoch", "listening on")
        gateway_url = line.rsplit(" ", 1)[1].strip()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gateway_url}/healthz") as r:
                assert r.status == 200
            async with http.get(f"http://127.0.0.1:{scheduler_port}/healthz") as r:
                assert r.status == 200
            # Bad input is still answered in the OpenAI error shape by the installed copy.
            async with http.post(f"{gateway_url}/v1/chat/completions", json={
                    "model": "wheel", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": "Bearer sk-unknown"}) as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"]
    finally:
        for process in (gateway, scheduler):
            if process.returncode is None:
                process.terminate()
            await process.wait()
