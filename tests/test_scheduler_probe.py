"""Probing a node whose page stands still while it shows work (scheduler.probe): a page left
stale by aborted requests is corrected, a stuck node whose engine runs again rejoins, and a
hung node's probe times out and changes nothing. Real HTTP servers over loopback, a real
redis-server, the pool's scheduler ticked by the test on a clock it moves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict

from admission.config import parse_config
from scheduler.probe import PROBE_PROMPT, Prober, key_warning, probe_headers, wants_probe
from scheduler.scrape import NodeView, parse_vllm_metrics
from tests.scheduler_stub import FakeVllm, always
from tests.stuck_support import STUCK_AFTER_MS, PoolClock, busy, stuck_pool

AFTER_S = STUCK_AFTER_MS / 1000
KEY_ENV = "KVGATE_TEST_PROBE_KEY"


def ghost(**kw: Any) -> FakeVllm:
    """The page vLLM leaves when every request it held was aborted at once: still counting
    them, its cache nearly full."""
    return busy(running=106, waiting=15, usage=0.904, **kw)


class Engine:
    """A node's POST /v1/completions: records each probe, then answers as `mode` says
    (`answer`: 200 and the page moves as a step would move it; `hang`; or a status)."""

    def __init__(self, page: FakeVllm, mode: str | int = "answer") -> None:
        self.page, self.mode = page, mode
        self.released = asyncio.Event()
        """Ends the probes it holds (`hang`): set before its server stops, which waits for
        them."""
        self.probed = asyncio.Event()
        """Set at its first probe."""
        self.probes: list[tuple[dict[str, Any], CIMultiDict[str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.probes.append((await request.json(), CIMultiDict(request.headers)))
        self.probed.set()
        if self.mode == "hang":
            await self.released.wait()
        if isinstance(self.mode, int):
            return web.json_response({"error": {"message": "no"}}, status=self.mode)
        # One step: the aborted requests are gone, the probe's token is counted.
        self.page.running, self.page.waiting, self.page.usage = 0, 0, 0.0
        self.page.generation_tokens = (self.page.generation_tokens or 0.0) + 1
        return web.json_response({"choices": [{"text": "x"}]})


def attach(ps: Any, timeout_s: float = 2.0) -> Prober:
    """A prober on the pool scheduler, as the service builds it, its key from the test's
    environment, its outcomes counted in the scheduler's metrics."""
    pool = ps.pool
    outcomes = ps.metrics.probes
    prober = Prober(pool, ps.poller.session, AFTER_S,
                    headers=probe_headers(pool, {KEY_ENV: "sk-probe"}),
                    on_probe=lambda node, outcome: outcomes.labels(pool.name, node,
                                                                   outcome).inc(),
                    clock=ps.clock, timeout_s=timeout_s)
    ps.prober = prober
    return prober


async def tick(ps: Any) -> dict[str, Any]:
    """One tick: each node's plan."""
    return {p.name: p for p in (await ps.tick(1, always)).plans}


def probe_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvgate.scheduler.probe"]


def count(ps: Any, node: str, outcome: str) -> float:
    return float(ps.metrics.probes.labels("p", node, outcome)._value.get())


async def test_a_page_left_stale_by_aborted_requests_is_probed_and_the_node_gets_work_again(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.probe")
    stale, idle = ghost(), busy(running=0, usage=0.0)
    engines = {"n1": Engine(stale), "n2": Engine(idle)}
    plans = []
    async with stuck_pool(redis_client, redis_url, {"n1": stale, "n2": idle},
                          completions={name: e.handle for name, e in engines.items()},
                          pool_extra={"backend_api_key_env": KEY_ENV,
                                      "served_model_name": "served-model"}) as (ps, clock):
        prober = attach(ps)
        plans.append(await tick(ps))
        await clock.advance(AFTER_S - 0.1)
        plans.append(await tick(ps))
        await prober.settled()
        assert engines["n1"].probes == []
        await clock.advance(0.1)
        plans.append(await tick(ps))
        await prober.settled()
        plans.append(await tick(ps))
    assert len(engines["n1"].probes) == 1 and engines["n2"].probes == []
    body, headers = engines["n1"].probes[0]
    assert body == {"model": "served-model", "prompt": PROBE_PROMPT, "max_tokens": 1}
    assert headers["Authorization"] == "Bearer sk-probe"
    assert headers["X-Request-Id"].startswith("kvgate-probe-")
    # The stale page kept Normal and Batch off the node; the probe's step corrected it.
    assert [p["n1"].measured for p in plans] == [0.904, 0.904, 0.904, 0.0]
    assert [p["n1"].tier_budgets[1] > 0 for p in plans] == [False, False, False, True]
    assert count(ps, "n1", "ok") == 1 and count(ps, "n2", "ok") == 0
    [line] = probe_lines(caplog)
    assert line.startswith("pool p: probed node n1, whose page had not changed for 5 s (not "
                           "stuck; 106 running, 15 waiting, KV usage 90.4%): answered in")


async def test_a_stuck_node_whose_engine_runs_again_rejoins_through_a_probe(
    redis_client: Any, redis_url: str
) -> None:
    """Paused, not hung: the gateways ended the requests it held (aborting them), and an
    engine with nothing to step on would leave its page frozen, the node out for good."""
    page = busy()
    engine = Engine(page, mode="hang")
    async with stuck_pool(redis_client, redis_url, {"n1": page},
                          completions={"n1": engine.handle}) as (ps, clock):
        prober = attach(ps, timeout_s=0.2)
        await clock.hold_task("n1")
        reasons = [(await tick(ps))["n1"].reason]
        await clock.advance(AFTER_S)
        reasons.append((await tick(ps))["n1"].reason)  # judged stuck, and probed: it hangs
        await prober.settled()
        await redis_client.delete(ps.store.keys.running)  # the gateways ended the tasks
        await clock.advance(1.0)
        reasons.append((await tick(ps))["n1"].reason)  # not probed again so soon
        engine.mode = "answer"  # the engine runs again
        await clock.advance(AFTER_S - 1.0)
        reasons.append((await tick(ps))["n1"].reason)
        await prober.settled()
        reasons.append((await tick(ps))["n1"].reason)
        engine.released.set()
    assert reasons == ["", "stuck", "stuck", "stuck", ""]
    assert len(engine.probes) == 2
    assert (count(ps, "n1", "timeout"), count(ps, "n1", "ok")) == (1, 1)


@pytest.mark.parametrize(("mode", "outcome", "says"), [
    (401, "refused", "refused: HTTP 401 (the scheduler needs the pool's backend_api_key_env"),
    (404, "refused", "refused: HTTP 404"),
    (500, "error", "error: HTTP 500"),
    ("hang", "timeout", "timeout: no answer in 0.2 s"),
])
async def test_a_failed_probe_is_counted_logged_once_and_changes_nothing(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture, mode: str | int,
    outcome: str, says: str
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.probe")
    page = ghost()
    engine = Engine(page, mode=mode)
    async with stuck_pool(redis_client, redis_url, {"n1": page},
                          completions={"n1": engine.handle},
                          pool_extra={"backend_api_key_env": KEY_ENV}) as (ps, clock):
        prober = attach(ps, timeout_s=0.2)
        await tick(ps)
        for _ in range(3):
            await clock.advance(AFTER_S)
            plan = (await tick(ps))["n1"]
            await prober.settled()
        engine.released.set()
    assert len(engine.probes) == 3 and count(ps, "n1", outcome) == 3
    assert plan.measured == 0.904
    lines = probe_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith(f"pool p: probe of node n1 failed: {says}")
    assert engine.probes[0][1]["Authorization"] == "Bearer sk-probe"
    assert "sk-probe" not in lines[0]


def view(m: Any, *, frozen_s: float = AFTER_S, stale: bool = False, ejected: bool = False,
         stuck: bool = False) -> NodeView:
    return NodeView(name="n1", metrics=m, capacity=None, stale=stale, ejected=ejected,
                    age_s=0.0, seq=1, error="", frozen_s=frozen_s, stuck=stuck)


@pytest.mark.parametrize(("what", "node", "wanted"), [
    ("a still page showing requests", view(parse_vllm_metrics(busy().render())), True),
    ("a still page showing KV usage only (some engines keep a block at rest)",
     view(parse_vllm_metrics(busy(running=0, usage=0.2).render())), False),
    ("a still idle page", view(parse_vllm_metrics(busy(running=0, usage=0.0).render())), False),
    ("a still idle page judged stuck (frozen)",
     view(parse_vllm_metrics(busy(running=0, usage=0.0).render()), stuck=True, ejected=True),
     True),
    ("a page still for less than stuck_after_ms",
     view(parse_vllm_metrics(busy().render()), frozen_s=AFTER_S - 0.01), False),
    ("a stale reading", view(parse_vllm_metrics(busy().render()), stale=True), False),
    ("a node ejected for failed scrapes",
     view(parse_vllm_metrics(busy().render()), ejected=True), False),
    ("no reading", view(None), False),
])
def test_which_nodes_want_a_probe(what: str, node: NodeView, wanted: bool) -> None:
    assert wants_probe(node, AFTER_S) is wanted, what


def test_the_probe_carries_the_pool_key_only_when_the_scheduler_has_it() -> None:
    config = parse_config({"redis": {"url": "redis://x"}, "pools": [
        {"name": "p", "backend_api_key_env": KEY_ENV,
         "backends": [{"name": "n1", "url": "http://127.0.0.1:1"}]}]}, env={})
    pool = config.pools["p"]
    assert probe_headers(pool, {KEY_ENV: " sk-1 "})["Authorization"] == "Bearer sk-1"
    assert "Authorization" not in probe_headers(pool, {})
    assert "Authorization" not in probe_headers(pool, {KEY_ENV: "sk-1\nX-Other: 1"})
    assert config.scheduler.probe_still_nodes is True
    assert key_warning(pool, {KEY_ENV: "sk-1"}) is None
    assert key_warning(config.pools["p"].__class__(name="q"), {}) is None  # no key needed
    warning = key_warning(pool, {KEY_ENV: ""})
    assert warning is not None and warning.startswith(
        f"pool p: backend_api_key_env names {KEY_ENV}, which is not set")


@asynccontextmanager
async def idle_node(redis_client: Any, redis_url: str, mode: str | int, timeout_s: float
                    ) -> AsyncIterator[tuple[Any, PoolClock, Prober, Engine]]:
    """One idle node whose engine answers probes as `mode` says, a prober on its pool, one
    tick taken; the probes it holds are let go at the end."""
    page = busy(running=0, usage=0.0)
    engine = Engine(page, mode=mode)
    async with stuck_pool(redis_client, redis_url, {"n1": page},
                          completions={"n1": engine.handle}) as (ps, clock):
        prober = attach(ps, timeout_s=timeout_s)
        await tick(ps)
        try:
            yield ps, clock, prober, engine
        finally:
            engine.released.set()


@pytest.mark.parametrize(("mode", "judged"), [("answer", False), ("hang", True), (401, True)])
async def test_a_frozen_idle_page_is_judged_only_once_a_probe_goes_unanswered(
    redis_client: Any, redis_url: str, mode: str | int, judged: bool
) -> None:
    """A request can sit in a live server's front end longer than stuck_after_ms (a video
    being fetched) while its idle engine's page stands still: a probe, which an idle live
    engine answers at once, tells that node from a hung one. A refused probe tells nothing:
    the node is judged as without probes."""
    async with idle_node(redis_client, redis_url, mode, 0.2) as (ps, clock, prober, engine):
        await clock.advance(1.0)
        await clock.hold_task("n1")  # the slow request: its task stays
        await clock.advance(AFTER_S)
        reasons = [(await tick(ps))["n1"].reason]  # the probe is sent
        await prober.settled()
        reasons.append((await tick(ps))["n1"].reason)
        await clock.advance(1.0)
        reasons.append((await tick(ps))["n1"].reason)
    assert len(engine.probes) == 1
    assert reasons == (["", "stuck", "stuck"] if judged else ["", "", ""])
    outcome = {"answer": "ok", "hang": "timeout", 401: "refused"}[mode]
    assert count(ps, "n1", outcome) == 1


async def test_a_hung_idle_node_is_judged_while_requests_keep_reaching_it(
    redis_client: Any, redis_url: str
) -> None:
    """It looks idle, so work keeps coming: the probe that confirms it must follow the
    release it judges on, not outlast the requests that come after."""
    async with idle_node(redis_client, redis_url, "hang", 0.2) as (ps, clock, prober, _):
        reasons = []
        for i in range(int(AFTER_S) + 4):
            await clock.advance(1.0)
            await clock.hold_task("n1", f"t{i}")
            reasons.append((await tick(ps))["n1"].reason)
            await prober.settled()
    assert reasons[-1] == "stuck" and reasons.index("stuck") <= int(AFTER_S) + 2, reasons


async def test_a_replica_that_does_not_lead_sends_no_probe_and_drops_its_own(
    redis_client: Any, redis_url: str
) -> None:
    async with idle_node(redis_client, redis_url, "hang", 30.0) as (ps, clock, prober, engine):
        await clock.advance(1.0)
        await clock.hold_task("n1")
        await clock.advance(AFTER_S)
        result = await ps.tick(1, lambda: False)
        assert [p.reason for p in result.plans] == [""] and not prober._inflight
        await tick(ps)  # leading: the confirming probe goes out, and hangs
        await asyncio.wait_for(engine.probed.wait(), 10)
        inflight = list(prober._inflight.values())
        assert len(inflight) == 1
        ps.stand_by()
        await asyncio.gather(*inflight, return_exceptions=True)
        assert inflight[0].cancelled() and not prober._inflight and not prober._started
    assert sum(count(ps, "n1", o) for o in ("ok", "timeout", "refused", "error", "connect")) == 0

