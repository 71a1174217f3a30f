"""The checks a configuration gets as a whole, after each table passed its own: names and
servers that must be unique, an admin token that must not be a tenant's key, a release call
that must end before the Redis client gives up, the Sentinels' credentials and their password
read from the environment (`with_sentinel_password`), and the start-up warnings about
settings that are valid but turn requests away (`startup_warnings`).
`admission.config.parse_config` runs the checks; the services log the warnings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from urllib.parse import urlsplit

from admission.configfields import ENV_NAME, ConfigError, shown_url
from admission.configschema import (
    Config,
    GatewaySettings,
    PoolSettings,
    SchedulerSettings,
    TenantSettings,
)
from admission.redisconfig import MIN_CONNECTIONS, RedisSettings


def _earlier(seen: dict[str, int], key: str, i: int) -> int | None:
    """The index that had `key` before `i`, or None (and `key` is recorded as `i`'s)."""
    first = seen.setdefault(key, i)
    return None if first == i else first


def check_unique_tenants(tenants: tuple[TenantSettings, ...]) -> None:
    """Tenant names and API keys are each one tenant's: the error names both entries (in a
    file of hundreds of tenants, "must be unique" alone sends the reader searching)."""
    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    for i, tenant in enumerate(tenants):
        if (first := _earlier(names, tenant.name, i)) is not None:
            raise ConfigError(f"tenants[{i}].name: tenant {tenant.name!r} is already defined "
                              f"by tenants[{first}]; tenant names must be unique")
        for j, key in enumerate(tenant.key_sha256):
            if (owner := _earlier(keys, key, i)) is not None:
                raise ConfigError(f"tenants[{i}].key_sha256[{j}]: also listed for tenant "
                                  f"{tenants[owner].name!r} (tenants[{owner}]); a key may "
                                  "belong to one tenant only")
            if tenant.key_sha256.index(key) != j:
                raise ConfigError(f"tenants[{i}].key_sha256[{j}]: listed twice")


DEFAULT_PORTS = {"http": 80, "https": 443}


def _server(url: str) -> str:
    """What makes two backend URLs one server: scheme and host in any case, the scheme's
    default port written or not (`http://h` is `http://h:80`), the path without a trailing
    slash, credentials aside. The URL was checked (`backend_url_error`): urlsplit reads it."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or DEFAULT_PORTS.get(scheme)
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def check_unique_pools(pools: list[PoolSettings]) -> None:
    """Pool names are unique, and so is each backend's URL within its pool: two entries of
    one server would each be given its whole KV cache. (Pools may share a server: vLLM
    serves several models, LoRA adapters, from one.)"""
    names: dict[str, int] = {}
    for i, pool in enumerate(pools):
        if (first := _earlier(names, pool.name, i)) is not None:
            raise ConfigError(f"pools[{i}].name: pool {pool.name!r} is already defined by "
                              f"pools[{first}]; pool names must be unique")
        urls: dict[str, int] = {}
        for j, backend in enumerate(pool.backends):
            if (same := _earlier(urls, _server(backend.url), j)) is not None:
                raise ConfigError(f"pools[{i}].backends[{j}].url: {shown_url(backend.url)!r} "
                                  f"is also pools[{i}].backends[{same}]'s; one server is one "
                                  "backend")


def check_admin_token(token: str | None, where: str,
                       tenants: tuple[TenantSettings, ...]) -> None:
    """The admin token is no tenant's API key: that tenant's key would open the admin API.
    The message names the tenant and never the hash, since it is printed to the log."""
    for i, tenant in enumerate(tenants):
        if token is not None and token in tenant.key_sha256:
            j = tenant.key_sha256.index(token)
            raise ConfigError(f"{where}: is also the key_sha256[{j}] of tenant {tenant.name!r} "
                              f"(tenants[{i}]), whose API key would then open the admin API; "
                              "give the admin a token of its own")


def check_stuck_after(gateway: GatewaySettings, scheduler: SchedulerSettings) -> None:
    """`stuck_after_ms` against the time a dead gateway's tasks stay in the running index: a
    node is judged stuck only while a task of kvgate's released there that long ago has not
    ended (scheduler.stuck), and a gateway that dies leaves its tasks there, their requests
    gone from the node, until its lease expires and the reaper runs."""
    held = gateway.lease_ttl_ms + scheduler.reap_interval_ms
    if scheduler.stuck_after_ms and scheduler.stuck_after_ms <= held:
        raise ConfigError(
            f"scheduler.stuck_after_ms: must be above gateway.lease_ttl_ms + "
            f"scheduler.reap_interval_ms ({held}), or 0, got {scheduler.stuck_after_ms}: the "
            "tasks of a gateway that died stay in the running index that long, and would make "
            "a healthy idle node look stuck")


def check_redis_calls(redis: RedisSettings, scheduler: SchedulerSettings, pools: int) -> None:
    """What one section's bounds cannot say: `release_call_ms` against the client's timeout,
    `max_connections` against the subscriptions a gateway keeps."""
    if scheduler.release_call_ms >= redis.socket_timeout_ms:
        raise ConfigError(
            f"scheduler.release_call_ms: must be below redis.socket_timeout_ms "
            f"({redis.socket_timeout_ms}), got {scheduler.release_call_ms}: a release call "
            "runs that long and then finishes its last release, so the leader's client would "
            "give up on it while Redis still runs the script, and every tick would fail")
    if redis.cluster and redis.sharded_pubsub:
        # One subscription per pool, each on its pool's shard; the shards may share a node,
        # and the pool is per node.
        least = pools + MIN_CONNECTIONS - 1
        if redis.max_connections < least:
            raise ConfigError(
                f"redis.max_connections: must be at least {least} with redis.cluster and "
                f"redis.sharded_pubsub, got {redis.max_connections}: a gateway keeps one "
                f"connection for good for each pool's wake-ups ({pools} pools), all on one "
                "node when their shards share it, and needs the rest for its calls")


SENTINEL_PASSWORD_KEY = "sentinel_password"
"""The key a password for the Sentinels is not given by: refused with a message that names
`sentinel_password_env` (a plain "unknown key" would leave the reader to guess)."""


def refuse_sentinel_password(table: Mapping[str, object]) -> None:
    """ConfigError if the `[redis]` table holds the Sentinels' password itself: a secret in the
    file ends up in a ConfigMap, a repository, a support ticket."""
    if SENTINEL_PASSWORD_KEY in table:
        raise ConfigError(f"redis.{SENTINEL_PASSWORD_KEY}: a password is never written in the "
                          "file; put it in an environment variable and name that variable in "
                          "redis.sentinel_password_env")


def with_sentinel_password(redis: RedisSettings, env: Mapping[str, str]) -> RedisSettings:
    """`redis` with the Sentinels' password read from the variable `sentinel_password_env`
    names, when the file is loaded: a variable missing from a pod fails its start with a line
    naming it, not every connection later with a refusal of the Sentinels.

    Refused, each naming its key: Sentinel credentials without `sentinel_master` (nothing
    would use them), a user name that is empty or holds a space, a user name without a
    password (AUTH takes both), a variable name that is no name (the password itself, pasted
    into the file: never echoed), and a variable that is unset or empty."""
    user, variable = redis.sentinel_username, redis.sentinel_password_env
    for name, value in (("sentinel_username", user), ("sentinel_password_env", variable)):
        if value is not None and redis.sentinel_master is None:
            raise ConfigError(f"redis.{name}: only with redis.sentinel_master (it is how "
                              "kvgate authenticates to the Sentinels; the primary's own "
                              "credentials are redis.url's)")
    if user is not None and (not user or any(c.isspace() for c in user)):
        raise ConfigError("redis.sentinel_username: must be a user name without spaces")
    if variable is None:
        if user is not None:
            raise ConfigError("redis.sentinel_username: needs redis.sentinel_password_env (the "
                              "Sentinels' AUTH takes a user name with its password)")
        return redis
    if not ENV_NAME.fullmatch(variable):
        raise ConfigError("redis.sentinel_password_env: must be the name of an environment "
                          "variable (letters, digits, _), not the password itself")
    password = env.get(variable, "")
    if not password:
        raise ConfigError(f"redis.sentinel_password_env: names {variable}, which is not set "
                          "(or empty) in the environment")
    return dataclasses.replace(redis, sentinel_password=password)


def startup_warnings(config: Config) -> list[str]:
    """What a gateway warns about at start: settings that are valid but turn requests away.

    - No tenant with a `key_sha256`: every request gets 401.
    - A tenant whose `burst` is below 1% of a second of its `rate`: its bucket refuses every
      request costing more than the burst (prompt + max_tokens; 400 `exceeds_burst`), however
      little of the rate it uses, which is rarely what such a rate was meant for.
    - A tenant whose `burst` is at or below a pool's `default_max_tokens`: a request of it
      without `max_tokens` costs its prompt (at least one token) plus that default, more than
      the burst, so every such request to the pool gets 400 `exceeds_burst`.
    - A pool without backends: no node gives it a budget, so the leader publishes it RED with no
      usable node, and every request to it gets 429 (VIP's wait in the queue until their
      tier's `queue_timeout_ms`).
    - A pool whose `stale_after_ms` is below the scheduler's poll interval: the state the
      leader publishes at each poll is older than that for part of every interval, and a
      request then queues for the next release instead of taking the fast path.
    - One server URL in two pools: each pool's budget counts the server's whole KV cache, so
      together they can place twice what it holds (one vLLM server serving several models is
      legitimate; its pools then need `capacity_tokens` that share the cache).
    """
    warnings = []
    if not any(t.key_sha256 for t in config.tenants):
        what = "no [[tenants]]" if not config.tenants else "no tenant has a key_sha256"
        warnings.append(f"{what}: every request will get 401 (no API key can match)")
    for i, tenant in enumerate(config.tenants):
        if tenant.burst * 100 < tenant.rate:
            warnings.append(
                f"tenants[{i}] ({tenant.name!r}): burst {tenant.burst} is below 1% of its rate "
                f"({tenant.rate} tokens/s): every request of more than {tenant.burst} tokens "
                "(prompt + max_tokens) gets 400 exceeds_burst")
        for j, (name, pool) in enumerate(config.pools.items()):
            if tenant.burst <= pool.default_max_tokens:
                warnings.append(
                    f"tenants[{i}] ({tenant.name!r}): burst {tenant.burst} is at or below "
                    f"pools[{j}].default_max_tokens {pool.default_max_tokens}: every chat "
                    f"request of it to pool {name!r} without max_tokens (prompt + "
                    f"{pool.default_max_tokens}) gets 400 exceeds_burst")
    poll_ms = config.scheduler.poll_interval_ms
    seen: dict[str, str] = {}
    for i, pool in enumerate(config.pools.values()):
        if not pool.backends:
            warnings.append(
                f"pools[{i}] ({pool.name!r}) has no backends: nothing is ever released to it; "
                "it is RED with no usable node, and every request to it gets 429 (VIP's "
                "after waiting its queue_timeout_ms)")
        if 0 < pool.stale_after_ms < poll_ms:
            warnings.append(
                f"pools[{i}].stale_after_ms {pool.stale_after_ms} is below "
                f"scheduler.poll_interval_ms {poll_ms}: between the leader's polls its state is "
                "older than that, and requests then queue instead of taking the fast path")
        for j, backend in enumerate(pool.backends):
            # One pool never names a server twice (check_unique_pools): a match is another's.
            where = f"pools[{i}].backends[{j}]"
            other = seen.setdefault(_server(backend.url), where)
            if other != where:
                warnings.append(
                    f"{where}.url {shown_url(backend.url)!r} is also {other}'s: each pool "
                    "counts that server's whole KV cache, so together they can place more than "
                    "it holds (give the pools capacity_tokens that share it)")
    return warnings
