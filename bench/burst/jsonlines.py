"""The offline tools' JSON lines: one result per line, printed as it comes and optionally
appended to a file, so a long sweep can be stopped, resumed and tabled later."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def emit(row: Mapping[str, object], path: Path | None) -> None:
    """Print ``row`` as one JSON line (flushed: sweeps run for minutes) and append it to
    ``path`` when given."""
    line = json.dumps(row)
    print(line, flush=True)
    if path is not None:
        with path.open("a") as f:
            f.write(line + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def safe(x: Any) -> Any:
    """`x` with what JSON cannot hold made plain: non-finite floats as strings ("inf", "nan";
    float() reads them back), mapping keys as their `label` (tiers) or str, tuples as lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(getattr(k, "label", k)): safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [safe(v) for v in x]
    return x
