"""Drives one node's engine in (scaled) real time and connects it to the HTTP handlers.

Simulated time is wall time since start multiplied by ``time_scale``. A step is scheduled, its
duration computed, and its results applied when the wall clock reaches the step's simulated end;
handlers waiting on a request are then woken. Back-to-back steps are chained on the simulated
schedule so that timer jitter (asyncio wakes ~0.5 ms late) does not accumulate into lost
throughput; once the loop falls behind by more than ``lag_tolerance_s`` the schedule restarts
from "now", the simulation loses time and the lag shows in ``sim:loop_lag_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

from bench.sim.config import SimConfig
from bench.sim.engine import Engine, RequestStatus, SimRequest, StepResult
from bench.sim.trace import NodeTrace

_LAG_PROBE_INTERVAL_S = 0.05


class EngineDeadError(RuntimeError):
    """The node has crashed; nothing is served any more."""


class RequestHandle:
    """What an HTTP handler holds for its request: the engine's view plus a wake-up."""

    __slots__ = ("_event", "req", "running_at_arrival", "sent", "streaming", "waiting_at_arrival")

    def __init__(self, req: SimRequest, streaming: bool, running: int = 0,
                 waiting: int = 0) -> None:
        self.req = req
        self.streaming = streaming
        self.running_at_arrival = running
        self.waiting_at_arrival = waiting
        self.sent = 0
        """Output tokens already written to the client (the handler keeps this)."""
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.req.status is RequestStatus.FINISHED

    async def wait(self) -> None:
        """Until new tokens, the end, or a crash; returns at once if one is pending."""
        await self._event.wait()
        self._event.clear()

    def wake(self) -> None:
        self._event.set()


class LagMonitor:
    """Maximum event-loop lag, per wall-clock second, over a sliding window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._per_second: deque[tuple[int, float]] = deque()
        self.max_total = 0.0

    def record(self, lag: float, wall: float) -> None:
        second = int(wall)
        if self._per_second and self._per_second[-1][0] == second:
            if lag > self._per_second[-1][1]:
                self._per_second[-1] = (second, lag)
        else:
            self._per_second.append((second, lag))
        horizon = second - int(self.window_s) - 1
        while self._per_second and self._per_second[0][0] < horizon:
            self._per_second.popleft()
        self.max_total = max(self.max_total, lag)

    def window_max(self, wall: float) -> float:
        horizon = wall - self.window_s
        return max((lag for sec, lag in self._per_second if sec + 1 > horizon), default=0.0)

    def reset(self) -> None:
        self._per_second.clear()
        self.max_total = 0.0


class NodeRunner:
    def __init__(self, config: SimConfig, trace: NodeTrace | None = None) -> None:
        self.config = config
        self.trace = trace
        self.engine = Engine(config)
        self.lag = LagMonitor(config.lag_window_s)
        self.crashed = False
        self._wall0 = time.monotonic()
        self._handles: dict[int, RequestHandle] = {}
        self._work = asyncio.Event()
        self._last_arrival = 0.0
        self._full_since: float | None = None
        self.kv_usage_peak = 0.0
        """Highest KV usage any step reached (at scheduling, before finished requests free)."""
        self._crash_callbacks: list[Callable[[], None]] = []
        self._changed = asyncio.Event()

    # -- clock -------------------------------------------------------------------------------

    def sim_now(self) -> float:
        return (time.monotonic() - self._wall0) * self.config.time_scale

    def _wall_of(self, sim_t: float) -> float:
        return self._wall0 + sim_t / self.config.time_scale

    def loop_lag_max(self) -> float:
        """Worst wall-clock lag (s) of the event loop over the last ``lag_window_s``."""
        return self.lag.window_max(time.monotonic())

    def loop_lag_max_total(self) -> float:
        """Worst wall-clock lag (s) since start or the last ``reset_lag()``."""
        return self.lag.max_total

    def reset_lag(self) -> None:
        self.lag.reset()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checking after every change of engine state
        (step, submit, abort, crash). Bound it with ``asyncio.timeout``."""
        while not predicate():
            await self._changed.wait()

    def _notify_changed(self) -> None:
        # A fresh event per generation: every waiter wakes once, none clears it for the others.
        self._changed.set()
        self._changed = asyncio.Event()

    # -- requests ----------------------------------------------------------------------------

    def submit(self, req: SimRequest, *, streaming: bool) -> RequestHandle:
        if self.crashed:
            raise EngineDeadError("engine is dead")
        now = self.sim_now()
        handle = RequestHandle(req, streaming, self.engine.num_running, len(self.engine.waiting))
        self.engine.add(req, now)
        self._last_arrival = now
        self._handles[req.seq] = handle
        self._work.set()
        self._notify_changed()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """The client went away: free the request's blocks, count it as aborted."""
        self._handles.pop(handle.req.seq, None)
        if not self.crashed and self.engine.abort(handle.req, self.sim_now()):
            self._trace_request(handle)
            self._notify_changed()

    def on_crash(self, callback: Callable[[], None]) -> None:
        self._crash_callbacks.append(callback)

    def crash(self) -> None:
        """Die like an OOM-killed node: every live request fails, nothing is served any more."""
        if self.crashed:
            return
        self.crashed = True
        self.engine.fail_all(self.sim_now())
        handles = list(self._handles.values())
        self._handles.clear()
        for handle in handles:
            handle.wake()
        self._work.set()
        self._notify_changed()
        for callback in self._crash_callbacks:
            callback()

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled or crashed."""
        probe = asyncio.create_task(self._probe_lag())
        try:
            await self._steps()
        finally:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe

    async def _steps(self) -> None:
        engine = self.engine
        tolerance = self.config.lag_tolerance_s * self.config.time_scale
        prev_end: float | None = None
        while not self.crashed:
            if not engine.has_work():
                self._work.clear()
                self._full_since = None
                await self._work.wait()
                prev_end = None
                continue
            now = self.sim_now()
            if prev_end is not None and now - prev_end <= tolerance:
                start = max(prev_end, self._last_arrival)
            else:
                start = now
            plan = engine.schedule(start)
            peak_usage = engine.kv_usage
            self.kv_usage_peak = max(self.kv_usage_peak, peak_usage)
            end = start + engine.step_seconds(plan)
            if self.trace is not None:
                self.trace.step(start, end - start, plan.shape.num_seqs,
                                plan.shape.prefill_tokens, peak_usage)
            deadline = self._wall_of(end)
            # Sleep even when late: handlers must get the loop between steps.
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            woke = time.monotonic()
            self.lag.record(max(0.0, woke - deadline), woke)
            if self.crashed:
                return
            self._deliver(engine.complete(plan, end))
            self._check_crash(bool(plan.preempted), peak_usage, start, end)
            self._notify_changed()
            prev_end = end

    def _deliver(self, result: StepResult) -> None:
        handles = self._handles
        for req in result.emitted:
            handle = handles.get(req.seq)
            if handle is None:
                continue
            if req.status is RequestStatus.FINISHED:
                del handles[req.seq]
                self._trace_request(handle)
                handle.wake()
            elif handle.streaming:
                handle.wake()

    def _trace_request(self, handle: RequestHandle) -> None:
        if self.trace is not None:
            self.trace.request(handle.req, handle.running_at_arrival, handle.waiting_at_arrival)

    def _check_crash(self, preempted: bool, usage: float, start: float, end: float) -> None:
        limit = self.config.crash_after_full_s
        if limit is None:
            return
        if preempted or usage >= self.config.crash_usage_threshold:
            if self._full_since is None:
                self._full_since = start
            if end - self._full_since >= limit:
                self.crash()
        else:
            self._full_since = None

    async def _probe_lag(self) -> None:
        # Catches lag while the engine idles or while handlers hog the loop between steps.
        while True:
            due = time.monotonic() + _LAG_PROBE_INTERVAL_S
            await asyncio.sleep(_LAG_PROBE_INTERVAL_S)
            woke = time.monotonic()
            self.lag.record(max(0.0, woke - due), woke)
