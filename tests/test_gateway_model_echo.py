"""The answer names the model the client asked for (the pool's name), not the served one.

A real gateway, the session's redis-server and vLLM-speaking backends on real sockets; the
backends serve `meta-llama/Llama-3.1-8B-Instruct` behind the pool `demo`, as
`examples/local.toml` sets it up. Whole bodies and every streamed chunk must come back as
`demo`, with nothing else changed (same chunks, same order, same content), and with
`echo_requested_model = false` the served name must pass through untouched.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from admission.tiers import Zone
from gateway.relay import Meter, SseRelay
from tests.gateway_harness import KEYS, POOL, Harness, running_gateway

SERVED = "meta-llama/Llama-3.1-8B-Instruct"
MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours of the rainbow."}]


def serving(served: str, *, echo: bool | None = None) -> Callable[[dict[str, Any]], None]:
    def adjust(data: dict[str, Any]) -> None:
        pool = data["pools"][0]
        pool["served_model_name"] = served
        if echo is not None:
            pool["echo_requested_model"] = echo
    return adjust


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url, adjust=serving(SERVED),
                               backend_options={"model": SERVED}) as harness:
        await harness.publish(Zone.GREEN)
        yield harness


@pytest.fixture
async def gw_off(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url, adjust=serving(SERVED, echo=False),
                               backend_options={"model": SERVED}) as harness:
        await harness.publish(Zone.GREEN)
        yield harness


def sse_events(raw: bytes) -> list[bytes]:
    """The events of an SSE body, without their blank-line separators."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    return raw[:-2].split(b"\n\n")


def chunks_of(raw: bytes) -> list[dict[str, Any]]:
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    return [orjson.loads(event.removeprefix(b"data: ")) for event in events[:-1]]


async def post(gw: Harness, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
        gw.url + path, json=body, headers={"Authorization": f"Bearer {KEYS['vip']}"}
    ) as response:
        return response.status, await response.read()


async def direct(gw: Harness) -> bytes:
    """What the backend itself answers to the body the gateway last forwarded to it."""
    sent = gw.backends[0].received[-1]
    url = gw.config.pools[POOL].backends[0].url + sent.path
    async with aiohttp.ClientSession() as session, session.post(url, json=sent.body) as response:
        assert response.status == 200
        return await response.read()


def without_identity(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk minus what differs between two runs of one request (its id and clock)."""
    return {k: v for k, v in chunk.items() if k not in ("id", "created")}


# --- Whole answers ----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5}),
], ids=["chat", "completion"])
async def test_a_whole_answer_names_the_requested_model(
    gw: Harness, path: str, body: dict[str, Any]
) -> None:
    status, raw = await post(gw, path, {"model": POOL, **body})
    assert status == 200, raw
    answer = orjson.loads(raw)
    assert answer["model"] == POOL
    assert gw.backends[0].received[-1].body["model"] == SERVED  # the node got its own name
    reference = orjson.loads(await direct(gw))
    assert reference["model"] == SERVED
    # Nothing but the name changed.
    assert without_identity({**answer, "model": SERVED}) == without_identity(reference)


# --- Streams ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6}),
    ("/v1/completions", {"prompt": ["Once upon a time", "In a hole"], "max_tokens": 6, "n": 2}),
], ids=["chat", "completion-4-sequences"])
async def test_every_streamed_chunk_names_the_requested_model_and_nothing_else_changes(
    gw: Harness, path: str, body: dict[str, Any]
) -> None:
    request = {"model": POOL, "stream": True, "stream_options": {"include_usage": True}, **body}
    status, raw = await post(gw, path, request)
    assert status == 200, raw
    chunks = chunks_of(raw)
    reference = chunks_of(await direct(gw))
    assert {c["model"] for c in reference} == {SERVED}
    assert len(chunks) == len(reference) > 6  # every token chunk, and the usage chunk
    assert all(chunk["model"] == POOL for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert [without_identity({**c, "model": SERVED}) for c in chunks] == [
        without_identity(c) for c in reference]


async def test_the_openai_sdk_sees_the_requested_model(gw: Harness) -> None:
    client = gw.openai("vip")
    whole = await client.chat.completions.create(model=POOL, messages=MESSAGES, max_tokens=4)
    assert whole.model == POOL
    stream = await client.chat.completions.create(
        model=POOL, messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert len(chunks) == 1 + 4 + 1  # role, four tokens, usage
    assert {chunk.model for chunk in chunks} == {POOL}
    text = await client.completions.create(model=POOL, prompt="Once", max_tokens=3)
    assert text.model == POOL
    pieces = [c async for c in await client.completions.create(
        model=POOL, prompt="Once", max_tokens=3, stream=True)]
    assert [p.model for p in pieces] == [POOL] * 3
    assert "".join(p.choices[0].text for p in pieces) == " t0 t1 t2"


async def test_with_echo_off_the_served_name_passes_through(gw_off: Harness) -> None:
    assert gw_off.gateway.pools[POOL].settings.echo_requested_model is False
    client = gw_off.openai("vip")
    whole = await client.chat.completions.create(model=POOL, messages=MESSAGES, max_tokens=4)
    assert whole.model == SERVED
    stream = await client.chat.completions.create(
        model=POOL, messages=MESSAGES, max_tokens=4, stream=True)
    assert [chunk.model async for chunk in stream] == [SERVED] * 5


# --- Events split across reads, and events that are not chunks --------------------------------

def _chunk(i: int, model: str = SERVED) -> bytes:
    payload = {"id": "chatcmpl-split", "object": "chat.completion.chunk", "created": 1,
               "model": model, "choices": [{"index": 0, "delta": {"content": f" w{i}"},
                                            "logprobs": None, "finish_reason": None}]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


# Events a node may send that are not well-formed chunks: they must reach the client as sent.
# (A node's error event is rewritten into OpenAI's shape: tests/test_openai_sdk_audit.py.)
UNTOUCHED = [
    b": keep-alive comment\n\n",
    b"data: not json at all\n\n",
    b'data: {"model": "' + SERVED.encode() + b'", "choices": [\n\n',  # broken JSON
    b'data: {"object": "vendor.heartbeat", "seq": 3}\n\n',
]
SPLIT_STREAM = [_chunk(0), _chunk(1), *UNTOUCHED, _chunk(2), _chunk(3), b"data: [DONE]\n\n"]


class SplitBackend:
    """Sends SPLIT_STREAM so that every network read of the gateway ends inside an event: it
    sends the rest of event k with the first part of event k+1, then waits until the client
    has received event k (so the gateway has read those bytes before any more exist)."""

    def __init__(self) -> None:
        self.delivered: asyncio.Queue[int] = asyncio.Queue()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.stream)
        return app

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = SPLIT_STREAM
        cuts = [max(1, len(event) // 3) for event in events]
        await response.write(events[0][:cuts[0]])
        for k, event in enumerate(events):
            nxt = events[k + 1][:cuts[k + 1]] if k + 1 < len(events) else b""
            await response.write(event[cuts[k]:] + nxt)
            if nxt:
                assert await self.delivered.get() == k
        await response.write_eof()
        return response


async def test_events_split_across_reads_are_rewritten_whole_and_others_pass_untouched(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    split = SplitBackend()
    runner = web.AppRunner(split.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    def adjust(data: dict[str, Any]) -> None:
        serving(SERVED)(data)
        data["pools"][0]["backends"] = [{"name": "node-0", "url": url}]

    try:
        async with running_gateway(redis_url, adjust=adjust) as gw:
            await gw.publish(Zone.GREEN)
            received: list[bytes] = []
            # A relay that held an event back would stall the lock-step: fail, do not hang.
            async with asyncio.timeout(30), aiohttp.ClientSession() as session, session.post(
                gw.url + "/v1/chat/completions",
                json={"model": POOL, "messages": MESSAGES, "max_tokens": 8, "stream": True},
                headers={"Authorization": f"Bearer {KEYS['vip']}"},
            ) as response:
                assert response.status == 200
                pending = b""
                async for data in response.content.iter_any():
                    pending += data
                    while b"\n\n" in pending:
                        event, pending = pending.split(b"\n\n", 1)
                        received.append(event + b"\n\n")
                        split.delivered.put_nowait(len(received) - 1)
                assert pending == b""
    finally:
        await runner.cleanup()
    assert len(received) == len(SPLIT_STREAM)
    for got, sent in zip(received, SPLIT_STREAM, strict=True):
        if sent.startswith(b"data: {\"id\""):
            assert orjson.loads(got[6:]) == {**orjson.loads(sent[6:]), "model": POOL}
        else:
            assert got == sent


# --- The relay on its own: any split of any stream, against a plain reference ----------------

def _token(model: str | None, i: int) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": "x", "choices": [{"index": 0, "text": f" {i}"}]}
    if model is not None:
        chunk["model"] = model
    return chunk


EVENT = st.one_of(
    st.builds(lambda m, i: b"data: " + orjson.dumps(_token(m, i)),
              st.sampled_from([SERVED, POOL, None, "other/model"]), st.integers(0, 99)),
    st.builds(lambda m: b"data: " + orjson.dumps(
        {"model": m, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                               "total_tokens": 5}}), st.sampled_from([SERVED])),
    st.sampled_from([b"data: [DONE]", b": ping", b"data: {\"model\": 1}", b"data: {broken",
                     b"data: [1, 2]", b'data:{"model":"' + SERVED.encode() + b'","choices":[]}',
                     b"event: message\ndata: {}"]),
)


def reference_relay(events: list[bytes], reply_model: str | None, strip_usage: bool) -> bytes:
    """What the client must get: each whole event, JSON chunks naming `reply_model` (when
    they named another model with a string), usage-only chunks dropped when stripping."""
    out = []
    for event in events:
        try:
            chunk = orjson.loads(event[5:]) if event.startswith(b"data:") else None
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            out.append(event)
            continue
        if not chunk.get("choices") and chunk.get("usage") is not None and strip_usage:
            continue
        model = chunk.get("model")
        if reply_model is not None and isinstance(model, str) and model != reply_model:
            out.append(b"data: " + orjson.dumps({**chunk, "model": reply_model}))
        else:
            out.append(event)
    return b"".join(event + b"\n\n" for event in out)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(EVENT, max_size=12), cuts=st.lists(st.integers(0, 4000), max_size=20),
       reply_model=st.sampled_from([POOL, None]), strip_usage=st.booleans())
def test_the_relay_rewrites_whole_events_whatever_the_reads(
    events: list[bytes], cuts: list[int], reply_model: str | None, strip_usage: bool
) -> None:
    stream = b"".join(event + b"\n\n" for event in events)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    relay = SseRelay(Meter(1), strip_usage=strip_usage, reply_model=reply_model)
    sent = [relay.feed(stream[a:b]) for a, b in itertools.pairwise(bounds)]
    assert b"".join(sent) + relay.flush() == reference_relay(events, reply_model, strip_usage)
    # Nothing is held back but the incomplete event: after each read, what went out is the
    # reference answer to the events completed so far.
    so_far = b""
    for b, out in zip(bounds[1:], sent, strict=True):
        so_far += out
        complete = stream[:b].count(b"\n\n")
        assert so_far == reference_relay(events[:complete], reply_model, strip_usage)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(EVENT, max_size=12), cuts=st.lists(st.integers(0, 4000), max_size=20),
       reply_model=st.sampled_from([POOL, None]), strip_usage=st.booleans())
def test_the_relay_reads_crlf_framed_streams_as_lf_ones(
    events: list[bytes], cuts: list[int], reply_model: str | None, strip_usage: bool
) -> None:
    """SSE lets lines end in CRLF (vLLM's end in LF; a server or proxy in front of it may
    re-frame). Such a stream was held whole, as one event that never ended: nothing reached
    the client until the end, unrenamed, its usage unread. The CR of a CRLF may end one read
    and its LF start the next."""
    stream = b"".join(event.replace(b"\n", b"\r\n") + b"\r\n\r\n" for event in events)
    # Reads of a lone CR too: one held and read as nothing once hid every event's end after it.
    crs = [i + 1 for i in range(len(stream) - 1) if stream[i:i + 1] == b"\r"][:10]
    bounds = sorted({0, len(stream), *crs, *(i - 1 for i in crs),
                     *(c for c in cuts if c < len(stream))})
    relay = SseRelay(Meter(1), strip_usage=strip_usage, reply_model=reply_model)
    sent = [relay.feed(stream[a:b]) for a, b in itertools.pairwise(bounds)]
    assert b"".join(sent) + relay.flush() == reference_relay(events, reply_model, strip_usage)
