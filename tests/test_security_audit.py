"""Attacks on a live gateway (real redis-server, real sockets): a node that lies about usage
or never ends an SSE event, a client that never reads its stream, body fields meant for the
engine's operator. Each test names what the attacker tries and what must hold."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from admission.tiers import Zone
from gateway.estimator import CHAT_ROLES
from gateway.parse import MAX_PROMPTS, MIN_TURN_TOKENS
from gateway.state import GATEWAY
from tests.gateway_harness import (
    BIG,
    KEYS,
    POOL,
    eventually,
    hostile_gateway,
    running_gateway,
    sha,
)

MESSAGES = [{"role": "user", "content": "Say hi."}]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def chat(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": POOL, "messages": MESSAGES, "max_tokens": max_tokens, **extra}


def _chunk(content: str) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "c", "object": "chat.completion.chunk", "model": POOL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}) + b"\n\n"


def _auth(who: str = "normal") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


async def _post(url: str, body: dict[str, Any], who: str = "normal",
                headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/chat/completions", json=body,
            headers={**_auth(who), **(headers or {})}) as response:
        return response.status, await response.read(), response.headers


# --- a node that lies about usage ----------------------------------------------------------


def _lying_node(usage: int, *, stream: bool) -> Handler:
    """A node that generates one token and reports `usage` tokens for it."""
    async def whole(request: web.Request) -> web.Response:
        await request.read()
        body = {"id": "x", "object": "chat.completion", "model": POOL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": usage, "completion_tokens": 1,
                          "total_tokens": usage + 1}}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def streamed(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        counts = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": usage + 5}
        await response.write(_chunk("hi") + b"data: " + orjson.dumps(
            {"id": "c", "object": "chat.completion.chunk", "model": POOL, "choices": [],
             "usage": counts}) + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    return streamed if stream else whole


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("usage", [10**15, 2**62])
async def test_a_node_reporting_absurd_usage_charges_at_most_what_the_request_could_use(
    redis_url: str, redis_client: Any, usage: int, stream: bool,
) -> None:
    """A buggy or hostile node reports 10^15 tokens (the tenant's bucket drained, its fair
    order pushed out of reach) or 2^62 (beyond the finish script's integers: it stops halfway,
    leaving a 'released' record whose reservation is already gone). The tenant must lose at
    most what the request could have used (its prompt at the context length, plus its
    max_tokens) and the task must settle cleanly."""
    async with hostile_gateway(redis_url, _lying_node(usage, stream=stream)) as (url, app):
        gw = app[GATEWAY]
        store = gw.pools[POOL].store
        status, _, headers = await _post(url, chat(max_tokens=8, stream=stream))
        assert status == 200
        await gw.settler.idle()
        record = await store.task(headers["X-Request-Id"])
        assert record is not None and record["state"] == "settled", record
        ceiling = 4096 + 8
        assert 0 < int(record["usage"]) <= ceiling
        raw = await redis_client.hget(store.keys.bucket_key("normal"), "micro_tokens")
        assert 1_000_000 - int(raw) / 1_000_000 <= ceiling + 1
        reserved = await redis_client.hgetall(store.keys.node_reserved)
        assert all(int(v) == 0 for v in reserved.values())
        assert gw.settler.given_up == frozenset()


async def test_a_whole_answer_without_usage_is_charged_what_it_reserved(
    redis_url: str, redis_client: Any,
) -> None:
    """A node whose answer carries no `usage` (or is not JSON): the settle charged the prompt
    alone, and a full generation went free (and read as a light request to the scheduler's
    learned usage ratio)."""
    async def no_usage(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=orjson.dumps({
            "id": "x", "object": "chat.completion", "model": POOL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi " * 50},
                         "finish_reason": "length"}]}), content_type="application/json")

    async with hostile_gateway(redis_url, no_usage) as (url, app):
        gw = app[GATEWAY]
        store = gw.pools[POOL].store
        status, _, headers = await _post(url, chat(max_tokens=50))
        assert status == 200
        await gw.settler.idle()
        record = await store.task(headers["X-Request-Id"])
        assert record is not None and record["state"] == "settled", record
        assert int(record["usage"]) == int(record["prompt_tokens"]) + 50


# --- a client that never reads its stream --------------------------------------------------


async def _endless_stream(request: web.Request) -> web.StreamResponse:
    """A generation that never ends, in 64 KB events, as fast as the gateway takes them; or,
    not streamed, a 32 MB answer (more than the kernel's socket buffers hold, and within what
    1,000 tokens with logprobs may take: `gateway.answersize.whole_answer_limit`)."""
    body = orjson.loads(await request.read())
    if not body.get("stream"):
        content = "x" * (32 << 20)
        return web.Response(body=orjson.dumps({
            "id": "x", "object": "chat.completion", "model": POOL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1000, "total_tokens": 1005}}),
            content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    event = _chunk("x" * 65_536)
    while True:
        await response.write(event)


async def _send_and_never_read(url: str, body: dict[str, Any]) -> socket.socket:
    """A raw client with a tiny receive window that sends its request and reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    payload = orjson.dumps(body)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEYS['normal']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    await asyncio.get_running_loop().sock_sendall(sock, head + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_never_reads_its_answer_does_not_hold_its_reservation(
    redis_url: str, redis_client: Any, stream: bool,
) -> None:
    """The client reads nothing: the node is throttled (bounded memory), and once the client
    has not taken a byte for the upstream timeout, the gateway drops it and ends its task,
    instead of holding its KV reservation (renewed by the live lease) for as long as the
    socket stays open."""
    async with hostile_gateway(redis_url, _endless_stream, upstream_timeout_ms=300) as (url, app):
        gw = app[GATEWAY]
        store = gw.pools[POOL].store
        sock = await _send_and_never_read(url, chat(max_tokens=1000, stream=stream,
                                                    logprobs=True, top_logprobs=20))
        try:
            gateway_set = store.keys.gateway_tasks_key("gw-audit")

            async def admitted() -> bool:
                return bool(await redis_client.scard(gateway_set))

            await eventually(admitted)
            (task_id,) = [m.decode() for m in await redis_client.smembers(gateway_set)]

            async def ended() -> bool:
                record = await store.task(task_id)
                return record is not None and record["state"] == "cancelled"

            await eventually(ended, within_s=5.0)
            reserved = await redis_client.hgetall(store.keys.node_reserved)
            assert all(int(v) == 0 for v in reserved.values())
        finally:
            sock.close()


# --- a node that never ends an SSE event ---------------------------------------------------


async def _endless_event(request: web.Request) -> web.StreamResponse:
    """One token, then an event that never ends: 64 KB pieces without a blank line."""
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk("hi") + b'data: {"choices": "')
    piece = b"x" * 65_536
    while True:
        await response.write(piece)


async def test_a_node_that_never_ends_an_event_gets_cut_off(
    redis_url: str, redis_client: Any,
) -> None:
    """The gateway holds at most one bounded event for the node, then ends the client's
    stream with an error event and the task as cancelled (charged the token it relayed),
    instead of buffering the node's bytes for as long as it sends them."""
    async with hostile_gateway(redis_url, _endless_event) as (url, app):
        gw = app[GATEWAY]
        status, raw, headers = await asyncio.wait_for(
            _post(url, chat(max_tokens=8, stream=True)), 10)
        assert status == 200
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[0] == _chunk("hi").rstrip(b"\n")
        error = orjson.loads(events[1].removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_broken_stream" and events[-1] == b"data: [DONE]"
        assert len(raw) < 10_000  # not one byte of the endless event reached the client
        await gw.settler.idle()
        record = await gw.pools[POOL].store.task(headers["X-Request-Id"])
        assert record is not None and record["state"] == "cancelled"
        assert gw.metrics.registry.get_sample_value("kvgate_gateway_upstream_errors_total", {
            "pool": POOL, "node": "node-0", "kind": "oversized_event"}) == 1


# --- engine fields in the body -------------------------------------------------------------


async def test_engine_fields_of_the_body_stay_the_operators(
    redis_url: str, redis_client: Any,
) -> None:
    """A client names the engine's request id (to collide with or abort another tenant's),
    sends KV-transfer instructions (to make the node pull blocks from a peer of its choosing),
    or reuses another tenant's `cache_salt` (to time hits in that tenant's prefix cache)."""
    async with running_gateway(redis_url) as gw:
        await gw.publish(Zone.GREEN, BIG)
        backend = gw.backends[0]
        sneaky: dict[str, Any] = {"request_id": "victim-42", "cache_salt": "acme-shared",
                  "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9",
                                         "remote_port": 5600, "remote_block_ids": [1, 2, 3]}}
        for who in ("normal", "batch", "normal"):
            status, payload, _ = await _post(gw.url, chat(**sneaky), who,
                                             {"X-data-parallel-rank": "3"})
            assert status == 200, payload
        assert not any(h.lower() == "x-data-parallel-rank"
                       for r in backend.received for h in r.headers)
        bodies = [r.body for r in backend.received]
        assert all("request_id" not in b and "kv_transfer_params" not in b for b in bodies)
        salts = [b["cache_salt"] for b in bodies]
        assert "acme-shared" not in salts
        assert salts[0] == salts[2] != salts[1]  # one partition per tenant and salt
        for no_salt in (chat(), chat(cache_salt=None)):
            assert (await _post(gw.url, no_salt))[0] == 200
            assert backend.received[-1].body.get("cache_salt") is None  # none: none added
        before = len(backend.received)
        for bad in ("", 7, ["a"]):
            status, payload, _ = await _post(gw.url, chat(cache_salt=bad))
            assert status == 400, bad
            assert orjson.loads(payload)["error"]["param"] == "cache_salt"
        assert len(backend.received) == before


async def test_an_isolated_prefix_cache_salts_every_tenants_unsalted_requests(
    redis_url: str, redis_client: Any,
) -> None:
    """With the pool's `isolate_prefix_cache`, a request without a salt still lands in its
    tenant's own partition: the same for the tenant's requests, another for each other tenant,
    and apart from the partitions of the tenant's own salts."""
    def isolate(data: dict[str, Any]) -> None:
        data["pools"][0]["isolate_prefix_cache"] = True

    async with running_gateway(redis_url, adjust=isolate) as gw:
        await gw.publish(Zone.GREEN, BIG)
        backend = gw.backends[0]
        for who, body in (("normal", chat()), ("batch", chat()), ("normal", chat(cache_salt=None)),
                          ("normal", chat(cache_salt="mine"))):
            status, payload, _ = await _post(gw.url, body, who)
            assert status == 200, payload
        salts = [r.body.get("cache_salt") for r in backend.received]
        assert all(isinstance(salt, str) and len(salt) == 64 for salt in salts), salts
        assert salts[0] == salts[2]  # one tenant's unsalted requests share a partition
        assert len({salts[0], salts[1], salts[3]}) == 3


async def test_a_requests_own_chat_template_is_refused_unless_the_pool_accepts_it(
    redis_url: str, redis_client: Any,
) -> None:
    """The prompt is counted with the pool's template: a client's own, on a node that trusts
    request templates, could render the messages a hundred times and reserve a hundredth."""
    template = "{% for i in range(100) %}{% for m in messages %}{{ m.content }}{% endfor %}" \
               "{% endfor %}"
    async with running_gateway(redis_url) as gw:
        await gw.publish(Zone.GREEN, BIG)
        status, payload, headers = await _post(gw.url, chat(chat_template=template))
        assert status == 400
        error = orjson.loads(payload)["error"]
        assert (error["param"], error["code"]) == ("chat_template", "chat_template_not_accepted")
        assert headers.get("x-should-retry") == "false"
        assert gw.backends[0].received == []
        assert (await _post(gw.url, chat(chat_template=None)))[0] == 200

    def accept(data: dict[str, Any]) -> None:
        data["pools"][0]["accept_chat_template"] = True

    async with running_gateway(redis_url, adjust=accept) as gw:
        await gw.publish(Zone.GREEN, BIG)
        status, payload, _ = await _post(gw.url, chat(chat_template=template))
        assert status == 200, payload
        assert gw.backends[0].received[-1].body["chat_template"] == template


# --- the admin token being guessed ---------------------------------------------------------


async def test_admin_token_guesses_are_counted(redis_url: str, redis_client: Any) -> None:
    """Guessing the admin token must be visible without the access log, like a tenant key's."""
    token = "adm-audit-token"
    async with running_gateway(redis_url, admin_token_sha256=sha(token)) as gw:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer guess-1"},
                            {"Authorization": "Bearer guess-2"},
                            {"Authorization": f"Bearer {token}"}):
                async with http.get(gw.url + "/admin/pools", headers=headers) as response:
                    await response.read()
            async with http.get(gw.url + "/metrics") as response:
                text = await response.text()
        registry = gw.gateway.metrics.registry
        for reason, count in (("missing_admin_token", 1), ("invalid_admin_token", 2)):
            assert registry.get_sample_value("kvgate_gateway_auth_failures_total",
                                             {"reason": reason}) == count
        assert "guess-1" not in text and token not in text


# --- a body of many empty messages -------------------------------------------------------


async def _never(request: web.Request) -> web.StreamResponse:
    raise AssertionError("nothing must reach the node")


async def test_more_messages_than_the_context_holds_are_refused_before_any_counting(
    redis_url: str, redis_client: Any,
) -> None:
    """Counting walks every message on the event loop; a body of more messages than the
    context could hold (each adds its turn's markers at least) is refused on its length."""
    async with hostile_gateway(redis_url, _never) as (url, app):
        counter = app[GATEWAY].pools[POOL].counter
        limit = app[GATEWAY].pools[POOL].settings.context_length
        before = (counter.stats.hits, counter.stats.misses)
        many = [{"role": "user", "content": ""}] * (limit // 2)
        status, answer, headers = await _post(url, chat(messages=many))
        error = orjson.loads(answer)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded"
        assert error["param"] == "messages" and headers["x-should-retry"] == "false"
        assert (counter.stats.hits, counter.stats.misses) == before
        # One message fewer than that is counted, and refused on its count like any other.
        status, answer, _ = await _post(url, chat(messages=many[:-1]))
        assert status == 400
        assert orjson.loads(answer)["error"]["code"] == "context_length_exceeded"
        assert (counter.stats.hits, counter.stats.misses) != before
        # The bound the refusal rests on: every empty turn, of every role, adds that much.
        for role in CHAT_ROLES:
            turn = {"role": role, "content": ""}
            added = counter.count_chat([turn, turn]) - counter.count_chat([turn])
            assert added >= MIN_TURN_TOKENS, role


async def test_batches_and_content_parts_too_many_to_count_are_refused_before_counting(
    redis_url: str, redis_client: Any,
) -> None:
    """A 4 MB body of a million one-character prompts held the event loop about 2 s while a
    count planned each (every tenant's requests waited), and was refused only then; a million
    content parts in one message, 0.3 s. Both are refused on their number first."""
    async with hostile_gateway(redis_url, _never) as (url, app):
        counter = app[GATEWAY].pools[POOL].counter
        limit = app[GATEWAY].pools[POOL].settings.context_length
        before = (counter.stats.hits, counter.stats.misses)
        async with aiohttp.ClientSession() as http:
            for prompt in (["a"] * (MAX_PROMPTS + 1), [[1]] * (MAX_PROMPTS + 1)):
                async with http.post(url + "/v1/completions", headers=_auth(), json={
                        "model": POOL, "prompt": prompt, "max_tokens": 1}) as response:
                    error = (await response.json())["error"]
                    assert response.status == 400 and error["param"] == "prompt", error
        parts = [{"type": "text", "text": ""}] * (limit + 1)
        status, answer, _ = await _post(url, chat(messages=[
            {"role": "user", "content": parts}]))
        error = orjson.loads(answer)["error"]
        assert status == 400 and error["param"] == "messages", error
        assert (counter.stats.hits, counter.stats.misses) == before


async def test_a_tenants_cached_counts_are_its_own(redis_url: str, redis_client: Any) -> None:
    """A cached count takes microseconds, an uncached one of a long text milliseconds: with one
    cache for every tenant, a tenant could time a guessed text padded past the context (refused,
    never charged) and learn whether another tenant had sent it."""
    async with hostile_gateway(redis_url, _never) as (url, app):
        counter = app[GATEWAY].pools[POOL].counter
        secret = [{"role": "user", "content": "the merger closes on Friday " * 1000}]
        status, _, _ = await _post(url, chat(messages=secret), who="vip")
        assert status == 400  # past the context: counted, then refused
        misses = counter.stats.misses
        status, _, _ = await _post(url, chat(messages=secret), who="normal")
        assert status == 400
        assert counter.stats.misses == misses + 1  # counted afresh: no trace of the other's
        status, _, _ = await _post(url, chat(messages=secret), who="normal")
        assert counter.stats.misses == misses + 1  # its own repeat is cached
