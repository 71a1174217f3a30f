"""Every `python -m` command of the project that a page names takes the flags the page passes.

tests/test_docs_quickstart.py checks the README's numbered steps; this checks every page a
reader browses (README.md, docs/, the lab's READMEs, the chart's and the SDKs' READMEs), in
code blocks and in code spans alike: a command of the project's own modules (`gateway`,
`scheduler`, `admission.*`, `bench.*`, or `kvgate-inspect`) followed by `--flags` must accept
each of them, as its `--help` lists them. A flag that was renamed or never existed would make
the reader's command fail with "unrecognized arguments".
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({
    ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").rglob("README.md"),
    *(ROOT / "helm").rglob("README.md"), *(ROOT / "clients").rglob("README.md"),
} - set((ROOT / "bench" / "results" / "tmp").rglob("*.md")))

OWN = re.compile(r"^(gateway|scheduler|admission(\.\w+)*|bench(\.\w+)+)$")
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
"""A code span, which may wrap across lines of the page."""
COMMAND = re.compile(r"(?:python -m ([\w.]+)|(kvgate-inspect))((?:[ \t]+[^\s#`&;|]+)*)")


def commands(text: str) -> list[tuple[str, set[str]]]:
    """(module, flags) of each command of the project in `text`'s code blocks and spans."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    lines += [" ".join(span.split()) for span in SPAN.findall(FENCE.sub("", text))]
    found: list[tuple[str, set[str]]] = []
    for line in lines:
        for match in COMMAND.finditer(line.split(" #", 1)[0]):
            module = match[1] or "admission.inspect"
            if not OWN.match(module):
                continue
            flags = {w.split("=", 1)[0] for w in match[3].split() if w.startswith("--")}
            found.append((module, flags))
    return found


@cache
def accepted(module: str) -> frozenset[str]:
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, (module, result.stderr[-2000:])
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))


def test_the_extraction_reads_blocks_and_spans() -> None:
    text = ("Run `python -m bench.sim --port 8001` then\n"
            "```console\n$ kvgate-inspect --config x.toml --watch 1    # --not-a-flag\n```\n"
            "and `python -m pytest --co`, `python -m bench.perf.core`, `python -m\n"
            "bench.perf.performance --only\nlatency`.\n")
    assert commands(text) == [("admission.inspect", {"--config", "--watch"}),
                              ("bench.sim", {"--port"}), ("bench.perf.core", set()),
                              ("bench.perf.performance", {"--only"})]


def test_the_pages_name_commands() -> None:
    modules = {module for page in PAGES for module, _ in commands(page.read_text("utf-8"))}
    assert {"gateway", "scheduler", "admission.inspect", "bench.burst.matrix"} <= modules


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_page_passes_is_accepted(page: Path) -> None:
    wrong = {(module, flag) for module, flags in commands(page.read_text("utf-8"))
             for flag in flags - accepted(module) - {"--help"}}
    assert not wrong, sorted(wrong)
