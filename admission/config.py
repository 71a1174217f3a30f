"""Loading the TOML configuration shared by gateways and schedulers, validated at start.

One file describes the whole deployment (Redis, model pools and their backends, tiers,
tenants); each service reads the sections it needs. Every error names the key that is wrong,
e.g. ``pools[0].zones.red: must be between 0.0 and 1.0, got 1.5``. ``REDIS_URL`` in the
environment overrides ``redis.url``.

What the settings are, their defaults and their bounds is admission.configschema's (and
admission.controlconfig's for `[pools.control]`, admission.fairconfig's for `[pools.fairness]`
and the tenants' fair-share keys, admission.quotaconfig's for `[[teams]]`): this module reads
each table into its dataclass field by field (`_section`), the type from the annotation, the
default from the field, the bounds from the field's metadata. It holds no default of its
own, so a default is changed in one place. The settings are re-exported here: services import
them from admission.config.

`startup_warnings`: what a gateway warns about at start, for a configuration that is valid but
still turns requests away. The services' command lines are admission.cli.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import ssl
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from redis.connection import to_bool

from admission.configchecks import (
    check_admin_token,
    check_redis_calls,
    check_stuck_after,
    check_unique_pools,
    check_unique_tenants,
    refuse_sentinel_password,
    startup_warnings,
    with_sentinel_password,
)
from admission.configfields import (
    UNSET,
    ConfigError,
    bounds_of,
    ceiling_error,
    is_sha256,
    split_address,
    url_query,
)
from admission.configschema import (
    DEFAULT_TIERS,
    Backend,
    Config,
    DedicatedNodes,
    EngineSettings,
    GatewaySettings,
    PoolSettings,
    SchedulerSettings,
    TenantSettings,
    TierSettings,
    ZoneSettings,
)
from admission.controlconfig import ControlSettings
from admission.quotaconfig import TeamSettings, check_members, check_teams
from admission.redisconfig import RedisSettings
from admission.tiers import Tier

__all__ = [
    "DEFAULT_TIERS",
    "Backend",
    "Config",
    "ConfigError",
    "ControlSettings",
    "DedicatedNodes",
    "EngineSettings",
    "GatewaySettings",
    "PoolSettings",
    "RedisSettings",
    "SchedulerSettings",
    "TeamSettings",
    "TenantSettings",
    "TierSettings",
    "ZoneSettings",
    "check_mounted_files",
    "check_redis_ca",
    "in_file",
    "load_config",
    "parse_config",
    "split_address",
    "startup_warnings",
    "tls_context",
]

T = TypeVar("T")


class _Reader:
    """Pulls typed values out of one TOML table, naming the full key on any error."""

    def __init__(self, table: Any, where: str) -> None:
        if not isinstance(table, dict):
            raise ConfigError(f"{where or 'config'}: must be a table")
        self.table: dict[str, Any] = table
        self.where = where
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        self.used.add(name)
        if name not in self.table:
            return default
        return self.check_kind(self.key(name), self.table[name], kind)

    @staticmethod
    def check_kind(where: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{where}: expected {_kind_name(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise ConfigError(f"{where}: expected {_kind_name(kinds)}, got {type(value).__name__}")
        return value

    def sub(self, name: str) -> _Reader:
        self.used.add(name)
        return _Reader(self.table.get(name, {}), self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise ConfigError(f"{self.key(unknown[0])}: unknown key")


class _Overridden(_Reader):
    """A table whose setting `name` the environment's `variable` overrides: errors about that
    setting name the variable, since the file's value is not the one at fault."""

    def __init__(self, r: _Reader, name: str, variable: str) -> None:
        super().__init__(r.table, r.where)
        self.used = r.used
        self.name, self.variable = name, variable

    def key(self, name: str) -> str:
        full = super().key(name)
        return f"{self.variable} (which overrides {full})" if name == self.name else full


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "an array", dict: "a table"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


class _Names(dict[str, str]):
    """`{name}` in a REPLACED message -> the setting's full name."""

    def __init__(self, r: _Reader) -> None:
        super().__init__()
        self.r = r

    def __missing__(self, name: str) -> str:
        return self.r.key(name)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(hint: Any) -> Any:
    """X of `X | None`, else the hint itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _scalar(where: str, value: Any, hint: Any) -> Any:
    """A value of the file as the setting's type, or ConfigError naming `where`."""
    if hint is bool:
        return _Reader.check_kind(where, value, bool)
    if hint is int:
        return _Reader.check_kind(where, value, int)
    if hint is float:
        return float(_Reader.check_kind(where, value, (int, float)))
    if hint is str:
        return _Reader.check_kind(where, value, str)
    if hint is Tier:
        # Outside the try: its ConfigError, a ValueError too, already names the key.
        text = _Reader.check_kind(where, value, str)
        try:
            return Tier.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    raise TypeError(f"{where}: the loader reads no setting of type {hint!r}")


def _field(r: _Reader, cls: type, name: str, defaults: Any = None) -> Any:
    """Setting `name` of `cls` from table `r`: the file's value, checked against the field's
    type and bounds, else its default (`defaults`' attribute when given, else the field's)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = _hints(cls)[name]
    if dataclasses.is_dataclass(hint):
        return _section(r.sub(name), typing.cast(type, hint))
    default = getattr(defaults, name) if defaults is not None else f.default
    if name not in r.table:
        if default is dataclasses.MISSING:
            raise ConfigError(f"{r.key(name)}: is required")
        r.used.add(name)
        return default
    r.used.add(name)
    where, raw = r.key(name), r.table[name]
    kind = _optional(hint)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        items = _Reader.check_kind(where, raw, list)
        if item is Tier:  # a tier list's error names the list, as "unknown tier ..." reads
            return tuple(_scalar(where, v, Tier) for v in items)
        return tuple(_scalar(f"{where}[{i}]", v, item) for i, v in enumerate(items))
    value = _scalar(where, raw, kind)
    if kind is str and value == "" and isinstance(default, str):
        # Refused rather than read as the default: a template that rendered `url = ""` from
        # an unset variable would otherwise reach the local Redis without a word.
        raise ConfigError(f"{where}: is empty; leave the key out for its default {default!r}")
    if kind is str and value == "" and UNSET in f.metadata:
        raise ConfigError(f"{where}: is empty; leave the key out for {f.metadata[UNSET]}")
    bounds = bounds_of(f)
    problem = None if bounds is None else bounds.error(value)
    if problem is None and kind is int:
        problem = ceiling_error(name, value)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return value


def _section(r: _Reader, cls: type[T], defaults: T | None = None, /, **given: Any) -> T:
    """Table `r` as a `cls`: every field not `given` read by `_field`, then the class's own
    checks (`check`), then unknown keys refused."""
    for old, message in getattr(cls, "REPLACED", {}).items():
        if old in r.table:
            raise ConfigError(f"{r.key(old)}: " + message.format_map(_Names(r)))
    values = dict(given)
    for f in dataclasses.fields(typing.cast(Any, cls)):
        if f.name not in values:
            values[f.name] = _field(r, cls, f.name, defaults)
    settings = cls(**values)
    check = getattr(settings, "check", None)
    if check is not None:
        check(r.key)
    r.done()
    return settings


def _backend(value: Any, where: str, index: int) -> Backend:
    if isinstance(value, str):  # the short form: a URL, named by its place in the list
        value = {"name": f"node-{index}", "url": value}  # checked as the table form is
    backend = _section(_Reader(value, where), Backend)
    return dataclasses.replace(backend, url=backend.url.rstrip("/"))


def _pool(r: _Reader) -> PoolSettings:
    given: dict[str, Any] = {}
    if "backends" in r.table:
        raw = r.get("backends", list)
        given["backends"] = tuple(
            _backend(b, f"{r.key('backends')}[{i}]", i) for i, b in enumerate(raw)
        )
    pool = _section(r, PoolSettings, **given)
    if not pool.dedicated.nodes and pool.dedicated.tiers:
        # Tiers without dedicated nodes dedicate nothing.
        pool = dataclasses.replace(pool, dedicated=dataclasses.replace(pool.dedicated, tiers=()))
    return pool


def _tiers(r: _Reader) -> dict[Tier, TierSettings]:
    tiers = {tier: _section(r.sub(tier.label), TierSettings, DEFAULT_TIERS[tier])
             for tier in DEFAULT_TIERS}
    r.done()
    return tiers


ADMIN_TOKEN_ENV = "KVGATE_ADMIN_TOKEN_SHA256"
"""Overrides `gateway.admin_token_sha256` when set and not empty: a deployment keeps the admin
token's hash in a secret store, beside the tenants' key hashes, rather than in the file."""


def _admin_token(env: Mapping[str, str]) -> str | None:
    value = env.get(ADMIN_TOKEN_ENV, "").strip()
    if not value:
        return None
    if not is_sha256(value):
        raise ConfigError(f"{ADMIN_TOKEN_ENV}: must be a lowercase hex SHA-256 (of the admin "
                          "token, never the token itself)", variable=ADMIN_TOKEN_ENV)
    return value


def parse_config(data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    root = _Reader(dict(data), "")
    env = os.environ if env is None else env
    pools_raw = root.get("pools", list) or []
    pools = [_pool(_Reader(p, f"pools[{i}]")) for i, p in enumerate(pools_raw)]
    if not pools:
        raise ConfigError("pools: at least one [[pools]] table is required")
    check_unique_pools(pools)
    tenants = tuple(
        _section(_Reader(t, f"tenants[{i}]"), TenantSettings)
        for i, t in enumerate(root.get("tenants", list) or [])
    )
    check_unique_tenants(tenants)
    teams = check_teams(_section(_Reader(t, f"teams[{i}]"), TeamSettings)
                        for i, t in enumerate(root.get("teams", list) or []))
    check_members(((f"tenants[{i}]", t.team, t.burst) for i, t in enumerate(tenants)), teams)
    redis = root.sub("redis")
    if env.get("REDIS_URL"):
        # The file's url is not used, so not judged: an empty one must not stop a deployment
        # whose environment gives the address.
        redis.used.add("url")
        file_url = None
        redis = _Overridden(redis, "url", "REDIS_URL")
    else:
        file_url = _field(redis, RedisSettings, "url")
    gateway = root.sub("gateway")
    file_admin_token = _field(gateway, GatewaySettings, "admin_token_sha256")
    admin_token = _admin_token(env)
    check_admin_token(admin_token or file_admin_token,
                       f"{ADMIN_TOKEN_ENV} (which overrides gateway.admin_token_sha256)"
                       if admin_token else "gateway.admin_token_sha256", tenants)
    refuse_sentinel_password(redis.table)
    # The Sentinels' password is given, never read from the file: it comes from the variable
    # the file names.
    try:
        redis_section = _section(redis, RedisSettings, url=env.get("REDIS_URL") or file_url,
                                 sentinel_password=None)
    except ConfigError as exc:
        if isinstance(redis, _Overridden) and str(exc).startswith(redis.key("url")):
            raise ConfigError(str(exc), variable=redis.variable) from None
        raise
    redis_settings = with_sentinel_password(redis_section, env)
    config = Config(
        redis=redis_settings,
        gateway=_section(gateway, GatewaySettings,
                         admin_token_sha256=admin_token or file_admin_token),
        scheduler=_section(root.sub("scheduler"), SchedulerSettings),
        tiers=_tiers(root.sub("tiers")),
        pools={p.name: p for p in pools},
        tenants=tenants,
        teams=teams,
    )
    root.done()
    check_redis_calls(config.redis, config.scheduler, len(config.pools))
    check_stuck_after(config.gateway, config.scheduler)
    return config


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return parse_config(data, env)
    except ConfigError as exc:
        raise in_file(path, exc) from None


def in_file(path: str | Path, error: ConfigError) -> ConfigError:
    """`error` naming the file before the key (`/etc/kvgate/config.toml: gateway.port: ...`),
    as its syntax errors do: the services' log names the key, and a reader with several files
    (a ConfigMap, a Secret's tenants, a local copy) needs to know which one holds it. An error
    about an environment variable's value (`REDIS_URL`, ...) is returned as it is: the file
    holds nothing wrong."""
    if error.variable is not None:
        return error
    return ConfigError(f"{path}: {error}")


def check_mounted_files(config: Config) -> None:
    """ConfigError if a file the services load at start cannot be loaded: every pool's
    `backend_ca_file` and the Redis connection's TLS files (`check_redis_ca`). Not part of
    `load_config`: `kvgate-inspect --config`, run with a copy of a pod's file on a laptop,
    reads the Redis settings and never a pool's `backend_ca_file` (the Redis CA it does load,
    and `--ssl-ca-file` names a local copy of it)."""
    config.backend_ssl_context()
    check_redis_ca(config)


def tls_context(settings: RedisSettings) -> ssl.SSLContext | None:
    """The TLS context of a connection to `settings.url`: None for redis:// and unix://; for
    rediss://, the CA (the URL's `ssl_ca_certs`, else `ssl_ca_file`, else the system's), the
    client certificate (`ssl_certfile`, `ssl_keyfile`) and the checks (`ssl_cert_reqs`,
    `ssl_check_hostname`) as the redis-py client reads them from the same URL, so that the
    gateways' multiplexed connection and the client library's connections trust the same
    server. OSError or ssl.SSLError if a file cannot be loaded."""
    if not settings.url.startswith("rediss://"):
        return None
    query = url_query(settings.url)
    # The system's CAs and the named file, as redis-py's connections trust them.
    context = ssl.create_default_context()
    ca = query.get("ssl_ca_certs") or settings.ssl_ca_file
    if ca:
        context.load_verify_locations(cafile=ca)
    if "ssl_certfile" in query:
        context.load_cert_chain(query["ssl_certfile"], query.get("ssl_keyfile"))
    reqs = query.get("ssl_cert_reqs", "required")
    check_hostname = to_bool(  # type: ignore[no-untyped-call, unused-ignore]
        query.get("ssl_check_hostname", "true")) is not False
    context.check_hostname = check_hostname and reqs != "none"
    context.verify_mode = {"none": ssl.CERT_NONE,
                           "optional": ssl.CERT_OPTIONAL}.get(reqs, ssl.CERT_REQUIRED)
    return context


def check_redis_ca(config: Config) -> None:
    """ConfigError if the files of the Redis connection's TLS (`redis.ssl_ca_file`, or the
    URL's `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`) cannot be loaded. The services call
    it at start: otherwise every connection fails on it, and is retried for ever, with the
    file's error alone. Not part of `load_config`, which checks files a process may not have
    mounted."""
    settings = config.redis
    query = url_query(settings.url)
    files = [("redis.url's ssl_ca_certs", query.get("ssl_ca_certs")),
             ("redis.ssl_ca_file", settings.ssl_ca_file),
             ("redis.url's ssl_certfile", query.get("ssl_certfile"))]
    for name, path in files:
        if path is None:
            continue
        try:
            if name.endswith("ssl_certfile"):
                ssl.create_default_context().load_cert_chain(path, query.get("ssl_keyfile"))
            else:
                ssl.create_default_context(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{name} {path!r}: cannot load it ({exc})") from None
