"""Fairness settings: `[pools.fairness]` and the per-tenant keys of fair release.

A pool releases queued work within each tier in weighted fair order across tenants (lua/_tenant.lua,
"Fair release"; docs/architecture.md, "Fairness within a tier"), or FIFO when `enabled` is
false. A tenant's `weight` is its share within its tier relative to the other tenants there;
its caps bound what it may hold queued and in flight in a pool. The fields declare each key's
default and bounds (admission.configfields); admission.config reads the table by them.
"""

from __future__ import annotations

from dataclasses import dataclass

from admission.configfields import ConfigError, KeyName, at_least, between
from admission.store import MAX_WEIGHT, MIN_WEIGHT


@dataclass(frozen=True, slots=True)
class FairnessSettings:
    enabled: bool = True
    """Weighted fair order across tenants within each tier; false: FIFO within each tier."""
    headroom: float = between(0.0, 0.5, 0.02)
    """The fraction of each node's capacity for a tier that a release from the queue leaves
    free when its tenant holds more than its weighted share of the tier's in-flight tokens while
    a lighter tenant is active: that tenant's next request then finds room at once instead of
    waiting for a completion; and a token of each node's prefill room, while a light tenant's
    fast path may overdraw that room down to minus two windows; and a second of YELLOW's
    Normal rate as a credit light tenants' fast path takes ahead of the refill (0: fair release
    gives every freed token and every task of the rate to the backlog)."""
    light_window_ms: int = at_least(100, 5_000)
    """How long a tenant counts as active and light after a request of its was admitted with
    none of its own queued while its tier had others' backlog (the room above is held for it
    that long after its last such admit)."""


def weight_field() -> float:
    """A tenant's `weight`: its share within its tier relative to the other tenants'."""
    return between(MIN_WEIGHT, MAX_WEIGHT, 1.0)


def cap_field() -> int:
    """A tenant's cap on queued or in-flight tokens per pool (0: no cap)."""
    return at_least(0, 0)


def check_tenant_caps(key: KeyName, burst: int, caps: dict[str, int]) -> None:
    """A cap (or allowance) below `burst`, the largest request the tenant may send, would
    refuse or hold such a request for ever: refused, naming the key."""
    for name, cap in caps.items():
        if 0 < cap < burst:
            raise ConfigError(f"{key(name)}: must be 0 (no cap) or at least the tenant's burst "
                              f"({burst}), the largest request it may send; got {cap}")
