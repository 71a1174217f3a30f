"""Docs and docstrings are reference for a reader who was never here: they say how kvgate works
and why, not when something was built or in which work session or ticket. This scans every
Markdown file and every source file's text (docstrings and comments included) for the marks of a
lab notebook: numbered work sessions and issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
            "|[0-9]+(?:st|nd|rd|th)?")
HISTORY = re.compile(
    rf"\b(?:{ORDINALS})\s+(?:work\s+)?sessions?\b|\bwork\s+sessions?\b|\bsessions?\s+[0-9]+\b"
    r"|\bissue\s+#?[0-9]+\b",
    re.IGNORECASE)
SOURCES = ("admission", "gateway", "scheduler", "lua", "bench", "clients", "helm", "docs",
           "examples", "deploy")


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "Makefile", ROOT / "Dockerfile"]
    for top in SOURCES:
        out += [p for p in (ROOT / top).rglob("*")
                if p.is_file() and p.suffix in {".py", ".lua", ".md", ".toml", ".yaml", ".go"}
                and "__pycache__" not in p.parts and "tmp" not in p.parts]
    return sorted(out)


def test_the_pattern_finds_history_and_leaves_ordinary_prose_alone() -> None:
    for text in ("the sixth session", "in work session 4", "session 12 found", "issue 9's list",
                 "see issue #5", "the 3rd session"):
        assert HISTORY.search(text), text
    for text in ("aiohttp.ClientSession()", "a session token", "the first token",
                 "issues a 429", "sessions of a user"):
        assert not HISTORY.search(text), text


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_reads_like_a_lab_notebook(path: Path) -> None:
    hits = [f"{n}: {line.strip()}" for n, line in
            enumerate(path.read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "\n".join(hits)
