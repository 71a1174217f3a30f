"""A LiteLLM proxy for the performance suite's comparison, in a virtualenv of its own.

    python -m bench.perf.litellm_env [--version V] [--verbose]    # install (or check) only

LiteLLM pins versions of aiohttp, pydantic, openai and others that conflict with the project's,
so it lives in `<repo>/.bench-venvs/litellm`, made with the base interpreter (never the
project's venv) and installed from PyPI once: a marker file holds the installed version and a
later call reinstalls only when the pin changes.

The proxy config routes one model name to an OpenAI-compatible backend and turns on the limits
LiteLLM enforces through Redis without a Postgres database: the deployment's `rpm` / `tpm`
with `usage-based-routing-v2` (the router counts each deployment's requests and tokens per
minute in Redis, shared by every proxy replica, and refuses a deployment over its limits), on a
private redis-server. The limits are far above the benchmark's rates, so they cost what they
cost on every request but never reject. A master key makes requests carry a bearer key, as
through the gateway. Logging is quiet: no per-request access log, no verbose or message
logging, no spend logs, so neither side pays for logs the other does not write.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".bench-venvs" / "litellm"
LITELLM_VERSION = "1.108.14"
"""The newest 1.108 release on PyPI: the version the issue's reference figures come from."""
MASTER_KEY = "sk-bench-litellm"
MODEL = "demo"
# Far above any rate the benchmark offers (a few thousand RPS is < 1e6 requests a minute), so the
# limits are checked and counted on every request but never reject one.
RPM_LIMIT = 100_000_000
TPM_LIMIT = 100_000_000_000
START_TIMEOUT_S = 180.0


def _bin(name: str) -> Path:
    return VENV / "bin" / name


def installed_version() -> str | None:
    marker = VENV / ".installed"
    try:
        return marker.read_text().strip() or None
    except OSError:
        return None


def ensure_installed(version: str = LITELLM_VERSION, *, quiet: bool = True) -> Path:
    """Make the LiteLLM venv unless it already holds `version`; return its `litellm` command."""
    if installed_version() == version and _bin("litellm").exists():
        return _bin("litellm")
    VENV.parent.mkdir(parents=True, exist_ok=True)
    # sys.executable may be the project's venv; `-m venv` builds from its base interpreter, so
    # the new venv sees none of the project's packages.
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    q = ["-q"] if quiet else []
    pip = [str(_bin("python")), "-m", "pip", "install", *q, "--disable-pip-version-check"]
    subprocess.run([*pip, f"litellm=={version}"], check=True)
    # Not `litellm[proxy]==V` in one go: the extra pins LiteLLM's companion packages to exact
    # post-releases (litellm-proxy-extras==0.4.110.post1, litellm-enterprise==0.1.79.post3 for
    # 1.108.14) that the index may not carry, which fails the whole install. The extra's other
    # requirements are installed as declared, the companions at the newest release up to the
    # pin. redis: the client the router's Redis usage counters need, not in the extra.
    subprocess.run([*pip, *proxy_requirements(), "redis"], check=True)
    (VENV / ".installed").write_text(version + "\n")
    return _bin("litellm")


_PROXY_REQUIREMENTS = """
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("litellm") or []:
    req = Requirement(line)
    if req.marker is None or not req.marker.evaluate({"extra": "proxy"}):
        continue
    if req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
"""


def relax_companion_pin(requirement: str) -> str:
    """`litellm-x==1.2.3.post4` -> `litellm-x>=1.2.3,<=1.2.3.post4`; anything else unchanged."""
    name, sep, pinned = requirement.partition("==")
    if not sep or not name.startswith("litellm-") or ".post" not in pinned:
        return requirement
    return f"{name}>={pinned.split('.post')[0]},<={pinned}"


def proxy_requirements() -> list[str]:
    """The `proxy` extra of the installed LiteLLM, its companion pins relaxed."""
    out = subprocess.run([str(_bin("python")), "-c", _PROXY_REQUIREMENTS], check=True,
                         capture_output=True, text=True).stdout
    return [relax_companion_pin(line.strip()) for line in out.splitlines() if line.strip()]


def proxy_config(backend_port: int, redis_host: str, redis_port: int,
                 redis_password: str | None = None) -> dict[str, Any]:
    """The proxy's config: `demo` -> the backend, usage limits counted in Redis, quiet logs."""
    params: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": f"http://127.0.0.1:{backend_port}/v1",
        # The instant backend ignores the key; the OpenAI client insists on one.
        "api_key": "sk-unused",
        "rpm": RPM_LIMIT,
        "tpm": TPM_LIMIT,
    }
    router: dict[str, Any] = {
        "routing_strategy": "usage-based-routing-v2",
        "redis_host": redis_host,
        "redis_port": redis_port,
        # No enable_pre_call_checks: it adds a context-window check (a full token count of
        # every prompt, about a seventh of the proxy's CPU in a profile), not the rate limits,
        # which usage-based-routing-v2 checks and counts in Redis by itself.
        "num_retries": 0,
    }
    if redis_password:
        router["redis_password"] = redis_password
    return {
        "model_list": [{"model_name": MODEL, "litellm_params": params}],
        "router_settings": router,
        "litellm_settings": {
            "set_verbose": False,
            "json_logs": False,
            "turn_off_message_logging": True,
            "drop_params": True,
            "telemetry": False,
        },
        "general_settings": {
            "master_key": MASTER_KEY,
            "disable_spend_logs": True,
            "disable_error_logs": True,
            "disable_adding_master_key_hash_to_db": True,
        },
    }


def write_config(path: Path, backend_port: int, redis_host: str, redis_port: int,
                 redis_password: str | None = None) -> Path:
    path.write_text(yaml.safe_dump(proxy_config(backend_port, redis_host, redis_port,
                                                 redis_password), sort_keys=False))
    return path


def proxy_env() -> dict[str, str]:
    """Environment for the proxy: quiet logs, no telemetry, nothing from the project's venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "DATABASE_URL")}
    env.update({
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
        # The proxy would otherwise fetch the model cost map from the internet at import.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "PATH": f"{VENV / 'bin'}:{env.get('PATH', '')}",
    })
    return env


@dataclass
class Proxy:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _answers(port: int) -> bool:
    """True once a real completion goes through: routes, auth and the backend all ready."""
    body = (b'{"model": "demo", "max_tokens": 4, '
            b'"messages": [{"role": "user", "content": "hi"}]}')
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
        headers={"Authorization": f"Bearer {MASTER_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_proxy(config: Path, port: int, log: Path) -> Proxy:
    """`litellm --config ... --num_workers 1` in the background; returns once it answers."""
    cmd = [str(_bin("litellm")), "--config", str(config), "--host", "127.0.0.1",
           "--port", str(port), "--num_workers", "1"]
    with open(log, "ab") as out:  # appended: a restarted proxy keeps the earlier lines
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=proxy_env(),
                                   cwd=config.parent)
    proxy = Proxy(process, port, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _answers(port):
            return proxy
        time.sleep(0.5)
    proxy.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"LiteLLM proxy did not answer on port {port}:\n{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.litellm_env",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", default=LITELLM_VERSION)
    p.add_argument("--verbose", action="store_true", help="show pip's output")
    args = p.parse_args(argv)
    print(ensure_installed(args.version, quiet=not args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
