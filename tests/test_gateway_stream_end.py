"""A stream's end as the gateway sees it: once the node's last event (`data: [DONE]`) is
written to the client, the answer is whole, whatever the connection does next. The session's
redis-server, the gateway's app on a real socket, and nodes over loopback: raw asyncio ones
(an aiohttp server cannot break a chunked body off) or the instant backend."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import orjson

from admission.tiers import Zone
from gateway.metrics import CLIENT_GONE, OK
from gateway.state import GATEWAY, METRICS
from tests.gateway_harness import KEYS, POOL, running_gateway
from tests.rawnode import Handler, read_request
from tests.test_gateway_node_head import _gateway_before

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": POOL,
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
USAGE = {**CHUNK, "choices": [],
         "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _ending_badly() -> Handler:
    """A node that streams a whole answer, `data: [DONE]` included, then drops the connection
    without the body's last chunk."""
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for event in (CHUNK, USAGE):
            writer.write(_chunked(b"data: " + orjson.dumps(event) + b"\n\n"))
        writer.write(_chunked(b"data: [DONE]\n\n"))
        await writer.drain()
        writer.transport.abort()
    return node


async def test_a_node_breaking_off_after_its_last_event_costs_the_client_nothing(
    redis_url: str, raw_server: Callable[[Handler], Awaitable[str]],
) -> None:
    """The client gets the answer as sent, with no error event after `[DONE]`, and the
    request counts as served, charged the node's usage; no node failure is counted."""
    async with _gateway_before(redis_url, await raw_server(_ending_badly())) as (url, app):
        async with aiohttp.ClientSession() as http, http.post(
                url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEYS['normal']}"},
                json={"model": POOL, "messages": [{"role": "user", "content": "Hi."}],
                      "max_tokens": 8, "stream": True}) as response:
            body = await response.read()
            task_id = response.headers["X-Request-Id"]
        assert response.status == 200
        assert body.endswith(b"data: [DONE]\n\n") and b"error" not in body
        gw = app[GATEWAY]
        await gw.settler.idle()
        record = await gw.pools[POOL].store.task(task_id)
        assert record is not None and record["state"] == "settled"
        registry = app[METRICS].registry
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": POOL, "tier": "normal", "outcome": OK}) == 1
        assert registry.get_sample_value("kvgate_gateway_upstream_errors_total", {
            "pool": POOL, "node": "node-0", "kind": "broken_stream"}) in (None, 0)


async def test_a_stream_read_to_its_last_event_is_delivered_when_the_client_closes_early(
    redis_url: str,
) -> None:
    """The OpenAI SDK's synchronous stream closes its connection at `data: [DONE]`, before
    the body's end; with a node that ends its body a little later, every such stream was
    recorded as cancelled and counted `client_gone` (out of the scheduler's learning, on the
    dashboards as clients leaving) though the client had the whole answer."""
    async with running_gateway(redis_url) as gw:
        await gw.publish(Zone.GREEN)
        backend = gw.backends[0]
        backend.end_gate = asyncio.Event()

        def read_whole_stream() -> tuple[str, str]:
            with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["vip"],
                               max_retries=0) as sdk:
                raw = sdk.chat.completions.with_raw_response.create(
                    model=POOL, messages=[{"role": "user", "content": "Hi."}], max_tokens=4,
                    stream=True)
                text = "".join(chunk.choices[0].delta.content or ""
                               for chunk in raw.parse() if chunk.choices)
                return raw.headers["x-request-id"], text

        task_id, text = await asyncio.to_thread(read_whole_stream)
        assert text == " t0 t1 t2 t3"
        await asyncio.wait_for(backend.aborted.wait(), 10)  # the gateway saw the client leave
        backend.end_gate.set()
        await gw.settled()
        assert (await gw.task(task_id))["state"] == "settled"
        registry = gw.app[METRICS].registry
        for outcome, count in ((OK, 1), (CLIENT_GONE, 0)):
            assert registry.get_sample_value("kvgate_gateway_requests_total", {
                "pool": POOL, "tier": "vip", "outcome": outcome}) == count
