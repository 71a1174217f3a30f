"""The burst experiment's parts: schedule, prompt sizes, FIFO limiter, load generator, report."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import random
import time
import tomllib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

from admission.config import DedicatedNodes, EngineSettings, ZoneSettings, parse_config
from admission.configschema import DEFAULT_TIERS
from admission.controlconfig import ControlSettings
from admission.keys import PoolKeys
from admission.scripts import register_scripts
from admission.store import PoolStore
from admission.tiers import Tier, Zone
from bench.burst.arm import ArmResult
from bench.burst.criteria import judge_all
from bench.burst.expconfig import POOL, PRESETS, Settings, kvgate_toml, with_overrides
from bench.burst.experiment import setup_section
from bench.burst.fifo_proxy import FifoLimiter
from bench.burst.loadgen import FAILED, OK, REJECTED, ClientSettings, LoadGenerator, Outcome
from bench.burst.monitor import NodeSample, Sample, parse_metrics, redis_queues
from bench.burst.report import markdown_table, summarize
from bench.burst.workload import (
    DEFAULT_CLASSES,
    PlannedRequest,
    Scale,
    Schedule,
    burst_profile,
    plan,
    prompt_text,
)
from bench.common.openloop import FULL_COLLECTIONS_DEFERRED, LoopLag, quiet_collector
from bench.common.stats import bootstrap_ratio_range
from bench.sim.config import SimConfig
from bench.sim.metrics import make_registry, render
from bench.sim.runner import NodeRunner
from bench.sim.tokens import chat_prompt_tokens
from gateway.estimator import load_tokenizer
from kvgate_client.policy import RetryPolicy

# -- schedule --------------------------------------------------------------------------------


def test_plan_is_seeded_and_poisson_rates_hold() -> None:
    profile = burst_profile(100.0, 100.0, 100.0, factor=4.0)
    scale = Scale(nodes=4, capacity_scale=0.5, time_scale=2.0)
    first = plan(profile, DEFAULT_CLASSES, scale, seed=7)
    assert plan(profile, DEFAULT_CLASSES, scale, seed=7).requests == first.requests
    assert plan(profile, DEFAULT_CLASSES, scale, seed=8).requests != first.requests
    assert [r.index for r in first.requests] == list(range(len(first.requests)))
    assert all(a.at <= b.at for a, b in zip(first.requests, first.requests[1:], strict=False))
    for klass in DEFAULT_CLASSES:
        for lo, hi, factor in ((0, 100, 1.0), (100, 200, 4.0 if klass.burst else 1.0)):
            n = sum(1 for r in first.requests if r.klass == klass.name and lo <= r.at < hi)
            expected = scale.wall_rate(klass.rate * factor) * 100
            # Poisson: the count is within 5 standard deviations of its mean.
            assert abs(n - expected) <= 5 * math.sqrt(expected), (klass.name, lo, n, expected)
    for r in first.requests:
        klass = next(c for c in DEFAULT_CLASSES if c.name == r.klass)
        assert klass.prompt.lo <= r.prompt_tokens <= klass.prompt.hi
        assert klass.output.lo <= r.output_tokens <= klass.output.hi


@pytest.mark.parametrize("tokens", [11, 12, 300, 8000])
def test_prompt_sizes_agree_between_simulator_and_gateway_tokenizer(tokens: int) -> None:
    text = prompt_text(tokens)
    assert chat_prompt_tokens([text]) == tokens
    # The gateway's Qwen2 tokenizer sees one token per word; the template adds its own.
    assert len(load_tokenizer().encode(text).ids) == tokens - 10


# -- FIFO limiter ----------------------------------------------------------------------------


async def test_fifo_limiter_is_first_come_first_served_per_node_cap() -> None:
    limiter = FifoLimiter(["http://a", "http://b"], max_inflight=1)
    assert {await limiter.acquire("vip"), await limiter.acquire("vip")} == {0, 1}
    order: list[str] = []

    async def wait(name: str) -> int:
        node = await limiter.acquire(name)
        order.append(name)
        return node

    first = asyncio.create_task(wait("batch"))
    second = asyncio.create_task(wait("normal"))
    leaver = asyncio.create_task(wait("gone"))
    third = asyncio.create_task(wait("vip"))
    await asyncio.sleep(0)
    assert limiter.queued_by_tier() == {"batch": 1, "normal": 1, "gone": 1, "vip": 1}
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    limiter.release(1)
    assert await first == 1
    limiter.release(0)
    assert await second == 0
    limiter.release(1)
    assert await third == 1
    # A VIP that came last waited for everyone before it: no tiers in a FIFO.
    assert order == ["batch", "normal", "vip"]
    assert limiter.inflight == [1, 1] and not limiter.queue


# -- load generator --------------------------------------------------------------------------


class _Stub:
    """An OpenAI-ish endpoint: 429 for the first ``reject`` attempts of each request id."""

    def __init__(self, reject: int, first_chunk_delay: float) -> None:
        self.reject = reject
        self.delay = first_chunk_delay
        self.seen: dict[str, list[float]] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        key = request.headers["Authorization"] + body["messages"][0]["content"][:40]
        attempts = self.seen.setdefault(key, [])
        attempts.append(time.perf_counter())
        if len(attempts) <= self.reject:
            return web.Response(status=429, headers={"retry-after-ms": "120", "Retry-After": "1"},
                                body=b'{"error": {"code": "capacity_exceeded"}}')
        n = int(request.headers["X-Sim-Output-Tokens"])
        assert body["max_tokens"] == n
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.delay)
        chunk = {"choices": [{"delta": {"content": " the"}, "index": 0}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": n}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        return resp


async def _serve(stub: _Stub) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", stub.handle)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _request(index: int, klass: str, tier: Tier, at: float) -> PlannedRequest:
    return PlannedRequest(index, klass, tier, at, prompt_tokens=50 + index, output_tokens=7,
                          stream=True)


async def _run(stub: _Stub, schedule: Schedule) -> LoadGenerator:
    clients = {
        "vip": ClientSettings("k-vip", None),
        "normal": ClientSettings("k-normal", RetryPolicy(base_delay_s=0.05, max_delay_s=0.1)),
    }
    async for url in _serve(stub):
        gen = LoadGenerator(schedule, [url], "m", clients, seed=1)
        async with aiohttp.ClientSession() as session:
            await gen.run(session, time.perf_counter())
            async with asyncio.timeout(10):
                await gen.wait_idle()
    return gen


async def test_vip_is_not_retried_and_normal_retries_no_sooner_than_the_hint() -> None:
    stub = _Stub(reject=1, first_chunk_delay=0.0)
    gen = await _run(stub, Schedule([_request(0, "vip", Tier.VIP, 0.0),
                                     _request(1, "normal", Tier.NORMAL, 0.0)]))
    vip, normal = gen.outcomes
    assert (vip.status, vip.attempts, vip.rejections) == (REJECTED, 1, 1)
    assert vip.ttft is None and vip.finished
    assert (normal.status, normal.attempts, normal.rejections) == (OK, 2, 1)
    assert normal.completion_tokens == 7
    times = next(v for k, v in stub.seen.items() if k.startswith("Bearer k-normal"))
    assert times[1] - times[0] >= 0.120  # retry-after-ms is a floor, jitter only adds
    counters = gen.stats.tiers
    assert (counters[Tier.VIP].failed, counters[Tier.NORMAL].ok) == (1, 1)
    assert counters[Tier.NORMAL].rejected_responses == 1
    assert len(gen.stats.rejected) == 2 and len(gen.stats.admitted) == 1


async def test_ttft_counts_from_the_intended_send_time() -> None:
    stub = _Stub(reject=0, first_chunk_delay=0.08)
    gen = await _run(stub, Schedule([_request(0, "vip", Tier.VIP, 0.05)]))
    (out,) = gen.outcomes
    assert out.status == OK
    assert out.ttft is not None and 0.08 <= out.ttft < 1.0
    assert out.sent_at is not None and out.sent_at >= 0.05


async def test_a_stream_cut_short_is_a_failure() -> None:
    async def short(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", short)
    server = TestServer(app)
    await server.start_server()
    try:
        gen = LoadGenerator(Schedule([_request(0, "vip", Tier.VIP, 0.0)]),
                            [str(server.make_url("")).rstrip("/")], "m",
                            {"vip": ClientSettings("k", None)})
        async with aiohttp.ClientSession() as session:
            await gen.run(session, time.perf_counter())
            async with asyncio.timeout(10):
                await gen.wait_idle()
    finally:
        await server.close()
    assert gen.outcomes[0].status == FAILED
    assert "3/7" in (gen.outcomes[0].error or "")


# -- metrics and report ----------------------------------------------------------------------


def test_parse_metrics_reads_the_simulator_exposition() -> None:
    runner = NodeRunner(SimConfig(capacity_scale=0.1, max_model_len=4096))
    runner.engine.stats.preemptions = 3
    runner.engine.stats.generation_tokens = 1234
    runner.kv_usage_peak = 0.5
    sample = parse_metrics(render(make_registry(runner)).decode())
    assert (sample.preemptions, sample.generation_tokens, sample.kv_peak) == (3, 1234, 0.5)
    assert sample.kv == 0.0 and sample.up


def _outcome(req: PlannedRequest, status: str, ttft: float | None, finished: bool = True
             ) -> Outcome:
    return Outcome(req, status=status, ttft=ttft, finished=finished,
                   done_at=req.at + 1 if finished else None, sent_at=req.at)


def test_report_counts_failures_as_infinitely_slow_and_censors_late_requests() -> None:
    settings: Settings = PRESETS["smoke"]
    b0, b1 = settings.profile.window("burst")
    vip = [_request(i, "vip-chat", Tier.VIP, b0 + 0.01 * i) for i in range(100)]
    outcomes = [_outcome(r, OK, 0.01) for r in vip[:98]]
    outcomes.append(_outcome(vip[98], FAILED, None))
    outcomes.append(_outcome(vip[99], OK, 0.02))
    late = _request(100, "vip-chat", Tier.VIP, b1 + 0.1)
    outcomes.append(_outcome(late, "incomplete", None, finished=False))
    node = NodeSample(kv_peak=0.5)
    samples = [Sample(0.0, [node]), Sample(b1, [node])]
    result = ArmResult(arm="c", settings=settings, outcomes=outcomes, samples=samples,
                       admitted=[], rejected=[], crashed_nodes=0, max_loop_lag_s=0.0,
                       send_lag_max_s=0.0, stopped_at=b1 + 1)
    s = summarize(result, None)
    assert s.counted[Tier.VIP] == 100  # the late, unfinished one is censored
    assert s.success[Tier.VIP] == pytest.approx(0.99)
    p50, p99 = s.vip_ttft_burst
    assert p50 == pytest.approx(0.01 * settings.time_scale * 1000)
    assert p99 == pytest.approx(0.02 * settings.time_scale * 1000)
    assert "VIP P99 TTFT burst / baseline (90% bootstrap range)" in markdown_table([s], None, 1.0)
    outcomes[0] = _outcome(vip[0], FAILED, None)
    assert math.isinf(summarize(result, None).vip_ttft_burst[1])
    # One still in flight past its tier's shipped queue timeout (simulated) has failed its
    # client, whenever it was sent: an arm whose queue holds it to the end gains nothing.
    timeout_s = DEFAULT_TIERS[Tier.VIP].queue_timeout_ms / 1000 / settings.time_scale
    held = dataclasses.replace(result, stopped_at=late.at + timeout_s)
    assert summarize(held, None).counted[Tier.VIP] == 101
    assert summarize(held, None).success[Tier.VIP] == pytest.approx(98 / 101)
    younger = dataclasses.replace(result, stopped_at=late.at + timeout_s * 0.99)
    assert summarize(younger, None).counted[Tier.VIP] == 100
    # One that has its first token is being served (a long answer on a busy node decodes for
    # longer than any queue timeout): not a failure, whatever its age.
    outcomes[-1] = _outcome(late, "incomplete", 0.05, finished=False)
    assert summarize(held, None).counted[Tier.VIP] == 100
    # Gateways whose loops ran late on more than 5% of their probes void the run, as a
    # lagging simulator does: their wall milliseconds count time_scale times in each TTFT.
    assert summarize(result, None).invalid == []
    late_gateways = dataclasses.replace(result, phase_load={
        "calm": {"gateway_late_share": 0.01}, "burst": {"gateway_late_share": 0.12}})
    (why,) = summarize(late_gateways, None).invalid
    assert "gateways' loops ran over 5 ms late in 12.0% of their probes (burst)" in why


def test_the_p99_ratio_comes_with_a_bootstrap_range_that_narrows_with_more_requests() -> None:
    rng = random.Random(3)

    def tail(n: int, scale: float) -> list[float]:
        return [scale * rng.expovariate(1 / 100) for _ in range(n)]

    few = bootstrap_ratio_range(tail(200, 3.0), tail(200, 1.0), 99)
    many = bootstrap_ratio_range(tail(5_000, 3.0), tail(5_000, 1.0), 99, draws=300)
    assert few[0] < 3.0 < few[1] and many[0] < 3.0 < many[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 3
    assert bootstrap_ratio_range([], [1.0], 99) == pytest.approx((math.nan, math.nan),
                                                                 nan_ok=True)
    # Same samples, same range: the report is reproducible.
    base, burst = tail(300, 1.0), tail(300, 2.0)
    assert bootstrap_ratio_range(burst, base, 99) == bootstrap_ratio_range(burst, base, 99)


def test_arm_c_config_keeps_nodes_for_vip_with_guests_as_the_flags_say() -> None:
    def dedicated(**flags: object) -> DedicatedNodes:
        settings = with_overrides(PRESETS["smoke"], **flags)
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        return parse_config(tomllib.loads(text), env={}).pools[POOL].dedicated

    one = dedicated(vip_nodes=1, guest_prompt=2048, max_guests=12)
    assert (one.nodes, one.guest_max_prompt_tokens, one.max_guests_per_node) == (
        ("node-0",), 2048, 12)
    assert dedicated(vip_nodes=1).guest_max_prompt_tokens == 0
    assert dedicated(vip_nodes=1, guest_prompt=512).max_guests_per_node == 32
    assert dedicated(vip_nodes=1, guest_prompt=9000, max_guests=1000,
                     guest_rate=5000).guest_prompt_tokens_per_s == 5000
    assert dedicated(vip_nodes=1, guest_prompt=512).guest_prompt_tokens_per_s == 0
    assert dedicated(vip_nodes=1, guest_prompt=9000,
                     guest_output=1000).guest_max_output_tokens == 1000
    assert dedicated(vip_nodes=1, guest_prompt=512).guest_max_output_tokens == 0
    assert dedicated(vip_nodes=1, guest_prompt=9000,
                     guest_running=64).guest_max_running == 64
    assert dedicated().nodes == ()


def test_arm_c_config_takes_the_zone_flags() -> None:
    def zones(**flags: object) -> ZoneSettings:
        settings = with_overrides(PRESETS["smoke"], **flags)
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        return parse_config(tomllib.loads(text), env={}).pools[POOL].zones

    assert zones(batch_ceiling=0.5).batch_ceiling == 0.5
    assert zones(vip_ceiling=0.84).vip_ceiling == 0.84
    assert zones(yellow=0.75).yellow == 0.75
    assert zones(kv_target=0.79).kv_target == 0.79
    assert zones() == ZoneSettings()


def test_arm_c_keeps_the_shipped_queue_timeouts_on_the_lab_clock() -> None:
    """VIP and Normal wait in the queue as long as the shipped defaults let them, in simulated
    time (a request held longer would be refused at a real scale); Batch the whole window."""
    def tiers(time_scale: float) -> dict[Tier, int]:
        settings = with_overrides(PRESETS["smoke"], time_scale=time_scale)
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        config = parse_config(tomllib.loads(text), env={})
        return {t: s.queue_timeout_ms for t, s in config.tiers.items()}

    assert tiers(1.0) == {Tier.VIP: DEFAULT_TIERS[Tier.VIP].queue_timeout_ms,
                          Tier.NORMAL: DEFAULT_TIERS[Tier.NORMAL].queue_timeout_ms,
                          Tier.BATCH: 5_000}
    assert tiers(8.0) == {Tier.VIP: 3_750, Tier.NORMAL: 7_500, Tier.BATCH: 5_000}


def test_arm_c_runs_the_shipped_control_converted_to_the_lab_clock() -> None:
    """A reduced-scale node runs time_scale times faster with capacity_scale of the throughput:
    the objective is the shipped one in the node's own time, nothing else changes."""
    def control(settings: Settings) -> ControlSettings:
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        return parse_config(tomllib.loads(text), env={}).pools[POOL].control

    shipped = ControlSettings()
    assert control(with_overrides(PRESETS["smoke"], time_scale=1.0, capacity_scale=1.0)) \
        == shipped
    lab = control(with_overrides(PRESETS["smoke"], time_scale=8.0, capacity_scale=0.25))
    assert lab.vip_ttft_objective_ms == round(shipped.vip_ttft_objective_ms / 8)
    assert lab.prefill_tokens_per_s == shipped.prefill_tokens_per_s * 2
    # The window the model derives (rate x objective) is a quarter of a real node's, as its
    # throughput is: the same time of prefill ahead of a VIP chat.
    assert lab.prefill_tokens_per_s * lab.vip_ttft_objective_ms == pytest.approx(
        shipped.prefill_tokens_per_s * shipped.vip_ttft_objective_ms / 4, rel=0.02)
    assert (lab.window_min_tokens, lab.window_max_tokens) == (
        shipped.window_min_tokens // 4, shipped.window_max_tokens // 4)
    assert (lab.enabled, lab.max_engine_running, lab.vip_miss_target, lab.quiet_nodes) == (
        shipped.enabled, shipped.max_engine_running, shipped.vip_miss_target,
        shipped.quiet_nodes)


def test_an_explored_vip_objective_is_converted_to_the_lab_clock_as_the_default_is() -> None:
    def objective(settings: Settings) -> int:
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        return parse_config(tomllib.loads(text), env={}).pools[POOL].control.vip_ttft_objective_ms

    full = with_overrides(PRESETS["smoke"], time_scale=1.0, capacity_scale=1.0)
    assert objective(with_overrides(full, vip_ttft_objective_ms=120)) == 120
    lab = with_overrides(PRESETS["smoke"], time_scale=8.0, capacity_scale=0.25)
    assert objective(with_overrides(lab, vip_ttft_objective_ms=120)) == 15


def test_explored_lane_settings_reach_arm_c_at_both_scales() -> None:
    def control(settings: Settings) -> tuple[int, float, int, bool, int]:
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        c = parse_config(tomllib.loads(text), env={}).pools[POOL].control
        return c.lane_nodes, c.lane_slowdown, c.lane_output, c.lane_on_miss, c.quiet_nodes

    shipped = ControlSettings()
    for scale, speed in ((1.0, 1.0), (0.25, 8.0)):
        base = with_overrides(PRESETS["smoke"], time_scale=speed, capacity_scale=scale)
        assert control(base) == (shipped.lane_nodes, shipped.lane_slowdown,
                                 shipped.lane_output, shipped.lane_on_miss, shipped.quiet_nodes)
        explored = dataclasses.replace(base, lane_nodes=1, lane_slowdown=1.5, lane_output=1024,
                                       lane_on_miss=True, quiet_nodes=0)
        assert control(explored) == (1, 1.5, 1024, True, 0)


def test_arm_c_runs_the_shipped_engine_timings_converted_to_the_lab_clock() -> None:
    """The projection's prefill allowance is wall time per prompt token: a k-slice on a clock
    time_scale times faster takes 1 / (k x time_scale) of it; the dispatch hop is wall time."""
    def engine(settings: Settings) -> EngineSettings:
        text = kvgate_toml(settings, "redis://127.0.0.1:1/0", ["http://a", "http://b"], 9, 5.0)
        return parse_config(tomllib.loads(text), env={}).pools[POOL].engine

    shipped = EngineSettings()
    assert engine(with_overrides(PRESETS["smoke"], time_scale=1.0, capacity_scale=1.0)) \
        == shipped
    lab = engine(with_overrides(PRESETS["smoke"], time_scale=8.0, capacity_scale=0.25))
    assert lab.prefill_us_per_token == round(shipped.prefill_us_per_token / 2)
    assert lab.dispatch_ms == shipped.dispatch_ms


def test_the_report_names_the_zone_settings_an_arm_changed() -> None:
    """A result file read without its command line must still say which zones it ran with."""
    def arm_c(**flags: object) -> str:
        lines = setup_section(with_overrides(PRESETS["smoke"], **flags))
        return next(line for line in lines if line.startswith("- (c)"))

    assert "except" not in arm_c()
    changed = arm_c(yellow=0.8, kv_target=0.79, batch_ceiling=0.77)
    assert "except `zones.kv_target = 0.79`, `zones.yellow = 0.8`, " \
        "`zones.batch_ceiling = 0.77`" in changed


async def test_the_kvgate_timeline_keeps_what_the_leader_published(
        redis_url: str, redis_client: aioredis.Redis) -> None:
    """Each sample of the kvgate arm holds the pool's published state, budgets, reservations
    and counters as Redis has them, so a release can be read against its projection."""
    text = kvgate_toml(PRESETS["smoke"], redis_url, ["http://a", "http://b"], 9, 5.0)
    policy = parse_config(tomllib.loads(text), env={}).pool_policy(POOL)
    store = PoolStore(redis_client, register_scripts(redis_client), POOL, policy)
    await store.publish_state(3, Zone.YELLOW, {"node-0": 1000, "node-1": 2000},
                              {"projected:node-1": "0.7100", "usage_ratio": "0.9800"})
    keys = PoolKeys(POOL)
    await redis_client.hset(keys.node_reserved, mapping={"node-0": 400})
    await redis_client.hset(keys.stats, mapping={"released_2": 17})
    await redis_client.zadd(keys.queue(Tier.BATCH), {"t1": 1.0, "t2": 2.0})
    await redis_client.hset(keys.held_by, mapping={"batch": "kv=2", "batch:task": "t1"})
    reading = await redis_queues(redis_client, POOL)()
    assert reading.queues == {"vip": 0, "normal": 0, "batch": 2}
    assert reading.zone == Zone.YELLOW.value
    published = reading.scheduler
    assert published["projected:node-1"] == "0.7100" and published["usage_ratio"] == "0.9800"
    assert (published["budget:node-0"], published["budget:node-1"]) == ("1000", "2000")
    assert published["reserved:node-0"] == "400" and "reserved:node-1" not in published
    assert published["stats:released_2"] == "17"
    assert (published["held_by:batch"], published["held_by:batch:task"]) == ("kv=2", "t1")


def test_an_arm_whose_vip_verdict_turns_on_the_load_generators_stalls_is_invalid() -> None:
    settings: Settings = PRESETS["smoke"]
    b0, b1 = settings.profile.window("burst")
    calm = [_request(i, "vip-chat", Tier.VIP, 0.5 + 0.01 * i) for i in range(100)]
    burst = [_request(100 + i, "vip-chat", Tier.VIP, b0 + 0.04 * i) for i in range(100)]
    outcomes = [_outcome(r, OK, 0.01) for r in calm + burst]
    node = NodeSample(kv_peak=0.5)
    samples = [Sample(0.0, [node]), Sample(b1, [node])]
    result = ArmResult(arm="a", settings=settings, outcomes=outcomes, samples=samples,
                       admitted=[], rejected=[], crashed_nodes=0, max_loop_lag_s=0.0,
                       send_lag_max_s=0.0, stopped_at=99.5,
                       client_lag=[0.001] * 100 + [0.5])
    # Two burst VIP requests waited 300 ms for their first token, in the second the load
    # generator stood still for 300 ms: they make the P99.
    stalled_at = {int(burst[k].at) for k in (50, 51)}
    for k in (50, 51):
        outcomes[100 + k] = _outcome(burst[k], OK, 0.3)
    quiet = summarize(result, None)
    judge_all([quiet], settings.burst_sim_s, settings.drain_factor)
    # The last second, after the load's end (the arm cancelling what is left), is not judged.
    assert not quiet.invalid and quiet.client_lag_ms[1:] == (1.0, 0, 200)
    assert quiet.vip_p99_steady[1] == quiet.vip_ttft_burst[1]
    for second in stalled_at:
        result.client_lag[second] = 0.3
    stalled = summarize(result, None)
    assert stalled.client_lag_ms[1] == pytest.approx(300)
    touched = sum(any(int(o.req.at) <= sec <= int(o.req.at + (o.ttft or 0))
                      for sec in stalled_at) for o in outcomes)
    assert stalled.client_lag_ms[2:] == (touched, 200)
    assert stalled.vip_p99_steady[1] < stalled.vip_ttft_burst[1]
    assert not stalled.invalid  # two seconds of a hundred: no lagging share
    judge_all([stalled], settings.burst_sim_s, settings.drain_factor)
    assert len(stalled.invalid) == 1 and "load generator's stalls" in stalled.invalid[0]
    judge_all([stalled], settings.burst_sim_s, settings.drain_factor)
    assert len(stalled.invalid) == 1  # judged again, marked once
    assert "load generator's loop" in markdown_table([stalled], None, 1.0)
    # Stalls that do not change the verdict leave the arm valid.
    result.outcomes = [_outcome(r, OK, 0.01) for r in calm + burst]
    harmless = summarize(result, None)
    judge_all([harmless], settings.burst_sim_s, settings.drain_factor)
    assert harmless.client_lag_ms[2] > 0 and not harmless.invalid


def test_the_loop_lag_probe_sees_a_blocked_loop_in_the_seconds_it_covered() -> None:
    lag = LoopLag(interval_s=0.001)

    async def scenario() -> None:
        stop = asyncio.Event()
        t0 = time.perf_counter()
        probe = asyncio.create_task(lag.run(t0, stop))
        await asyncio.sleep(0.01)
        time.sleep(0.08)  # noqa: ASYNC251 - holds the loop, as a full collection does
        await asyncio.sleep(0.01)
        stop.set()
        await probe

    asyncio.run(scenario())
    assert max(lag.per_second) >= 0.07
    lag.record(2.5, 0.02)
    assert len(lag.per_second) == 3 and lag.per_second[2] == 0.02
    lag.record(-1.0, 5.0)  # before the start: not part of the run
    assert max(lag.per_second) < 5.0


def test_the_quiet_collector_freezes_what_exists_and_defers_full_collections() -> None:
    before = gc.get_threshold()
    kept = [[i] for i in range(1000)]
    with quiet_collector():
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold()[2] == FULL_COLLECTIONS_DEFERRED
        assert gc.get_threshold()[:2] == before[:2]
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
