"""Open-loop load generator for the burst experiment.

Requests leave at the times a seeded schedule planned (bench.burst.workload.plan), whatever
happened to earlier ones: nothing waits for a response before sending the next request, and the HTTP
connection pool is unbounded, so a slow server cannot slow the senders down. Every latency is
measured from the request's *intended* send time, so a late send or a client-side backoff counts
against the server (no coordinated omission; LESSONS.md).

Each request is a chat completion with a known output length, forced with the simulator's
``X-Sim-Output-Tokens`` header, so the engine's work is the same in every arm; ``max_tokens`` is
what the planned request says the client declares (bench.burst.workload.MaxTokensMix: the exact
length, a cap several times it, or nothing). With ``send_priority`` (arm (d)) the body carries
the tier as vLLM's ``priority`` (VIP 0, the highest). Streaming requests ask for ``include_usage``;
TTFT is the arrival of the first chunk carrying content.

Normal and Batch clients retry 429 and 503 with the SDK's policy (kvgate_client: full jitter,
never sooner than ``retry-after-ms``, bounded attempts, a retry budget per tenant); VIP clients
do not retry. A stream that broke after its first byte is not retried (the SDK does not either).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from admission.tiers import Tier
from bench.burst.workload import PlannedRequest, Schedule, prompt_text
from bench.common.openloop import sleep_until
from bench.sim.protocol import OUTPUT_TOKENS_HEADER
from kvgate_client.budget import RetryBudget
from kvgate_client.hints import parse_retry_after
from kvgate_client.policy import RetryPolicy

TIER_HEADER = "X-Bench-Tier"
"""Sent for statistics only (the FIFO proxy counts its queue per tier with it); nothing
schedules on it. The gateway ignores it: tiers come from the API key."""

OK, REJECTED, FAILED, INCOMPLETE = "ok", "rejected", "failed", "incomplete"


@dataclass(slots=True)
class Outcome:
    """What happened to one planned request. Times are seconds from the arm's start."""

    req: PlannedRequest
    status: str = INCOMPLETE
    attempts: int = 0
    rejections: int = 0
    """429 answers received (each attempt can get one)."""
    sent_at: float | None = None
    """When the first attempt actually left (intended time + send lag)."""
    ttft: float | None = None
    """Seconds from the intended send time to the first content chunk (streaming only)."""
    done_at: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    request_id: str | None = None
    """The last attempt's request id (the gateway's task id), to join engine traces."""
    finished: bool = False
    """The client is done with it (answered, or gave up); False while in flight or retrying."""

    @property
    def latency(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.req.at


@dataclass(slots=True)
class TierCounters:
    sent: int = 0
    ok: int = 0
    rejected_responses: int = 0
    failed: int = 0
    inflight: int = 0


@dataclass(slots=True)
class LoadGenStats:
    tiers: dict[Tier, TierCounters] = field(
        default_factory=lambda: {t: TierCounters() for t in Tier}
    )
    admitted: list[tuple[float, Tier]] = field(default_factory=list)
    """(time, tier) of every 200 answer (the request got through to an engine)."""
    rejected: list[tuple[float, Tier]] = field(default_factory=list)
    """(time, tier) of every 429 answer."""
    send_lag_max: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """How one traffic class talks to the endpoint."""

    api_key: str
    policy: RetryPolicy | None
    """None: never retry (VIP)."""


class LoadGenerator:
    def __init__(
        self,
        schedule: Schedule,
        targets: Sequence[str],
        model: str,
        clients: Mapping[str, ClientSettings],
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        send_priority: bool = False,
    ) -> None:
        if not targets:
            raise ValueError("at least one target URL is needed")
        self.schedule = schedule
        self.targets = [t.rstrip("/") + "/v1/chat/completions" for t in targets]
        self.model = model
        self.send_priority = send_priority
        self.clients = dict(clients)
        self.budgets = {name: RetryBudget() for name in self.clients}
        self.outcomes = [Outcome(r) for r in schedule.requests]
        self.stats = LoadGenStats()
        self._rng = random.Random(f"loadgen:{seed}")
        self._next_target = 0
        self._clock = clock
        self._t0 = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def now(self) -> float:
        return self._clock() - self._t0

    async def run(self, session: aiohttp.ClientSession, t0: float) -> None:
        """Send every planned request on schedule (``t0`` is the arm's start on ``clock``),
        then return; responses keep arriving until ``wait_idle`` or ``cancel``."""
        self._t0 = t0
        for outcome in self.outcomes:
            await sleep_until(t0 + outcome.req.at)
            lag = self.now() - outcome.req.at
            self.stats.send_lag_max = max(self.stats.send_lag_max, lag)
            task = asyncio.create_task(self._one(session, outcome))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def pending(self) -> int:
        return len(self._tasks)

    async def wait_idle(self) -> None:
        """Until every dispatched request has finished (bound it with ``asyncio.timeout``)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def cancel(self) -> None:
        """Stop everything still in flight; those requests keep status INCOMPLETE."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _target(self) -> str:
        url = self.targets[self._next_target % len(self.targets)]
        self._next_target += 1
        return url

    def _body(self, req: PlannedRequest) -> bytes:
        body: dict[str, object] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt_text(req.prompt_tokens)}],
            "stream": req.stream,
        }
        if req.max_tokens is not None:
            body["max_tokens"] = req.max_tokens
        if self.send_priority:
            # Arm (d): the client itself asks vLLM's priority scheduler for its tier.
            body["priority"] = int(req.tier)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    async def _one(self, session: aiohttp.ClientSession, out: Outcome) -> None:
        req = out.req
        settings = self.clients[req.klass]
        budget = self.budgets[req.klass]
        counters = self.stats.tiers[req.tier]
        body = self._body(req)
        headers = {
            "Authorization": f"Bearer {settings.api_key}",
            "Content-Type": "application/json",
            OUTPUT_TOKENS_HEADER: str(req.output_tokens),
            TIER_HEADER: req.tier.label,
            # The nodes trace a request under this id (kvgate's gateway sends its task id
            # instead and answers with it): the engine's part of a TTFT is then known in
            # every arm, not only behind the gateway.
            "X-Request-Id": f"bench-{req.index}",
        }
        out.request_id = headers["X-Request-Id"]
        counters.sent += 1
        counters.inflight += 1
        budget.record_request()
        out.sent_at = self.now()
        policy = settings.policy
        try:
            attempt = 0
            while True:
                out.attempts += 1
                status, hint_s = await self._attempt(session, out, body, headers)
                if status == 200:
                    break
                retryable = policy is not None and status in policy.retryable_statuses
                if not retryable or policy is None or attempt + 1 >= policy.max_attempts:
                    break
                if hint_s is not None and hint_s > policy.max_retry_after_s:
                    break
                delay = policy.delay(attempt, hint_s, self._rng.random)
                elapsed = self.now() - req.at
                if policy.deadline_s is not None and elapsed + delay > policy.deadline_s:
                    break
                if not budget.try_spend():
                    break
                await asyncio.sleep(delay)
                attempt += 1
        finally:
            counters.inflight -= 1
        out.finished = True
        if out.status == OK:
            counters.ok += 1
        else:
            counters.failed += 1

    async def _attempt(
        self,
        session: aiohttp.ClientSession,
        out: Outcome,
        body: bytes,
        headers: Mapping[str, str],
    ) -> tuple[int, float | None]:
        """One HTTP exchange; returns (status, retry hint in s). Sets ``out`` on the way."""
        tier = out.req.tier
        try:
            async with session.post(self._target(), data=body, headers=headers) as resp:
                out.request_id = resp.headers.get("X-Request-Id", out.request_id)
                if resp.status != 200:
                    text = await resp.read()
                    hint = parse_retry_after(resp.headers, wall_clock=time.time)
                    if resp.status == 429:
                        out.rejections += 1
                        self.stats.tiers[tier].rejected_responses += 1
                        self.stats.rejected.append((self.now(), tier))
                        out.status = REJECTED
                    else:
                        out.status = FAILED
                    out.error = f"HTTP {resp.status}: {text[:200].decode(errors='replace')}"
                    out.done_at = self.now()
                    return resp.status, hint
                self.stats.admitted.append((self.now(), tier))
                if out.req.stream:
                    await self._read_stream(resp, out)
                else:
                    self._read_body(await resp.read(), out)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            out.status = FAILED
            out.error = f"{type(exc).__name__}: {exc}"
            out.done_at = self.now()
            # Refused or reset before any answer: the SDK retries connection errors.
            return 503 if out.ttft is None and out.completion_tokens == 0 else 0, None
        return 200, None

    async def _read_stream(self, resp: aiohttp.ClientResponse, out: Outcome) -> None:
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            # Parse only what is needed: chunks until the first content, then the usage chunk.
            if out.ttft is None:
                chunk = orjson.loads(data)
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    out.ttft = self.now() - out.req.at
                self._take_usage(chunk, out)
            elif b'"usage":{' in data:
                self._take_usage(orjson.loads(data), out)
        self._finish(out, complete=done)

    def _read_body(self, raw: bytes, out: Outcome) -> None:
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._finish(out, complete=False)
            return
        self._take_usage(payload, out)
        self._finish(out, complete=isinstance(payload, dict) and "choices" in payload)

    @staticmethod
    def _take_usage(chunk: object, out: Outcome) -> None:
        if isinstance(chunk, dict):
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                out.completion_tokens = int(usage.get("completion_tokens") or 0)

    def _finish(self, out: Outcome, *, complete: bool) -> None:
        out.done_at = self.now()
        # A response that ended early (no [DONE], or fewer tokens than forced) is a failure:
        # the client did not get what it asked for.
        if complete and out.completion_tokens == out.req.output_tokens:
            out.status = OK
            out.error = None
        else:
            out.status = FAILED
            out.error = (
                f"incomplete response: {out.completion_tokens}/{out.req.output_tokens} tokens"
            )
