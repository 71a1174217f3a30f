"""What each section of the performance suite (`python -m bench.perf.performance`) hands back.

A section module exposes `run(options: PerfOptions) -> Section`; the suite runs the sections
one after another (never two at once: they share two cores) and writes one report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class PerfOptions:
    results_dir: Path
    """Where charts (PNG) go; the suite writes performance.md and performance.json here."""
    workdir: Path
    """Scratch space for configs, logs and Redis data; removed after the run."""
    quick: bool = False
    """Short phases and small counts: checks that the section runs, not its figures."""
    soak_s: float = 600.0


@dataclass(frozen=True)
class Check:
    """One of the performance targets, as measured in this run."""

    name: str
    target: str
    value: str
    met: bool


@dataclass
class Section:
    title: str
    markdown: str
    """The body under the section's heading: tables and what they mean, no heading."""
    checks: list[Check] = field(default_factory=list)
    charts: list[Path] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    """Raw figures, JSON-serialisable, for performance.json."""


def save_figure(fig: Figure, path: Path) -> Path:
    """Lay out, write as PNG (creating the folder) and free the figure: every chart the same."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
