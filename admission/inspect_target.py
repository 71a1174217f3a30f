"""Which Redis and which pools `kvgate-inspect` reads, named before it reads them.

The CLI finds its Redis the way the services do, first match wins:

1. ``--config FILE``: the file's ``[redis]`` settings, ``REDIS_URL`` (when set and not empty)
   overriding ``redis.url`` exactly as in the gateway and the scheduler, and ``--ssl-ca-file``
   its ``redis.ssl_ca_file`` (``--cluster`` is refused: the file says whether it is one);
2. ``--redis-url URL`` (an empty one is an error: ``--redis-url "$REDIS_URL"`` with the
   variable unset must not read the default server);
3. ``REDIS_URL``;
4. the services' default, ``redis://127.0.0.1:6379/0``.

A tool that falls back to a default must say so: a default that reaches the wrong server (a
laptop's own Redis, database 0 instead of the one the services use) would otherwise print an
empty but plausible picture. So the address and where it came from are always printed, as a
URL without credentials (host:port/db, the socket path, the Sentinel master or the cluster
seed), and a Redis that holds no key of the pools asked for is an error naming the key pattern
it looked for, never an empty table.

``--ssl-ca-file`` with a URL that is not ``rediss://`` is an error, as ``redis.ssl_ca_file`` is
in the file: the CA would go unused, and the reads would go out in clear text to someone who
asked for TLS. A CA that cannot be loaded is an error of the flag (or of the file's key) before
the first read, as it is at a service's start, not a connection error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ssl
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio.connection import parse_url

from admission.config import ConfigError, RedisSettings, TenantSettings, load_config
from admission.configfields import redis_url_error
from admission.connection import redis_address
from admission.keys import NAME_PATTERN, ROOT, PoolKeys

ANY_POOL_PATTERN = f"{ROOT}:{{*}}:*"
"""Keys of every pool (the scheduler's own keys, ``{sched}``, match too and are skipped)."""
SCAN_COUNT = 500
"""Keys per SCAN step: large enough to be quick, small enough not to stall the server."""


def pool_pattern(pool: str) -> str:
    """The glob every key of `pool` matches."""
    return PoolKeys(pool).prefix + "*"


@dataclass(frozen=True, slots=True)
class Target:
    """What one run of the CLI reads."""

    settings: RedisSettings
    source: str
    """Where the Redis address came from (a flag, REDIS_URL, the file, the default)."""
    pools: tuple[str, ...]
    """Empty: every pool found in the keyspace."""
    pools_source: str
    tenants: tuple[TenantSettings, ...] = ()
    ca_source: str = "--ssl-ca-file"
    """Who named `settings.ssl_ca_file`: the flag, or the file's key."""
    teams: tuple[str, ...] = ()
    """The file's `[[teams]]` (quota levels), by name."""
    configured_pools: tuple[str, ...] = ()
    """The file's pools (`pools` may name others, with --pool)."""

    @property
    def address(self) -> str:
        return redis_address(self.settings)

    def announce(self) -> str:
        return f"reading {self.address} ({self.source})"


def _check_url(url: str, where: str) -> str:
    """`url`, checked as the services check `redis.url`: ConfigError naming `where`."""
    problem = redis_url_error(url)
    try:
        parse_url(url)
    except ValueError as exc:
        problem = problem or str(exc)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return url


def _check_tls(settings: RedisSettings, ssl_ca_file: str, source: str) -> None:
    """ConfigError unless `settings` use TLS, as the services check `redis.ssl_ca_file`."""
    if not ssl_ca_file:
        raise ConfigError("--ssl-ca-file: must name a CA bundle (it is empty)")
    if not settings.url.startswith("rediss://"):
        raise ConfigError(f"--ssl-ca-file: needs a rediss:// URL (TLS), and "
                          f"{redis_address(settings)} ({source}) is not one; the CA is not "
                          "used without TLS")


def check_ca(target: Target) -> None:
    """ConfigError naming where the CA came from if it cannot be loaded; reads the file."""
    path = target.settings.ssl_ca_file
    if path and target.settings.url.startswith("rediss://"):
        try:
            ssl.create_default_context(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            hint = "" if target.ca_source == "--ssl-ca-file" else "; name a copy with --ssl-ca-file"
            raise ConfigError(f"{target.ca_source}: cannot load {path!r} ({exc}){hint}") from None


def _file_sets_url(path: str) -> bool:
    with open(path, "rb") as f:
        redis = tomllib.load(f).get("redis", {})
    return isinstance(redis, dict) and bool(redis.get("url"))


def resolve_target(*, config: str | None, redis_url: str | None, cluster: bool,
                   ssl_ca_file: str | None, pools: Sequence[str],
                   env: Mapping[str, str]) -> Target:
    """The Redis and pools to read; no I/O but reading the config file.

    ConfigError: the file is invalid, or a URL is not one the services would accept.
    """
    named = tuple(pools)
    if config is not None:
        if cluster:
            # The file says whether its Redis is a cluster; a flag that disagreed would read
            # another server than the services do.
            raise ConfigError(f"--cluster: with --config, redis.cluster of {config} decides")
        loaded = load_config(config, env)
        settings = loaded.redis
        if env.get("REDIS_URL"):
            source = f"REDIS_URL, which overrides redis.url of {config}"
        elif _file_sets_url(config):
            source = f"redis.url of {config}"
        else:
            source = f"the default: {config} sets no redis.url and REDIS_URL is not set"
        ca_source = f"redis.ssl_ca_file of {config}"
        if ssl_ca_file is not None:
            # The file's CA path is the services' (a pod's mount); one run elsewhere names its
            # own copy.
            _check_tls(settings, ssl_ca_file, source)
            settings = _with_ca(settings, ssl_ca_file)
            source += ", with the CA of --ssl-ca-file"
            ca_source = "--ssl-ca-file"
        return Target(settings, source, named or tuple(loaded.pools),
                      "--pool" if named else f"the pools of {config}", loaded.tenants,
                      ca_source, tuple(loaded.teams), tuple(loaded.pools))
    if redis_url == "":
        # `--redis-url "$REDIS_URL"` in a shell where it is unset: falling back to REDIS_URL or
        # the default would read another server than the one the flag was meant to name.
        raise ConfigError("--redis-url: is empty (an unset variable, as in "
                          "--redis-url \"$REDIS_URL\"?); name the Redis the services use")
    if redis_url is not None:
        url, source = _check_url(redis_url, "--redis-url"), "--redis-url"
    elif env.get("REDIS_URL"):
        url, source = _check_url(env["REDIS_URL"], "REDIS_URL"), "REDIS_URL"
    else:
        url = RedisSettings().url
        source = "the default: no --config, no --redis-url and REDIS_URL is not set"
    settings = RedisSettings(url=url, cluster=cluster)
    if ssl_ca_file is not None:
        _check_tls(settings, ssl_ca_file, source)
        settings = _with_ca(settings, ssl_ca_file)
    return Target(settings, source, named,
                  "--pool" if named else f"every pool found ({ANY_POOL_PATTERN})")


def _with_ca(settings: RedisSettings, ca_file: str) -> RedisSettings:
    """`settings` with `ca_file` as the CA, also where the URL names one (`ssl_ca_certs`):
    the URL's would win in the client, and it is the services' path (a pod's mount), which a
    run elsewhere names its own copy of with --ssl-ca-file."""
    parts = urlsplit(settings.url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k != "ssl_ca_certs"]
    url = urlunsplit(parts._replace(query=urlencode(query)))
    return dataclasses.replace(settings, url=url, ssl_ca_file=ca_file)


async def pool_has_keys(client: Any, pool: str) -> bool:
    """Whether Redis holds any key of `pool`: its fixed keys first (one EXISTS), then a SCAN
    that stops at the first match (tasks and buckets have per-id names)."""
    keys = PoolKeys(pool)
    fixed = [keys.state, keys.clock, keys.node_capacity, keys.node_reserved, keys.leases,
             keys.stats, keys.tenant_queued, *keys.queues]
    if int(await client.exists(*fixed)) > 0:
        return True
    async with contextlib.aclosing(
            client.scan_iter(match=pool_pattern(pool), count=SCAN_COUNT)) as found:
        async for _ in found:
            return True
    return False


class NothingFound(Exception):
    """Redis answered, but holds no key of the pools asked for (or of any pool)."""


async def discover_pools(client: Any, foreign: set[str] | None = None) -> list[str]:
    """Pool names found in the keyspace (one SCAN pass), for when none is named.

    A key of the pattern whose tag is no pool name (`kvg:{a b}:x`, `kvg:{}:x`: written by
    hand or by another program) is not kvgate's: its tag is left out, and added to
    `foreign` when given. Read as a pool, it raised ValueError from PoolKeys and the CLI
    ended with a traceback, whatever the real pools held."""
    pools: set[str] = set()
    async for raw in client.scan_iter(match=ANY_POOL_PATTERN, count=SCAN_COUNT):
        key = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        tag = key[len(ROOT) + 2:key.find("}")]
        if tag == "sched":
            continue
        if NAME_PATTERN.match(tag):
            pools.add(tag)
        elif foreign is not None:
            foreign.add(tag)
    return sorted(pools)


async def choose_pools(client: Any, target: Target, say: Callable[[str], None]) -> list[str]:
    """The pools to show, named through `say`; NothingFound if Redis holds none of them.

    A named pool with no key at all, beside others that have some, is shown (empty) with a
    warning: a pool whose scheduler has not published yet looks like that.
    """
    if not target.pools:
        foreign: set[str] = set()
        pools = await discover_pools(client, foreign)
        if foreign:
            say(f"ignored the keys matching {ANY_POOL_PATTERN} whose tag is no pool name: "
                f"{', '.join(repr(t) for t in sorted(foreign)[:5])}"
                f"{' and more' if len(foreign) > 5 else ''}")
        if not pools:
            raise NothingFound(
                f"no kvgate keys in {target.address}: no key matches {ANY_POOL_PATTERN}. "
                "Is this the Redis and database the services use (--config, REDIS_URL)?")
        say(f"pools {', '.join(pools)} ({target.pools_source})")
        return pools
    empty = [pool for pool in target.pools if not await pool_has_keys(client, pool)]
    if len(empty) == len(target.pools):
        raise NothingFound(
            f"no kvgate keys of pool {', '.join(empty)} in {target.address}: no key matches "
            f"{', '.join(pool_pattern(p) for p in empty)}. Is this the Redis and database the "
            "services use, and has a scheduler or gateway of that pool run?")
    say(f"pools {', '.join(target.pools)} ({target.pools_source})")
    for pool in empty:
        say(f"pool {pool}: no key matches {pool_pattern(pool)} (shown empty)")
    return list(target.pools)
