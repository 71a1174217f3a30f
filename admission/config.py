"""The TOML configuration shared by gateways and schedulers, validated at start.

One file describes the whole deployment (Redis, model pools and their backends, tiers,
tenants); each service reads the sections it needs. Every error names the key that is wrong,
e.g. ``pools[0].zones.red: must be a number between 0 and 1``. ``REDIS_URL`` in the environment
overrides ``redis.url``.
"""

from __future__ import annotations

import os
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from admission.controlconfig import ControlSettings, parse_control
from admission.keys import check_name
from admission.store import PoolPolicy, TenantQuota
from admission.tiers import Tier


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_ms: int = 500
    connect_timeout_ms: int = 500
    max_connections: int = 128
    """Bounded on purpose: callers wait for a connection instead of opening unbounded ones."""
    pool_timeout_ms: int = 1_000
    ssl_ca_file: str | None = None
    cluster: bool = False
    sharded_pubsub: bool = False
    sentinel_master: str | None = None
    """The primary's name at the Sentinels; set: the primary is found through `sentinels`."""
    sentinels: tuple[str, ...] = ()
    """Sentinel addresses, "host:port"."""

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [split_address(a) for a in self.sentinels]


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" ("[v6::addr]:port" for IPv6); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class TierSettings:
    queue_timeout_ms: int
    max_queued: int


@dataclass(frozen=True, slots=True)
class ZoneSettings:
    yellow: float = 0.70
    red: float = 0.85
    hysteresis: float = 0.03
    kv_target: float = 0.78
    """Normal's ceiling: the projected KV usage (fraction of a node) up to which Normal work
    is placed on a node."""
    vip_ceiling: float | None = None
    """VIP's ceiling, between `kv_target` and `red` (None: `red`): the room between the two is
    VIP's alone, so a VIP chat finds a node in every zone while any node is below it."""
    batch_ceiling: float | None = None
    """Batch's ceiling, at most `kv_target` (None: `yellow`, or `kv_target` if lower): Batch
    never takes the room Normal and VIP are placed in."""
    yellow_normal_rate: float = 20.0
    """Normal releases per second allowed in YELLOW."""
    batch_trickle_rate: float = 0.0
    """Batch releases per second allowed even while higher tiers wait in GREEN (anti-starvation)."""
    aggregate: str = "max"
    """How node figures make the pool's zone: 'max' (the fullest node) or 'total' (pool sum)."""
    projection: str = "peak"
    """How released tasks count in projected usage: 'peak' (the highest usage their decoding
    reaches over time, as the short ones end) or 'final' (every task at its final size)."""
    max_engine_waiting: int = 8
    """A node whose engine reports more requests waiting than this gets no new releases until
    its queue shrinks (it is out of compute: more work only queues inside it, and queued
    prompts take KV no projection has seen). 0: off."""
    max_overcommit: float = 3.0
    """Upper bound on reserved tokens / KV tokens the scheduler allows from learned usage."""
    usage_margin: float = 0.10
    """Safety margin added to the learned usage/reservation ratio before overcommitting."""

    def ceilings(self) -> tuple[float, float, float]:
        """Each tier's ceiling on a node's projected KV (VIP, Normal, Batch), defaults
        resolved: VIP up to the RED line, Normal up to `kv_target`, Batch up to the YELLOW
        line (or `kv_target` if that is lower)."""
        vip = self.red if self.vip_ceiling is None else self.vip_ceiling
        batch = (min(self.yellow, self.kv_target) if self.batch_ceiling is None
                 else self.batch_ceiling)
        return (vip, self.kv_target, batch)


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    url: str
    capacity_tokens: int | None = None
    """KV capacity in tokens; None = read from vllm:cache_config_info."""


@dataclass(frozen=True, slots=True)
class DedicatedNodes:
    """Backends kept for some tiers: those tiers try them first (then the shared backends),
    and the other tiers' work reaches them only as guests. Keeps long prefills off the nodes
    serving VIP chats."""

    nodes: tuple[str, ...] = ()
    tiers: tuple[Tier, ...] = ()
    guest_max_prompt_tokens: int = 0
    """Work of the other tiers whose prompt is at most this many tokens may run on the kept
    nodes too, trying them first (0: none). Short prompts mean no long prefill for a VIP to
    wait behind; the dedicated nodes' compute does not sit idle between VIP chats."""
    max_guests_per_node: int = 32
    """At most this many guests alive on each dedicated node at once: the cap keeps its batch, and
    so its step time and the VIP tail, the same before and during a flood."""
    guest_prompt_tokens_per_s: int = 0
    """Paces each dedicated node's guests by their prompts (0: unpaced): after a guest of p prompt
    tokens the node takes no other guest for p / this many seconds. Set below what the 1x
    traffic would bring, the dedicated node's prefill work is the same before and during a flood."""
    guest_max_output_tokens: int = 0
    """Guests must also ask for at most this many output tokens (0: no bound). A long
    generation's short prompt passes the prompt bound and the pace, then decodes for minutes:
    it is what fills a dedicated node's batch and slows the VIP chats beside it."""
    guest_max_running: int = 0
    """A dedicated node whose engine reports more running sequences than this takes no new guests
    until it runs fewer (0: no bound). VIP chats are not capped there, so their own number,
    which grows with the node's step time, can push a node near its decode limit; closing it
    to guests then keeps the step time, and so the VIP tail, where it was."""

    @property
    def tier_mask(self) -> int:
        """The tiers as the scripts read them: bit 2^tier for each (1 VIP, 2 Normal, 4 Batch)."""
        return sum(1 << int(t) for t in set(self.tiers))


@dataclass(frozen=True, slots=True)
class PoolSettings:
    name: str
    backends: tuple[Backend, ...]
    context_length: int = 32_768
    default_max_tokens: int = 1_024
    max_max_tokens: int = 8_192
    tokenizer: str | None = None
    """Path to tokenizer.json(.gz); None = the shipped Qwen2 tokenizer."""
    default_system_prompt: str | None = None
    pass_priority: bool = False
    """Forward the tier as vLLM's `priority` (needs --scheduling-policy priority)."""
    served_model_name: str | None = None
    """The model name the backends serve (vLLM --served-model-name); None = the pool name.
    The gateway writes it into the forwarded request's `model`."""
    echo_requested_model: bool = True
    """Write the name the client asked for (the pool's name) into each response's `model`,
    whole bodies and every streamed chunk; False passes the backend's served name through."""
    stale_after_ms: int = 2_000
    backend_ca_file: str | None = None
    """PEM bundle of the CA that signed the backends' https certificates (a private CA);
    trusted beside the system's CAs. None: the system's CAs only."""
    zones: ZoneSettings = field(default_factory=ZoneSettings)
    dedicated: DedicatedNodes = field(default_factory=DedicatedNodes)
    control: ControlSettings = field(default_factory=ControlSettings)
    """`[pools.control]`: the release control's objectives (admission.controlconfig)."""


@dataclass(frozen=True, slots=True)
class TenantSettings:
    name: str
    tier: Tier
    key_sha256: tuple[str, ...]
    rate: int
    burst: int
    max_queued: int

    @property
    def quota(self) -> TenantQuota:
        return TenantQuota(self.name, self.rate, self.burst, self.max_queued)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    id: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    lease_ttl_ms: int = 10_000
    renew_interval_ms: int = 3_000
    wake_fallback_ms: int = 250
    """How often a queued request checks its task record in case a wake-up was lost."""
    upstream_timeout_ms: int = 600_000
    """Longest silence from a backend (between two reads) before the request fails with 502."""
    upstream_ms_per_output_token: int = 100
    """Added to `upstream_timeout_ms` per output token a non-streamed request may generate: such
    a request is silent until its answer is whole, so its silence grows with its length."""
    upstream_connect_timeout_ms: int = 2_000
    fail_open_tiers: tuple[Tier, ...] = ()
    """Tiers sent straight to a backend, unadmitted and counted, while Redis is unreachable
    (default: none, every tier fails closed with 503)."""
    retry_jitter: float = 0.25
    """Retry hints are spread upward by a random 0..retry_jitter fraction of their value."""
    unavailable_retry_ms: int = 2_000
    """Retry hint of a 503 while Redis is unreachable."""
    access_log: bool = True
    admin_token_sha256: str | None = None
    tenant_metrics: bool = False
    retention_s: int = 600


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = 9100
    id: str | None = None
    poll_interval_ms: int = 50
    scrape_timeout_ms: int = 200
    eject_after_failures: int = 3
    leader_ttl_ms: int = 1_500
    """Leader lease; a standby takes over at most this long after the leader dies."""
    stale_policy: str = "full"
    """What a node whose metrics are stale counts as: 'full' (no releases to it) or 'last'."""
    reap_interval_ms: int = 1_000
    release_batch: int = 2_000
    """Most tasks one release script call may pop (bounds the script's run time)."""
    usage_halflife_s: float = 60.0
    """Half-life of the learned usage/reservation ratio (older settles weigh less)."""
    preemption_cooldown_ms: int = 10_000
    """After a node reports a preemption, no overcommit on it for this long."""


@dataclass(frozen=True, slots=True)
class Config:
    redis: RedisSettings
    gateway: GatewaySettings
    scheduler: SchedulerSettings
    tiers: Mapping[Tier, TierSettings]
    pools: Mapping[str, PoolSettings]
    tenants: tuple[TenantSettings, ...]

    def pool_policy(self, pool: str) -> PoolPolicy:
        return PoolPolicy(
            tier_queue_caps=(
                self.tiers[Tier.VIP].max_queued,
                self.tiers[Tier.NORMAL].max_queued,
                self.tiers[Tier.BATCH].max_queued,
            ),
            lease_ttl_ms=self.gateway.lease_ttl_ms,
            stale_after_ms=self.pools[pool].stale_after_ms,
            retention_s=self.gateway.retention_s,
        )

    def backend_ssl_context(self) -> ssl.SSLContext | None:
        """What https backends are verified against: the system's CAs plus every pool's
        `backend_ca_file` (one context serves all pools: gateway and scheduler each keep one
        client for every backend). None when no pool names a file: the clients' default."""
        files = sorted({p.backend_ca_file for p in self.pools.values() if p.backend_ca_file})
        if not files:
            return None
        context = ssl.create_default_context()
        for path in files:
            try:
                context.load_verify_locations(cafile=path)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"backend_ca_file {path!r}: cannot load it ({exc})") from None
        return context


DEFAULT_TIERS = {
    Tier.VIP: TierSettings(queue_timeout_ms=30_000, max_queued=10_000),
    Tier.NORMAL: TierSettings(queue_timeout_ms=60_000, max_queued=10_000),
    Tier.BATCH: TierSettings(queue_timeout_ms=600_000, max_queued=100_000),
}


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
        value = self.table[name]
        if isinstance(value, bool) and kind is not bool and bool not in (
            kind if isinstance(kind, tuple) else (kind,)
        ):
            raise ConfigError(f"{self.key(name)}: expected {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise ConfigError(
                f"{self.key(name)}: expected {_kind_name(kind)}, got {type(value).__name__}"
            )
        return value

    def integer(self, name: str, default: int, minimum: int = 0) -> int:
        value: int = self.get(name, int, default)
        if value < minimum:
            raise ConfigError(f"{self.key(name)}: must be >= {minimum}, got {value}")
        return value

    def number(self, name: str, default: float, lo: float, hi: float) -> float:
        value = float(self.get(name, (int, float), default))
        if not lo <= value <= hi:
            raise ConfigError(f"{self.key(name)}: must be between {lo} and {hi}, got {value}")
        return value

    def optional_number(self, name: str, lo: float, hi: float) -> float | None:
        if self.get(name, (int, float)) is None:
            return None
        return self.number(name, 0.0, lo, hi)

    def string(self, name: str, default: str | None = None) -> str | None:
        value: str | None = self.get(name, str, default)
        return value

    def required(self, name: str, kind: type) -> Any:
        if name not in self.table:
            raise ConfigError(f"{self.key(name)}: is required")
        return self.get(name, kind)

    def sub(self, name: str) -> _Reader:
        self.used.add(name)
        return _Reader(self.table.get(name, {}), self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise ConfigError(f"{self.key(unknown[0])}: unknown key")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "an array", dict: "a table"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _name(r: _Reader, key: str, kind: str) -> str:
    value: str = r.required(key, str)
    try:
        return check_name(kind, value)
    except ValueError as exc:
        raise ConfigError(f"{r.key(key)}: {exc}") from None


def _redis(r: _Reader, env: Mapping[str, str]) -> RedisSettings:
    d = RedisSettings()
    file_url = r.string("url", d.url) or d.url
    settings = RedisSettings(
        url=env.get("REDIS_URL") or file_url,
        socket_timeout_ms=r.integer("socket_timeout_ms", d.socket_timeout_ms, 1),
        connect_timeout_ms=r.integer("connect_timeout_ms", d.connect_timeout_ms, 1),
        max_connections=r.integer("max_connections", d.max_connections, 1),
        pool_timeout_ms=r.integer("pool_timeout_ms", d.pool_timeout_ms, 1),
        ssl_ca_file=r.string("ssl_ca_file"),
        cluster=r.get("cluster", bool, d.cluster),
        sharded_pubsub=r.get("sharded_pubsub", bool, d.sharded_pubsub),
        sentinel_master=r.string("sentinel_master"),
        sentinels=tuple(r.get("sentinels", list, [])),
    )
    if not settings.url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{r.key('url')}: must start with redis://, rediss:// or unix://")
    _sentinel(r, settings)
    r.done()
    return settings


def _sentinel(r: _Reader, settings: RedisSettings) -> None:
    for i, address in enumerate(settings.sentinels):
        where = f"{r.key('sentinels')}[{i}]"
        if not isinstance(address, str):
            raise ConfigError(f"{where}: expected a string \"host:port\"")
        try:
            split_address(address)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    master = settings.sentinel_master
    if master is None:
        if settings.sentinels:
            raise ConfigError(f"{r.key('sentinel_master')}: is required with "
                              f"{r.key('sentinels')}")
        return
    if not master or any(c.isspace() for c in master):
        raise ConfigError(f"{r.key('sentinel_master')}: must be a name without spaces")
    if not settings.sentinels:
        raise ConfigError(f"{r.key('sentinels')}: at least one \"host:port\" is required with "
                          f"{r.key('sentinel_master')}")
    if settings.cluster:
        raise ConfigError(f"{r.key('sentinel_master')}: not with {r.key('cluster')} = true "
                          "(a Redis Cluster fails over by itself)")
    if settings.url.startswith("unix://"):
        raise ConfigError(f"{r.key('url')}: must be redis:// or rediss:// with Sentinel")


def _tiers(r: _Reader) -> dict[Tier, TierSettings]:
    tiers = {}
    for tier, default in DEFAULT_TIERS.items():
        t = r.sub(tier.label)
        tiers[tier] = TierSettings(
            queue_timeout_ms=t.integer("queue_timeout_ms", default.queue_timeout_ms, 1),
            max_queued=t.integer("max_queued", default.max_queued, 0),
        )
        t.done()
    r.done()
    return tiers


def _zones(r: _Reader) -> ZoneSettings:
    if "batch_headroom" in r.table:
        raise ConfigError(f"{r.key('batch_headroom')}: replaced by {r.key('batch_ceiling')}, "
                          "Batch's own ceiling on a node's projected KV usage (a fraction)")
    d = ZoneSettings()
    z = ZoneSettings(
        yellow=r.number("yellow", d.yellow, 0.0, 1.0),
        red=r.number("red", d.red, 0.0, 1.0),
        hysteresis=r.number("hysteresis", d.hysteresis, 0.0, 0.5),
        kv_target=r.number("kv_target", d.kv_target, 0.0, 1.0),
        yellow_normal_rate=r.number("yellow_normal_rate", d.yellow_normal_rate, 0.0, 1e6),
        batch_trickle_rate=r.number("batch_trickle_rate", d.batch_trickle_rate, 0.0, 1e6),
        vip_ceiling=r.optional_number("vip_ceiling", 0.0, 1.0),
        batch_ceiling=r.optional_number("batch_ceiling", 0.0, 1.0),
        aggregate=r.string("aggregate", d.aggregate) or d.aggregate,
        projection=r.string("projection", d.projection) or d.projection,
        max_engine_waiting=r.integer("max_engine_waiting", d.max_engine_waiting, 0),
        max_overcommit=r.number("max_overcommit", d.max_overcommit, 1.0, 100.0),
        usage_margin=r.number("usage_margin", d.usage_margin, 0.0, 1.0),
    )
    if not z.yellow < z.red:
        raise ConfigError(f"{r.key('yellow')}: must be below {r.key('red')}")
    # Each tier's ceiling is at most the next higher tier's: a setting that let Batch or
    # Normal fill the room VIP is placed in would break strict tiers.
    vip, normal, batch = z.ceilings()
    if not batch <= normal:
        raise ConfigError(f"{r.key('batch_ceiling')}: must be at most {r.key('kv_target')}")
    if not normal <= vip:
        raise ConfigError(f"{r.key('vip_ceiling')}: must be at least {r.key('kv_target')}"
                          + ("" if z.vip_ceiling is not None else
                             f" (unset, it is {r.key('red')})"))
    if not vip <= z.red:
        raise ConfigError(f"{r.key('vip_ceiling')}: must be at most {r.key('red')}")
    if z.aggregate not in ("max", "total"):
        raise ConfigError(f"{r.key('aggregate')}: must be 'max' or 'total'")
    if z.projection not in ("peak", "final"):
        raise ConfigError(f"{r.key('projection')}: must be 'peak' or 'final'")
    r.done()
    return z


def _backend(value: Any, where: str, index: int) -> Backend:
    if isinstance(value, str):
        return Backend(name=f"node-{index}", url=value.rstrip("/"))
    b = _Reader(value, where)
    url: str = b.required("url", str)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{b.key('url')}: must be an http:// or https:// URL")
    capacity = b.get("capacity_tokens", int)
    backend = Backend(name=_name(b, "name", "backend"), url=url.rstrip("/"),
                      capacity_tokens=capacity)
    b.done()
    return backend


def _pool(r: _Reader) -> PoolSettings:
    d_ctx, d_max = 32_768, 8_192
    raw_backends = r.get("backends", list, [])
    backends = tuple(
        _backend(b, f"{r.key('backends')}[{i}]", i) for i, b in enumerate(raw_backends)
    )
    if len({b.name for b in backends}) != len(backends):
        raise ConfigError(f"{r.key('backends')}: backend names must be unique")
    pool = PoolSettings(
        name=_name(r, "name", "pool"),
        backends=backends,
        context_length=r.integer("context_length", d_ctx, 1),
        default_max_tokens=r.integer("default_max_tokens", 1_024, 1),
        max_max_tokens=r.integer("max_max_tokens", d_max, 1),
        tokenizer=r.string("tokenizer"),
        default_system_prompt=r.string("default_system_prompt"),
        pass_priority=r.get("pass_priority", bool, False),
        served_model_name=r.string("served_model_name"),
        echo_requested_model=r.get("echo_requested_model", bool, True),
        stale_after_ms=r.integer("stale_after_ms", 2_000, 0),
        backend_ca_file=r.string("backend_ca_file"),
        zones=_zones(r.sub("zones")),
        dedicated=_dedicated(r.sub("dedicated"), {b.name for b in backends}),
        control=parse_control(r.sub("control"), ConfigError),
    )
    if pool.default_max_tokens > pool.max_max_tokens:
        raise ConfigError(f"{r.key('default_max_tokens')}: above max_max_tokens")
    r.done()
    return pool


def _dedicated(r: _Reader, backends: set[str]) -> DedicatedNodes:
    nodes = r.get("nodes", list, [])
    for i, node in enumerate(nodes):
        if node not in backends:
            raise ConfigError(f"{r.key('nodes')}[{i}]: {node!r} is not a backend of this pool")
    try:
        tiers = tuple(Tier.parse(t) for t in r.get("tiers", list, []))
    except ValueError as exc:
        raise ConfigError(f"{r.key('tiers')}: {exc}") from None
    if nodes and not tiers:
        raise ConfigError(f"{r.key('tiers')}: name the tiers the dedicated nodes serve")
    if nodes and set(nodes) == backends and len(set(tiers)) < len(Tier):
        raise ConfigError(f"{r.key('nodes')}: leaves no backend for the other tiers")
    guest_prompt = r.integer("guest_max_prompt_tokens", 0, 0)
    max_guests = r.integer("max_guests_per_node", 32, 1)
    guest_rate = r.integer("guest_prompt_tokens_per_s", 0, 0)
    guest_output = r.integer("guest_max_output_tokens", 0, 0)
    guest_running = r.integer("guest_max_running", 0, 0)
    if guest_prompt and not nodes:
        raise ConfigError(f"{r.key('guest_max_prompt_tokens')}: guests need dedicated nodes")
    if guest_rate and not guest_prompt:
        raise ConfigError(f"{r.key('guest_prompt_tokens_per_s')}: paces guests, so it needs "
                          "guest_max_prompt_tokens")
    if guest_output and not guest_prompt:
        raise ConfigError(f"{r.key('guest_max_output_tokens')}: bounds guests, so it needs "
                          "guest_max_prompt_tokens")
    if guest_running and not guest_prompt:
        raise ConfigError(f"{r.key('guest_max_running')}: bounds guests, so it needs "
                          "guest_max_prompt_tokens")
    r.done()
    return DedicatedNodes(tuple(nodes), tiers if nodes else (), guest_prompt, max_guests,
                          guest_rate, guest_output, guest_running)


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _tenant(r: _Reader) -> TenantSettings:
    keys = r.get("key_sha256", list, [])
    for i, k in enumerate(keys):
        if not (isinstance(k, str) and _is_sha256(k)):
            raise ConfigError(f"{r.key('key_sha256')}[{i}]: must be a lowercase hex SHA-256")
    tier_name: str = r.required("tier", str)
    try:
        tier = Tier.parse(tier_name)
    except ValueError as exc:
        raise ConfigError(f"{r.key('tier')}: {exc}") from None
    tenant = TenantSettings(
        name=_name(r, "name", "tenant"),
        tier=tier,
        key_sha256=tuple(keys),
        rate=r.integer("rate", 10_000, 0),
        burst=r.integer("burst", 100_000, 1),
        max_queued=r.integer("max_queued", 100, 0),
    )
    if tenant.burst > 1_000_000_000:
        raise ConfigError(f"{r.key('burst')}: must be at most 1e9 tokens")
    r.done()
    return tenant


def _gateway(r: _Reader) -> GatewaySettings:
    d = GatewaySettings()
    fail_open = r.get("fail_open_tiers", list, [])
    try:
        tiers = tuple(Tier.parse(t) for t in fail_open)
    except ValueError as exc:
        raise ConfigError(f"{r.key('fail_open_tiers')}: {exc}") from None
    g = GatewaySettings(
        host=r.string("host", d.host) or d.host,
        port=r.integer("port", d.port, 0),
        id=r.string("id"),
        max_body_bytes=r.integer("max_body_bytes", d.max_body_bytes, 1024),
        lease_ttl_ms=r.integer("lease_ttl_ms", d.lease_ttl_ms, 100),
        renew_interval_ms=r.integer("renew_interval_ms", d.renew_interval_ms, 10),
        wake_fallback_ms=r.integer("wake_fallback_ms", d.wake_fallback_ms, 10),
        upstream_timeout_ms=r.integer("upstream_timeout_ms", d.upstream_timeout_ms, 100),
        upstream_ms_per_output_token=r.integer(
            "upstream_ms_per_output_token", d.upstream_ms_per_output_token, 0
        ),
        upstream_connect_timeout_ms=r.integer(
            "upstream_connect_timeout_ms", d.upstream_connect_timeout_ms, 1
        ),
        fail_open_tiers=tiers,
        retry_jitter=r.number("retry_jitter", d.retry_jitter, 0.0, 1.0),
        unavailable_retry_ms=r.integer("unavailable_retry_ms", d.unavailable_retry_ms, 1),
        access_log=r.get("access_log", bool, d.access_log),
        admin_token_sha256=r.string("admin_token_sha256"),
        tenant_metrics=r.get("tenant_metrics", bool, False),
        retention_s=r.integer("retention_s", d.retention_s, 1),
    )
    if g.admin_token_sha256 is not None and not _is_sha256(g.admin_token_sha256):
        raise ConfigError(f"{r.key('admin_token_sha256')}: must be a lowercase hex SHA-256 "
                          "(of the admin token, never the token itself)")
    if g.renew_interval_ms * 2 > g.lease_ttl_ms:
        raise ConfigError(f"{r.key('renew_interval_ms')}: must be at most half of lease_ttl_ms")
    r.done()
    return g


def _scheduler(r: _Reader) -> SchedulerSettings:
    d = SchedulerSettings()
    s = SchedulerSettings(
        host=r.string("host", d.host) or d.host,
        port=r.integer("port", d.port, 0),
        id=r.string("id"),
        poll_interval_ms=r.integer("poll_interval_ms", d.poll_interval_ms, 5),
        scrape_timeout_ms=r.integer("scrape_timeout_ms", d.scrape_timeout_ms, 5),
        eject_after_failures=r.integer("eject_after_failures", d.eject_after_failures, 1),
        leader_ttl_ms=r.integer("leader_ttl_ms", d.leader_ttl_ms, 100),
        stale_policy=r.string("stale_policy", d.stale_policy) or d.stale_policy,
        reap_interval_ms=r.integer("reap_interval_ms", d.reap_interval_ms, 10),
        release_batch=r.integer("release_batch", d.release_batch, 1),
        usage_halflife_s=r.number("usage_halflife_s", d.usage_halflife_s, 0.1, 86_400.0),
        preemption_cooldown_ms=r.integer(
            "preemption_cooldown_ms", d.preemption_cooldown_ms, 0
        ),
    )
    if s.stale_policy not in ("full", "last"):
        raise ConfigError(f"{r.key('stale_policy')}: must be 'full' or 'last'")
    r.done()
    return s


def parse_config(data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    root = _Reader(dict(data), "")
    env = os.environ if env is None else env
    pools_raw = root.get("pools", list, [])
    pools = [_pool(_Reader(p, f"pools[{i}]")) for i, p in enumerate(pools_raw)]
    if not pools:
        raise ConfigError("pools: at least one [[pools]] table is required")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError("pools: pool names must be unique")
    tenants = tuple(
        _tenant(_Reader(t, f"tenants[{i}]"))
        for i, t in enumerate(root.get("tenants", list, []))
    )
    if len({t.name for t in tenants}) != len(tenants):
        raise ConfigError("tenants: tenant names must be unique")
    all_keys = [k for t in tenants for k in t.key_sha256]
    if len(set(all_keys)) != len(all_keys):
        raise ConfigError("tenants: the same key_sha256 is listed for two tenants")
    config = Config(
        redis=_redis(root.sub("redis"), env),
        gateway=_gateway(root.sub("gateway")),
        scheduler=_scheduler(root.sub("scheduler")),
        tiers=_tiers(root.sub("tiers")),
        pools={p.name: p for p in pools},
        tenants=tenants,
    )
    root.done()
    return config


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    config = parse_config(data, env)
    config.backend_ssl_context()  # a CA file that cannot be loaded is an error of the file
    return config
