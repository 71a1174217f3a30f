"""What held each tier's queue, per phase, from one kvgate arm's sampled timeline.

``python -m bench.burst.held LOG_DIR/arm-c [--baseline 8] [--burst 12]`` reads the arm's
``samples.jsonl`` (bench.burst.monitor: each sample keeps the pool's ``held_by`` hash, which the
leader's release writes, lua/release.lua) and prints, per phase and tier, how many samples found
the queue non-empty and, of those, the share in which each reason held it: a per-node reason
(kv, prefill, quiet, lane, dedicated) counts once per sample whatever the number of nodes that
gave it, so the shares of a phase may add up to more than 1. Phases are by the sample's time
(wall seconds from the start): baseline, burst (``[baseline, baseline + burst)``), after.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from admission.reads import HELD_REASONS, held_map
from admission.tiers import Tier
from bench.burst.workload import burst_profile

_PHASES = ("baseline", "burst", "after")


@dataclass(slots=True)
class Tally:
    samples: int = 0
    waiting: int = 0
    """Samples with the tier's queue non-empty."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Samples in which each reason held it."""
    unrecorded: int = 0
    """Samples with a queue and no reason recorded yet (a release had not run since it filled)."""


def tally(samples: Iterable[dict[str, object]], baseline_s: float, burst_s: float
          ) -> dict[tuple[str, str], Tally]:
    """(phase, tier label) -> Tally."""
    out = {(p, t.label): Tally() for p in _PHASES for t in Tier}
    profile = burst_profile(baseline_s, burst_s, after_s=math.inf)
    for sample in samples:
        phase = profile.phase_at(float(sample["t"]))  # type: ignore[arg-type]
        queues = sample.get("queues") or {}
        published = sample.get("scheduler") or {}
        assert isinstance(queues, dict) and isinstance(published, dict)
        held = held_map({k[len("held_by:"):]: v for k, v in published.items()
                         if k.startswith("held_by:")})
        for tier in Tier:
            row = out[(phase, tier.label)]
            row.samples += 1
            if not queues.get(tier.label):
                continue
            row.waiting += 1
            why = held.get(tier.label)
            if why is None:
                row.unrecorded += 1
            else:
                row.reasons.update(why.kinds().keys())
    return out


def render(rows: dict[tuple[str, str], Tally]) -> list[str]:
    lines = ["| phase | tier | samples | queue not empty | "
             + " | ".join(HELD_REASONS) + " | not recorded |",
             "|---|---|---:|---:|" + "---:|" * (len(HELD_REASONS) + 1)]
    for (phase, tier), row in rows.items():
        if not row.waiting:
            continue
        shares = [f"{row.reasons[r] / row.waiting:.0%}" if row.reasons[r] else ""
                  for r in HELD_REASONS]
        lines.append(f"| {phase} | {tier} | {row.samples} | {row.waiting} | "
                     + " | ".join(shares) + f" | {row.unrecorded or ''} |")
    if len(lines) == 2:
        lines.append("\nNo queue was found waiting in any sample.")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst.held", description=__doc__)
    p.add_argument("arm_dir", type=Path, help="a kvgate arm's log directory (LOG_DIR/arm-c)")
    p.add_argument("--baseline", type=float, default=8.0,
                   help="wall seconds (reduced scale: 8; full scale: 300)")
    p.add_argument("--burst", type=float, default=12.0,
                   help="wall seconds (reduced scale: 12; full scale: 240)")
    args = p.parse_args(argv)
    path = args.arm_dir / "samples.jsonl"
    if not path.is_file():
        p.error(f"{path}: no such file (a kvgate arm's log directory holds it)")
    with path.open() as f:
        samples = [json.loads(line) for line in f if line.strip()]
    print("\n".join(render(tally(samples, args.baseline, args.burst))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
