"""`--check-config` of `python -m gateway` and `python -m scheduler`, run as processes: the
checks each service makes at start, the environment and the files the configuration names
included, one line and exit status 0 or 2, with nothing connected to and nothing bound.

Redis and the backends are a listening socket of the test's, which must see no connection,
and the configured ports are held by the test, which a service binding them would fail on."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway_harness import ROOT
from tests.test_config import KEY_HASH

SERVICES = ("gateway", "scheduler")
KEY_VARIABLE = "KVGATE_TEST_CHECK_VLLM_KEY"


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    return sock


@pytest.fixture
def watched() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """(Redis and backends, the gateway's port, the scheduler's port), all listening."""
    socks = (_listener(), _listener(), _listener())
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _port(sock: socket.socket) -> int:
    port: int = sock.getsockname()[1]
    return port


def _config(tmp_path: Path, watched: tuple[socket.socket, ...], pool: str = "") -> Path:
    target, gateway, scheduler = map(_port, watched)
    path = tmp_path / "kvgate.toml"
    path.write_text(f"""
[redis]
url = "redis://127.0.0.1:{target}/0"
[gateway]
port = {gateway}
[scheduler]
port = {scheduler}

[[pools]]
name = "a"
backends = ["http://127.0.0.1:{target}"]
{pool}

[[pools]]
name = "b"
backends = ["http://127.0.0.1:{target}/b"]

[[tenants]]
name = "t"
tier = "vip"
key_sha256 = ["{KEY_HASH}"]
""")
    return path


def _check(service: str, path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", service, "--config", str(path), *args,
                           "--check-config"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False, env={"PATH": "/usr/bin:/bin", **env})


def _refused(service: str, path: Path, *args: str, **env: str) -> str:
    """The stderr of a check that must fail (exit 2)."""
    done = _check(service, path, *args, **env)
    assert done.returncode == 2, done
    return done.stderr


def _untouched(watched: tuple[socket.socket, ...]) -> None:
    with pytest.raises(BlockingIOError):
        watched[0].accept()


@pytest.mark.parametrize("service", SERVICES)
def test_a_valid_configuration_is_one_line_and_exit_0_with_nothing_connected_or_bound(
    service: str, tmp_path: Path, watched: tuple[socket.socket, ...],
) -> None:
    path = _config(tmp_path, watched)
    done = _check(service, path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"configuration OK: {path} (2 pools, 1 tenant)\n"
    assert "error" not in done.stderr
    _untouched(watched)


@pytest.mark.parametrize("service", SERVICES)
def test_an_invalid_file_is_its_error_and_exit_2(service: str, tmp_path: Path,
                                                 watched: tuple[socket.socket, ...]) -> None:
    path = _config(tmp_path, watched, pool='backends_ca_file = "/etc/ca.pem"')
    done = _check(service, path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"configuration error: {path}: pools[0].backends_ca_file: unknown key"]


@pytest.mark.parametrize("service", SERVICES)
def test_the_files_the_configuration_names_are_loaded(service: str, tmp_path: Path,
                                                      watched: tuple[socket.socket, ...]) -> None:
    missing = tmp_path / "ca.pem"
    path = _config(tmp_path, watched, pool=f'backend_ca_file = "{missing}"')
    refusal = _refused(service, path)
    assert refusal.startswith(f"configuration error: {path}: pools[0].backend_ca_file "
                              f"'{missing}': cannot load it"), refusal


@pytest.mark.parametrize("service", SERVICES)
def test_the_variables_the_service_reads_are_checked(service: str, tmp_path: Path,
                                                     watched: tuple[socket.socket, ...]) -> None:
    path = _config(tmp_path, watched)
    # The variable's value is at fault, not the file: the file is not named.
    assert _refused(service, path, REDIS_URL="redis://127.0.0.1:1/x").splitlines() == [
        "configuration error: REDIS_URL (which overrides redis.url): database 'x' is not a "
        "database number (the path is the database: redis://HOST:PORT/0)"]


def test_the_gateway_checks_the_backends_key_variable_the_scheduler_never_reads(
    tmp_path: Path, watched: tuple[socket.socket, ...],
) -> None:
    path = _config(tmp_path, watched, pool=f'backend_api_key_env = "{KEY_VARIABLE}"')
    assert _refused("gateway", path).splitlines() == [
        f"configuration error: {path}: pools[0].backend_api_key_env: names {KEY_VARIABLE}, "
        "which is not set (or empty) in the gateway's environment"]
    assert _check("gateway", path, **{KEY_VARIABLE: "sk-1"}).returncode == 0
    assert _check("scheduler", path).returncode == 0
    _untouched(watched)


def test_the_gateway_loads_the_tokenizers_and_checks_its_id(
    tmp_path: Path, watched: tuple[socket.socket, ...],
) -> None:
    missing = tmp_path / "tokenizer.json"
    path = _config(tmp_path, watched, pool=f'tokenizer = "{missing}"')
    assert _refused("gateway", path).splitlines() == [
        f"configuration error: {path}: pools[0].tokenizer: cannot read '{missing}' (No such "
        "file or directory)"]
    assert _check("scheduler", path).returncode == 0
    refusal = _refused("gateway", _config(tmp_path, watched), "--id", "gw 1")
    assert refusal.startswith("configuration error: --id (the gateway id): gateway name "
                              "'gw 1' must be"), refusal
