"""Traffic mixes defined in a TOML file, so that the matrix, the ideal, the sweep and the
experiment run mixes that are not in the repository without editing it.

    python -m bench.burst.matrix --mix-file my-mixes.toml --seed 201-205 --size 2,4

The file holds one table per mix under ``mix``; the table's name is the mix's name (cells are
written as ``<scale>-<name>-n<size>-s<seed>``). Each mix lists its tenant classes as an array of
tables, either restating a class of the repository's mixes (``like = "<mix>/<class>"``, with
any field changed) or from scratch::

    [mix.rag]
    summary = "retrieval prompts (Normal) at 300%"   # optional
    burst_factor = 3.0                               # optional, default 4.0
    max_tokens = { none = 0.2, cap = 0.5, exact = 0.3, cap_factor = 4.0 }   # optional

    [[mix.rag.class]]
    like = "article/vip-chat"                        # the VIP chats every mix keeps

    [[mix.rag.class]]
    name = "normal-rag"
    tier = "normal"                                  # vip, normal or batch
    rate = 0.8            # arrivals per simulated second per real GPU node at 1x
    prompt = [2000, 6000] # tokens, drawn uniformly; { lo = 2000, hi = 6000, log = true }
    output = [50, 400]    # draws log-uniformly
    stream = true         # optional, default true
    burst = true          # optional, default false: whether the burst multiplies it

Rates and sizes mean what they mean in bench.burst.workload: real scale, scaled to the
simulated fleet in one place. What the matrix needs of a mix is checked when the file is read,
each error naming its key: a VIP class (the VIP criteria read it), a class the burst
multiplies, class names usable as tenant names and unique in their mix, sizes that fit the
engines' context, and no name of the repository's own mixes (a cell's name must say which
traffic ran). A cell's record keeps the whole definition of the mix it ran (``traffic``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from admission.tiers import Tier
from bench.burst.expconfig import Settings
from bench.burst.mixes import MIXES, REALISTIC, Mix
from bench.burst.workload import CHAT_OVERHEAD_TOKENS, MaxTokensMix, Range, TrafficClass

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
"""Mix and class names: a class's name is its tenant's, and both go into file names."""
BUILTIN = frozenset(MIXES)
"""The repository's own mixes, whose names a file may not take."""
MIX_KEYS = frozenset({"summary", "burst_factor", "max_tokens", "class"})
CLASS_KEYS = frozenset({"like", "name", "tier", "rate", "prompt", "output", "stream", "burst"})
RANGE_KEYS = frozenset({"lo", "hi", "log"})
TOKENS_KEYS = frozenset({"none", "cap", "exact", "cap_factor"})


class MixFileError(ValueError):
    """The file cannot define the mixes it states; the message names the key."""


def _unknown(table: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        known = ", ".join(sorted(allowed))
        raise MixFileError(f"{where}: unknown key {extra[0]!r} (known: {known})")


def _number(value: Any, where: str, *, low: float, inclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MixFileError(f"{where}: must be a number, not {value!r}")
    if value < low or (value == low and not inclusive):
        raise MixFileError(f"{where}: must be {'>=' if inclusive else '>'} {low:g}, not {value!r}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise MixFileError(f"{where}: must be true or false, not {value!r}")
    return value


def _range(value: Any, where: str, low: int) -> Range:
    if isinstance(value, list):
        if len(value) != 2:
            raise MixFileError(f"{where}: must be [lo, hi] or {{ lo, hi, log }}")
        lo, hi, log = value[0], value[1], False
    elif isinstance(value, dict):
        _unknown(value, RANGE_KEYS, where)
        if "lo" not in value or "hi" not in value:
            raise MixFileError(f"{where}: needs lo and hi")
        lo, hi, log = value["lo"], value["hi"], _bool(value.get("log", False), f"{where}.log")
    else:
        raise MixFileError(f"{where}: must be [lo, hi] or {{ lo, hi, log }}, not {value!r}")
    for key, x in (("lo", lo), ("hi", hi)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise MixFileError(f"{where}.{key}: must be a whole number of tokens, not {x!r}")
    if lo < low:
        raise MixFileError(f"{where}.lo: must be >= {low}, not {lo}")
    if hi < lo:
        raise MixFileError(f"{where}: hi {hi} is below lo {lo}")
    return Range(lo, hi, log)


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise MixFileError(f"{where}: must be 1-40 of a-z, 0-9 and '-', starting with a letter "
                           f"or digit, not {value!r}")
    return value


def _like(value: Any, where: str) -> TrafficClass:
    if isinstance(value, str) and "/" in value:
        mix, _, name = value.partition("/")
        if mix in BUILTIN:
            for klass in MIXES[mix].classes:
                if klass.name == name:
                    return klass
    known = ", ".join(f"{m}/{c.name}" for m in sorted(BUILTIN) for c in MIXES[m].classes)
    raise MixFileError(f"{where}: must name a class of the repository's mixes ({known}), "
                       f"not {value!r}")


def _class(table: Any, where: str, max_model_len: int) -> TrafficClass:
    if not isinstance(table, dict):
        raise MixFileError(f"{where}: must be a table")
    _unknown(table, CLASS_KEYS, where)
    base = _like(table["like"], f"{where}.like") if "like" in table else None
    if base is None:
        missing = [k for k in ("name", "tier", "rate", "prompt", "output") if k not in table]
        if missing:
            raise MixFileError(f"{where}: needs {', '.join(missing)} (or like = "
                               "\"<mix>/<class>\")")
        base = TrafficClass("", Tier.VIP, 1.0, Range(1, 1), Range(1, 1))
    fields: dict[str, Any] = {}
    if "name" in table:
        fields["name"] = _name(table["name"], f"{where}.name")
    if "tier" in table:
        try:
            if not isinstance(table["tier"], str):
                raise ValueError
            fields["tier"] = Tier.parse(table["tier"])
        except ValueError:
            raise MixFileError(f"{where}.tier: must be vip, normal or batch, not "
                               f"{table['tier']!r}") from None
    if "rate" in table:
        fields["rate"] = _number(table["rate"], f"{where}.rate", low=0)
    if "prompt" in table:
        # A prompt is the simulator's count of the whole chat, its template's tokens included.
        fields["prompt"] = _range(table["prompt"], f"{where}.prompt", CHAT_OVERHEAD_TOKENS + 1)
    if "output" in table:
        fields["output"] = _range(table["output"], f"{where}.output", 1)
    for key in ("stream", "burst"):
        if key in table:
            fields[key] = _bool(table[key], f"{where}.{key}")
    klass = dataclasses.replace(base, **fields)
    if klass.prompt.hi + klass.output.hi > max_model_len:
        raise MixFileError(f"{where}: prompt hi + output hi = "
                           f"{klass.prompt.hi + klass.output.hi} tokens, more than the "
                           f"engines' context of {max_model_len}")
    return klass


def _max_tokens(value: Any, where: str) -> MaxTokensMix:
    if not isinstance(value, dict):
        raise MixFileError(f"{where}: must be a table {{ none, cap, exact, cap_factor }}")
    _unknown(value, TOKENS_KEYS, where)
    args = {k: _number(value[k], f"{where}.{k}", low=0, inclusive=True)
            for k in TOKENS_KEYS if k in value}
    try:
        return dataclasses.replace(REALISTIC, **args)
    except ValueError as exc:
        raise MixFileError(f"{where}: {exc}") from None


def parse_mix(name: str, table: Any, max_model_len: int) -> Mix:
    """One mix from its table; MixFileError naming the key at fault."""
    where = f"mix.{name}"
    _name(name, where)
    if name in BUILTIN:
        raise MixFileError(f"{where}: {name!r} is one of the repository's mixes; "
                           "give yours another name")
    if not isinstance(table, dict):
        raise MixFileError(f"{where}: must be a table")
    _unknown(table, MIX_KEYS, where)
    rows = table.get("class")
    if not isinstance(rows, list) or not rows:
        raise MixFileError(f"{where}.class: needs at least one [[{where}.class]]")
    classes = tuple(_class(row, f"{where}.class[{i}]", max_model_len)
                    for i, row in enumerate(rows))
    names = [c.name for c in classes]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise MixFileError(f"{where}.class[{i}].name: {n!r} is already a class of this mix")
    if not any(c.tier is Tier.VIP for c in classes):
        raise MixFileError(f"{where}: needs a VIP class (the VIP criteria read it; "
                           "like = \"article/vip-chat\" is the one every repository mix keeps)")
    if not any(c.burst for c in classes):
        raise MixFileError(f"{where}: needs a class with burst = true (the burst multiplies it)")
    summary = table.get("summary", f"{name} (from a mix file)")
    if not isinstance(summary, str):
        raise MixFileError(f"{where}.summary: must be a string")
    factor = _number(table.get("burst_factor", 4.0), f"{where}.burst_factor", low=1,
                     inclusive=True)
    tokens = (_max_tokens(table["max_tokens"], f"{where}.max_tokens")
              if "max_tokens" in table else REALISTIC)
    return Mix(name, summary, classes, factor, tokens)


def load_mixes(path: Path, max_model_len: int | None = None) -> dict[str, Mix]:
    """Every mix of the file at `path`, in its order; MixFileError when it cannot.
    `max_model_len`: the engines' context (default: the experiment's)."""
    context = Settings().max_model_len if max_model_len is None else max_model_len
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise MixFileError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise MixFileError(f"{path}: not TOML ({exc})") from None
    _unknown(doc, frozenset({"mix"}), str(path))
    tables = doc.get("mix")
    if not isinstance(tables, dict) or not tables:
        raise MixFileError(f"{path}: defines no mix (a [mix.<name>] table with "
                           "[[mix.<name>.class]] rows)")
    try:
        return {name: parse_mix(name, table, context) for name, table in tables.items()}
    except MixFileError as exc:
        raise MixFileError(f"{path}: {exc}") from None


def register(mixes: Mapping[str, Mix]) -> None:
    """Make `mixes` known to every runner (bench.burst.mixes.MIXES). A name already known with
    another definition is an error: two runs under one name would not be the same traffic."""
    for name, mix in mixes.items():
        known = MIXES.get(name)
        if known is not None and known != mix:
            raise MixFileError(f"mix {name!r} is already defined otherwise")
    MIXES.update(mixes)


def use_mix_file(path: Path | None) -> list[str]:
    """Read and register the mixes of `path` (None: none); their names, in the file's order."""
    if path is None:
        return []
    mixes = load_mixes(path)
    register(mixes)
    return list(mixes)


def one_mix(name: str, mix_file: Path | None) -> str:
    """`name`, a single mix known once `mix_file`'s are registered; MixFileError if not."""
    if "," in name:
        raise MixFileError(f"one mix, not {name!r}")
    (only,) = chosen_mixes(name, mix_file)
    return only


def chosen_mixes(spec: str | None, mix_file: Path | None) -> list[str]:
    """The mixes a run names (`spec`, comma-separated), after registering those of `mix_file`;
    without `spec`, the file's mixes, or else the repository's. MixFileError: the file, or a
    name that is neither the repository's nor the file's."""
    from_file = use_mix_file(mix_file)
    if spec is None:
        return from_file or [m for m in MIXES if m in BUILTIN]
    names = [m.strip() for m in spec.split(",") if m.strip()]
    for name in names:
        if name not in MIXES:
            raise MixFileError(f"unknown mix {name!r}; choose from {', '.join(MIXES)}")
    return names


def definition(mix: Mix) -> dict[str, Any]:
    """What a cell's record keeps of the mix it ran: everything the schedule is drawn from."""
    return {"name": mix.name, "summary": mix.summary, "burst_factor": mix.burst_factor,
            "max_tokens": dataclasses.asdict(mix.max_tokens),
            "classes": [{**dataclasses.asdict(c), "tier": c.tier.label} for c in mix.classes]}


def same_traffic(recorded: Mapping[str, Any], mix: Mix) -> bool:
    """Whether a record's `traffic` (definition(), as JSON) is `mix`'s: everything the
    schedule is drawn from, the summary's words aside."""
    def drawn(d: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k != "summary"}

    return drawn(recorded) == drawn(json.loads(json.dumps(definition(mix))))
