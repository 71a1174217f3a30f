"""docs/configuration.md against the parser in admission/config.py: nothing missing, nothing
invented, every documented default the real one.

How the schema is derived (no second copy of it to fall out of date):

- *Which keys the parser accepts.* Every table of the file is read through one
  `admission.config._Reader`, and `_Reader.done()` rejects any key the loader did not read
  (`_Reader.get`/`sub` and the loader's field-by-field `_field` record the key in `used`).
  So the accepted keys of a section are exactly the reader's `used` set when `done()` runs.
  The test wraps `done()`, parses a config that has every kind of table (a pool with a
  backend table and a zones table, a tenant), and records each reader's path (`pools[0].zones`
  normalised to `pools.zones`) and `used` keys. A used key that is itself a recorded section
  (`zones`, `backends`, `redis`, `tiers.vip`, ...) is a section, not a leaf key.
- *Defaults.* For each documented key with a default, the key is set to the documented value
  (a TOML literal in the table) in an otherwise minimal config, which must parse, and the
  resulting attribute must equal the one parsed without the key: that is the real default,
  whatever the loader does. *required* keys must fail when left out, *unset* ones must parse
  to None.
- *One default.* A default exists only on its settings dataclass field (admission.configschema,
  admission.controlconfig) or, per tier, in `DEFAULT_TIERS`: each is replaced in turn by a
  marked object equal to it, and the parsed setting must be that very object.
- *Types.* The documented default must be of the documented type, and a value of the wrong
  type must be rejected with an error naming the key.
- *Unknown keys.* Every section (and the top level) rejects a key that is not in the schema.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from admission import config as cfg
from admission.config import ADMIN_TOKEN_ENV, Config, ConfigError, parse_config
from admission.configfields import bounds_of
from admission.tiers import Tier

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
TYPES = ("string", "integer", "number", "boolean", "array of strings")
REQUIRED, UNSET = "*required*", "*unset*"

# Where each documented section's values end up in the parsed Config. The test fails if the
# parser grows a section that is missing here or in the document.
ACCESSORS: dict[str, Callable[[Config], Any]] = {
    "redis": lambda c: c.redis,
    "gateway": lambda c: c.gateway,
    "scheduler": lambda c: c.scheduler,
    "tiers.vip": lambda c: c.tiers[Tier.VIP],
    "tiers.normal": lambda c: c.tiers[Tier.NORMAL],
    "tiers.batch": lambda c: c.tiers[Tier.BATCH],
    "pools": lambda c: c.pools["p"],
    "pools.zones": lambda c: c.pools["p"].zones,
    "pools.dedicated": lambda c: c.pools["p"].dedicated,
    "pools.control": lambda c: c.pools["p"].control,
    "pools.fairness": lambda c: c.pools["p"].fairness,
    "pools.engine": lambda c: c.pools["p"].engine,
    "pools.backends": lambda c: c.pools["p"].backends[0],
    "tenants": lambda c: c.tenants[0],
    "teams": lambda c: c.teams["crew"],
}


def base() -> dict[str, Any]:
    """The smallest config with one table of every kind (only required keys given)."""
    return {
        "redis": {},
        "gateway": {},
        "scheduler": {},
        "tiers": {"vip": {}, "normal": {}, "batch": {}},
        "pools": [{
            "name": "p",
            "backends": [{"name": "gpu-0", "url": "http://127.0.0.1:9001"}],
            "zones": {},
            "dedicated": {},
            "control": {},
            "fairness": {},
            "engine": {},
        }],
        "tenants": [{"name": "acme", "tier": "vip"}],
        "teams": [{"name": "crew"}],
    }


def parse(data: Mapping[str, Any]) -> Config:
    return parse_config(data, env={})


def table_of(data: dict[str, Any], section: str) -> dict[str, Any]:
    """The TOML table of `section` inside `data` (first element of arrays of tables)."""
    node: Any = data
    for part in section.split(".") if section else []:
        node = node[part]
        if isinstance(node, list):
            node = node[0]
    assert isinstance(node, dict)
    return node


# --- The document --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    section: str
    key: str
    type: str
    default: str
    used_by: str
    meaning: str

    @property
    def value(self) -> Any:
        """The documented default as a TOML value."""
        return tomllib.loads(f"v = {self.default.strip('`')}")["v"]


def _cells(line: str) -> list[str]:
    # Split on pipes that are not escaped (`\|` is a literal pipe inside a cell).
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def document_rows() -> list[Row]:
    rows: list[Row] = []
    section: str | None = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^#{2,4} `\[{1,2}([a-z_.]+)\]{1,2}`\s*$", line)
        if heading:
            section = heading.group(1)
            continue
        if line.startswith("#"):
            section = None
            continue
        if section is None or not line.startswith("|"):
            continue
        cells = _cells(line)
        if cells[0] == "key" or set("".join(cells)) <= set("-: "):
            continue
        assert len(cells) == 5, f"{section}: a key row needs 5 cells: {line}"
        key = re.fullmatch(r"`([a-z_0-9]+)`", cells[0])
        assert key, f"{section}: key cell must be `name`: {cells[0]}"
        rows.append(Row(section, key.group(1), *cells[1:]))
    return rows


def environment_variables() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    part = text.split("## Environment", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", part, flags=re.MULTILINE)


ROWS = document_rows()


def row_id(row: Row) -> str:
    return f"{row.section}.{row.key}"


# --- The parser ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schema:
    keys: dict[str, set[str]]
    """Section path -> leaf keys the parser accepts there."""
    sections: set[str]


def parser_schema() -> Schema:
    seen: dict[str, set[str]] = {}
    original = cfg._Reader.done

    def recording_done(self: cfg._Reader) -> None:
        where = re.sub(r"\[\d+\]", "", self.where)
        seen.setdefault(where, set()).update(self.used)
        original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cfg._Reader, "done", recording_done)
        parse(base())
    sections = set(seen)
    keys = {
        where: {k for k in used if (f"{where}.{k}" if where else k) not in sections}
        for where, used in seen.items()
    }
    return Schema({w: k for w, k in keys.items() if k}, sections)


SCHEMA = parser_schema()


# --- Tests ---------------------------------------------------------------------------------


def test_the_document_has_the_tables() -> None:
    assert len(ROWS) >= 60
    assert {r.section for r in ROWS} >= {"redis", "gateway", "pools.zones", "tenants"}
    ids = [row_id(r) for r in ROWS]
    assert len(ids) == len(set(ids)), "a key is documented twice"


def test_every_accepted_key_is_documented_and_every_documented_key_is_accepted() -> None:
    documented: dict[str, set[str]] = {}
    for row in ROWS:
        documented.setdefault(row.section, set()).add(row.key)
    missing = sorted(f"{s}.{k}" for s, keys in SCHEMA.keys.items()
                     for k in keys - documented.get(s, set()))
    invented = sorted(f"{s}.{k}" for s, keys in documented.items()
                      for k in keys - SCHEMA.keys.get(s, set()))
    assert not missing, f"accepted by admission/config.py but not documented: {missing}"
    assert not invented, f"documented but rejected by admission/config.py: {invented}"
    assert set(SCHEMA.keys) == set(ACCESSORS), "a section without an accessor in this test"


def test_the_parser_derivation_sees_what_it_should() -> None:
    # Guards the derivation itself: if _Reader stopped recording keys, the test above would
    # compare two empty sets.
    assert SCHEMA.keys["pools.zones"] >= {"yellow", "red", "kv_target"}
    assert {"zones", "backends"}.isdisjoint(SCHEMA.keys["pools"])
    assert SCHEMA.sections >= {"", "tiers", "tiers.vip", "pools.backends"}


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_documented_default_is_the_real_default(row: Row) -> None:
    assert row.type in TYPES, f"{row_id(row)}: unknown type {row.type!r}"
    assert row.used_by in ("gateway", "scheduler", "both", "none")
    assert row.meaning and not row.meaning.endswith(" |")
    get = ACCESSORS[row.section]
    without = base()
    table_of(without, row.section).pop(row.key, None)
    if row.default == REQUIRED:
        with pytest.raises(ConfigError, match=re.escape(f".{row.key}: is required")):
            parse(without)
        return
    real = getattr(get(parse(without)), row.key)
    if row.default == UNSET:
        assert real is None, f"{row_id(row)} is documented as unset but defaults to {real!r}"
        return
    assert re.fullmatch(r"`[^`]+`", row.default), f"{row_id(row)}: default must be `TOML`"
    documented = row.value
    kinds: dict[str, tuple[type, ...]] = {
        "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
        "array of strings": (list,),
    }
    assert isinstance(documented, kinds[row.type]), f"{row_id(row)}: default is not a {row.type}"
    assert row.type == "boolean" or not isinstance(documented, bool)
    with_default = copy.deepcopy(without)
    table_of(with_default, row.section)[row.key] = documented
    parsed = getattr(get(parse(with_default)), row.key)
    assert parsed == real, f"{row_id(row)}: documented default {row.default}, real {real!r}"


WRONG_TYPE: dict[str, Any] = {
    "string": 1, "integer": "1", "number": "1", "boolean": "yes", "array of strings": "vip",
}


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_a_value_of_the_wrong_type_is_rejected_naming_the_key(row: Row) -> None:
    data = base()
    table_of(data, row.section)[row.key] = WRONG_TYPE[row.type]
    with pytest.raises(ConfigError, match=rf"\.{row.key}: expected "):
        parse(data)


@pytest.mark.parametrize("section", sorted(SCHEMA.sections), ids=lambda s: s or "top level")
def test_unknown_keys_are_rejected(section: str) -> None:
    data = base()
    table_of(data, section)["no_such_key"] = 1
    with pytest.raises(ConfigError, match=r"no_such_key: unknown key"):
        parse(data)


def test_environment_is_documented_and_redis_url_overrides_the_file() -> None:
    assert environment_variables() == ["REDIS_URL", "KVGATE_ADMIN_TOKEN_SHA256"]
    data = base()
    data["redis"]["url"] = "redis://from-file:6379/0"
    assert parse_config(data, env={}).redis.url == "redis://from-file:6379/0"
    assert parse_config(data, env={"REDIS_URL": "rediss://env:6380/1"}).redis.url == (
        "rediss://env:6380/1"
    )
    # Empty counts as not set, as documented.
    assert parse_config(data, env={"REDIS_URL": ""}).redis.url == "redis://from-file:6379/0"


def test_the_admin_tokens_hash_may_come_from_the_environment() -> None:
    data = base()
    in_file, in_env = "a" * 64, "b" * 64
    data.setdefault("gateway", {})["admin_token_sha256"] = in_file
    assert parse_config(data, env={}).gateway.admin_token_sha256 == in_file
    assert parse_config(data, env={ADMIN_TOKEN_ENV: in_env}).gateway.admin_token_sha256 == in_env
    assert parse_config(data, env={ADMIN_TOKEN_ENV: ""}).gateway.admin_token_sha256 == in_file
    del data["gateway"]["admin_token_sha256"]
    assert parse_config(data, env={ADMIN_TOKEN_ENV: in_env}).gateway.admin_token_sha256 == in_env
    # The token itself (not its hash) is refused, naming the variable, never echoing it.
    with pytest.raises(ConfigError, match=ADMIN_TOKEN_ENV) as refused:
        parse_config(data, env={ADMIN_TOKEN_ENV: "my-admin-token"})
    assert "my-admin-token" not in str(refused.value)


def test_the_example_config_uses_only_documented_keys() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "local.toml"
    with example.open("rb") as f:
        data = tomllib.load(f)
    documented = {row_id(r) for r in ROWS}

    def walk(node: Any, where: str) -> Iterator[str]:
        if isinstance(node, list):
            for item in node:
                yield from walk(item, where)
        elif isinstance(node, dict):
            for key, value in node.items():
                path = f"{where}.{key}" if where else key
                if path in SCHEMA.sections:
                    yield from walk(value, path)
                else:
                    yield path

    used = set(walk(data, ""))
    assert used, "the example has no keys?"
    assert used <= documented, sorted(used - documented)


# --- Each default is written once ----------------------------------------------------------


class _MarkedInt(int):
    pass


class _MarkedFloat(float):
    pass


class _MarkedStr(str):
    pass


class _MarkedTuple(tuple[Any, ...]):
    pass


def _marked(value: Any) -> Any:
    """An object equal to `value` but not any object the loader could have made itself (a
    bool, which cannot be subclassed, is flipped instead)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return _MarkedInt(value)
    if isinstance(value, float):
        return _MarkedFloat(value)
    if isinstance(value, str):
        return _MarkedStr(value)
    if isinstance(value, tuple):
        return _MarkedTuple(value)
    raise AssertionError(f"no marker for {value!r}")


def _defaulted_fields() -> list[tuple[str, str]]:
    """(section, field) of every setting with a default of its own (None: unset, no value)."""
    parsed = parse(base())
    out = []
    for section, get in ACCESSORS.items():
        for f in dataclasses.fields(get(parsed)):
            if f.default is not dataclasses.MISSING and f.default is not None:
                out.append((section, f.name))
    return out


DEFAULTED = _defaulted_fields()


def test_the_defaults_written_once_cover_every_section() -> None:
    sections = {s for s, _ in DEFAULTED}
    # TierSettings has no defaults of its own (DEFAULT_TIERS, below); a backend's only
    # optional setting is unset by default.
    assert sections == set(ACCESSORS) - {"tiers.vip", "tiers.normal", "tiers.batch",
                                         "pools.backends"}
    assert len(DEFAULTED) >= 60


@pytest.mark.parametrize(("section", "name"), DEFAULTED, ids=lambda v: str(v))
def test_the_loader_takes_each_default_from_the_dataclass_field(section: str, name: str
                                                               ) -> None:
    """The dataclass field's default is the only one: replaced by a marked object, the parsed
    setting is that very object, so no literal in admission/config.py stands in for it."""
    get = ACCESSORS[section]
    data = base()
    table_of(data, section).pop(name, None)
    settings_type = type(get(parse(data)))
    f = {f.name: f for f in dataclasses.fields(settings_type)}[name]
    marker = _marked(f.default)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(f, "default", marker)
        parsed = getattr(get(parse(data)), name)
    if isinstance(marker, bool):
        assert parsed is marker
    else:
        assert type(parsed) is type(marker) and parsed is marker, (
            f"{section}.{name}: the loader wrote its own default {parsed!r}")


def test_the_tier_defaults_come_from_default_tiers_alone() -> None:
    marked = {tier: cfg.TierSettings(_MarkedInt(s.queue_timeout_ms), _MarkedInt(s.max_queued))
              for tier, s in cfg.DEFAULT_TIERS.items()}
    with pytest.MonkeyPatch.context() as mp:
        for tier, settings in marked.items():
            mp.setitem(cfg.DEFAULT_TIERS, tier, settings)
        parsed = parse(base())
    for tier, settings in marked.items():
        assert parsed.tiers[tier].queue_timeout_ms is settings.queue_timeout_ms
        assert parsed.tiers[tier].max_queued is settings.max_queued


@pytest.mark.parametrize(("section", "name"), DEFAULTED, ids=lambda v: str(v))
def test_every_default_keeps_its_own_bounds(section: str, name: str) -> None:
    settings_type = type(ACCESSORS[section](parse(base())))
    f = {f.name: f for f in dataclasses.fields(settings_type)}[name]
    bounds = bounds_of(f)
    assert bounds is None or bounds.error(f.default) is None, f"{section}.{name}"
