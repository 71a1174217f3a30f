"""A node's /metrics page is read up to a cap (scheduler.scrape.MAX_PAGE_BYTES), enforced while
reading: a larger page is a failed scrape with reason `oversized`, counted, ejecting the node
after `eject_after` in a row like any other failure, and logged once per streak.

Real aiohttp servers on loopback serve the pages: one that never ends (only a reader that
stops at the cap returns before the scrape's timeout), one that declares a length over the cap
and then sends nothing, and the stub vLLM page padded past a small cap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from scheduler.app import SERVICE
from scheduler.app import create_app as scheduler_app
from scheduler.scrape import MAX_PAGE_BYTES, Poller
from tests.gateway_harness import serve_app
from tests.scheduler_stub import FakeVllm, make_config, serve_fake

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PATIENT_S = 30.0
"""A scrape timeout no test reaches: a scrape that ends did so for its own reason."""


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    async with serve_app(app) as url:
        yield url


def poller(url: str, session: aiohttp.ClientSession, errors: list[str | None]) -> Poller:
    config = make_config("redis://x", [{"name": "n1", "url": url}])
    return Poller(config.pools["p"].backends, session, timeout_s=PATIENT_S, stale_after_s=60.0,
                  eject_after=3, on_scrape=lambda node, s, error: errors.append(error),
                  pool="p")


async def test_a_page_that_never_ends_fails_at_the_cap_not_at_the_timeout() -> None:
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        await response.prepare(request)
        line = b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n' * 4096
        try:
            while True:
                await response.write(line)
                sent += len(line)
        except ConnectionResetError:  # the scraper hung up
            return response

    errors: list[str | None] = []
    async with serve(endless) as url, aiohttp.ClientSession() as session:
        scraper = poller(url, session, errors)
        started = time.monotonic()
        view = (await scraper.poll(PATIENT_S))[0]
        took = time.monotonic() - started
        await scraper.close()
    assert errors == ["oversized"]
    assert (view.error, view.stale, view.metrics) == ("oversized", True, None)
    assert sent > MAX_PAGE_BYTES  # the cap itself was reached, not some other limit
    assert took < 1.0, took


async def test_a_declared_length_over_the_cap_fails_before_the_body_arrives() -> None:
    hold = asyncio.Event()

    async def declares(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        response.content_length = MAX_PAGE_BYTES + 1
        await response.prepare(request)
        await response.write(b"# HELP vllm:kv_cache_usage_perc\n")
        await hold.wait()  # the rest never comes while the test runs
        return response

    errors: list[str | None] = []
    async with serve(declares) as url, aiohttp.ClientSession() as session:
        scraper = poller(url, session, errors)
        try:
            view = (await scraper.poll(PATIENT_S))[0]
        finally:
            hold.set()
            await scraper.close()
    assert errors == ["oversized"] and view.error == "oversized"


async def test_an_oversized_page_is_counted_ejects_the_node_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.scheduler.scrape")
    fake = FakeVllm(usage=0.25)
    page = fake.render().encode()
    async with serve_fake(fake) as url, aiohttp.ClientSession() as session:
        config = make_config("redis://x", [{"name": "n1", "url": url}])
        service = scheduler_app(config, me="sched-test")[SERVICE]  # built, not started

        def failed(reason: str) -> float | None:
            return service.metrics.registry.get_sample_value(
                "kvgate_scheduler_scrape_errors_total",
                {"pool": "p", "node": "n1", "reason": reason})

        assert failed("oversized") == 0.0  # exported before the first one
        scraper = Poller(config.pools["p"].backends, session, timeout_s=PATIENT_S,
                         stale_after_s=60.0, eject_after=3, pool="p",
                         on_scrape=service._scrape_hook("p"), max_page_bytes=len(page))
        # A page of exactly the cap is read; one byte more is not.
        view = (await scraper.poll(PATIENT_S))[0]
        assert view.metrics is not None and view.metrics.kv_usage == 0.25 and not view.stale
        fake.body = page + b"\n"
        for ejected in (False, False, True):
            view = (await scraper.poll(PATIENT_S))[0]
            assert (view.error, view.stale, view.ejected) == ("oversized", True, ejected)
        assert (failed("oversized"), failed("parse")) == (3.0, 0.0)
        fake.body = None
        view = (await scraper.poll(PATIENT_S))[0]
        assert (view.stale, view.ejected, view.error) == (False, False, "")
        await scraper.close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.name == "kvgate.scheduler.scrape"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO], lines
    assert lines[0][1].startswith("pool p: node n1 scrape failed: /metrics page")
    assert f"over the {len(page)}-byte cap" in lines[0][1]
    assert lines[1][1].startswith("pool p: node n1 /metrics page fits again after 3 failed")
