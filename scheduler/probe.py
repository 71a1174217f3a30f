"""Probing a node whose page stands still while it shows work: one completion of one token,
sent by the leader, so that a live engine takes a step and its page tells the truth again.

An idle vLLM engine takes no step, and its page changes only at a step. So a page can freeze
with figures that are no longer true:

- **A page left stale by aborted requests.** When every request a node held is aborted at
  once (their clients left), its page can go on reporting them running and its KV cache
  nearly full (vLLM issues #22545 and #29928, in vLLM's tracker). kvgate counts that usage as
  the node's (foreign work it must leave room for), gives the node no work, and with no work
  no step runs to correct the page: without a probe the node is lost until its server
  restarts, and with the default zone aggregate (the fullest node) the whole pool stays RED.
- **A node judged stuck whose engine was only paused** (a weight update, a long pause of its
  process). The gateways end the requests it held, which aborts them; once the engine runs
  again it has nothing to step on, and its page stays as it froze (scheduler.stuck: a stuck
  node rejoins only when its page changes).

So the leader probes a node none of whose page figures has changed for `stuck_after_ms`,
read well (not failing, not stale), that is judged stuck or shows requests running or
waiting; then again every `stuck_after_ms` while that lasts. A live engine answers within a
step, its figures change at once, and the node is judged on them: a stale page is corrected,
a stuck node rejoins. A hung engine does not answer: the probe is given up after
`PROBE_TIMEOUT_S` (or half of `stuck_after_ms`, if shorter), which closes the connection
and tells vLLM to drop it, and changes nothing. A probe's answer does not rejoin a node by
itself: a data-parallel server sends it to one of its engines, and the page says which
engines moved.

A probe also confirms an engine hung while idle before it is judged stuck (`Prober.hung`,
scheduler.stuck): a request can wait in a live server's front end longer than
`stuck_after_ms` (a video being fetched) while its idle engine's page stands still, and a
live engine answers a probe at once. Such a probe goes to a node whose page shows nothing
held, and counts in the same metric and alert.

The probe is `POST /v1/completions` with the pool's served model name, the prompt ".", and
`max_tokens` 1, and the pool's backend API key (`backend_api_key_env`) when the scheduler's
environment holds it. One at a time per node. Outcomes are counted in
`kvgate_scheduler_probes_total{outcome}`; a failing one is logged once per streak (a 401,
403 or 404 is `refused`: the scheduler lacks the key, or the model name is wrong).
`scheduler.probe_still_nodes = false` turns probing off.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import aiohttp

from admission.failurelog import FailureLog

if TYPE_CHECKING:
    from admission.config import PoolSettings
    from scheduler.scrape import NodeView

log = logging.getLogger("kvgate.scheduler.probe")

PROBE_TIMEOUT_S = 10.0
"""Longest wait for a probe's answer (or half of `stuck_after_ms`, if shorter). The nodes
probed show a page that has not changed for `stuck_after_ms`: a live engine among them has
nothing else to step on, and answers one token within a step or two."""
PROBE_OUTCOMES = ("ok", "refused", "error", "timeout", "connect")
"""`ok`: answered 200; `refused`: 401, 403 or 404 (credentials or model name); `error`: any
other status; `timeout`: no answer within the timeout; `connect`: no connection."""
PROBE_PROMPT = "."
MAX_ANSWER_BYTES = 64 * 1024
"""A probe's answer is read up to this many bytes (one token's completion is a few hundred)."""

ProbeHook = Callable[[str, str], None]
"""Called after every probe with (node, outcome)."""


def probe_headers(pool: PoolSettings, env: Mapping[str, str]) -> dict[str, str]:
    """The probe's headers: the pool's backend API key when the variable its
    `backend_api_key_env` names is set here (the gateways refuse to start without it; a
    scheduler without it still scrapes, and its probes are refused and logged)."""
    headers = {"Content-Type": "application/json", "User-Agent": "kvgate-scheduler-probe"}
    variable = pool.backend_api_key_env
    key = env.get(variable, "").strip() if variable else ""
    if key and not any(c in key for c in "\r\n"):
        headers["Authorization"] = f"Bearer {key}"
    return headers


def key_warning(pool: PoolSettings, env: Mapping[str, str]) -> str | None:
    """What the scheduler logs at start when the pool's backends take a key it lacks (the
    variable `backend_api_key_env` names is unset, empty, or holds a line break): its probes
    will be refused."""
    variable = pool.backend_api_key_env
    if variable is None or "Authorization" in probe_headers(pool, env):
        return None
    return (f"pool {pool.name}: backend_api_key_env names {variable}, which is not set (or "
            "not usable) in the scheduler's environment: nodes that require the key will "
            "refuse its probes (give the scheduler the variable, as the gateways have it; "
            "Helm: scheduler.extraEnv)")


def wants_probe(view: NodeView, after_s: float) -> bool:
    """Whether the node's page has stood still for `after_s` while it shows requests running
    or waiting, or it is judged stuck (the module docstring), on a good, fresh reading. KV
    usage alone does not count: some engines report a little at rest (a reserved block), and
    a page left stale by aborted requests still counts them."""
    m = view.metrics
    if m is None or view.stale or (view.ejected and not view.stuck):
        return False
    if view.frozen_s < after_s:
        return False
    return view.stuck or m.running + m.waiting > 0


class Prober:
    """One pool's probes (the module docstring); `after_s` as the pool's stuck_after_ms."""

    def __init__(self, pool: PoolSettings, session: aiohttp.ClientSession, after_s: float, *,
                 headers: Mapping[str, str], on_probe: ProbeHook | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.pool = pool
        self.session = session
        self.after_s = after_s
        self.headers = dict(headers)
        self.on_probe = on_probe
        self.clock = clock
        # At most half the interval: a confirming probe (`hung`) must end, timed out, before
        # the releases it follows age past it, with ticks to spare.
        self.timeout = aiohttp.ClientTimeout(total=min(timeout_s, after_s / 2))
        self.urls = {b.name: b.url for b in pool.backends}
        self._started: dict[str, float] = {}
        """node -> when its last probe started (this process's clock)."""
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._last: dict[str, str] = {}
        """node -> its last probe's outcome while it wants probes (a run of answered probes
        is logged once)."""
        self._done: dict[str, tuple[float, str]] = {}
        """node -> when its last ended probe started, and its outcome (`hung`)."""
        self._logs = {
            name: FailureLog(f"pool {pool.name}: probe of node {name}", clock, log,
                             recovered=f"pool {pool.name}: node {name} answers probes again")
            for name in self.urls}

    def due(self, views: Sequence[NodeView]) -> list[str]:
        """The nodes to probe now: wanted, none in flight, none started `after_s` ago."""
        now = self.clock()
        return [v.name for v in views
                if v.name in self.urls and wants_probe(v, self.after_s)
                and v.name not in self._inflight
                and now - self._started.get(v.name, -float("inf")) >= self.after_s]

    def start(self, views: Sequence[NodeView]) -> list[str]:
        """Start the due probes (not awaited: a hung node's probe must not hold the tick);
        the nodes probed."""
        nodes = self.due(views)
        for view in views:
            if not wants_probe(view, self.after_s):
                self._last.pop(view.name, None)
        by_name = {v.name: v for v in views}
        for name in nodes:
            self._launch(by_name[name])
        return nodes

    def hung(self, view: NodeView, since: float) -> bool | None:
        """For judging a frozen page (scheduler.stuck): whether a probe of the node started at
        `since` (monotonic) or later went unanswered. An idle live engine answers a token at
        once, however slowly its server takes in other requests (a video being fetched), so
        an answer says the page is still only because nothing reached the engine. True: it
        timed out or found no connection, or it could not tell (refused, an error status: the
        node is then judged as without probes); False: answered; None: not known yet (a
        probe is in flight, started now if none was)."""
        if view.name not in self.urls:
            return True
        if view.name in self._inflight:
            return None
        done = self._done.get(view.name)
        if done is not None and done[0] >= since:
            return done[1] != "ok"
        self._launch(view)
        return None

    def _launch(self, view: NodeView) -> None:
        self._started[view.name] = self.clock()
        task = asyncio.create_task(self._probe(view), name=f"probe:{view.name}")
        self._inflight[view.name] = task
        task.add_done_callback(functools.partial(self._ended, view.name))

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        if self._inflight.get(name) is task:  # not a later probe of the node's
            del self._inflight[name]

    async def _probe(self, view: NodeView) -> None:
        name = view.name
        begun = self._started[name]
        body = {"model": self.pool.served_model_name or self.pool.name,
                "prompt": PROBE_PROMPT, "max_tokens": 1}
        headers = {**self.headers, "X-Request-Id": f"kvgate-probe-{uuid.uuid4().hex[:16]}"}
        started = self.clock()
        outcome, detail = "ok", ""
        try:
            async with self.session.post(self.urls[name] + "/v1/completions", json=body,
                                         headers=headers, timeout=self.timeout) as response:
                await response.content.read(MAX_ANSWER_BYTES)
                if response.status in (401, 403, 404):
                    outcome = "refused"
                    detail = (f"HTTP {response.status} (the scheduler needs the pool's "
                              "backend_api_key_env variable and served_model_name, as the "
                              "gateways do)")
                elif response.status != 200:
                    outcome, detail = "error", f"HTTP {response.status}"
        except TimeoutError:
            outcome, detail = "timeout", f"no answer in {self.timeout.total:g} s"
        except aiohttp.ClientError as exc:
            outcome, detail = "connect", type(exc).__name__
        self._done[name] = (begun, outcome)
        if self.on_probe is not None:
            self.on_probe(name, outcome)
        if outcome == "ok":
            self._logs[name].succeeded()
            if self._last.get(name) != "ok" and view.metrics is not None:
                m = view.metrics
                log.info("pool %s: probed node %s, whose page had not changed for %.0f s "
                         "(%s; %d running, %d waiting, KV usage %.1f%%): answered in %.2f s",
                         self.pool.name, name, view.frozen_s,
                         "stuck" if view.stuck else "not stuck", m.running, m.waiting,
                         100 * m.kv_usage, self.clock() - started)
        else:
            self._logs[name].failed(f"{outcome}: {detail}")
        self._last[name] = outcome

    async def settled(self) -> None:
        """Until the probes in flight have ended."""
        tasks = list(self._inflight.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def forget(self) -> None:
        """A leadership ends or starts: the probes of the earlier term are dropped (their
        answers say nothing of the page the next term reads), and the next term probes on
        its own schedule."""
        for task in self._inflight.values():
            task.cancel()
        self._inflight.clear()
        self._done.clear()
        self._last.clear()
        self._started.clear()

    async def close(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
