"""The gateway ends the requests a stuck node holds: once the leader publishes the node as
`stuck` in `nodes_out`, every exchange with it silent for `CUT_QUIET_S` ends with a 502
`upstream_stuck` the client may send again (an error event in a stream that had begun), the
task is cancelled and its reservation returned. Exchanges that are receiving, and nodes out
for another reason, are left alone. Real gateway, real Redis, a node over loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from admission.tiers import Zone
from gateway import stucknodes
from gateway.state import GATEWAY
from tests.gateway_harness import BIG, KEYS, POOL, hostile_gateway

QUIET_S = 0.5
ROUND_MS = 100


@pytest.fixture(autouse=True)
def short_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stucknodes, "CUT_QUIET_S", QUIET_S)


def chunk(content: str) -> bytes:
    event = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": POOL,
             "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def head_only(content_type: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A stuck engine that sent an answer's head and nothing more: a stream's (vLLM sends it
    at once), or a whole answer's (a proxy in front of the node may)."""
    async def node(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": content_type})
        await response.prepare(request)
        await asyncio.Event().wait()
        return response

    return node


async def frozen(request: web.Request) -> web.StreamResponse:
    """A stuck engine: a stream gets its head and one token, a whole answer nothing."""
    body = await request.json()
    if not body.get("stream"):
        await asyncio.Event().wait()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("t0"))
    await asyncio.Event().wait()
    return response


async def trickling(request: web.Request) -> web.StreamResponse:
    """A node that recovered: a token every 50 ms, then the end."""
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(16):
        await response.write(chunk(f"t{i}"))
        await asyncio.sleep(0.05)
    await response.write(b"data: [DONE]\n\n")
    return response


@asynccontextmanager
async def gateway(redis_url: str, node: Any, out: str) -> AsyncIterator[tuple[str, Any]]:
    """The gateway over one node, the leader's state saying `nodes_out` = `out`."""
    async with hostile_gateway(redis_url, node, renew_interval_ms=ROUND_MS) as (url, app):
        gw = app[GATEWAY]
        await gw.pools[POOL].store.publish_state(1, Zone.GREEN, {"node-0": BIG},
                                                 {"nodes_out": out})
        yield url, gw


def body(stream: bool) -> dict[str, Any]:
    return {"model": POOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": stream}


HEADERS = {"Authorization": f"Bearer {KEYS['vip']}"}


async def reserved(gw: Any) -> int:
    raw = await gw.redis.hgetall(gw.pools[POOL].store.keys.node_reserved)
    return sum(int(v) for v in raw.values())


@pytest.mark.parametrize(("what", "node"), [
    ("before its head", frozen),
    ("after its head", head_only("application/json")),
])
async def test_a_whole_answer_held_by_a_stuck_node_ends_in_a_502_to_send_again_for_free(
    redis_url: str, what: str, node: Any
) -> None:
    async with gateway(redis_url, node, "node-0:stuck") as (url, gw), \
            aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body(False),
                             headers=HEADERS) as response:
            payload = await response.json()
            assert response.status == 502, what
            assert response.headers["x-should-retry"] == "true"
            assert int(response.headers["Retry-After"]) >= 0
            task_id = response.headers["X-Request-Id"]
        error = payload["error"]
        assert (error["code"], error["type"]) == ("upstream_stuck", "server_error")
        assert "stuck" in error["message"]
        await gw.settler.idle()
        record = await gw.pools[POOL].store.task(task_id)
        assert record is not None
        assert (record["state"], int(record.get("usage", 0))) == ("cancelled", 0)
        assert await reserved(gw) == 0
        errors = gw.metrics.child(gw.metrics.upstream_errors, POOL, "node-0", "stuck")
        assert errors._value.get() == 1


async def test_a_stream_held_by_a_stuck_node_ends_with_an_error_event(redis_url: str) -> None:
    async with gateway(redis_url, frozen, "node-0:stuck") as (url, gw), \
            aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body(True),
                             headers=HEADERS) as response:
            assert response.status == 200
            text = (await response.read()).decode()
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "t0"
        assert json.loads(events[1])["error"]["code"] == "upstream_stuck"
        assert events[2:] == ["[DONE]"]
        await gw.settler.idle()
        assert await reserved(gw) == 0


async def test_a_stream_cut_before_its_first_token_costs_nothing(redis_url: str) -> None:
    async with gateway(redis_url, head_only("text/event-stream"), "node-0:stuck") as (url, gw), \
            aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body(True),
                             headers=HEADERS) as response:
            task_id = response.headers["X-Request-Id"]
            text = (await response.read()).decode()
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert json.loads(events[0])["error"]["code"] == "upstream_stuck"
        assert events[1:] == ["[DONE]"]
        await gw.settler.idle()
        record = await gw.pools[POOL].store.task(task_id)
        assert record is not None
        assert (record["state"], int(record.get("usage", 0))) == ("cancelled", 0)


async def test_a_stream_that_receives_is_not_ended_even_on_a_node_published_stuck(
    redis_url: str
) -> None:
    async with gateway(redis_url, trickling, "node-0:stuck") as (url, _), \
            aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body(True),
                             headers=HEADERS) as response:
            text = (await response.read()).decode()
        assert text.count('"content"') == 16 and text.endswith("data: [DONE]\n\n")
        assert "error" not in text


async def test_a_node_out_for_another_reason_keeps_its_requests(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with gateway(redis_url, frozen, "node-0:stale") as (url, gw), \
            aiohttp.ClientSession() as http:
        store = gw.pools[POOL].store
        reads, read_often = 0, asyncio.Event()
        original = store.nodes_out

        async def counted() -> dict[str, str]:
            nonlocal reads
            out: dict[str, str] = await original()
            reads += 1
            if reads == 5:
                read_often.set()
            return out

        monkeypatch.setattr(store, "nodes_out", counted)
        sent = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body(False),
                                               headers=HEADERS))
        # Rounds read the state only while a request is in flight: four whole rounds (the
        # fifth read comes after the fourth's cuts), the later ones after the request had been
        # silent longer than the quiet bound.
        await asyncio.wait_for(read_often.wait(), 10)
        assert gw.upstream.client.busy(gw.pools[POOL].url("node-0")) == 1 and not sent.done()
        sent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sent
