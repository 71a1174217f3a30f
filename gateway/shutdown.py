"""Stopping a gateway within a bound: ``--shutdown-timeout`` plus `SETTLE_MARGIN_S`.

On SIGTERM the gateway

1. stops accepting: its listening sockets close, idle keep-alive connections close, and a
   connection with a request in flight closes once that request is answered;
2. waits for the requests in flight, up to the timeout;
3. answers the requests still queued (never scheduled) with 503 ``gateway_shutting_down`` and
   a retry hint, their tasks leaving the queue: the client retries on another gateway instead
   of seeing its connection cut; they get `QUEUED_ANSWER_S` to go out, and a request that
   reaches admission meanwhile (its body was still arriving, or its admit's reply was in
   flight) gets the same answer (`gateway.admit.Admitter.answer_queued`);
4. cancels those still running (streams longer than the timeout). The client's stream ends
   there, without ``[DONE]``: a truncated answer, which the client can tell from a whole one;
   a request no byte of whose answer went out yet (a whole answer still being generated) gets
   the 503 ``gateway_shutting_down`` instead of a connection closed without an answer. The
   node's generation is aborted, and the task's finish charges what was generated and
   returns the rest of the reservation;
5. settles what is left and closes (the app's cleanup): finishes still failing against Redis
   get `SETTLE_DRAIN_S`, then are left to the lease reaper;

and exits. Steps 3 to 5 fit in `SETTLE_MARGIN_S`, enforced as a deadline, so the process is
gone ``timeout + SETTLE_MARGIN_S`` seconds after the signal at the latest; with Redis healthy the
settles take milliseconds and it exits right after the timeout (or as soon as the last request
ends). A Kubernetes pod's ``terminationGracePeriodSeconds`` must cover the preStop sleep, the
timeout and this margin, or the kubelet's SIGKILL lands first.

Why not aiohttp's own bound (``AppRunner(shutdown_timeout=T)``): its server waits T for each
connection's handler, then waits up to T again while the handler keeps running, and only then
cancels it. A stream that outlives the timeout kept the process for up to twice the timeout,
and a pod sized for the flag was killed before its settles ran.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.errors import SHUTDOWN_RETRY_MS, jittered, shutting_down

log = logging.getLogger("kvgate.gateway")

SETTLE_MARGIN_S = 5.0
"""After the timeout, the most the gateway takes to exit: cancelled requests end, pending
settles drain, background tasks stop, connections close. Size the pod's grace period with it."""
CANCEL_GRACE_S = 1.0
"""How long cancelled requests get to run their cleanup (abort the node's generation, start the
task's finish). Longer would only mean one of them ignores cancellation."""
QUEUED_ANSWER_S = 0.5
"""How long the 503s of the requests still queued at the timeout get to go out (a cancel and a
short answer each) before whatever still runs is cancelled."""
SETTLE_DRAIN_S = 2.0
"""How long finishes still failing against Redis are retried at shutdown before being left to
the lease reaper (the lease expires and the scheduler returns the reservations)."""
BACKGROUND_STOP_S = 1.0
"""How long the wake listener, its fallback poll and the lease renewer get to stop."""
EXIT_RESERVE_S = 0.5
"""Part of the margin kept for the event loop's teardown and the interpreter's exit, after
`stop_serving` returns. The parts add up: 0.5 + 1 + 2 + 1 + 0.5 = `SETTLE_MARGIN_S`."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InFlight:
    """The requests being handled, as tasks, so shutdown can wait for them and then cancel
    them: the middleware registers each request's task for as long as its handler runs."""

    def __init__(self, jitter: float = 0.0) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cutting = False
        self.jitter = jitter
        """`gateway.retry_jitter`, spreading the retry hints of the 503s the cut answers."""
        self._rng = random.Random()

    def __len__(self) -> int:
        return len(self._tasks)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - a handler always runs in a task
            return await handler(request)
        self._tasks.add(task)
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if not self._cutting or request.writer.output_size:
                raise  # the client left, or its answer had begun: nothing more to say
            # Cut by the shutdown before any byte of its answer went out: an answer the
            # client can act on (retry, on another gateway) rather than a connection closed
            # without one, which clients see as a network failure.
            task.uncancel()
            return shutting_down(
                "cut the request before its answer",
                jittered(SHUTDOWN_RETRY_MS, self.jitter, self._rng),
                {"Connection": "close"},  # the retry must take another connection
            ).response()
        finally:
            self._tasks.discard(task)

    async def wait(self, timeout_s: float) -> int:
        """Until no request runs or `timeout_s` passed; how many still run."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, timeout_s))
        return len(self._tasks)

    async def cancel(self, grace_s: float) -> int:
        """Cancel every request still running, then wait up to `grace_s` for them to end;
        how many did not (they ignored the cancellation)."""
        tasks = set(self._tasks)
        self._cutting = True
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        return sum(not t.done() for t in tasks)


async def stop_serving(runner: web.AppRunner, requests: InFlight, timeout_s: float,
                       answer_queued: Callable[[], int] | None = None) -> None:
    """Steps 1 to 5 of the module's docstring; returns within `timeout_s` + `SETTLE_MARGIN_S`
    - `EXIT_RESERVE_S` of being called. `answer_queued` ends the queued requests (step 3) and
    says how many."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    for site in list(runner.sites):
        await site.stop()
    # Idle keep-alive connections close now; busy ones after their response (aiohttp's own
    # first shutdown step, where the installed version has it).
    close_idle = getattr(runner.server, "pre_shutdown", None)
    if close_idle is not None:
        close_idle()
    running = len(requests)
    left = await requests.wait(timeout_s)
    if left and answer_queued is not None:
        queued = answer_queued()
        if queued:
            log.warning("shutdown: %d queued requests answered 503 after %.1f s", queued,
                        timeout_s)
            left = await requests.wait(QUEUED_ANSWER_S)
    if left:
        log.warning("shutdown: %d of %d requests still running after %.1f s: cancelling them",
                    left, running, timeout_s)
        stuck = await requests.cancel(CANCEL_GRACE_S)
        if stuck:
            log.warning("shutdown: %d requests ignored cancellation", stuck)
    # A deadline over the pieces' own bounds: whatever hangs (a close that never returns),
    # the process still exits in time; the lease reaper returns what it leaves behind.
    deadline = began + timeout_s + SETTLE_MARGIN_S - EXIT_RESERVE_S
    try:
        async with asyncio.timeout_at(deadline):
            await runner.cleanup()
    except TimeoutError:
        log.warning("shutdown: cleanup unfinished %.1f s after the timeout; exiting anyway "
                    "(leases expire and the scheduler reaps what was left)",
                    SETTLE_MARGIN_S - EXIT_RESERVE_S)
    log.info("shutdown: stopped %.2f s after the signal", loop.time() - began)
