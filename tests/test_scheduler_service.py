"""The service as deployed in-process: the app's endpoints, a queued task released and its
gateway woken by the poll loop, and the reaper returning a dead gateway's reservation."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import signal
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from admission.keys import SchedulerKeys
from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore
from admission.tiers import Tier
from bench.common.localredis import LocalRedis, free_port
from scheduler.app import SERVICE, create_app
from scheduler.service import SchedulerService
from tests.gateway_harness import ROOT
from tests.scheduler_stub import (
    FakeVllm,
    admit,
    eventually,
    make_config,
    next_message,
    queue_tasks,
    reserved,
    serve_fake,
)
from tests.test_security import PASSWORD, make_tls_dir


async def test_app_serves_health_and_metrics_and_releases(
    redis_client: Any, redis_url: str
) -> None:
    fake = FakeVllm(usage=0.25, preemptions=2)
    async with serve_fake(fake) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"poll_interval_ms": 20})
        # Queued before any scheduler ran: no budget was published, the fast path cannot fire.
        store = PoolStore(redis_client, register_scripts(redis_client), "p", PoolPolicy())
        await queue_tasks(store, [("q1", Tier.NORMAL, 1_000)])
        # A known epoch: a new leadership takes max(stored + 1, Redis TIME in µs), and this one
        # is above the clock until the year 2096.
        await redis_client.set(SchedulerKeys().epoch, 4_000_000_000_000_000)
        pubsub = redis_client.pubsub()
        await pubsub.subscribe(store.keys.wake_channel("gw"))
        app = create_app(config, me="s1")
        async with TestClient(TestServer(app)) as client:
            service = app[SERVICE]
            message = await next_message(pubsub)
            assert message is not None and message["data"] == b"q1 n1"
            await pubsub.aclose()
            await eventually(lambda: service.ticks >= 1)
            assert service.leading

            health = await (await client.get("/healthz")).json()
            assert health["id"] == "s1" and health["leading"] is True
            assert health["epoch"] == 4_000_000_000_000_001
            assert health["pools"]["p"]["zone"] == "GREEN"
            text = await (await client.get("/metrics")).text()
            for line in ('kvgate_scheduler_leader 1.0', 'kvgate_scheduler_zone{pool="p"} 0.0',
                         'kvgate_scheduler_kv_usage{node="n1",pool="p"} 0.25',
                         'kvgate_scheduler_released_total{pool="p",tier="normal"} 1.0',
                         'kvgate_scheduler_node_preemptions{node="n1",pool="p"} 2.0',
                         'kvgate_scheduler_epoch 4.000000000000001e+15'):
                assert line in text, line
            assert 'kvgate_scheduler_scrape_duration_seconds_count{node="n1",pool="p"}' in text
            assert 'kvgate_scheduler_queue_depth{pool="p",tier="vip"} 0.0' in text
        # The app's cleanup resigned the lease.
        assert await redis_client.get("kvg:{sched}:leader") is None


async def test_reaper_returns_a_dead_gateways_reservation(
    redis_client: Any, redis_url: str
) -> None:
    async with serve_fake(FakeVllm()) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"poll_interval_ms": 20, "reap_interval_ms": 20})
        config = dataclasses.replace(config, gateway=dataclasses.replace(
            config.gateway, lease_ttl_ms=100, renew_interval_ms=50))
        app = create_app(config, me="s1")
        async with TestClient(TestServer(app)):
            service = app[SERVICE]
            await eventually(lambda: service.leading and service.ticks > 1)
            store = service.pools[0].store
            result = await admit(store, "t1", Tier.VIP, 5_000, gateway="doomed")
            assert result.outcome is AdmitOutcome.RELEASED
            assert await reserved(store) == {"n1": 5_000}
            # The gateway never renews its 100 ms lease: it died.
            for _ in range(300):
                if (await store.task("t1") or {}).get("state") == "reaped":
                    break
                await asyncio.sleep(0.01)
            assert (await store.task("t1") or {})["state"] == "reaped"
            assert await reserved(store) == {}


async def test_a_replica_that_stops_leading_stops_exporting_pool_gauges(
    redis_client: Any, redis_url: str
) -> None:
    async with serve_fake(FakeVllm(usage=0.3)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"poll_interval_ms": 20})
        app = create_app(config, me="s1")
        async with TestClient(TestServer(app)) as client:
            service = app[SERVICE]
            await eventually(lambda: service.leading and service.ticks > 1)
            assert 'kvgate_scheduler_kv_usage{node="n1",pool="p"} 0.3' in await (
                await client.get("/metrics")).text()
            assert service.elector is not None
            service.elector.step_down("test")
            service._sync_leader_metrics()
            # Read synchronously: no await lets the elector lead again in between.
            text = generate_latest(service.metrics.registry).decode()
            assert "kvgate_scheduler_kv_usage{" not in text
            assert "kvgate_scheduler_zone{" not in text
            assert "kvgate_scheduler_leader 0.0" in text


def test_reaper_waits_one_lease_after_redis_failed() -> None:
    now = [100.0]
    config = make_config("redis://127.0.0.1:1/0", [{"name": "n1", "url": "http://x"}])
    service = SchedulerService(config, me="s1", clock=lambda: now[0])
    assert service.reaping_allowed("p")
    service._redis_failed_at["p"] = now[0]
    now[0] += config.gateway.lease_ttl_ms / 1000 - 0.001
    assert not service.reaping_allowed("p")
    now[0] += 0.002
    assert service.reaping_allowed("p")


def test_no_node_is_judged_stuck_until_the_reaper_has_had_its_wait_and_a_pass() -> None:
    now = [100.0]
    config = make_config("redis://127.0.0.1:1/0", [{"name": "n1", "url": "http://x"}])
    service = SchedulerService(config, me="s1", clock=lambda: now[0])
    assert service.judging_allowed("p")
    service._redis_failed_at["p"] = now[0]
    now[0] += config.gateway.lease_ttl_ms / 1000
    assert service.reaping_allowed("p") and not service.judging_allowed("p")
    now[0] += config.scheduler.reap_interval_ms / 1000
    assert service.judging_allowed("p")


async def test_stopping_survives_a_lost_cancel() -> None:
    """A loop whose first cancel is swallowed (as Python 3.11's wait_for can) still stops."""
    from scheduler.service import cancel_until_done

    swallowed = 0

    async def loop_that_loses_one_cancel() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    async def failed() -> None:
        raise RuntimeError("boom")

    tasks = [asyncio.ensure_future(loop_that_loses_one_cancel()), asyncio.ensure_future(failed())]
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_until_done(tasks, recancel_s=0.05), 5)
    assert swallowed == 1
    assert tasks[0].cancelled()
    assert isinstance(tasks[1].exception(), RuntimeError)


async def test_https_nodes_signed_by_a_private_ca_are_scraped_with_backend_ca_file(
    redis_client: Any, redis_url: str, tmp_path: Path
) -> None:
    certs = make_tls_dir(tmp_path / "tls")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs / "server.crt", certs / "server.key")
    fake = FakeVllm(usage=0.25)
    async with serve_fake(fake, tls) as url:
        assert url.startswith("https://")
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             scheduler={"poll_interval_ms": 20},
                             pool_extra={"backend_ca_file": str(certs / "ca.crt")})
        service = SchedulerService(config, me="s1")
        await service.start()
        try:
            await eventually(lambda: fake.scrapes >= 1 and service.ticks >= 1)
            state = await redis_client.hgetall("kvg:{p}:state")
            assert state[b"usage:n1"] == b"0.2500"
        finally:
            await service.stop()
        # Without the file the system's CAs do not know ours: the node is never read.
        plain = make_config(redis_url, [{"name": "n1", "url": url}],
                            scheduler={"poll_interval_ms": 20})
        assert plain.backend_ssl_context() is None
        scrapes = fake.scrapes
        service = SchedulerService(plain, me="s2")
        await service.start()
        try:
            await eventually(lambda: service.ticks >= 3 or scrapes < fake.scrapes)
        finally:
            await service.stop()
        assert fake.scrapes == scrapes


async def test_scheduler_process_names_its_redis_and_the_port_it_bound(
    redis_factory: Callable[..., LocalRedis], tmp_path: Path,
) -> None:
    """`python -m scheduler --port 0`: the listening line has the port the system picked (the
    one /healthz answers on), and the start line the Redis in use, never its password."""
    server = redis_factory(password=PASSWORD)
    config = tmp_path / "scheduler.toml"
    config.write_text(f"""
[redis]
url = "redis://127.0.0.1:1/0"   # REDIS_URL below wins

[[pools]]
name = "p"
backends = [{{ name = "n1", url = "http://127.0.0.1:{free_port()}" }}]
""")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler", "--config", str(config), "--port", "0",
        cwd=ROOT, env={**os.environ, "REDIS_URL": server.url},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert process.stderr is not None
    seen: list[str] = []
    try:
        # The service starts (and may lead) before the listening line is logged.
        while not (any("leads with epoch" in line for line in seen)
                   and any("listening on" in line for line in seen)):
            line = await asyncio.wait_for(process.stderr.readline(), 30)
            assert line, seen
            seen.append(line.decode())
        text = "".join(seen)
        assert f"Redis redis://127.0.0.1:{server.port}/0" in text and PASSWORD not in text
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", text)
        assert found is not None and int(found[1]) != 0, text
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{found[1]}/healthz") as answer:
            assert answer.status == 200 and (await answer.json())["leading"] is True
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)


async def test_failed_leadership_calls_are_counted_in_a_metric() -> None:
    """A replica that cannot reach Redis counts every failed acquire (a log line says it once,
    then every 30 s: the counter is what an alert reads)."""
    config = make_config(f"redis://127.0.0.1:{free_port()}/0", [{"name": "n1", "url": "http://x"}],
                         scheduler={"poll_interval_ms": 20})
    service = SchedulerService(config, me="s1")
    await service.start()
    try:
        await eventually(lambda: _leadership_errors(service) >= 2)
        assert not service.leading
    finally:
        await service.stop()


async def test_healthz_says_whether_redis_is_unreachable_or_refuses_the_credentials(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    """A replica with a wrong password answers /healthz 200 (a restart would not repair it)
    but says Redis refused it, and which error; one cut off says unreachable; one that
    leads says ok."""
    server = redis_factory(password=PASSWORD)
    wrong = server.url.replace(PASSWORD, "not-the-password")
    cases = [(wrong, "refused", "AuthenticationError WRONGPASS"),
             (f"redis://127.0.0.1:{free_port()}/0", "unreachable", "ConnectionError"),
             (server.url, "ok", None)]
    for url, state, error in cases:
        config = make_config(url, [{"name": "n1", "url": "http://x"}],
                             scheduler={"poll_interval_ms": 20})
        app = create_app(config, me="s1")
        service = app[SERVICE]
        async with TestClient(TestServer(app)) as client:
            await _settled(service, leading=state == "ok")
            answer = await client.get("/healthz")
            assert answer.status == 200
            health = await answer.json()
            assert health["redis"] == {"state": state, "error": error}, health
            if state != "ok":
                assert PASSWORD not in await answer.text()


async def test_a_lease_lapsed_in_an_outage_is_a_step_down_said_and_counted_at_once(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    """A leader whose renewals stop getting through stops leading by its own clock; that
    step-down was neither logged nor counted in kvgate_scheduler_leadership_changes_total
    until Redis answered again (the metric was synced by the pool loops, which wait while
    the replica is a standby)."""
    server = redis_factory()
    config = make_config(server.url, [{"name": "n1", "url": "http://x"}],
                         scheduler={"poll_interval_ms": 20, "leader_ttl_ms": 300})
    service = SchedulerService(config, me="s1")
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.leader")
    await service.start()
    try:
        await eventually(lambda: service.leading)
        assert _sample(service, "kvgate_scheduler_leadership_changes_total") == 1
        server.stop()
        await eventually(
            lambda: _sample(service, "kvgate_scheduler_leadership_changes_total") == 2)
        assert _sample(service, "kvgate_scheduler_leader") == 0
        assert any("steps down" in r.getMessage() and "lease lapsed" in r.getMessage()
                   for r in caplog.records)
    finally:
        await service.stop()


def _sample(service: SchedulerService, name: str) -> float:
    return service.metrics.registry.get_sample_value(name) or 0.0


async def _settled(service: SchedulerService, *, leading: bool) -> None:
    if leading:
        await eventually(lambda: service.leading)
    else:
        await eventually(lambda: _leadership_errors(service) >= 1)


def _leadership_errors(service: SchedulerService) -> float:
    return _sample(service, "kvgate_scheduler_leadership_errors_total")


async def test_an_unreachable_redis_cluster_is_an_outage_not_the_end_of_the_replica() -> None:
    """redis-py's cluster client raises a cluster none of whose nodes answers as a
    RedisClusterException, which is no RedisError. Caught as RedisError alone it made `start`
    raise (the eviction check) and ended the elector's loop at its first call: a replica that
    only a restart would bring back, and could not start while the cluster was down. It must
    count the failures and keep trying, as for a standalone Redis that does not answer."""
    config = make_config(f"redis://127.0.0.1:{free_port()}/0", [{"name": "n1", "url": "http://x"}],
                         scheduler={"poll_interval_ms": 20, "leader_ttl_ms": 300})
    config = dataclasses.replace(config, redis=dataclasses.replace(config.redis, cluster=True))
    service = SchedulerService(config, me="s1")
    await service.start()
    try:
        await eventually(lambda: _leadership_errors(service) >= 3)
        assert service.ended_loops == [] and not service.leading
        assert service.elector is not None and service.elector.failures >= 3
    finally:
        await service.stop()
