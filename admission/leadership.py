"""The schedulers' election: one leader at a time, fenced by an epoch that only grows.

`leader.lua` acquires, renews or resigns the lease in one atomic call and raises the epoch
each time the lease changes hands; the leader's writes carry its epoch, and the pool scripts
refuse an older one (admission.errors.FencedError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from admission.keys import SchedulerKeys
from admission.scripts import Scripts


@dataclass(frozen=True, slots=True)
class Leadership:
    leading: bool
    epoch: int
    holder: str | None
    lease_left_ms: int


async def leadership(
    client: Any, scripts: Scripts, me: str, ttl_ms: int, *, resign: bool = False
) -> Leadership:
    """Acquire or renew (`resign`: free) the lease for `me`; `client` is the one `scripts`
    were registered with."""
    keys = SchedulerKeys()
    reply = await scripts.leader(
        keys=[keys.leader, keys.epoch], args=[me, ttl_ms, "resign" if resign else "acquire"]
    )
    raw = reply[2]
    holder = raw.decode() if isinstance(raw, bytes) else str(raw)
    return Leadership(bool(int(reply[0])), int(reply[1]), holder or None, int(reply[3]))
