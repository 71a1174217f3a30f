"""What ships: the wheel and the container image hold the services and their Lua scripts, never
the lab (`bench/`: simulator, experiments, benchmarks) or the tests."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"admission", "gateway", "scheduler", "lua"}


def test_the_wheel_holds_the_services_and_not_the_lab(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info/ next to the sources.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    wheel = next(out.glob("kvgate-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(
        ".dist-info")}
    assert tops == SHIPPED
    assert "lua/admit.lua" in names
    assert not [n for n in names if n.startswith(("bench/", "tests/"))]
    # The redis-server harness is test scaffolding: it lives in bench/common, not in admission/.
    assert not [n for n in names if "localredis" in n]


def test_the_image_copies_the_services_and_not_the_lab() -> None:
    copied = re.findall(r"^COPY\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert {c for c in copied if "." not in c} == SHIPPED
    assert "bench" not in copied and "tests" not in copied
