"""A retired pool: one whose keys are in Redis but which the configuration no longer has (its
model was taken out of service), judged and deleted whole by `kvgate-prune --retired-pools`.

Nothing serves such a pool once every gateway and scheduler has rolled: no leader publishes
its state or reaps its tasks, so its keys (queues, task records, buckets, fairness and quota
hashes, the state) stay for good. A task of it can only be alive while some gateway still
holds it, and a gateway that holds tasks renews its lease in the pool; so the pool is kept
while any lease in it is unexpired. It is also kept while anything wrote to it less than the
least idle time ago (the leader publishes the state every poll, an admit writes its tenant's
bucket): another deployment sharing this Redis may serve it with its own configuration. And,
as a tenant's keys are, while a bucket or quota of it is spent, unless spent ones may go too.

The keys are deleted by SCAN and UNLINK in batches, not in one atomic step: there is no
script's worth of declared keys to name, and nothing writes to a retired pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from admission.inspect_fair import allowance_used, as_text, month_index, scan_hashes
from admission.inspect_read import bucket_level
from admission.inspect_target import SCAN_COUNT, pool_pattern
from admission.keys import PoolKeys
from admission.reads import redis_time_us
from admission.scripts import frozen_clock_allowed


@dataclass(frozen=True, slots=True)
class PoolJudgement:
    verdict: str
    """'forgotten' (deleted), 'forgettable' (would be) or 'kept'."""
    reason: str
    """Why kept: 'leased' (a gateway holds work there), 'recent' (written less than the least
    idle time ago) or 'spent' (a bucket or quota below its burst or with an allowance in use);
    '' otherwise."""
    idle_us: int | None
    """µs since the last write its keys record (None: none recorded)."""
    keys: int
    """Keys deleted (or found, when not deleted)."""


def is_spent(h: Mapping[str, str], now_us: int) -> bool:
    """A bucket's or a quota level's hash holds what a fresh one would not: a level below its
    burst at `now_us`, or an allowance used in the current day or month (lua/forget.lua)."""
    level = bucket_level(h, now_us)
    if level is not None and level[0] < level[2] * 1_000_000:
        return True
    return any(used for used in allowance_used(h, now_us, month_index(now_us)))


async def _now_us(client: Any, keys: PoolKeys) -> int:
    if frozen_clock_allowed():
        frozen = await client.hget(keys.clock, "frozen_us")
        if frozen is not None:
            return int(frozen)
    return await redis_time_us(client, keys.state)


async def judge_pool(client: Any, pool: str, min_idle_us: int, spent: bool,
                     apply: bool) -> PoolJudgement:
    """Whether `pool`'s keys may go (see the module's doc), and with `apply`, their deletion."""
    keys = PoolKeys(pool)
    now = await _now_us(client, keys)
    leases = await client.zrange(keys.leases, 0, -1, withscores=True)
    if any(score > now for _, score in leases):
        return PoolJudgement("kept", "leased", None, 0)
    hashes = {**await scan_hashes(client, keys.bucket_key("")),
              **{"quota:" + k: h for k, h in (await scan_hashes(client, keys.quota_key("")))
                 .items()}}
    writes = [int(h["updated_us"]) for h in hashes.values()
              if h.get("updated_us", "").isdigit()]
    for key, field in ((keys.state, "updated_us"), (keys.clock, "last_us")):
        raw = await client.hget(key, field)
        if raw is not None and as_text(raw).isdigit():
            writes.append(int(raw))
    idle = max(0, now - max(writes)) if writes else None
    if idle is not None and idle < min_idle_us:
        return PoolJudgement("kept", "recent", idle, 0)
    if not spent and any(is_spent(h, now) for h in hashes.values()):
        return PoolJudgement("kept", "spent", idle, 0)
    found = [as_text(k) async for k in client.scan_iter(match=pool_pattern(pool),
                                                       count=SCAN_COUNT)]
    if not apply:
        return PoolJudgement("forgettable", "", idle, len(found))
    deleted = 0
    for start in range(0, len(found), SCAN_COUNT):
        deleted += int(await client.unlink(*found[start:start + SCAN_COUNT]))
    return PoolJudgement("forgotten", "", idle, deleted)
