"""A setting of arm (c)'s release control, as ``bench.burst.sweep`` and ``bench.burst.matrix
--point`` take it: ``default`` (the shipped control) or comma-separated ``o=<ms>``, ``r=<n>``,
``m=<n>``, ``s=<x>``, ``l=<n>``, ``ls=<x>``, ``lo=<tokens>``, ``le=<0|1>``, ``q=<n>`` at real scale
(bench.burst.sweep lists what each sets)."""

from __future__ import annotations

import dataclasses

from bench.burst.expconfig import Settings

_KEYS = {"o": "vip_ttft_objective_ms", "r": "max_engine_running", "m": "running_min",
         "s": "vip_slowdown", "l": "lane_nodes", "ls": "lane_slowdown", "lo": "lane_output",
         "le": "lane_on_miss", "q": "quiet_nodes"}
_SLOWDOWNS = ("s", "ls")
"""Keys whose value is a multiple (a float), not a count."""


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    """One setting of arm (c)'s control; None fields keep the shipped default."""

    vip_ttft_objective_ms: int | None = None
    max_engine_running: int | None = None
    running_min: int | None = None
    vip_slowdown: float | None = None
    lane_nodes: int | None = None
    lane_slowdown: float | None = None
    lane_output: int | None = None
    lane_on_miss: bool | None = None
    quiet_nodes: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Point:
        """``default``, or ``o=120``, ``r=16``, ``o=120,r=16``, ``m=0,s=0``, ``l=1,ls=1.5``."""
        if spec.strip() == "default":
            return cls()
        fields: dict[str, int | float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in _KEYS:
                raise ValueError(f"{item!r}: expected o=<ms>, r=<sequences>, m=<sequences>, "
                                 "s=<slowdown>, l=<nodes>, ls=<slowdown>, lo=<tokens>, "
                                 "le=<0|1> or q=<nodes>")
            number: int | float = float(value) if key in _SLOWDOWNS else int(value)
            if (number < (1 if key in ("o", "ls") else 0)
                    or (key == "s" and 0 < number < 1)
                    or (key in _SLOWDOWNS and number > 100)
                    or (key == "le" and number > 1)):
                raise ValueError(f"{item!r}: out of range")
            fields[_KEYS[key]] = bool(number) if key == "le" else number
        if not fields:
            raise ValueError(f"{spec!r}: no setting")
        return cls(**fields)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        parts = [f"{k}={int(v) if isinstance(v, bool) else v:g}" for k, name in _KEYS.items()
                 if (v := getattr(self, name)) is not None]
        return ",".join(parts) or "default"

    def apply(self, settings: Settings) -> Settings:
        return dataclasses.replace(settings, **{k: v for k, v in dataclasses.asdict(self).items()
                                                if v is not None})
