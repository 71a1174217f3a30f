"""How a setting of the TOML configuration is declared: one dataclass field, its one default.

A settings dataclass (admission.configschema, admission.controlconfig) declares each key as a
field whose annotation is the key's type and whose default is the key's default; `at_least`,
`between`, `optional_between`, `tcp_port` and `one_of` add the bounds a value must keep. The
loader (admission.config) reads every field from the file by those declarations alone, so a
default or a bound is written once, next to the setting it belongs to.

A class may also declare

- `check(self, key)`: the checks that span several of its settings; `key(name)` is the full
  name of a setting as errors show it (`pools[0].zones.red`), and `check` raises ConfigError;
- `REPLACED`: keys that no longer exist, each mapped to the message that names what replaced
  it (`{name}` in the message is the full name of the setting `name`). Such a key in a file is
  a start-up error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KeyName = Callable[[str], str]
"""The full name of a setting of the table being read, e.g. "yellow" -> "pools[0].zones.yellow"."""

BOUNDS = "kvgate.bounds"
"""The field metadata key holding a setting's `Bounds`."""


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a value must satisfy besides its type."""

    lo: float | None = None
    """The least value (an integer setting's minimum, a number setting's lower end)."""
    hi: float | None = None
    """The upper end (None: only `lo` bounds the value)."""
    choices: tuple[str, ...] = ()
    """A string must be one of these (empty: any string)."""

    def error(self, value: Any) -> str | None:
        """Why `value` breaks the bounds (the text after the key), or None."""
        if self.choices:
            if value in self.choices:
                return None
            return "must be " + " or ".join(repr(c) for c in self.choices)
        if self.hi is None:
            if self.lo is not None and value < self.lo:
                return f"must be >= {self.lo}, got {value}"
            return None
        if self.lo is not None and not self.lo <= value <= self.hi:
            return f"must be between {self.lo} and {self.hi}, got {value}"
        return None


def bounds_of(f: dataclasses.Field[Any]) -> Bounds | None:
    found = f.metadata.get(BOUNDS)
    return found if isinstance(found, Bounds) else None


def at_least(minimum: int, default: int) -> int:
    """An integer setting of at least `minimum`."""
    return field(default=default, metadata={BOUNDS: Bounds(lo=minimum)})


def between(lo: float, hi: float, default: float) -> float:
    """A number setting in [lo, hi] (both finite, so NaN and infinities are refused)."""
    assert math.isfinite(lo) and math.isfinite(hi)
    return field(default=default, metadata={BOUNDS: Bounds(lo=float(lo), hi=float(hi))})


PORT_MAX = 65535
"""The highest TCP port: a larger number would wrap modulo 65536 when bound."""


def tcp_port(default: int) -> int:
    """A TCP port setting: 0..`PORT_MAX` (0: the system picks a free port)."""
    return field(default=default, metadata={BOUNDS: Bounds(lo=0, hi=PORT_MAX)})


def optional_between(lo: float, hi: float) -> float | None:
    """A number setting in [lo, hi], unset (None) by default."""
    return field(default=None, metadata={BOUNDS: Bounds(lo=float(lo), hi=float(hi))})


def one_of(default: str, *others: str) -> str:
    """A string setting that must be `default` or one of `others`."""
    return field(default=default, metadata={BOUNDS: Bounds(choices=(default, *others))})


def required_at_least(minimum: int) -> Any:
    """An integer setting of at least `minimum` with no default of its own (the caller
    supplies the defaults, as `admission.configschema.DEFAULT_TIERS` does per tier)."""
    return field(metadata={BOUNDS: Bounds(lo=minimum)})
