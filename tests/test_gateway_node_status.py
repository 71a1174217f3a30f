"""A node's answer whose status is neither 200, nor a 4xx of the request's, nor a 5xx of its own
(a real aiohttp node on loopback, the session's redis-server).

No OpenAI answer is a 1xx, another 2xx or a 3xx: a proxy in front of the node redirecting http
to https, a 204, a 201 carrying an error. Relayed with its own status and labelled
`invalid_request_error`, it would read to the SDKs as a bodiless success or as the client's
fault; the client gets 502 `upstream_malformed_answer` instead, refunded in full, counted as
`kind="malformed_answer"` and logged once per node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.state import GATEWAY
from tests.gateway_harness import KEYS, POOL, hostile_gateway

WAIT_S = 5.0
"""Most any request may take; a passing test takes a fraction of it."""


def _answering(status: int, body: bytes | None, headers: dict[str, str] | None = None,
               ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def node(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, body=body, headers=headers,
                            content_type=None if body is None else "application/json")
    return node


async def _chat(url: str) -> tuple[int, bytes, str]:
    """(status, body, X-Request-Id) of a chat request through the gateway at `url`, a redirect
    not followed."""
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/chat/completions", allow_redirects=False,
            headers={"Authorization": f"Bearer {KEYS['normal']}"},
            json={"model": POOL, "messages": [{"role": "user", "content": "Hi."}],
                  "max_tokens": 8}) as response:
        return response.status, await response.read(), response.headers["X-Request-Id"]


_ERROR = orjson.dumps({"error": {"message": "bad things", "type": "BadRequestError",
                                 "param": None, "code": 400}})


@pytest.mark.parametrize(("status", "body", "headers"), [
    pytest.param(204, None, None, id="204"),
    pytest.param(201, _ERROR, None, id="201-error-body"),
    pytest.param(302, None, None, id="302-no-location"),
    pytest.param(301, b"", {"Location": "https://node.example/v1/chat/completions"},
                 id="301-to-https"),
])
async def test_a_status_no_openai_answer_has_is_a_502_refunded_and_logged_once(
    redis_url: str, redis_client: Any, caplog: pytest.LogCaptureFixture, status: int,
    body: bytes | None, headers: dict[str, str] | None,
) -> None:
    caplog.set_level(logging.ERROR, logger="kvgate.gateway")
    node = _answering(status, body, headers)
    async with hostile_gateway(redis_url, node) as (url, app):
        gw = app[GATEWAY]
        registry = gw.metrics.registry
        for attempt in (1, 2):
            got, raw, task_id = await asyncio.wait_for(_chat(url), WAIT_S)
            assert got == 502, raw
            error = orjson.loads(raw)["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert (error["code"], error["type"]) == ("upstream_malformed_answer", "server_error")
            assert f"HTTP {status}" in error["message"]
            assert registry.get_sample_value("kvgate_gateway_upstream_errors_total", {
                "pool": POOL, "node": "node-0", "kind": "malformed_answer"}) == attempt
            await gw.settler.idle()
            record = await gw.pools[POOL].store.task(task_id)
            assert record is not None and record["state"] == "cancelled"
            assert int(record.get("usage", 0)) == 0
        assert await redis_client.hget(gw.pools[POOL].store.keys.node_reserved, "node-0") is None
        outcomes = {outcome: registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": POOL, "tier": "normal", "outcome": outcome})
            for outcome in ("invalid", "upstream_error")}
        assert outcomes == {"invalid": 0, "upstream_error": 2}
    logged = [r for r in caplog.records if "node-0 sent" in r.getMessage()]
    assert len(logged) == 1 and f"HTTP {status}" in logged[0].getMessage()
