"""`[redis]`: how every service and tool reaches the pool's Redis (a server, a Sentinel-watched
primary, or a Cluster), with the bounds the connections keep. The fields declare each key's
default and bounds (admission.configfields); admission.config reads the table by them, and
admission.connection connects by them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio.connection import parse_url

from admission.configfields import (
    ConfigError,
    KeyName,
    at_least,
    optional_text,
    redis_url_error,
    split_address,
)

MIN_CONNECTIONS = 4
"""The least `redis.max_connections`: one connection the pub/sub subscription keeps for good,
and three for the calls a scheduler makes at the same time (lease renewal, a tick, the
reaper); more wait for a free one, up to `pool_timeout_ms`."""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_ms: int = at_least(1, 500)
    connect_timeout_ms: int = at_least(1, 500)
    max_connections: int = at_least(
        MIN_CONNECTIONS, 128,
        why="each process keeps one connection for good for its pub/sub subscription (a "
            "gateway's wake-ups, the scheduler's handover), and the scheduler's lease renewal, "
            "ticks and reaper call Redis at the same time; with fewer the leader loses its "
            "lease waiting for a connection")
    """Bounded on purpose: callers wait for a connection instead of opening unbounded ones.
    With `cluster` and `sharded_pubsub` a gateway holds one subscription per pool, each on its
    pool's shard (admission.config checks the pools' number against this)."""
    pool_timeout_ms: int = at_least(1, 1_000)
    ssl_ca_file: str | None = optional_text("the system's CAs")
    cluster: bool = False
    sharded_pubsub: bool = False
    sentinel_master: str | None = None
    """The primary's name at the Sentinels; set: the primary is found through `sentinels`."""
    sentinels: tuple[str, ...] = ()
    """Sentinel addresses, "host:port"."""
    sentinel_username: str | None = None
    """The Sentinels' ACL user kvgate authenticates as; None: their default user."""
    sentinel_password_env: str | None = None
    """Name of the environment variable holding the Sentinels' password (their `requirepass`);
    None: the Sentinels are contacted without AUTH (admission.configchecks reads it)."""
    sentinel_password: str | None = field(default=None, repr=False)
    """The password `sentinel_password_env` names, read when the file is loaded. No key of the
    file (the loader gives it, so one written there is refused) and out of repr, lest a
    logged settings object show it."""

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [split_address(a) for a in self.sentinels]

    def _check_cluster(self, key: KeyName) -> None:
        """What a Redis Cluster client cannot connect with: it would only fail later, in
        every service, with a RedisClusterException traceback."""
        if self.url.startswith("unix://"):
            raise ConfigError(f"{key('url')}: must be redis:// or rediss:// with "
                              f"{key('cluster')} = true (a cluster's nodes are found by host "
                              "and port, not by a socket path)")
        db = int(parse_url(self.url).get("db") or 0)
        if db != 0:
            raise ConfigError(f"{key('url')}: database {db} with {key('cluster')} = true; a "
                              "Redis Cluster has database 0 only (leave the path out or make "
                              "it /0)")

    def check(self, key: KeyName) -> None:
        problem = redis_url_error(self.url, needs_host=self.sentinel_master is None)
        try:
            parse_url(self.url)  # the client's own checks: its query parameters
        except ValueError as exc:
            problem = problem or str(exc)
        if problem is not None:
            raise ConfigError(f"{key('url')}: {problem}")
        if self.cluster:
            self._check_cluster(key)
        if self.ssl_ca_file is not None and not self.url.startswith("rediss://"):
            raise ConfigError(f"{key('ssl_ca_file')}: needs a rediss:// {key('url')} (TLS); "
                              "the CA is not used without TLS")
        for i, address in enumerate(self.sentinels):
            try:
                split_address(address)
            except ValueError as exc:
                raise ConfigError(f"{key('sentinels')}[{i}]: {exc}") from None
        master = self.sentinel_master
        if master is None:
            if self.sentinels:
                raise ConfigError(f"{key('sentinel_master')}: is required with "
                                  f"{key('sentinels')}")
            return
        if not master or any(c.isspace() for c in master):
            raise ConfigError(f"{key('sentinel_master')}: must be a name without spaces")
        if not self.sentinels:
            raise ConfigError(f"{key('sentinels')}: at least one \"host:port\" is required "
                              f"with {key('sentinel_master')}")
        if self.cluster:
            raise ConfigError(f"{key('sentinel_master')}: not with {key('cluster')} = true "
                              "(a Redis Cluster fails over by itself)")
        if self.url.startswith("unix://"):
            raise ConfigError(f"{key('url')}: must be redis:// or rediss:// with Sentinel")
