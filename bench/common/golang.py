"""Building the Go client SDK's programs (clients/go) for the tests and the bench.

The module has no dependencies, and every go command runs with GOPROXY=off and
GOTOOLCHAIN=local: Debian's golang-go (1.19) is enough, and nothing reaches the network.
Builds share Go's build cache (~/.cache/go-build), so a second build of the same program takes
about a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

GO_MODULE = Path(__file__).resolve().parents[2] / "clients" / "go"
GO_ENV = {"GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": ""}
BUILD_TIMEOUT_S = 300.0

# The programs, as packages of the module.
CHAT_EXAMPLE = "./examples/chat"
RETRY_STORM = "./cmd/kvgate-retrystorm"


class GoMissing(RuntimeError):
    """No `go` on PATH: `make go` (or `apt-get install golang-go`) installs it."""


def go_binary() -> str:
    go = shutil.which("go")
    if go is None:
        raise GoMissing("no `go` on PATH: run `make go` (Debian's golang-go) first")
    return go


def build(package: str, out_dir: Path) -> Path:
    """`go build` one package of clients/go into out_dir; returns the executable's path."""
    out = out_dir / Path(package).name
    result = subprocess.run(
        [go_binary(), "build", "-o", str(out), package],
        cwd=GO_MODULE,
        env={**os.environ, **GO_ENV},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"go build {package} failed:\n{result.stdout}{result.stderr}")
    return out
