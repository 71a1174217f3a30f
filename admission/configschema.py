"""The configuration's schema: every setting with its one default, its bounds and its checks.

Each TOML table is one frozen dataclass below (`[redis]` is admission.redisconfig's,
`[pools.control]` admission.controlconfig's, `[pools.fairness]` admission.fairconfig's,
`[[teams]]` admission.quotaconfig's);
admission.config reads a file into them by their fields alone (admission.configfields says
how a field declares its type, default and bounds), so the defaults written here are the only
ones. docs/configuration.md lists every key with these defaults; tests/test_config_reference.py
holds the two together.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from admission.configfields import (
    ENV_NAME,
    ConfigError,
    KeyName,
    at_least,
    backend_url_error,
    between,
    is_sha256,
    one_of,
    optional_at_least,
    optional_between,
    optional_text,
    required_at_least,
    tcp_port,
)
from admission.controlconfig import ControlSettings
from admission.fairconfig import FairnessSettings, cap_field, check_tenant_caps, weight_field
from admission.keys import check_name
from admission.quotaconfig import TeamSettings, levels_of
from admission.redisconfig import RedisSettings
from admission.store import PoolPolicy, TenantQuota
from admission.tiers import Tier

MIN_STUCK_AFTER_MS = 1_000
"""The shortest `[scheduler] stuck_after_ms` besides 0 (off)."""


def _check_name(key: KeyName, name: str, kind: str, value: str) -> None:
    try:
        check_name(kind, value)
    except ValueError as exc:
        raise ConfigError(f"{key(name)}: {exc}") from None


@dataclass(frozen=True, slots=True)
class TierSettings:
    queue_timeout_ms: int = required_at_least(1)
    max_queued: int = required_at_least(0)


DEFAULT_TIERS = {
    Tier.VIP: TierSettings(queue_timeout_ms=30_000, max_queued=10_000),
    Tier.NORMAL: TierSettings(queue_timeout_ms=60_000, max_queued=10_000),
    Tier.BATCH: TierSettings(queue_timeout_ms=600_000, max_queued=100_000),
}
"""Each tier's defaults (`[tiers.vip]`, ...): the tiers share one dataclass, not its defaults."""


@dataclass(frozen=True, slots=True)
class ZoneSettings:
    REPLACED: ClassVar[Mapping[str, str]] = {
        "batch_headroom": "replaced by {batch_ceiling}, Batch's own ceiling on a node's "
                          "projected KV usage (a fraction)",
    }

    yellow: float = between(0.0, 1.0, 0.70)
    red: float = between(0.0, 1.0, 0.85)
    hysteresis: float = between(0.0, 0.5, 0.03)
    kv_target: float = between(0.0, 1.0, 0.78)
    """Normal's ceiling: the projected KV usage (fraction of a node) up to which Normal work
    is placed on a node."""
    vip_ceiling: float | None = optional_between(0.0, 1.0)
    """VIP's ceiling, between `kv_target` and `red` (None: `red`): the room between the two is
    VIP's alone, so a VIP chat finds a node in every zone while any node is below it."""
    batch_ceiling: float | None = optional_between(0.0, 1.0)
    """Batch's ceiling, above 0 and at most `kv_target` (None: `yellow`, or `kv_target` if
    lower): Batch never takes the room Normal and VIP are placed in."""
    yellow_normal_rate: float = between(0.0, 1e6, 20.0)
    """Normal releases per second allowed in YELLOW."""
    batch_trickle_rate: float = between(0.0, 1e6, 0.0)
    """Batch releases per second allowed even while higher tiers wait in GREEN (anti-starvation)."""
    batch_min_share: float = between(0.0, 0.5, 0.0)
    """In GREEN, while VIP or Normal work and Batch work both wait: the least share of the
    tokens the leader releases from the queues that goes to Batch, past the waiting higher
    tiers (scheduler.policy.BatchShare; 0: off). At most one half: a larger share would put
    Batch ahead of the tiers above it, not keep it from starving."""
    aggregate: str = one_of("max", "total")
    """How node figures make the pool's zone: 'max' (the fullest node) or 'total' (pool sum)."""
    projection: str = one_of("peak", "final")
    """How released tasks count in projected usage: 'peak' (the highest usage their decoding
    reaches over time, as the short ones end) or 'final' (every task at its final size)."""
    max_engine_waiting: int = at_least(0, 8)
    """A node whose engine reports more requests waiting than this gets no new releases until
    its queue shrinks (it is out of compute: more work only queues inside it, and queued
    prompts take KV no projection has seen). 0: off."""
    max_overcommit: float = between(1.0, 100.0, 3.0)
    """Upper bound on reserved tokens / KV tokens the scheduler allows from learned usage."""
    usage_margin: float = between(0.0, 1.0, 0.10)
    """Safety margin added to the learned usage/reservation ratio before overcommitting."""

    def ceilings(self) -> tuple[float, float, float]:
        """Each tier's ceiling on a node's projected KV (VIP, Normal, Batch), defaults
        resolved: VIP up to the RED line, Normal up to `kv_target`, Batch up to the YELLOW
        line (or `kv_target` if that is lower)."""
        vip = self.red if self.vip_ceiling is None else self.vip_ceiling
        batch = (min(self.yellow, self.kv_target) if self.batch_ceiling is None
                 else self.batch_ceiling)
        return (vip, self.kv_target, batch)

    def check(self, key: KeyName) -> None:
        if not self.yellow < self.red:
            raise ConfigError(f"{key('yellow')}: must be below {key('red')}")
        if not self.hysteresis < self.yellow:
            # A pool leaves YELLOW below `yellow - hysteresis`: at or under 0, never.
            raise ConfigError(f"{key('hysteresis')}: must be below {key('yellow')}, or a pool "
                              "that turned YELLOW would never be GREEN again")
        if not self.kv_target > 0:
            raise ConfigError(f"{key('kv_target')}: must be above 0, or no Normal or Batch "
                              "work would ever be placed")
        if self.batch_ceiling is not None and not self.batch_ceiling > 0:
            raise ConfigError(f"{key('batch_ceiling')}: must be above 0, or no Batch work "
                              "would ever be placed")
        # Each tier's ceiling is at most the next higher tier's: a setting that let Batch or
        # Normal fill the room VIP is placed in would break strict tiers.
        vip, normal, batch = self.ceilings()
        if not batch <= normal:
            raise ConfigError(f"{key('batch_ceiling')}: must be at most {key('kv_target')}")
        if not normal <= vip:
            raise ConfigError(f"{key('vip_ceiling')}: must be at least {key('kv_target')}"
                              + ("" if self.vip_ceiling is not None else
                                 f" (unset, it is {key('red')})"))
        if not vip <= self.red:
            raise ConfigError(f"{key('vip_ceiling')}: must be at most {key('red')}")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """`[pools.engine]`: what the leader's projection assumes about the way to a pool's
    engines and their prefill, the two timings it cannot read from a scrape. Both are
    allowances: set too long, released tasks only look younger (later to finish, not yet in
    the measurement), which the projection treats as more overlap, the safe side."""

    dispatch_ms: int = at_least(1, 250)
    """How long after its release a task may take to reach its engine (the gateway's wake-up
    and forward): until then the task counts as not measured yet. An allowance, not a
    measurement: a forward takes milliseconds, and 250 ms covers a gateway that missed the
    pub/sub wake-up and found its release by its periodic check (`gateway.wake_fallback_ms`,
    250 ms by default)."""
    prefill_us_per_token: int = at_least(1, 66)
    """How long a prompt token may wait for and take its prefill once its task reached the
    engine: a task decodes only after that, so its decoding age leaves it out. 66 µs a token
    is 15,000 tokens/s, half the 30,000 tokens/s an H100 prefills an 8B model at (the middle
    of the published 25-35k tokens/s range that bench/sim/timing.py is calibrated to), for
    the queueing behind other prompts; the control's `prefill_tokens_per_s` starts from the
    same 15,000. Set it from the pool's GPU: a slower prefill needs more."""

    @property
    def dispatch_us(self) -> int:
        return self.dispatch_ms * 1_000


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    url: str
    capacity_tokens: int | None = optional_at_least(1)
    """KV capacity in tokens; None = read from vllm:cache_config_info."""

    def check(self, key: KeyName) -> None:
        _check_name(key, "name", "backend", self.name)
        problem = backend_url_error(self.url)
        if problem is not None:
            raise ConfigError(f"{key('url')}: {problem}")


@dataclass(frozen=True, slots=True)
class DedicatedNodes:
    """Backends dedicated to some tiers: those tiers try them first (then the shared
    backends), and the other tiers' work reaches them only as guests. Keeps long prefills off
    the nodes serving VIP chats."""

    nodes: tuple[str, ...] = ()
    tiers: tuple[Tier, ...] = ()
    guest_max_prompt_tokens: int = at_least(0, 0)
    """Work of the other tiers whose prompt is at most this many tokens may run on the dedicated
    nodes too, trying them first (0: none). Short prompts mean no long prefill for a VIP to
    wait behind; the dedicated nodes' compute does not sit idle between VIP chats."""
    max_guests_per_node: int = at_least(1, 32)
    """At most this many guests alive on each dedicated node at once: the cap keeps its batch, and
    so its step time and the VIP tail, the same before and during a flood."""
    guest_prompt_tokens_per_s: int = at_least(0, 0)
    """Paces each dedicated node's guests by their prompts (0: unpaced): after a guest of p prompt
    tokens the node takes no other guest for p / this many seconds. Set below what the 1x
    traffic would bring, the dedicated node's prefill work is the same before and during a flood."""
    guest_max_output_tokens: int = at_least(0, 0)
    """Guests must also ask for at most this many output tokens (0: no bound). A long
    generation's short prompt passes the prompt bound and the pace, then decodes for minutes:
    it is what fills a dedicated node's batch and slows the VIP chats beside it."""
    guest_max_running: int = at_least(0, 0)
    """A dedicated node whose engine reports more running sequences than this takes no new guests
    until it runs fewer (0: no bound). VIP chats are not capped there, so their own number,
    which grows with the node's step time, can push a node near its decode limit; closing it
    to guests then keeps the step time, and so the VIP tail, where it was."""

    @property
    def tier_mask(self) -> int:
        """The tiers as the scripts read them: bit 2^tier for each (1 VIP, 2 Normal, 4 Batch)."""
        return sum(1 << int(t) for t in set(self.tiers))

    def check(self, key: KeyName) -> None:
        if self.nodes and not self.tiers:
            raise ConfigError(f"{key('tiers')}: name the tiers the dedicated nodes serve")
        if self.guest_max_prompt_tokens and not self.nodes:
            raise ConfigError(f"{key('guest_max_prompt_tokens')}: guests need dedicated nodes")
        for name, what in (("guest_prompt_tokens_per_s", "paces"),
                           ("guest_max_output_tokens", "bounds"),
                           ("guest_max_running", "bounds")):
            if getattr(self, name) and not self.guest_max_prompt_tokens:
                raise ConfigError(f"{key(name)}: {what} guests, so it needs "
                                  "guest_max_prompt_tokens")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    name: str
    backends: tuple[Backend, ...] = ()
    context_length: int = at_least(1, 32_768)
    default_max_tokens: int = at_least(1, 1_024)
    max_max_tokens: int = at_least(1, 8_192)
    tokenizer: str | None = optional_text("the bundled Qwen2 tokenizer")
    """Path to tokenizer.json(.gz); None = the shipped Qwen2 tokenizer."""
    default_system_prompt: str | None = None
    pass_priority: bool = False
    """Forward the tier as vLLM's `priority` (needs --scheduling-policy priority)."""
    accept_chat_template: bool = False
    """Forward a chat request's own `chat_template` (nodes started with vLLM's
    --trust-request-chat-template). Off: such a request is refused with a 400, since the
    gateway counts the prompt with the pool's template and the client's could be far longer."""
    isolate_prefix_cache: bool = False
    """Give each tenant its own partition of the nodes' prefix cache: a request without a
    `cache_salt` is sent with one derived from its tenant (vLLM V1 engines; V0 refuses the
    field). Off: unsalted requests of all tenants share the cache."""
    served_model_name: str | None = optional_text("the pool's name")
    """The model name the backends serve (vLLM --served-model-name); None = the pool name.
    The gateway writes it into the forwarded request's `model`."""
    echo_requested_model: bool = True
    """Write the name the client asked for (the pool's name) into each response's `model`,
    whole bodies and every streamed chunk; False passes the backend's served name through."""
    stale_after_ms: int = at_least(0, 2_000)
    backend_ca_file: str | None = optional_text("the system's CAs only")
    """PEM bundle of the CA that signed the backends' https certificates (a private CA);
    trusted beside the system's CAs. None: the system's CAs only."""
    backend_api_key_env: str | None = None
    """Name of the environment variable holding the API key the backends require (vLLM
    --api-key): the gateway sends it to them as a bearer token, never the client's own key.
    None: no credentials (a client's Authorization header is never forwarded either)."""
    zones: ZoneSettings = field(default_factory=ZoneSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    """`[pools.engine]`: the timings the projection assumes for the way to the engines."""
    dedicated: DedicatedNodes = field(default_factory=DedicatedNodes)
    control: ControlSettings = field(default_factory=ControlSettings)
    """`[pools.control]`: the release control's objectives (admission.controlconfig)."""
    fairness: FairnessSettings = field(default_factory=FairnessSettings)
    """`[pools.fairness]`: release order within a tier (admission.fairconfig)."""

    def check(self, key: KeyName) -> None:
        _check_name(key, "name", "pool", self.name)
        names: dict[str, int] = {}
        for i, b in enumerate(self.backends):
            if names.setdefault(b.name, i) != i:
                raise ConfigError(f"{key('backends')}[{i}].name: backend {b.name!r} is already "
                                  f"{key('backends')}[{names[b.name]}]; names must be unique")
        if self.default_max_tokens > self.max_max_tokens:
            raise ConfigError(f"{key('default_max_tokens')}: above max_max_tokens")
        if self.max_max_tokens > self.context_length:
            # Prompt and output share the context: above it, a max_tokens the pool allows
            # would still be refused, as context_length_exceeded.
            raise ConfigError(f"{key('max_max_tokens')}: must be at most "
                              f"{key('context_length')} ({self.context_length}), got "
                              f"{self.max_max_tokens}")
        env = self.backend_api_key_env
        if env is not None and not ENV_NAME.fullmatch(env):
            raise ConfigError(f"{key('backend_api_key_env')}: must be the name of an "
                              "environment variable (letters, digits, _), not the key itself")
        nodes = self.dedicated.nodes
        for i, node in enumerate(nodes):
            if node not in names:
                raise ConfigError(f"{key('dedicated.nodes')}[{i}]: {node!r} is not a backend "
                                  "of this pool")
            if node in nodes[:i]:
                raise ConfigError(f"{key('dedicated.nodes')}[{i}]: {node!r} is listed twice")
        if nodes and set(nodes) == set(names) and len(set(self.dedicated.tiers)) < len(Tier):
            raise ConfigError(f"{key('dedicated.nodes')}: leaves no backend for the other tiers")


@dataclass(frozen=True, slots=True)
class TenantSettings:
    name: str
    tier: Tier
    key_sha256: tuple[str, ...] = ()
    rate: int = at_least(0, 10_000)
    burst: int = at_least(1, 100_000)
    max_queued: int = at_least(0, 100)
    weight: float = weight_field()
    """Share within its tier relative to the other tenants' (admission.fairconfig)."""
    max_queued_tokens: int = cap_field()
    """Most tokens of its requests queued at once in a pool (0: no cap)."""
    max_inflight_tokens: int = cap_field()
    """Most tokens reserved by its released, unfinished requests in a pool (0: no cap)."""
    team: str | None = None
    """The `[[teams]]` entry enclosing the tenant: its requests also pay at that team's
    bucket and at every level above it (admission.quotaconfig)."""
    daily_tokens: int = at_least(0, 0)
    """The tenant's own allowance per UTC day in a pool (0: none)."""
    monthly_tokens: int = at_least(0, 0)
    """The tenant's own allowance per UTC month in a pool (0: none)."""

    @property
    def quota(self) -> TenantQuota:
        """Its own limits (without the enclosing levels: `Config.quota_of`)."""
        return TenantQuota(self.name, self.rate, self.burst, self.max_queued,
                           weight=self.weight, max_queued_tokens=self.max_queued_tokens,
                           max_inflight_tokens=self.max_inflight_tokens,
                           daily_tokens=self.daily_tokens, monthly_tokens=self.monthly_tokens)

    def check(self, key: KeyName) -> None:
        for i, k in enumerate(self.key_sha256):
            if not is_sha256(k):
                raise ConfigError(f"{key('key_sha256')}[{i}]: must be a lowercase hex SHA-256")
        _check_name(key, "name", "tenant", self.name)
        if self.burst > 1_000_000_000:
            raise ConfigError(f"{key('burst')}: must be at most 1e9 tokens")
        check_tenant_caps(key, self.burst, {"max_queued_tokens": self.max_queued_tokens,
                                            "max_inflight_tokens": self.max_inflight_tokens,
                                            "daily_tokens": self.daily_tokens,
                                            "monthly_tokens": self.monthly_tokens})


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = tcp_port(8080)
    id: str | None = None
    max_body_bytes: int = at_least(1024, 4 * 1024 * 1024)
    request_read_timeout_ms: int = at_least(1, 30_000)
    """Longest a client may take to send a generation request's body, counted from the end of
    its headers; then 408 `request_timeout`. Until then a client trickling its body holds a
    connection and a handler."""
    keepalive_timeout_ms: int = at_least(1, 75_000)
    """Longest a client connection stays open without a complete request head: idle between
    requests, or sending a request line and headers (aiohttp's keep-alive timer, the only
    bound it has on a head). Above the 60 s idle timeouts of AWS ALB and nginx's upstream
    keep-alive, so that such a load balancer never reuses a connection the gateway is
    closing."""
    lease_ttl_ms: int = at_least(100, 10_000)
    renew_interval_ms: int = at_least(10, 3_000)
    wake_fallback_ms: int = at_least(10, 250)
    """How often a queued request checks its task record in case a wake-up was lost."""
    upstream_timeout_ms: int = at_least(100, 600_000)
    """Longest silence from a backend (between two reads) before the request fails with 502."""
    upstream_ms_per_output_token: int = at_least(0, 100)
    """Added to `upstream_timeout_ms` per token one sequence of a non-streamed request may
    generate (its sequences decode in the same steps): such a request is silent until its
    answer is whole, so its silence grows with its length."""
    upstream_connect_timeout_ms: int = at_least(1, 2_000)
    fail_open_tiers: tuple[Tier, ...] = ()
    """Tiers sent straight to a backend, unadmitted and counted, while Redis is unreachable
    (default: none, every tier fails closed with 503)."""
    retry_jitter: float = between(0.0, 1.0, 0.25)
    """Retry hints are spread upward by a random 0..retry_jitter fraction of their value."""
    unavailable_retry_ms: int = at_least(1, 2_000)
    """Retry hint of a 503 while Redis is unreachable."""
    access_log: bool = True
    admin_token_sha256: str | None = None
    tenant_metrics: bool = False
    retention_s: int = at_least(1, 600)

    def check(self, key: KeyName) -> None:
        if self.id is not None:
            _check_name(key, "id", "gateway", self.id)
        if self.admin_token_sha256 is not None and not is_sha256(self.admin_token_sha256):
            raise ConfigError(f"{key('admin_token_sha256')}: must be a lowercase hex SHA-256 "
                              "(of the admin token, never the token itself)")
        if self.renew_interval_ms * 2 > self.lease_ttl_ms:
            raise ConfigError(f"{key('renew_interval_ms')}: must be at most half of "
                              "lease_ttl_ms")


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = tcp_port(9100)
    id: str | None = None
    poll_interval_ms: int = at_least(5, 50)
    scrape_timeout_ms: int = at_least(5, 200)
    eject_after_failures: int = at_least(1, 3)
    leader_ttl_ms: int = at_least(100, 1_500)
    """Leader lease; a standby takes over at most this long after the leader dies."""
    stale_policy: str = one_of("full", "last")
    """What a node whose metrics are stale counts as: 'full' (no releases to it) or 'last'."""
    reap_interval_ms: int = at_least(10, 1_000)
    release_batch: int = at_least(1, 2_000)
    """Most tasks a tick's release may pop per tier."""
    release_call_ms: int = at_least(
        1, 20,
        why="0 (no bound) lets one release call run past redis.socket_timeout_ms, and the "
            "leader's client then gives up on it while Redis still runs the script")
    """Redis time one release script call may run before it stops after its next release; the
    tick's release goes on in further calls. Redis runs one script at a time, so this bounds
    how long a release holds every gateway's admits. Below `redis.socket_timeout_ms`
    (admission.config checks it): otherwise the leader's client gives up on calls Redis still
    runs, every tick fails, and the reaper, which waits for Redis to answer again, never
    runs."""
    usage_halflife_s: float = between(0.1, 86_400.0, 60.0)
    """Half-life of the learned usage/reservation ratio (older settles weigh less)."""
    preemption_cooldown_ms: int = at_least(0, 10_000)
    """After a node reports a preemption, no overcommit on it for this long."""
    stuck_after_ms: int = at_least(0, 30_000)
    """A node whose engine holds requests and changes none of its figures for this long, with
    a task kvgate released there as long ago, is ejected until they change (scheduler.stuck);
    0: never."""
    probe_still_nodes: bool = True
    """Send a one-token completion to a node whose page has not changed for `stuck_after_ms`
    while it shows work or is judged stuck, so that a live engine steps and its page tells the
    truth again (scheduler.probe); never while `stuck_after_ms` is 0."""

    def check(self, key: KeyName) -> None:
        if 0 < self.stuck_after_ms < MIN_STUCK_AFTER_MS:
            raise ConfigError(
                f"{key('stuck_after_ms')}: must be 0 (off) or at least {MIN_STUCK_AFTER_MS}, "
                f"got {self.stuck_after_ms}: a busy engine's figures rest for a step or two, "
                "and a node judged stuck gets no new work")


@dataclass(frozen=True, slots=True)
class Config:
    redis: RedisSettings
    gateway: GatewaySettings
    scheduler: SchedulerSettings
    tiers: Mapping[Tier, TierSettings]
    pools: Mapping[str, PoolSettings]
    tenants: tuple[TenantSettings, ...]
    teams: Mapping[str, TeamSettings] = field(default_factory=dict)
    """`[[teams]]` by name: the quota levels enclosing tenants (admission.quotaconfig)."""

    def quota_of(self, tenant: TenantSettings) -> TenantQuota:
        """What the scripts check a request of `tenant` against: its own limits and every
        level enclosing it, innermost first."""
        return dataclasses.replace(tenant.quota, levels=levels_of(tenant.team, self.teams))

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
            fair=self.pools[pool].fairness.enabled,
            fair_headroom=self.pools[pool].fairness.headroom,
            fair_light_window_ms=self.pools[pool].fairness.light_window_ms,
        )

    def backend_ssl_context(self) -> ssl.SSLContext | None:
        """What https backends are verified against: the system's CAs plus every pool's
        `backend_ca_file` (one context serves all pools: gateway and scheduler each keep one
        client for every backend). None when no pool names a file: the clients' default."""
        files = {p.backend_ca_file: i for i, p in enumerate(self.pools.values())
                 if p.backend_ca_file}
        if not files:
            return None
        context = ssl.create_default_context()
        for path, i in sorted(files.items()):
            try:
                context.load_verify_locations(cafile=path)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"pools[{i}].backend_ca_file {path!r}: cannot load it "
                                  f"({exc})") from None
        return context
