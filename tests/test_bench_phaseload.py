"""bench.burst.phaseload: the gateways' loop-lag histogram read off their /metrics pages (two
real servers over loopback), and each phase's cores and lateness from two snapshots."""

from __future__ import annotations

import dataclasses
import math

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.exposition import generate_latest

from admission.tiers import Tier
from bench.burst.criteria import validity
from bench.burst.phaseload import (
    Snapshot,
    describe,
    full_gcs,
    lag_buckets,
    phase_load,
    read_pages,
    summed_full_gcs,
    summed_lag,
)
from bench.burst.report import ArmSummary
from gateway.metrics import GatewayMetrics

PAGE = web.AppKey("page", bytes)


def _page(*lags: float) -> bytes:
    metrics = GatewayMetrics()
    for lag in lags:
        metrics.loop_lag.observe(lag)
    return generate_latest(metrics.registry)


def test_the_buckets_are_read_cumulative_from_a_gateways_page() -> None:
    buckets = lag_buckets(_page(0.0005, 0.003, 0.02).decode())
    assert (buckets[0.001], buckets[0.005], buckets[0.05], buckets[math.inf]) == (1, 2, 3, 3)


def test_a_phase_counts_only_what_happened_between_its_snapshots() -> None:
    start = Snapshot(10.0, {"sims": 4.0, "gateways": 1.0},
                     {0.001: 50, 0.005: 60, 0.02: 60, math.inf: 60})
    # 100 probes in the phase: 80 within 1 ms, 10 more within 5 ms, 9 within 20 ms, 1 past it.
    end = Snapshot(20.0, {"sims": 9.0, "gateways": 4.0, "redis": 0.5},
                   {0.001: 130, 0.005: 150, 0.02: 159, math.inf: 160})
    load = phase_load(start, end)
    assert load["cores:sims"] == 0.5 and load["cores:gateways"] == 0.3
    assert load["cores:redis"] == 0.05  # started after the first snapshot: from 0
    assert load["gateway_probes"] == 100
    assert load["gateway_late_share"] == 0.1
    assert load["gateway_lag_p99_ms"] == 20.0
    assert end.lag is not None
    end_slow = Snapshot(20.0, end.cpu, {**end.lag, math.inf: 170})
    assert phase_load(start, end_slow)["gateway_lag_p99_ms"] == math.inf
    assert "gateway_probes" not in phase_load(start, Snapshot(20.0, end.cpu, None))
    (line,) = describe({"burst": load})
    assert line.startswith("burst: cores gateways 0.30, redis 0.05, sims 0.50; gateways' loops")
    assert "garbage" not in line and "gateway_full_gcs" not in load  # not read: not reported
    # The full collections of the phase, when both snapshots read them.
    collected = phase_load(dataclasses.replace(start, full_gc=(3.0, 0.25)),
                           dataclasses.replace(end, full_gc=(5.0, 0.4)))
    assert collected["gateway_full_gcs"] == 2
    assert collected["gateway_full_gc_ms"] == pytest.approx(150.0)
    (line,) = describe({"burst": collected})
    assert line.endswith("; 2 full garbage collections in the gateways, 150 ms in all")


def test_full_collections_are_read_from_a_gateways_page_and_summed() -> None:
    metrics = GatewayMetrics()
    full = metrics.gc_pause.labels("2")
    for pause in (0.02, 0.08):
        full.observe(pause)
    metrics.gc_pause.labels("0").observe(0.5)  # young collections are not counted
    page = generate_latest(metrics.registry).decode()
    assert full_gcs(page) == pytest.approx((2.0, 0.1))
    assert summed_full_gcs([page, page]) == pytest.approx((4.0, 0.2))
    assert summed_full_gcs([page, "no histogram"]) is None
    assert summed_full_gcs(None) is None and summed_full_gcs([]) is None


async def test_the_gateways_are_summed_and_one_that_does_not_answer_voids_the_reading() -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=request.app[PAGE])

    servers = []
    for page in (_page(0.0005, 0.003), _page(0.02)):
        app = web.Application()
        app[PAGE] = page
        app.router.add_get("/metrics", metrics)
        servers.append(TestServer(app, host="127.0.0.1"))
    for server in servers:
        await server.start_server()
    try:
        urls = [str(s.make_url("")).rstrip("/") for s in servers]
        async with aiohttp.ClientSession() as session:
            lag = summed_lag(await read_pages(session, urls))
            assert lag is not None and (lag[0.001], lag[0.005], lag[math.inf]) == (1, 2, 3)
            assert summed_lag(await read_pages(session, [])) is None
            await servers[1].close()
            assert summed_lag(await read_pages(session, urls)) is None
    finally:
        for server in servers:
            await server.close()


def test_the_validity_line_says_how_busy_the_machine_was_when_it_was_recorded() -> None:
    base = ArmSummary(arm="c", kv_peak=0.5, preemptions=0, crashed_nodes=0,
                      success={t: 1.0 for t in Tier}, counted={t: 10 for t in Tier},
                      vip_ttft_base=(100.0, 150.0), vip_ttft_burst=(120.0, 200.0),
                      last_batch_s=0.0, batch_unfinished=0, goodput=1.0, goodput_ratio=0.9)
    assert "cores busy" not in validity(base)  # older records: the line they were made with
    loaded = dataclasses.replace(base, phase_load={
        "calm": {"cores:sims": 0.2},
        "burst": {"cores:sims": 0.5, "cores:gateways": 0.25, "gateway_late_share": 0.038}})
    assert validity(loaded).endswith(
        "; 0.75 cores busy in the burst, gateways' loops late by over 5 ms in 3.8% of their "
        "probes)")
