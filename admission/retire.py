"""A retired pool: one whose keys are in Redis but which the configuration no longer has (its
model was taken out of service), judged and deleted whole by `kvgate-prune --retired-pools`
when named with ``--pool``.

Nothing serves such a pool once every gateway and scheduler has rolled: no leader publishes
its state or reaps its tasks, so its keys (queues, task records, buckets, fairness and quota
hashes, the state) stay for good. It is kept while the schedulers' leader still publishes it
(its state carries the current fencing epoch: a scheduler whose configuration still has the
pool), while any gateway's lease in it is unexpired (a gateway holding work there renews it;
an idle one holds none), while anything of it was written less than the least idle time ago
(never less than `POOL_MIN_IDLE_S`: its buckets, tenants' drains, the state, the queue
clock), and, as a tenant's keys are, while a bucket or quota of it is spent, unless spent ones
may go too.

The keys are deleted by SCAN and UNLINK in batches, not in one atomic step: there is no
script's worth of declared keys to name. A gateway that still admits for the pool between the
judgement and the deletion would lose what it wrote; the idle floor and the epoch check are
what make that a configuration mistake rather than a race.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from admission.inspect_fair import allowance_used, as_text, month_index, read_hashes
from admission.inspect_read import bucket_level
from admission.inspect_target import SCAN_COUNT, pool_pattern
from admission.keys import PoolKeys, SchedulerKeys
from admission.reads import redis_time_us
from admission.scripts import frozen_clock_allowed

POOL_MIN_IDLE_S = 3_600.0
"""The least idle time a whole pool is judged by, whatever --min-idle says: a pool's deletion
takes every key it has, not one tenant's."""


@dataclass(frozen=True, slots=True)
class PoolJudgement:
    verdict: str
    """'forgotten' (deleted), 'forgettable' (would be) or 'kept'."""
    reason: str
    """Why kept: 'published' (the leader's state carries the current epoch), 'leased' (a
    gateway holds work there), 'recent' (written less than the least idle time ago, or after
    now: a clock stepped back) or 'spent' (a bucket or quota below its burst or with an
    allowance in use); '' otherwise."""
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
    published, state_at = await client.hmget(keys.state, "epoch", "updated_us")
    current = await client.get(SchedulerKeys().epoch)
    if published is not None and current is not None and as_text(published) == as_text(current):
        return PoolJudgement("kept", "published", None, 0)
    leases = await client.zrange(keys.leases, 0, -1, withscores=True)
    if any(score > now for _, score in leases):
        return PoolJudgement("kept", "leased", None, 0)
    # One SCAN of the pool's keys: what its buckets and tenants say, and what goes.
    found = [as_text(k) async for k in client.scan_iter(match=pool_pattern(pool),
                                                       count=SCAN_COUNT)]
    buckets = (keys.bucket_key(""), keys.quota_key(""))
    read = await read_hashes(client, [k for k in found
                                      if k.startswith((*buckets, keys.tenant_key("")))])
    levels = [h for k, h in read.items() if k.startswith(buckets)]
    tenants = [h for k, h in read.items() if not k.startswith(buckets)]
    writes = [int(h[field]) for group, field in ((levels, "updated_us"), (tenants, "drain_us"))
              for h in group if h.get(field, "").isdigit()]
    for raw in (state_at, await client.hget(keys.clock, "last_us")):
        if raw is not None and as_text(raw).isdigit():
            writes.append(int(as_text(raw)))
    idle = max(0, now - max(writes)) if writes else None
    # As lua/forget.lua: a write after now (the clock stepped back) is recent.
    if writes and now - max(writes) < min_idle_us:
        return PoolJudgement("kept", "recent", idle, 0)
    if not spent and any(is_spent(h, now) for h in levels):
        return PoolJudgement("kept", "spent", idle, 0)
    if not apply:
        return PoolJudgement("forgettable", "", idle, len(found))
    deleted = 0
    for start in range(0, len(found), SCAN_COUNT):
        deleted += int(await client.unlink(*found[start:start + SCAN_COUNT]))
    return PoolJudgement("forgotten", "", idle, deleted)
