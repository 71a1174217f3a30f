"""Admission of one request: one admit call, then the wait if it queued.

Outcomes, as the client sees them:

- released (fast path, or by the scheduler while the request waited): a `Ticket` naming the node;
- rejected: 429 with the backpressure protocol (`capacity_exceeded`: zone RED, queue full,
  or the tenant's cap on queued requests, the last with the time its own queue takes to make
  room; `rate_limit_exceeded`: the tenant's bucket, with its exact refill time;
  `rate_limit_exceeded_queued_tokens`: the tenant's cap on queued tokens, with the time its own
  queue takes to drain the excess; the tenant's limits with `X-RateLimit-Scope`), or a 4xx with
  `x-should-retry: false` when the request can never be admitted as sent;
- queued past the tier's timeout or the client's deadline (`X-Request-Timeout`, seconds, or
  an OpenAI SDK's declared read timeout less a margin and, for a whole answer, the time it may
  take: `gateway.handlers`): the
  task is cancelled and the client gets a 429 whose hint follows the same rule as a rejected
  admit's (`admission.hints`: the queue's drain rate, or in RED the leader's estimate of when
  the pool leaves it);
- Redis unreachable (a transient error: `admission.errors.is_transient`): 503 with Retry-After
  (fail closed), unless the tier is in `gateway.fail_open_tiers`, which goes straight to a
  backend, counted in a metric; Redis refusing for good (credentials, ACL, a key of the wrong
  type, a failing script): 500 `admission_misconfigured`, not retryable, for every tier;
- the gateway stopping (`Admitter.answer_queued`): 503 `gateway_shutting_down` with
  Retry-After for every request queued then or reaching admission afterwards, its task
  cancelled.

A client that disconnects while queued cancels its task at once (the handler is cancelled; the
cancel runs in the settler, which cancellation cannot interrupt).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass

from admission.config import Config, TenantSettings
from admission.errors import REDIS_ERRORS, AdmissionError, describe, is_transient
from admission.failurelog import FailureLog
from admission.outcomes import AdmitOutcome, AdmitResult, RejectReason
from admission.store import PoolStore
from admission.tiers import Tier
from gateway import metrics as m
from gateway.errors import (
    CAPACITY_EXCEEDED,
    KEY_SCOPE,
    MAX_RETRY_MS,
    QUEUED_TOKENS_EXCEEDED,
    SHUTDOWN_RETRY_MS,
    ApiError,
    admission_misconfigured,
    jittered,
    never_retry,
    quota_refusal,
    shutting_down,
    too_many_requests,
    unavailable,
)
from gateway.metrics import CLIENT_DEADLINE, QUEUE_TIMEOUT, GatewayMetrics
from gateway.parse import Inbound
from gateway.pools import PoolRuntime
from gateway.settle import Settler
from gateway.waiter import WakeHub, Woken, wait_for_release

log = logging.getLogger("kvgate.gateway")

NOT_SENT = {"x-should-retry": "true"}
"""On an error status for a request that never reached a node (so a retry cannot run it
twice): the SDKs, kvgate's and OpenAI's, retry any status that says so, and not a 500 or 502
that does not."""


class _RandomBlock:
    """The kernel's random bytes read 4 KB at a time: one system call per 512 task ids.
    Not thread-safe: the event loop's thread is its one caller."""

    def __init__(self) -> None:
        self.block = b""
        self.at = 0
        os.register_at_fork(after_in_child=self.reset)  # a child must not reuse our bytes

    def reset(self) -> None:
        self.block, self.at = b"", 0

    def take8(self) -> bytes:
        at = self.at
        if at + 8 > len(self.block):
            self.block, at = os.urandom(4096), 0
        self.at = at + 8
        return self.block[at:at + 8]


_random_block = _RandomBlock()


def new_task_id() -> str:
    """64 random bits in hex: an id is stored four times per queued task (record key, queue,
    gateway set, running index), so its length is Redis memory; a collision among live tasks
    (about 1 in 10^9 with 100,000 queued) is caught by the admit script as 'duplicate'."""
    return _random_block.take8().hex()

STORE_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError, AdmissionError)
"""What a call of the store raises when Redis fails: the request fails closed (503) or open, or
with a 500 when the failure is permanent.
With Redis Cluster that includes RedisClusterException, which is no RedisError: without it an
unreachable cluster was a 500 with a traceback per request, fail-open tiers included, and a
gateway could not start while the cluster was down."""

QUEUE_ANSWER_GRACE_S = 0.2
"""After a queued request's deadline: how long its cancel and the drain hint of its 429 may
take before the answer is sent without them (the cancel then finishes in the background)."""

_CAPACITY_MESSAGES = {
    RejectReason.ZONE_RED: "Cluster KV-Cache is currently saturated. Please backoff.",
    RejectReason.NO_NODE: "No inference node of this model is reachable. Please backoff.",
    RejectReason.QUEUE_FULL: "The queue of this priority tier is full. Please backoff.",
}


@dataclass(slots=True)
class Ticket:
    task_id: str
    pool: PoolRuntime
    node: str
    url: str
    tier: Tier
    labels: tuple[str, ...]
    admitted: bool = True
    """False when let through unadmitted (fail-open): there is nothing to settle."""
    queued_s: float = 0.0


SHUTTING_DOWN = "shutting_down"
"""The state a queued request's wait ends with when its gateway stops (`answer_queued`)."""


class Admitter:
    def __init__(
        self,
        gateway_id: str,
        config: Config,
        hub: WakeHub,
        settler: Settler,
        metrics: GatewayMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.gateway_id = gateway_id
        self.config = config
        self.hub = hub
        self.settler = settler
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.jitter = config.gateway.retry_jitter
        # Each tenant's limits with its enclosing quota levels, built once (not per request).
        self.quotas = {t.name: config.quota_of(t) for t in config.tenants}
        self._queued: dict[str, asyncio.Future[Woken]] = {}
        """The requests waiting in a queue now: what `answer_queued` ends at shutdown."""
        self.closing = False
        """Set by `answer_queued`: every request that reaches admission from then on is
        answered as the queued ones were."""
        self.store_down = FailureLog("admission store call", time.monotonic, log,
                                     recovered="admission store answers again")
        """Failed admits, logged once per streak: during an outage every request fails, and a
        line per request flooded the log (each is counted in redis_errors{op="admit"})."""
        self.store_refuses = FailureLog(
            "admission store call (refused for good: Redis credentials, ACL, keys or scripts)",
            time.monotonic, log, recovered="admission store answers again")
        """Permanent failures, a streak of their own: logged when they start even amid an
        outage's transient ones."""
        self._unknown_nodes: set[str] = set()
        """Nodes a release named that this gateway's config lacks, logged once each: the
        mismatch lasts until the configs agree, and every request released there fails."""

    def answer_queued(self) -> int:
        """At shutdown, end every request still queued here with a 503 the client can retry on
        another gateway (their tasks leave the queue), rather than cut its connection without
        an answer. Returns how many.

        From then on the gateway is `closing`: a request that was still on its way to the
        queue (its body arriving, its prompt being counted, its admit's reply in flight) gets
        the same 503 when it reaches admission, or as soon as its admit returns (its task then
        cancelled, as at a deadline); otherwise it would enter the queue after this call and
        lose its connection, without an answer, when the requests still running are
        cancelled."""
        self.closing = True
        pending = [f for f in self._queued.values() if not f.done()]
        for future in pending:
            future.set_result(Woken(None, SHUTTING_DOWN, False))
        return len(pending)

    def _shutting_down(self) -> ApiError:
        error = shutting_down("had not scheduled the request yet",
                              self._hint(SHUTDOWN_RETRY_MS))
        error.tag = m.SHUTTING_DOWN
        return error

    def _hint(self, retry_ms: int, *, cap: int | None = MAX_RETRY_MS) -> int:
        return jittered(retry_ms, self.jitter, self.rng, cap=cap)

    async def admit(
        self,
        inbound: Inbound,
        tenant: TenantSettings,
        tier: Tier,
        client_timeout_ms: int | None,
        *,
        arrived: float | None = None,
    ) -> Ticket:
        """`arrived`: loop time the request came in (default: now), from which its deadline
        counts (the tier's queue timeout or the client's `client_timeout_ms`)."""
        if self.closing:
            raise self._shutting_down()
        pool = inbound.pool
        store = pool.store
        labels = self.metrics.tier_labels(pool.name, tier, tenant.name)
        tier_timeout_ms = timeout_ms = self.config.tiers[tier].queue_timeout_ms
        if client_timeout_ms is not None:
            timeout_ms = max(1, min(timeout_ms, client_timeout_ms))
        # Whose deadline ends the wait: the tier's queue timeout alone is what the VIP alert
        # on queue timeouts means, not a client that chose to wait less.
        expiry = QUEUE_TIMEOUT if timeout_ms == tier_timeout_ms else CLIENT_DEADLINE
        if arrived is None:
            arrived = asyncio.get_running_loop().time()
        deadline = arrived + timeout_ms / 1000
        task_id = new_task_id()
        woken = self.hub.expect(task_id)
        live = self.settler.live
        live.add(task_id)
        try:
            try:
                result = await store.admit(
                    task_id=task_id,
                    tenant=self.quotas.get(tenant.name) or self.config.quota_of(tenant),
                    tier=tier,
                    prompt_tokens=inbound.prompt_tokens,
                    max_tokens=inbound.max_tokens,
                    gateway=self.gateway_id,
                    queue_timeout_ms=timeout_ms,
                    tier_timeout_ms=tier_timeout_ms,
                )
            except STORE_ERRORS as exc:
                return self._store_failed(exc, task_id, inbound, tier, labels)
            except BaseException:
                # Cancelled (client gone) while the admit was in flight: it may have run.
                self.settler.finish(store, task_id, None, cancelled=True, labels=labels)
                raise
            self.store_down.succeeded()
            self.store_refuses.succeeded()
            if result.outcome is AdmitOutcome.RELEASED:
                assert result.node is not None
                self.metrics.child(self.metrics.tokens_reserved, *labels).inc(inbound.cost)
                if self.closing:
                    # The node has not been asked yet, and what still runs is cut within
                    # `QUEUED_ANSWER_S`: give the reservation back and answer as the queued.
                    self.settler.finish(store, task_id, None, cancelled=True, labels=labels)
                    raise self._shutting_down()
                return self._ticket(task_id, pool, result.node, tier, labels, 0.0)
            if result.outcome is AdmitOutcome.QUEUED:
                self.metrics.child(self.metrics.tokens_reserved, *labels).inc(inbound.cost)
                self.hub.queued(task_id, store, tier)
                if self.closing and not woken.done():
                    # Queued after `answer_queued` ran: the wait ends at once, as theirs did.
                    woken.set_result(Woken(None, SHUTTING_DOWN, False))
                return await self._wait(task_id, woken, pool, tier, labels, deadline, expiry)
            live.discard(task_id)  # refused: nothing was written
            if result.outcome is AdmitOutcome.REJECTED:
                self.metrics.child(self.metrics.rejections, *labels, str(result.reason)).inc()
                if result.reason is RejectReason.QUOTA:
                    self.metrics.child(self.metrics.quota_rejections, pool.name,
                                       result.scope or KEY_SCOPE).inc()
                raise self._rejection(result, inbound, tenant)
            raise ApiError(500, "Duplicate task id; please retry.", type_="server_error",
                           code="internal_error", retry_after_ms=self._hint(100),
                           headers=NOT_SENT)
        except ApiError as exc:
            exc.headers.setdefault("X-Request-Id", task_id)
            raise
        finally:
            self.hub.forget(task_id)

    def _ticket(
        self, task_id: str, pool: PoolRuntime, node: str, tier: Tier, labels: tuple[str, ...],
        queued_s: float,
    ) -> Ticket:
        url = pool.url(node)
        if url is None:
            # The scheduler knows a node this gateway's config does not: give the budget back.
            if node not in self._unknown_nodes and len(self._unknown_nodes) < 1000:
                self._unknown_nodes.add(node)
                log.error("task %s released to node %r, unknown to this gateway (logged once "
                          "per node)", task_id, node)
            self.settler.finish(pool.store, task_id, None, cancelled=True, labels=labels)
            error = unavailable(
                "The request was routed to a node this gateway does not know.",
                code="unknown_node", retry_ms=self._hint(1000), status=502, headers=NOT_SENT,
            )
            # Counted as what it is, not as a node's failure: no node was asked.
            error.tag = m.UNKNOWN_NODE
            raise error
        return Ticket(task_id, pool, node, url, tier, labels, queued_s=queued_s)

    def _store_failed(
        self, exc: BaseException, task_id: str, inbound: Inbound, tier: Tier,
        labels: tuple[str, ...],
    ) -> Ticket:
        self.metrics.child(self.metrics.redis_errors, "admit").inc()
        pool = inbound.pool
        # If the admit ran before its reply was lost, the task is an orphan now: the lease
        # renewal's sweep cancels it once Redis answers again. (No retry loop per request
        # here: during an outage that would pile up one per rejected request.)
        self.settler.live.discard(task_id)
        if not is_transient(exc):
            # Redis answers, and refuses the same way every time: failing open would send a
            # tier to the nodes unbounded for as long as nobody notices, and a 503's hint
            # would have clients retry what only an operator fixes.
            self.store_refuses.failed(describe(exc))
            error = admission_misconfigured()
            error.tag = m.MISCONFIGURED
            raise error
        self.store_down.failed(describe(exc))
        if tier in self.config.gateway.fail_open_tiers:
            node = pool.any_node()
            url = pool.url(node) if node is not None else None
            if node is not None and url is not None:
                self.metrics.child(self.metrics.fail_open, pool.name, tier.label).inc()
                return Ticket(task_id, pool, node, url, tier, labels, admitted=False)
        raise unavailable(
            "The admission service is unavailable. Please retry later.",
            code="admission_unavailable",
            retry_ms=self._hint(self.config.gateway.unavailable_retry_ms),
        )

    def _rejection(
        self, result: AdmitResult, inbound: Inbound, tenant: TenantSettings
    ) -> ApiError:
        reason = result.reason
        if reason is RejectReason.EXCEEDS_BURST:
            return never_retry(
                400,
                f"This request needs {inbound.cost} tokens ({inbound.prompt_tokens} prompt + "
                f"{inbound.max_tokens} max output), more than this API key's burst of "
                f"{tenant.burst} tokens, so it can never be admitted. Lower "
                f"{inbound.max_tokens_param} or shorten the prompt.",
                code="exceeds_burst",
                param=inbound.max_tokens_param,
            )
        if reason is RejectReason.QUOTA:
            return quota_refusal(result.scope or KEY_SCOPE, result.limit, inbound.cost,
                                 result.retry_after_ms, lambda ms: self._hint(ms, cap=None),
                                 zone=result.zone.value, depth=result.depth)
        if reason is RejectReason.TENANT_QUEUED_TOKENS:
            drain_ms = result.retry_after_ms or inbound.pool.store.policy.default_retry_ms
            queued = ("" if result.queued_tokens is None
                      else f"{result.queued_tokens} tokens of requests queued and ")
            return too_many_requests(
                QUEUED_TOKENS_EXCEEDED,
                f"This API key has {queued}a cap of {tenant.max_queued_tokens} queued tokens; "
                f"this request needs {inbound.cost} more. Its queue drains enough in about "
                f"{drain_ms} ms.",
                retry_ms=self._hint(drain_ms),
                zone=result.zone.value,
                depth=result.depth,
                scope=KEY_SCOPE,
            )
        if reason is RejectReason.TENANT_QUEUE_FULL:
            # The key's own cap, like the one on queued tokens: its scope, and the time its
            # own queue takes to make room, not the pool's.
            drain_ms = result.retry_after_ms or inbound.pool.store.policy.default_retry_ms
            held = ("" if result.queued_requests is None
                    else f" ({result.queued_requests} now)")
            return too_many_requests(
                CAPACITY_EXCEEDED,
                f"This API key has too many requests queued{held}: its cap is "
                f"{tenant.max_queued}. Its queue makes room in about {drain_ms} ms. "
                "Please backoff.",
                retry_ms=self._hint(drain_ms),
                zone=result.zone.value,
                depth=result.depth,
                scope=KEY_SCOPE,
            )
        assert reason is not None
        retry_ms = result.retry_after_ms
        return too_many_requests(
            CAPACITY_EXCEEDED,
            _CAPACITY_MESSAGES.get(reason, "Capacity exceeded. Please backoff."),
            retry_ms=self._hint(retry_ms if retry_ms is not None
                                else inbound.pool.store.policy.default_retry_ms),
            zone=result.zone.value,
            depth=result.depth,
        )

    async def _wait(
        self,
        task_id: str,
        woken: asyncio.Future[Woken],
        pool: PoolRuntime,
        tier: Tier,
        labels: tuple[str, ...],
        deadline: float,
        expiry: str,
    ) -> Ticket:
        """`deadline`: loop time at which the client gets its answer if still queued; `expiry`:
        the rejection reason it is counted under then (whose deadline it is)."""
        store = pool.store
        loop = asyncio.get_running_loop()
        started = loop.time()
        queued = self.metrics.child(self.metrics.queued, pool.name)
        queued.inc()
        self._queued[task_id] = woken
        try:
            outcome = await wait_for_release(woken, timeout_s=deadline - started)
        except BaseException:
            # Client gone (handler cancelled) or shutting down: leave the queue now.
            self.settler.finish(store, task_id, None, cancelled=True, labels=labels)
            raise
        finally:
            queued.dec()
            del self._queued[task_id]
        waited = loop.time() - started
        # The deadline is the client's: the cancel and the hint below get a short grace, then
        # the answer goes out whatever Redis does (a hanging Redis would hold it for a socket
        # timeout per call); the cancel goes on in the settler.
        answer_at = loop.time() + QUEUE_ANSWER_GRACE_S
        if outcome is not None and outcome.node is not None:
            self.metrics.child(self.metrics.queue_wait, pool.name, tier.label).observe(waited)
            return self._ticket(task_id, pool, outcome.node, tier, labels, waited)
        if outcome is None or outcome.state == SHUTTING_DOWN:
            # Our deadline (or this gateway's end) came first: take the task out of the queue
            # ourselves (before the hint is read, so that the depth reported no longer counts
            # it).
            leaving = self.settler.finish(store, task_id, None, cancelled=True, labels=labels)
            await asyncio.wait((leaving,), timeout=answer_at - loop.time())
        else:
            self.settler.live.discard(task_id)  # already ended in Redis
        if outcome is not None and outcome.state == SHUTTING_DOWN:
            raise self._shutting_down()
        if outcome is not None and outcome.state != "expired":
            # Reaped (this gateway's lease lapsed) or ended by someone else.
            error = unavailable(
                "The queued request was dropped by the cluster. Please retry.",
                code="queue_task_lost", retry_ms=self._hint(1000),
            )
            error.tag = m.TASK_LOST
            raise error
        self.metrics.child(self.metrics.rejections, *labels, expiry).inc()
        try:
            async with asyncio.timeout_at(answer_at):
                zone, depth, retry_ms = await self._queue_hint(store, tier)
        except TimeoutError:
            self.metrics.child(self.metrics.redis_errors, "drain_hint").inc()
            zone, depth, retry_ms = self._unknown_hint(store)
        error = too_many_requests(
            CAPACITY_EXCEEDED,
            f"The request waited {waited:.1f} s in the queue without being scheduled. "
            "Please backoff.",
            retry_ms=self._hint(retry_ms),
            zone=zone,
            depth=depth,
        )
        error.tag = QUEUE_TIMEOUT
        raise error

    async def _queue_hint(self, store: PoolStore, tier: Tier) -> tuple[str, int | None, int]:
        """(zone, tasks queued at `tier` or above, hint in ms before jitter), by the rule of a
        rejected admit's hint."""
        try:
            view = await store.queue_view(tier)
        except STORE_ERRORS:
            self.metrics.child(self.metrics.redis_errors, "drain_hint").inc()
            return self._unknown_hint(store)
        return view.zone.value, view.ahead, store.retry_hint_ms(view, tier)

    def _unknown_hint(self, store: PoolStore) -> tuple[str, None, int]:
        """A queue's hint while its Redis cannot be read: no zone, no depth (0 would read as an
        empty queue), and no sooner than the 503 `admission_unavailable` of the same outage
        tells new requests to come back."""
        return "UNKNOWN", None, max(store.policy.default_retry_ms,
                                    self.config.gateway.unavailable_retry_ms)
