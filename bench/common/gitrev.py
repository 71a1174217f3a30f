"""The commit an experiment ran on, for its record."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def revision() -> str:
    """HEAD's short hash, with "+changes" when the work tree differs from it outside
    bench/results: the records a run writes are its outputs, so a second run after the first
    (another seed, another cell) is still on the commit's code. "unknown" outside a checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    ":!bench/results")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")
