"""The suite's Redis fixtures never empty a server they did not start.

Each test starts a real redis-server holding data a developer would care about (a sentinel key,
another pool's keys, a loaded script), points a pytest session in a child process at it the way
a developer would, runs real tests of the admission core, and then checks that the data is all
still there and that nothing of the tests was left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from bench.common.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "return 'still cached'"
# The documented switches (tests/conftest.py), spelled out as a developer types them.
EXTERNAL_REDIS_ENV = "KVGATE_TEST_EXTERNAL_REDIS_URL"
NO_SKIP_ENV = "KVGATE_TEST_NO_SKIP"
# Tests of the admission core that need only a pool of their own (they may run on an external
# server), and two that flush (they must get the private server even when one is offered).
POOL_ONLY = [
    "test_cancel_returns_every_balance_to_its_start",
    "test_tenant_queue_cap_protects_other_tenants",
    "test_dedicated_nodes_serve_only_their_tiers_which_try_them_first",
]
FLUSHING = [
    "test_script_flush_mid_test_does_not_break_later_calls",
    "test_epochs_never_go_backwards_when_redis_loses_its_data",
]


def run_pytest(tests: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items()
                 if k not in {"REDIS_URL", EXTERNAL_REDIS_ENV} and not k.startswith("PYTEST_")}
    child_env.update(env)
    selection = " or ".join(tests)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
         "tests/test_core.py"],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def precious(redis_factory: Callable[..., LocalRedis]) -> Iterator[tuple[LocalRedis, redis.Redis]]:
    """A server with someone else's data on it: a sentinel key, another pool, a cached script."""
    server = redis_factory()
    client = redis.Redis.from_url(server.url)
    client.set("sentinel", "do not flush")
    client.hset("kvg:{production}:state", mapping={"zone": "GREEN", "epoch": "7"})
    client.zadd("kvg:{production}:queue:vip", {"task-1": 1})
    client.script_load(SCRIPT)
    try:
        yield server, client
    finally:
        client.close()


def assert_untouched(client: redis.Redis) -> None:
    assert client.get("sentinel") == b"do not flush"
    assert client.hgetall("kvg:{production}:state") == {b"zone": b"GREEN", b"epoch": b"7"}
    assert client.zrange("kvg:{production}:queue:vip", 0, -1, withscores=True) == [
        (b"task-1", 1.0)]
    assert sorted(client.keys("*")) == sorted(
        [b"sentinel", b"kvg:{production}:state", b"kvg:{production}:queue:vip"]), (
        "test keys were left behind")


def commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_opted_in_external_server_is_used_under_a_prefix_and_never_flushed(
        precious: tuple[LocalRedis, redis.Redis]) -> None:
    server, client = precious
    digest = client.script_load(SCRIPT)
    before = commands(client)
    result = run_pytest(POOL_ONLY + FLUSHING, {EXTERNAL_REDIS_ENV: server.url, NO_SKIP_ENV: "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout, result.stdout
    after = commands(client)
    # The pool-only tests did run here: their scripts and their clean-up reached this server.
    assert after.get("evalsha", 0) + after.get("eval", 0) > before.get("evalsha", 0) + before.get(
        "eval", 0)
    assert after.get("scan", 0) > before.get("scan", 0)
    assert after.get("unlink", 0) > before.get("unlink", 0)
    for destructive in ("flushdb", "flushall", "script|flush"):
        assert after.get(destructive, 0) == before.get(destructive, 0), destructive
    assert client.script_exists(digest) == [True]
    assert_untouched(client)


def test_redis_url_in_the_environment_is_never_used(
        precious: tuple[LocalRedis, redis.Redis]) -> None:
    server, client = precious
    digest = client.script_load(SCRIPT)
    connections = int(client.info("stats")["total_connections_received"])
    result = run_pytest(POOL_ONLY + FLUSHING, {"REDIS_URL": server.url})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout, result.stdout
    # Not one connection: the suite ran entirely on servers it started.
    assert int(client.info("stats")["total_connections_received"]) == connections
    assert client.script_exists(digest) == [True]
    assert_untouched(client)


def test_no_skip_turns_a_skip_into_a_failure_with_its_reason(tmp_path: Path) -> None:
    case = tmp_path / "test_case.py"
    case.write_text("import pytest\n\n"
                    "def test_needs_a_tool() -> None:\n"
                    "    pytest.skip('frobnicator not installed')\n\n"
                    "@pytest.mark.xfail(reason='known', strict=True)\n"
                    "def test_known_failure() -> None:\n"
                    "    raise AssertionError\n", encoding="utf-8")
    base = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
            "-p", "tests.conftest", "--rootdir", str(tmp_path), str(case)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT)
    allowed = subprocess.run(base, cwd=tmp_path, env={**env, NO_SKIP_ENV: "0"},
                             capture_output=True, text=True, timeout=120, check=False)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "SKIPPED" in allowed.stdout and "frobnicator not installed" in allowed.stdout
    forbidden = subprocess.run(base, cwd=tmp_path, env={**env, NO_SKIP_ENV: "1"},
                               capture_output=True, text=True, timeout=120, check=False)
    assert forbidden.returncode == 1, forbidden.stdout + forbidden.stderr
    assert "1 failed, 1 xfailed" in forbidden.stdout, forbidden.stdout
    assert "frobnicator not installed" in forbidden.stdout
