"""A stuck engine: its /metrics answers, it holds requests, and its page does not change.
The leader ejects it after `stuck_after_ms` (no new work, no say in the zone, `nodes_out` says
`stuck`) and takes it back at the first reading that changed or shows it idle."""

from __future__ import annotations

import logging
import math
from contextlib import AsyncExitStack
from typing import Any

import pytest

from admission.config import ConfigError, parse_config
from admission.tiers import Tier
from scheduler.scrape import EngineFigures, parse_vllm_metrics
from scheduler.stuck import StuckWatch
from tests.scheduler_stub import (
    FakeVllm,
    always,
    make_config,
    one_node_poller,
    pool_scheduler,
    queue_tasks,
    serve_fake,
    state,
)
from tests.stuck_support import SHORT_LEASE, STUCK_AFTER_MS, PoolClock, busy, stuck_pool


def test_the_generated_token_counter_is_read() -> None:
    m = parse_vllm_metrics(busy().render())
    assert m.generation_tokens == 400.0 and m.shows_decoding
    assert m.engines == (EngineFigures("0", True, (
        ("vllm:generation_tokens_total", 400.0), ("vllm:inter_token_latency_seconds_count", 398.0),
        ("vllm:kv_cache_usage_perc", 0.3), ("vllm:num_preemptions_total", 0.0),
        ("vllm:num_requests_running", 2.0), ("vllm:num_requests_waiting", 0.0),
        ("vllm:prompt_tokens_total", 1_000.0))),)
    bare = parse_vllm_metrics(FakeVllm(usage=0.3, running=2, prompt_tokens=5.0).render())
    assert bare.generation_tokens is None and not bare.shows_decoding


async def _ticks(redis_client: Any, redis_url: str, fakes: dict[str, FakeVllm],
                 steps: list[tuple[float, dict[str, dict[str, Any]]]],
                 scheduler: dict[str, Any] | None = None,
                 tasks_on: tuple[str, ...] = ("n1",)) -> list[dict[str, Any]]:
    """Tick a pool of `fakes` once, then once after each step (seconds to advance, changes to
    the fakes' fields); each tick's plans' reasons, node_capacity and nodes_out. The nodes of
    `tasks_on` hold a task kvgate released before the first tick."""
    out: list[dict[str, Any]] = []
    async with stuck_pool(redis_client, redis_url, fakes, scheduler) as (ps, clock):
        for node in tasks_on:
            await clock.hold_task(node)
        for seconds, changes in [(0.0, {}), *steps]:
            await clock.advance(seconds)
            for name, fields in changes.items():
                for field, value in fields.items():
                    setattr(fakes[name], field, value)
            result = await ps.tick(1, always)
            capacity = await redis_client.hgetall(ps.store.keys.node_capacity)
            out.append({
                "reasons": {p.name: p.reason for p in result.plans},
                "capacity": sorted(k.decode() for k in capacity),
                "nodes_out": (await state(ps.store)).get("nodes_out", ""),
                "stuck_gauge": {p.name: ps.metrics.stuck.labels("p", p.name)._value.get()
                                for p in result.plans},
                "ejected_gauge": {p.name: ps.metrics.ejected.labels("p", p.name)._value.get()
                                  for p in result.plans},
            })
    return out


async def test_a_busy_node_whose_counters_rest_is_ejected_as_stuck_and_rejoins_when_they_move(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.pool")
    stuck, healthy = busy(), busy()
    ticks = await _ticks(redis_client, redis_url, {"n1": stuck, "n2": healthy}, [
        (4.9, {"n2": {"generation_tokens": 500.0}}),
        (0.1, {"n2": {"generation_tokens": 600.0}}),
        (1.0, {"n2": {"generation_tokens": 700.0}}),
        (1.0, {"n1": {"generation_tokens": 401.0}}),
    ])
    assert [t["reasons"]["n1"] for t in ticks] == ["", "", "stuck", "stuck", ""]
    assert [t["reasons"]["n2"] for t in ticks] == [""] * 5
    assert [t["capacity"] for t in ticks] == [["n1", "n2"]] * 2 + [["n2"]] * 2 + [["n1", "n2"]]
    assert [t["nodes_out"] for t in ticks] == ["", "", "n1:stuck", "n1:stuck", ""]
    assert [t["stuck_gauge"]["n1"] for t in ticks] == [0, 0, 1, 1, 0]
    assert [t["ejected_gauge"]["n1"] for t in ticks] == [0, 0, 1, 1, 0]
    lines = [r.getMessage() for r in caplog.records if "n1" in r.getMessage()]
    assert lines == [
        "pool p: node n1 ejected as stuck: its engine holds 2 running and 0 waiting requests "
        "and its page has not changed for 5 s; no work goes to it until it changes or is idle",
        "pool p: node n1 moves again and rejoins the pool",
    ]


@pytest.mark.parametrize(("what", "changes"), [
    ("its KV usage moves (a long prompt's prefill allocates blocks chunk by chunk)",
     {"usage": 0.31}),
    ("its waiting count changes", {"waiting": 1}),
    ("its prompt counter moves (a prefill ended)", {"prompt_tokens": 1_500.0}),
    ("its inter-token histogram moves (a decode step)", {"itl": (4.1, 399.0)}),
    ("it is idle", {"running": 0}),
    ("its counters start again (the engine restarted)",
     {"prompt_tokens": 0.0, "generation_tokens": 0.0, "itl": (0.0, 0.0)}),
])
async def test_any_move_or_an_idle_reading_keeps_a_node_in(
    redis_client: Any, redis_url: str, what: str, changes: dict[str, Any]
) -> None:
    ticks = await _ticks(redis_client, redis_url, {"n1": busy()}, [
        (4.0, {"n1": changes}), (4.0, {}),
    ])
    assert [t["reasons"]["n1"] for t in ticks] == ["", "", ""], what


async def test_waiting_requests_alone_count_as_held(redis_client: Any, redis_url: str) -> None:
    ticks = await _ticks(redis_client, redis_url, {"n1": busy(waiting=3)}, [
        (0.0, {"n1": {"running": 0}}), (5.0, {}),
    ])
    assert [t["reasons"]["n1"] for t in ticks] == ["", "", "stuck"]


@pytest.mark.parametrize(("what", "fake", "scheduler"), [
    ("the page counts no decoded token", FakeVllm(usage=0.3, running=2, prompt_tokens=9.0),
     None),
    ("stuck_after_ms is 0", busy(), {"stuck_after_ms": 0}),
])
async def test_no_node_is_judged_stuck_when(redis_client: Any, redis_url: str, what: str,
                                            fake: FakeVllm,
                                            scheduler: dict[str, Any] | None) -> None:
    ticks = await _ticks(redis_client, redis_url, {"n1": fake}, [(60.0, {})],
                         scheduler=scheduler)
    assert [t["reasons"]["n1"] for t in ticks] == ["", ""], what


async def test_a_stuck_node_gets_no_queued_work_and_the_other_node_takes_it(
    redis_client: Any, redis_url: str
) -> None:
    fakes = {"n1": busy(), "n2": FakeVllm(usage=0.1, generation_tokens=0.0)}
    async with stuck_pool(redis_client, redis_url, fakes) as (ps, clock):
        await clock.hold_task("n1")
        await ps.tick(1, always)
        await clock.advance(STUCK_AFTER_MS / 1000)
        await queue_tasks(ps.store, [(f"v{i}", Tier.VIP, 1_000) for i in range(6)])
        result = await ps.tick(1, always)
        assert {t.task_id for t in result.released} == {f"v{i}" for i in range(6)}
        placed = {t.node for t in result.released}
        assert placed == {"n2"}, placed


def test_stuck_after_ms_is_0_or_above_a_second_and_a_dead_gateway_s_lease() -> None:
    def parse(scheduler: dict[str, Any], gateway: dict[str, Any] | None = None) -> Any:
        return parse_config({"redis": {"url": "redis://x"}, "scheduler": scheduler,
                             "gateway": gateway or {},
                             "pools": [{"name": "p", "backends": [
                                 {"name": "n1", "url": "http://127.0.0.1:1"}]}]}, env={})

    assert parse({}).scheduler.stuck_after_ms == 30_000
    assert parse({"stuck_after_ms": 0}).scheduler.stuck_after_ms == 0
    short = {"lease_ttl_ms": 500, "renew_interval_ms": 200}
    assert parse({"stuck_after_ms": 1_000, "reap_interval_ms": 100}, short
                 ).scheduler.stuck_after_ms == 1_000
    with pytest.raises(ConfigError, match=r"scheduler\.stuck_after_ms: must be 0 \(off\) or at "
                                          r"least 1000, got 999"):
        parse({"stuck_after_ms": 999})
    with pytest.raises(ConfigError, match=r"stuck_after_ms: must be >= 0"):
        parse({"stuck_after_ms": -1})
    # The defaults' lease (10 s) and reap interval (1 s): a dead gateway's tasks stay 11 s.
    with pytest.raises(ConfigError, match=r"scheduler\.stuck_after_ms: must be above "
                                          r"gateway\.lease_ttl_ms \+ scheduler\.reap_interval_ms "
                                          r"\(11000\), or 0, got 11000"):
        parse({"stuck_after_ms": 11_000})
    assert parse({"stuck_after_ms": 11_001}).scheduler.stuck_after_ms == 11_001


async def test_failed_scrapes_eject_a_node_for_the_failures_not_as_stuck(
    redis_client: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Scrapes that fail say nothing of the engine (a network split, a slow /metrics): the
    node is ejected for them, and judged stuck only once a good reading shows its page
    unchanged for stuck_after_ms; both are logged, as the reason changes."""
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.pool")
    ticks = await _ticks(redis_client, redis_url, {"n1": busy(), "n2": busy()}, [
        (1.0, {"n1": {"status": 503}}),
        *[(1.0, {"n2": {"generation_tokens": 400.0 + 10 * i}}) for i in range(1, 9)],
        (1.0, {"n1": {"status": 200}, "n2": {"generation_tokens": 500.0}}),
    ])
    assert [t["reasons"]["n1"] for t in ticks] == ["", "stale", "stale"] + ["ejected"] * 7 + [
        "stuck"]
    assert [t["stuck_gauge"]["n1"] for t in ticks] == [0] * 10 + [1]
    lines = [r.getMessage() for r in caplog.records if "n1" in r.getMessage()]
    assert [line.split(":")[1].strip() for line in lines] == [
        "node n1 ejected after 3 failed scrapes in a row (last", "node n1 ejected as stuck"]


async def test_a_new_leader_keeps_a_node_published_stuck_out_until_its_page_changes(
    redis_client: Any, redis_url: str
) -> None:
    frozen_node, idle_node = busy(), busy()
    async with stuck_pool(redis_client, redis_url, {"n1": frozen_node, "n2": idle_node}) as (
            ps, clock):
        await clock.hold_task("n1")
        await clock.hold_task("n2")
        await ps.tick(1, always)
        await clock.advance(STUCK_AFTER_MS / 1000)
        result = await ps.tick(1, always)
        assert {p.name: p.reason for p in result.plans} == {"n1": "stuck", "n2": "stuck"}
        ps.new_term()  # another replica leads: it has read neither node yet
        idle_node.running = 0
        result = await ps.tick(2, always)
        assert {p.name: p.reason for p in result.plans} == {"n1": "stuck", "n2": ""}
        assert (await state(ps.store))["nodes_out"] == "n1:stuck"
        frozen_node.generation_tokens = 401.0
        await clock.advance(0.05)
        result = await ps.tick(2, always)
        assert {p.name: p.reason for p in result.plans} == {"n1": "", "n2": ""}
        # Not published stuck: a new term judges it afresh, in until stuck_after_ms.
        ps.new_term()
        result = await ps.tick(3, always)
        assert {p.name: p.reason for p in result.plans} == {"n1": "", "n2": ""}
        await clock.advance(STUCK_AFTER_MS / 1000)
        result = await ps.tick(3, always)
        assert {p.name: p.reason for p in result.plans} == {"n1": "stuck", "n2": ""}


def two_engines(first: FakeVllm, second: FakeVllm) -> bytes:
    """One data-parallel server's page: `first` as engine 0, `second` as engine 1."""
    other = [line.replace('engine="0"', 'engine="1"') for line in second.render().splitlines()
             if not line.startswith("#") and "cache_config_info" not in line]
    return (first.render() + "\n".join(other) + "\n").encode()


async def test_one_hung_engine_of_a_data_parallel_server_makes_the_node_stuck(
    redis_client: Any, redis_url: str
) -> None:
    hung, moving = busy(), busy()
    server = FakeVllm(body=two_engines(hung, moving))

    def step(tokens: float, hung_tokens: float = 400.0) -> dict[str, dict[str, Any]]:
        moving.generation_tokens, hung.generation_tokens = tokens, hung_tokens
        return {"n1": {"body": two_engines(hung, moving)}}

    m = parse_vllm_metrics(server.body.decode() if server.body else "")
    assert [(e.engine, e.busy) for e in m.engines] == [("0", True), ("1", True)]
    assert m.running == 4
    ticks = await _ticks(redis_client, redis_url, {"n1": server}, [
        (2.5, step(500.0)), (2.5, step(600.0)), (1.0, step(700.0, hung_tokens=401.0)),
    ])
    assert [t["reasons"]["n1"] for t in ticks] == ["", "", "stuck", ""]


async def test_a_page_that_counts_requests_kvgate_does_not_hold_is_not_stuck(
    redis_client: Any, redis_url: str
) -> None:
    """vLLM's page can keep counting requests that were all aborted, with no step to correct
    it (an idle engine takes none). Without a task of kvgate's released there long enough
    ago, such a node is left in: judged stuck, it would get no work and never change."""
    ticks = await _ticks(redis_client, redis_url, {"n1": busy()}, [(60.0, {})], tasks_on=())
    assert [t["reasons"]["n1"] for t in ticks] == ["", ""]


async def test_once_stuck_a_node_stays_out_after_kvgate_s_tasks_there_end(
    redis_client: Any, redis_url: str
) -> None:
    """The gateways end the tasks a stuck node holds: the node must stay out while its page
    stays frozen, not come back to take new work and hold it."""
    async with stuck_pool(redis_client, redis_url, {"n1": busy()}) as (ps, clock):
        await clock.hold_task("n1")
        await ps.tick(1, always)
        await clock.advance(STUCK_AFTER_MS / 1000)
        assert [p.reason for p in (await ps.tick(1, always)).plans] == ["stuck"]
        await redis_client.delete(ps.store.keys.running)  # the gateways ended them
        for _ in range(3):
            await clock.advance(1.0)
            assert [p.reason for p in (await ps.tick(1, always)).plans] == ["stuck"]


async def test_the_task_must_be_as_old_as_the_stillness(redis_client: Any, redis_url: str) -> None:
    async with stuck_pool(redis_client, redis_url, {"n1": busy()}) as (ps, clock):
        reasons = [(await ps.tick(1, always)).plans[0].reason]
        await clock.advance(4.0)
        await clock.hold_task("n1")
        for seconds in (1.0, 3.0, 0.9, 0.1):
            await clock.advance(seconds)
            reasons.append((await ps.tick(1, always)).plans[0].reason)
    # Still from 0 s; the task released at 4 s is old enough at 9 s, not before.
    assert reasons == ["", "", "", "", "stuck"]


async def test_a_stuck_node_whose_scrapes_fail_stays_stuck_until_its_page_changes(
    redis_client: Any, redis_url: str
) -> None:
    ticks = await _ticks(redis_client, redis_url, {"n1": busy()}, [
        (5.0, {}), (1.0, {"n1": {"status": 503}}), (1.0, {}), (1.0, {}), (1.0, {}),
        (1.0, {"n1": {"status": 200}}), (1.0, {"n1": {"generation_tokens": 401.0}}),
    ])
    assert [t["reasons"]["n1"] for t in ticks] == ["", "stuck"] + ["stuck"] * 5 + [""]


async def test_no_node_is_judged_while_the_reaper_is_held_back(
    redis_client: Any, redis_url: str
) -> None:
    """After Redis failures the reaper waits a lease: a dead gateway's tasks may stay in the
    running index past stuck_after_ms, and must not make a node look stuck."""
    async with stuck_pool(redis_client, redis_url, {"n1": busy()}) as (ps, clock):
        await clock.hold_task("n1")
        allowed = False
        ps.may_judge_stuck = lambda: allowed
        await ps.tick(1, always)
        await clock.advance(STUCK_AFTER_MS / 1000)
        assert [p.reason for p in (await ps.tick(1, always)).plans] == [""]
        allowed = True
        assert [p.reason for p in (await ps.tick(1, always)).plans] == ["stuck"]


def test_a_new_leader_that_read_a_node_before_learning_it_was_stuck_keeps_it_out() -> None:
    """A scrape begun in the earlier term may end before the new leader reads nodes_out."""
    watch = StuckWatch(5.0)
    page = parse_vllm_metrics(busy().render())
    watch.reading("n1", page, 100.0)
    watch.inherit(["n1"])
    still = watch.still_s("n1", page, 100.0)
    assert still == 5.0 and watch.stuck("n1", still)
    watch.reading("n1", parse_vllm_metrics(busy(generation_tokens=401.0).render()), 100.05)
    assert not watch.stuck("n1", watch.still_s("n1", page, 100.05))


def test_a_figure_that_is_not_a_number_is_left_out_of_the_engine_s_figures() -> None:
    page = parse_vllm_metrics(FakeVllm(usage=0.3, running=2, prompt_tokens=math.nan,
                                       generation_tokens=400.0).render())
    [engine] = page.engines
    assert "vllm:prompt_tokens_total" not in dict(engine.figures)
    watch = StuckWatch(5.0)
    watch.reading("n1", page, 100.0)
    watch.reading("n1", page, 106.0)
    assert watch.still_s("n1", page, 106.0) == 6.0


async def test_without_the_running_index_read_the_old_tasks_are_read_for_the_candidates(
    redis_client: Any, redis_url: str
) -> None:
    """With the final projection and the release control off, the tick does not read the
    running index: the nodes holding old tasks are read from Redis, at most once a second."""
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_fake(busy()))
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"stuck_after_ms": STUCK_AFTER_MS},
                             zones={"projection": "final"}, gateway=SHORT_LEASE)
        clock = PoolClock(redis_client, None)
        ps = await stack.enter_async_context(
            pool_scheduler(redis_client, config, clock=clock.local))
        clock.store = ps.store
        await clock.start()
        await ps.tick(1, always)
        await clock.advance(STUCK_AFTER_MS / 1000)
        assert [p.reason for p in (await ps.tick(1, always)).plans] == [""]  # no task there
        await clock.advance(0.5)
        await clock.hold_task("n1")
        # Held now: not old enough yet.
        assert [p.reason for p in (await ps.tick(1, always)).plans] == [""]
        await clock.advance(STUCK_AFTER_MS / 1000)
        assert [p.reason for p in (await ps.tick(1, always)).plans] == ["stuck"]


async def test_a_node_whose_page_moves_during_the_read_is_not_judged() -> None:
    fake = busy()
    async with one_node_poller(fake, timeout_s=1.0, eject_after=3) as (poller, _):
        poller.stuck_watch = StuckWatch(0.0001)
        views = await poller.poll(1.0)
        views = await poller.poll(1.0)
        assert views[0].still_s > 0

        async def moved_meanwhile(nodes: set[str], age_s: float) -> dict[str, float]:
            fake.generation_tokens = 401.0
            await poller.poll(1.0)  # a scrape that ends while the tick reads Redis
            return {"n1": 0.0}

        judged = await poller.judge_stuck(views, moved_meanwhile)
        assert not judged[0].stuck and not judged[0].ejected

        async def still_meanwhile(nodes: set[str], age_s: float) -> dict[str, float]:
            await poller.poll(1.0)
            return {"n1": 0.0}

        await poller.poll(1.0)
        judged = await poller.judge_stuck(await poller.poll(1.0), still_meanwhile)
        assert judged[0].stuck and judged[0].ejected  # unchanged: judged


async def test_a_node_whose_scrapes_fail_does_not_hold_back_the_judgement_of_others(
    redis_client: Any, redis_url: str
) -> None:
    """n1's page shows requests no task of kvgate's stands behind, and its scrapes then fail:
    its stillness, measured to its last good reading, must not lengthen the age n2's tasks
    need."""
    failing, hung = busy(), busy()
    after_s = STUCK_AFTER_MS / 1000
    async with stuck_pool(redis_client, redis_url, {"n1": failing, "n2": hung}) as (
            ps, clock):
        await ps.tick(1, always)
        await clock.advance(after_s)
        # n1 still for after_s, with no task of kvgate's; n2 takes a task and a last step.
        await clock.hold_task("n2")
        hung.generation_tokens = 401.0
        await ps.tick(1, always)
        failing.status = 500
        await clock.advance(after_s)
        reasons = {p.name: p.reason for p in (await ps.tick(1, always)).plans}
    assert reasons == {"n1": "stale", "n2": "stuck"}
