"""What the scripts answer: outcomes, reasons and task states, and the parsers of their replies.

`admission.store.PoolStore` calls the scripts and returns these; the gateway and the scheduler
read them without touching a key. The string values are the ones the Lua scripts write (task
records' `state`, admit replies, pub/sub wake messages), so they are also what `redis-cli`
shows.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from admission.errors import ScriptReplyError
from admission.hints import QueueView, parse_rate, retry_hint_ms, tenant_drain_hint_ms
from admission.tiers import Tier, Zone


def text_of(value: Any) -> str:
    """A reply element as text (clients may or may not decode responses)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class AdmitOutcome(enum.StrEnum):
    RELEASED = "released"
    QUEUED = "queued"
    REJECTED = "rejected"
    DUPLICATE = "duplicate"


class RejectReason(enum.StrEnum):
    EXCEEDS_BURST = "exceeds_burst"
    QUOTA = "quota"
    ZONE_RED = "zone_red"
    NO_NODE = "no_node"
    """RED because no node of the pool is usable (every one ejected or stale): an outage."""
    QUEUE_FULL = "queue_full"
    TENANT_QUEUE_FULL = "tenant_queue_full"
    TENANT_QUEUED_TOKENS = "tenant_queued_tokens"


class TaskState(enum.StrEnum):
    QUEUED = "queued"
    RELEASED = "released"
    SETTLED = "settled"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REAPED = "reaped"

    @property
    def terminal(self) -> bool:
        return self not in (TaskState.QUEUED, TaskState.RELEASED)


@dataclass(frozen=True, slots=True)
class AdmitResult:
    outcome: AdmitOutcome
    zone: Zone
    depth: int
    node: str | None = None
    reason: RejectReason | None = None
    retry_after_ms: int | None = None
    """None when no retry can succeed (the request exceeds the tenant's burst, or rate is 0).
    Capacity rejections: `admission.hints.retry_hint_ms` of `view`."""
    state: TaskState | None = None
    """For DUPLICATE: the state the existing task is in."""
    view: QueueView | None = None
    """For capacity rejections: what the hint was computed from."""
    scope: str | None = None
    """For QUOTA: the level that cannot pay ('key', or 'team:<name>')."""
    limit: str | None = None
    """For QUOTA: what ran out there: 'bucket', 'daily', 'monthly', or 'held' (a bucket that
    never refills, short now but not once the level's live tasks give back what they did not
    use: `retry_after_ms` is then the floor, as for any wait nobody can measure)."""
    queued_tokens: int | None = None
    """For TENANT_QUEUED_TOKENS: the tokens of the tenant's requests queued in the pool when it
    was refused (this request not counted)."""
    queued_requests: int | None = None
    """For TENANT_QUEUE_FULL: how many of the tenant's requests were queued in the pool when
    it was refused."""


@dataclass(frozen=True, slots=True)
class ReleasedTask:
    task_id: str
    gateway: str
    node: str | None
    """None: the task expired in the queue instead of being released."""
    tier: Tier
    cost: int = 0
    """Tokens the release reserved (prompt + max output); 0 for an expired task."""


class Released(list[ReleasedTask]):
    """The tasks one release call released or expired, and the Normal credit of the YELLOW
    rate (lua/release.lua ARGV[11]) the call found unused and left for light tenants' fast
    path (both 0 when the call was given no credit to leave)."""

    credit_before: int = 0
    credit_after: int = 0
    calls: int = 1
    """Script calls it took (more than one when each was bounded in Redis time)."""
    more: bool = False
    """The last call stopped on a bound (its Redis time, or the heads it may look at) with
    work perhaps left for the next tick."""


@dataclass(frozen=True, slots=True)
class FinishResult:
    outcome: str
    """The state the task ended in, or 'noop' when it had already ended (or never existed)."""
    previous: str
    refunded: int


@dataclass(frozen=True, slots=True)
class ForgetResult:
    """`lua/forget.lua`'s verdict on one tenant's or quota level's keys."""

    verdict: str
    """'forgotten' (deleted), 'forgettable' (would be: a dry run) or 'kept'."""
    reason: str
    """Why kept: 'queued', 'in_flight', 'held', 'wrong_type', 'spent', 'recent' or 'absent';
    '' otherwise."""
    idle_us: int | None
    """µs since the last write its keys record (None: they record none, or it was kept for
    something alive before they were read)."""
    keys: int
    """Keys deleted (or that would be)."""


@dataclass(frozen=True, slots=True)
class ReapResult:
    reaped: int
    expired: int
    returned_tokens: int
    more: bool



def parse_wake(data: bytes | str) -> tuple[str, str | None]:
    """A wake-up message as `PoolStore.notify` publishes it: (task id, node, or None when the
    task expired in the queue)."""
    text = data.decode() if isinstance(data, bytes) else data
    task_id, _, node = text.partition(" ")
    return task_id, node.strip() or None


def view_of(zone: Zone, ahead: int, facts: Sequence[Any]) -> QueueView:
    """(drain, red_clear_s, state_age_ms) as the scripts report them."""
    drain, red_clear_s, age_ms = facts
    return QueueView(zone, ahead, parse_rate(drain), parse_rate(red_clear_s),
                     max(0, int(age_ms)))


def parse_admit(reply: Sequence[Any], tier: Tier, floor_ms: int) -> AdmitResult:
    """An admit.lua reply; a capacity rejection's hint from `admission.hints` (at least
    `floor_ms`)."""
    try:
        outcome = AdmitOutcome(text_of(reply[0]))
        detail = text_of(reply[1])
        retry = int(reply[2])
        depth = int(reply[3])
        zone = Zone(text_of(reply[4]))
        view = view_of(zone, depth, reply[5:8]) if len(reply) >= 8 else None
        scope, limit = (text_of(reply[5]), text_of(reply[6])) if len(reply) == 7 else (None, None)
        queued = int(reply[5]) if len(reply) == 6 else None
    except (ValueError, IndexError) as exc:
        raise ScriptReplyError(f"unexpected admit reply {reply!r}") from exc
    if outcome is AdmitOutcome.RELEASED:
        return AdmitResult(outcome, zone, depth, node=detail)
    if outcome is AdmitOutcome.REJECTED:
        if view is not None:
            retry = retry_hint_ms(view, tier, floor_ms)
        elif detail in (RejectReason.TENANT_QUEUED_TOKENS, RejectReason.TENANT_QUEUE_FULL):
            # The tenant's own caps: the wait is its own queue's drain, not the pool's.
            retry = tenant_drain_hint_ms(retry, floor_ms)
        elif limit == "held":
            retry = max(1, floor_ms)
        full = detail == RejectReason.TENANT_QUEUE_FULL
        return AdmitResult(outcome, zone, depth, reason=RejectReason(detail),
                           retry_after_ms=None if retry < 0 else retry, view=view,
                           scope=scope, limit=limit,
                           queued_tokens=None if full else queued,
                           queued_requests=queued if full else None)
    if outcome is AdmitOutcome.DUPLICATE:
        return AdmitResult(outcome, zone, depth, state=TaskState(detail))
    return AdmitResult(outcome, zone, depth)
