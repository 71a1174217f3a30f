"""The command lines of `python -m gateway` and `python -m scheduler` (and their console
scripts): flags checked by argparse, a usage error rather than a traceback; the name the
command was run by in `--help`; a port already in use reported in one line; and the gateway's
warning about a configuration no request can pass."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.common.localredis import free_port
from gateway.__main__ import build_parser as gateway_parser
from scheduler.__main__ import build_parser as scheduler_parser
from tests.gateway_harness import ROOT, start_gateway_process

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "gateway": gateway_parser, "scheduler": scheduler_parser}
SERVICES = tuple(PARSERS)


def _config(tmp_path: Path, *, tenants: bool = True) -> Path:
    path = tmp_path / "kvgate.toml"
    text = f"""
[redis]
url = "redis://127.0.0.1:1/0"   # REDIS_URL wins where a test needs Redis

[[pools]]
name = "demo"
backends = [{{ name = "node-0", url = "http://127.0.0.1:{free_port()}" }}]
"""
    if tenants:
        text += '\n[[tenants]]\nname = "vip"\ntier = "vip"\nkey_sha256 = ["' + "a" * 64 + '"]\n'
    path.write_text(text)
    return path


def _run(service: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", service, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize(("args", "message"), [
    (("--port", "99999"), "argument --port: must be a port number from 0 to 65535 (0: a free "
                          "port), got '99999'"),
    (("--port", "-1"), "argument --port: must be a port number from 0 to 65535"),
    (("--port", "http"), "argument --port: must be a port number from 0 to 65535"),
    (("--log-level", "verbose"), "argument --log-level: invalid choice: 'VERBOSE' (choose from "
                                 "'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')"),
])
def test_bad_flags_are_usage_errors(service: str, args: tuple[str, ...], message: str,
                                    tmp_path: Path) -> None:
    result = _run(service, "--config", str(_config(tmp_path)), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith(f"usage: python -m {service} ")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_shutdown_timeout_that_is_no_deadline_is_a_usage_error(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A negative timeout is a deadline already past (cleanup is cut at once and nothing in
    flight settles); NaN and infinity are none at all."""
    parse = PARSERS["gateway"]().parse_args
    assert parse(["--config", "x", "--shutdown-timeout", "0"]).shutdown_timeout == 0.0
    assert parse(["--config", "x", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    with pytest.raises(SystemExit) as info:
        parse(["--config", "x", "--shutdown-timeout", value])
    assert info.value.code == 2
    assert (f"argument --shutdown-timeout: must be a number of seconds, 0 or more, got {value!r}"
            in capsys.readouterr().err)


@pytest.mark.parametrize("service", SERVICES)
def test_flags_take_the_whole_port_range_and_levels_in_any_case(service: str) -> None:
    parse = PARSERS[service]().parse_args
    assert parse(["--config", "x", "--port", "65535"]).port == 65535
    assert parse(["--config", "x", "--port", "0"]).port == 0
    assert parse(["--config", "x", "--log-level", "warning"]).log_level == "WARNING"
    assert parse(["--config", "x"]).log_level == "INFO"


@pytest.mark.parametrize("service", SERVICES)
def test_help_names_the_command_as_it_was_run(service: str, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    monkeypatch.setattr(sys, "argv", [f"/opt/venv/bin/kvgate-{service}", "--help"])
    text = PARSERS[service]().format_help()
    assert text.startswith(f"usage: kvgate-{service} ")
    assert "REDIS_URL" in text and "redis.url" in text
    assert "``" not in text
    monkeypatch.setattr(sys, "argv", [str(ROOT / service / "__main__.py"), "--help"])
    assert PARSERS[service]().format_help().startswith(f"usage: python -m {service} ")


@pytest.mark.parametrize("service", SERVICES)
def test_the_console_script_shows_its_own_name(service: str) -> None:
    """As pip's generated `kvgate-gateway` wrapper runs `main`: argv[0] is the script."""
    wrapper = (f"import sys; from {service}.__main__ import main; "
               f"sys.argv[0] = '/usr/local/bin/kvgate-{service}'; sys.exit(main())")
    result = subprocess.run([sys.executable, "-c", wrapper, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: kvgate-{service} ")


def test_a_gateway_still_starting_exits_on_sigterm(tmp_path: Path) -> None:
    """As PID 1 in a container, where SIGTERM's default action does nothing (stood in for by
    ignoring it), a gateway told to stop while it loads its tokenizers exits at once with
    128 + SIGTERM, rather than after the pod's grace period."""
    wrapper = (
        "import os, signal, sys, time\n"
        "import gateway.__main__ as m\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "def loading(config):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "m.tokenizer_error = loading\n"
        "sys.exit(m.main())\n")
    config = _config(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", wrapper, "--config", str(config), "--port", "0"], cwd=ROOT,
        capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr


@pytest.mark.parametrize("service", SERVICES)
async def test_a_port_in_use_is_one_line_and_exit_1(service: str, redis_url: str,
                                                    tmp_path: Path) -> None:
    """A second service on a taken port says so in one line, starts nothing (no "started"
    line, no session left unclosed) and exits 1."""
    config = _config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", service, "--config", str(config), "--port", str(port),
            cwd=ROOT, env={**os.environ, "REDIS_URL": redis_url},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 1, err
    assert out == b""
    assert err.decode().splitlines() == [
        f"cannot listen on 127.0.0.1:{port}: address already in use (by another {service}, or "
        f"another program): choose another port with --port or {service}.port"]


async def test_a_gateway_without_tenants_warns_that_every_request_gets_401(
    redis_url: str, tmp_path: Path
) -> None:
    process, _ = await start_gateway_process(_config(tmp_path, tenants=False), redis_url)
    try:
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stderr is not None
        err = (await process.stderr.read()).decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    warnings = [line for line in err.splitlines() if "every request will get 401" in line]
    assert len(warnings) == 1 and " WARNING kvgate.gateway no [[tenants]]: " in warnings[0], err
