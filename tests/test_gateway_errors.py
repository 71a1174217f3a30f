"""Every answer other than success keeps OpenAI's error shape; Redis trouble fails closed (or
open for the configured tiers, counted); operational endpoints; nothing secret is logged."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from bench.common.localredis import LocalRedis, free_port
from tests.gateway_harness import BIG, EPOCH, KEYS, Harness, eventually, running_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Say hi."}]


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> Any:
    async with running_gateway(redis_url) as harness:
        await harness.publish(Zone.GREEN, BIG)
        yield harness


async def _post(gw: Harness, body: bytes | dict[str, Any], *, who: str | None = "vip",
                path: str = "/v1/chat/completions",
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    all_headers = {**(gw.auth(who) if who else {}), **(headers or {})}
    async with aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(gw.url + path, headers=all_headers, **kwargs) as response:
            return response.status, await response.json(), response.headers


def _openai_shape(payload: dict[str, Any]) -> dict[str, Any]:
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.mark.parametrize(("body", "param", "code"), [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    ({"model": "demo"}, "messages", None),
    ({"model": "demo", "messages": [{"content": "no role"}]}, "messages[0].role", None),
    ({"model": "demo", "messages": [*MESSAGES, {"role": "wizard", "content": "x"}]},
     "messages[1].role", None),
    ({"model": "demo", "messages": MESSAGES, "max_tokens": 0}, "max_tokens", None),
    ({"model": "demo", "messages": MESSAGES, "stream": "yes"}, "stream", None),
    ({"model": "demo", "messages": MESSAGES, "stream_options": {"include_usage": True}},
     "stream_options", None),
    ({"messages": MESSAGES}, "model", None),
    ({"model": "demo", "messages": MESSAGES, "stream": True,
      "stream_options": {"include_usage": "false"}}, "stream_options.include_usage", None),
    ({"model": "demo", "messages": [{"role": "user"}]}, "messages[0].content", None),
    ({"model": "demo", "messages": [{"role": "system", "content": None}, *MESSAGES]},
     "messages[0].content", None),
    ({"model": "demo", "messages": [*MESSAGES, {"role": "assistant"}, *MESSAGES]},
     "messages[1].content", None),
    ({"model": "demo", "messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c1"}]},
     "messages[1].content", None),
    ({"model": "demo", "messages": [*MESSAGES, {"role": "function", "name": "f"}]},
     "messages[1].content", None),
    ({"model": "demo", "messages": MESSAGES, "tools": [{"type": "function"}]},
     "tools[0].function", None),
    ({"model": "demo", "messages": MESSAGES, "tools": [{"function": {"parameters": {}}}]},
     "tools[0].function.name", None),
])
async def test_malformed_requests_are_400(gw: Harness, body: Any, param: str | None,
                                          code: str | None) -> None:
    status, payload, _ = await _post(gw, body)
    assert status == 400
    error = _openai_shape(payload)
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert gw.backends[0].received == []


async def test_messages_and_tools_the_openai_api_takes_are_forwarded(gw: Harness) -> None:
    # Content is required but for an assistant turn that calls a tool (or a function, or
    # stands for an earlier answer's audio or refusal), and a function result's may be null;
    # a tool of another type than function (OpenAI's custom tools) carries no `function`.
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "rain"}]},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": None},
        {"role": "assistant", "audio": {"id": "audio_1"}},
        {"role": "assistant", "content": None, "refusal": "I cannot help with that."},
        {"role": "user", "content": ""},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather"}},
             {"type": "custom", "custom": {"name": "grammar"}}]
    status, payload, _ = await _post(gw, {"model": "demo", "messages": messages,
                                          "tools": tools, "max_tokens": 2})
    assert status == 200, payload
    forwarded = gw.backends[0].received[-1].body
    assert forwarded["messages"] == messages and forwarded["tools"] == tools

    for include_usage in (False, None):
        options: Any = {"include_usage": include_usage}  # null: not set, as vLLM reads it
        stream = await gw.openai("vip").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=2, stream=True, stream_options=options)
        assert [chunk async for chunk in stream][-1].usage is None
        assert gw.backends[0].received[-1].body["stream_options"] == {"include_usage": True}


def _nested_list(depth: int) -> bytes:
    """A JSON array `depth` levels deep, written out (no encoder of ours writes it)."""
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("field", ["metadata", "response_format"])
async def test_a_body_nested_deeper_than_the_gateway_can_forward_is_400_not_500(
    gw: Harness, field: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """orjson reads 1,024 levels of nesting but writes 254: a field the gateway passes through
    untouched, nested in between, parsed, was admitted, and failed as the body was written
    for the node: a 500 `internal_error` (and a traceback), which the SDKs retry twice. It is
    the client's 400 now, before admission. Shallower nesting still passes as sent."""
    caplog.set_level(logging.INFO)
    head = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    status, payload, headers = await _post(gw, head + f'"{field}": '.encode()
                                           + _nested_list(300) + b"}")
    assert status == 400, payload
    error = _openai_shape(payload)
    assert error["type"] == "invalid_request_error" and error["code"] == "nesting_too_deep"
    assert "x-request-id" not in headers  # refused before admission: no task
    assert gw.backends[0].received == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    status, payload, _ = await _post(gw, head + f'"{field}": '.encode()
                                     + _nested_list(200) + b"}")
    assert status == 200, payload
    assert gw.backends[0].received[-1].body[field] == orjson.loads(_nested_list(200))


async def test_tools_nested_past_the_interpreters_stack_are_400_not_500(
    gw: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    """A tool's `parameters` nested about 1,000 levels deep (orjson reads up to 1,024) made
    the count's `json.dumps` raise RecursionError: a 500 the SDKs retry. A 400 now, naming
    `tools` (or, where the interpreter's stack holds it, refused as too deep to forward)."""
    caplog.set_level(logging.INFO)
    body = (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], '
            b'"tools": [{"type": "function", "function": {"name": "f", "parameters": '
            + _nested_list(1010) + b"}}]}")
    status, payload, _ = await _post(gw, body)
    assert status == 400, payload
    error = _openai_shape(payload)
    assert error["param"] == "tools" or error["code"] == "nesting_too_deep", error
    assert gw.backends[0].received == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_unknown_role_is_refused_naming_the_allowed_ones(gw: Harness) -> None:
    wizard: list[Any] = [{"role": "wizard", "content": "Cast a spell."}]
    with pytest.raises(openai.BadRequestError) as info:
        await gw.openai("vip").chat.completions.create(model="demo", messages=wizard)
    error = _openai_shape(info.value.response.json())
    assert error["param"] == "messages[0].role" and error["type"] == "invalid_request_error"
    for role in ("system", "developer", "user", "assistant", "tool", "function"):
        assert role in error["message"]
    assert gw.backends[0].received == []
    # OpenAI's newer name for the system turn is one of them.
    done = await gw.openai("vip").chat.completions.create(
        model="demo", max_tokens=2,
        messages=[{"role": "developer", "content": "Be terse."}, *MESSAGES])
    assert done.choices and gw.backends[0].received[-1].body["messages"][0]["role"] == "developer"


@pytest.mark.parametrize(("counts", "param", "message"), [
    ({"best_of": 200}, "best_of", "'best_of' must be at most 128."),
    ({"n": 200}, "n", "'n' must be at most 128."),
    ({"n": 200, "best_of": 200}, "n", "'n' must be at most 128."),
    ({"n": 3, "best_of": 2}, "best_of", "'best_of' must be at least 'n' (got best_of=2, n=3)."),
    ({"best_of": 0}, "best_of", "'best_of' must be an integer >= 1."),
])
async def test_sequence_counts_are_refused_naming_their_own_field(
    gw: Harness, counts: dict[str, int], param: str, message: str
) -> None:
    status, payload, _ = await _post(
        gw, {"model": "demo", "prompt": "hi", "max_tokens": 2, **counts}, path="/v1/completions")
    assert status == 400
    error = _openai_shape(payload)
    assert (error["param"], error["message"]) == (param, message)
    assert error["type"] == "invalid_request_error"
    assert gw.backends[0].received == []


async def test_best_of_reserves_a_sequence_per_candidate(gw: Harness) -> None:
    status, _, headers = await _post(
        gw, {"model": "demo", "prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 3},
        path="/v1/completions")
    assert status == 200
    prompt = gw.gateway.pools["demo"].counter.count_prompt("hi")
    record = await gw.task(headers["X-Request-Id"])
    assert int(record["cost"]) == prompt + 2 * 3


async def test_unknown_model_is_404(gw: Harness) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await gw.openai("vip").chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.code == "model_not_found"


async def test_missing_key_is_401(gw: Harness) -> None:
    status, payload, headers = await _post(gw, {"model": "demo", "messages": MESSAGES}, who=None)
    assert status == 401 and _openai_shape(payload)["code"] == "missing_api_key"
    assert headers["WWW-Authenticate"] == "Bearer"


async def test_limits_on_max_tokens_and_context(gw: Harness) -> None:
    client = gw.openai("vip")
    with pytest.raises(openai.BadRequestError) as too_many:
        await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1025)
    assert too_many.value.code == "max_tokens_too_large"
    long_prompt = _user("word " * 5000)  # > 4,096-token context
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.chat.completions.create(model="demo", messages=long_prompt, max_tokens=5)
    assert "maximum context length is 4096 tokens" in too_long.value.message
    assert too_long.value.code == "context_length_exceeded"
    fits = _user("word " * 3500)
    with pytest.raises(openai.BadRequestError) as over:
        await client.chat.completions.create(model="demo", messages=fits, max_tokens=1000)
    assert "'max_tokens' or 'max_completion_tokens' is too large: 1000" in over.value.message
    assert over.value.code == "context_length_exceeded"
    # None of the three can succeed as sent, whatever the load: clients are told not to retry.
    for refused in (too_many, too_long, over):
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in refused.value.response.headers
    assert gw.backends[0].received == []
    # Without max_tokens the default (64) is cut to what the context leaves, as vLLM does.
    near_full = _user("word " * 4070)
    done = await client.chat.completions.create(model="demo", messages=near_full)
    assert done.usage is not None and done.usage.total_tokens == 4096


async def test_body_over_the_limit_is_413(redis_url: str, redis_client: aioredis.Redis) -> None:
    async with running_gateway(redis_url, max_body_bytes=2048) as gw:
        status, payload, _ = await _post(
            gw, {"model": "demo", "messages": [{"role": "user", "content": "x" * 4096}]})
        assert status == 413 and _openai_shape(payload)["code"] == "request_too_large"


async def test_a_body_that_does_not_decode_is_400_not_500(
    gw: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    """A body whose bytes do not match its Content-Encoding fails as aiohttp reads it in the
    handler: a client error in OpenAI's shape, which the SDKs do not retry, and no traceback.
    `Expect: 100-continue` holds the body back until the handler reads it, as curl does for
    large bodies, so that the error is met there and not by the parser in front of it."""
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    caplog.set_level(logging.INFO)
    try:
        body = b"not gzip at all"
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEYS["vip"].encode() + b"\r\nContent-Encoding: gzip\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
            b"HTTP/1.1 100")
        writer.write(body)
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode("latin-1")
        status_line, *lines = head.rstrip("\r\n").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        payload = await reader.readexactly(int(headers["content-length"]))
    finally:
        writer.close()
    assert status_line.split()[1] == "400"
    assert headers["connection"].lower() == "close"
    error = _openai_shape(orjson.loads(payload))
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_body"
    assert "content-encoding: gzip" in error["message"].lower()
    assert gw.backends[0].received == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_unknown_expectation_is_a_417_in_the_openai_shape(gw: Harness) -> None:
    """aiohttp answers an `Expect` it does not meet before any middleware, in plain text that
    no SDK parses: the gateway's own handler answers it in OpenAI's shape, and still sends
    `100 Continue` for `100-continue`."""
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", headers={
                **gw.auth("vip"), "Expect": 'x"G5|./'}, json={"model": "demo"}) as response:
            assert response.status == 417
            error = _openai_shape(await response.json())
            assert (error["code"], error["param"]) == ("expectation_failed", "Expect")
        async with http.get(gw.url + "/healthz", headers={"Expect": "later"}) as response:
            assert response.status == 417
            assert _openai_shape(await response.json())["code"] == "expectation_failed"
        async with http.post(gw.url + "/v1/chat/completions", headers=gw.auth("vip"),
                             json={"model": "demo", "messages": MESSAGES, "max_tokens": 2},
                             expect100=True) as response:
            assert response.status == 200


async def test_a_request_routed_to_a_node_the_gateway_does_not_know_is_safe_to_retry(
        gw: Harness) -> None:
    """The scheduler's configuration names a node this gateway's does not (a rollout half
    done): the request never reaches a node, its reservation is given back, and the answer
    says a retry is safe, which the SDKs need to retry a 502."""
    await gw.store.publish_state(EPOCH, Zone.GREEN, {"ghost": BIG})
    status, payload, headers = await _post(gw, {"model": "demo", "messages": MESSAGES,
                                                "max_tokens": 5})
    assert status == 502 and _openai_shape(payload)["code"] == "unknown_node"
    assert headers["x-should-retry"] == "true" and payload["error"]["retry_after_ms"] > 0
    await gw.settled()
    assert (await gw.task(headers["X-Request-Id"]))["state"] == "cancelled"
    assert all(b.received == [] for b in gw.backends)
    # Counted as what it is: no node failed (the upstream-errors alert must not fire).
    outcomes = {s.labels["outcome"]: s.value
                for metric in gw.gateway.metrics.registry.collect()
                for s in metric.samples if s.name == "kvgate_gateway_requests_total"
                and s.value}
    assert outcomes == {"unknown_node": 1}, outcomes


async def test_wrong_method_and_path_keep_the_openai_shape(gw: Harness) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/v1/chat/completions") as response:
            assert response.status == 405
            assert _openai_shape(await response.json())["code"] == "method_not_allowed"
            assert "POST" in response.headers["Allow"]
        async with http.get(gw.url + "/v2/nothing") as response:
            assert response.status == 404
            assert _openai_shape(await response.json())["code"] == "not_found"


async def test_requests_that_can_never_fit_say_do_not_retry(gw: Harness) -> None:
    # Bigger than the tenant's whole burst (1,000 tokens): 400, never a 429 loop.
    status, payload, headers = await _post(
        gw, {"model": "demo", "messages": MESSAGES, "max_tokens": 1000}, who="small")
    assert status == 400 and headers["x-should-retry"] == "false"
    assert _openai_shape(payload)["code"] == "exceeds_burst"
    # A bucket that never refills, once spent: a 429 as OpenAI's, not retryable either.
    status, _, _ = await _post(gw, {"model": "demo", "messages": MESSAGES, "max_tokens": 900},
                               who="frozen")
    assert status == 200
    status, payload, headers = await _post(
        gw, {"model": "demo", "messages": MESSAGES, "max_tokens": 900}, who="frozen")
    assert status == 429 and headers["x-should-retry"] == "false"
    assert _openai_shape(payload)["code"] == payload["error"]["type"] == "insufficient_quota"


async def test_redis_unreachable_fails_closed_except_fail_open_tiers(
    redis_client: aioredis.Redis,
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with running_gateway(dead, fail_open_tiers=["vip"], wait_subscribed=False) as gw:
        with pytest.raises(openai.InternalServerError) as info:
            await gw.openai("normal").chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=3)
        assert info.value.status_code == 503
        headers = info.value.response.headers
        assert int(headers["retry-after"]) >= 2 and int(headers["retry-after-ms"]) >= 2000
        assert info.value.response.json()["error"]["code"] == "admission_unavailable"
        assert gw.backends[0].received == []
        vip = await gw.openai("vip").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=3)
        assert vip.choices  # straight to the backend, unadmitted
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_gateway_fail_open_total",
                                         {"pool": "demo", "tier": "vip"}) == 1
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "demo", "tier": "normal", "outcome": "unavailable"}) == 1
        assert (registry.get_sample_value("kvgate_gateway_redis_errors_total",
                                          {"op": "admit"}) or 0) >= 2
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/readyz") as response:
            assert response.status == 503
            async with http.get(gw.url + "/healthz") as response:
                assert response.status == 200


async def test_an_unreachable_redis_cluster_fails_closed_too_not_500() -> None:
    """redis-py's cluster client raises a cluster none of whose nodes answers as a
    RedisClusterException, which is no RedisError: the gateway must still start, answer 503
    `admission_unavailable` (fail open for the configured tiers) and say not ready, rather than
    fail to start or answer 500 with a traceback per request."""
    dead = f"redis://127.0.0.1:{free_port()}/0"

    def cluster(data: dict[str, Any]) -> None:
        data["redis"]["cluster"] = True

    async with running_gateway(dead, adjust=cluster, fail_open_tiers=["vip"],
                               wait_subscribed=False) as gw:
        for _ in range(3):
            with pytest.raises(openai.InternalServerError) as info:
                await gw.openai("normal").chat.completions.create(
                    model="demo", messages=MESSAGES, max_tokens=3)
            assert info.value.status_code == 503
            assert info.value.response.json()["error"]["code"] == "admission_unavailable"
            assert "retry-after" in info.value.response.headers
        vip = await gw.openai("vip").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=3)
        assert vip.choices  # failed open
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "demo", "tier": "normal", "outcome": "unavailable"}) == 3
        assert registry.get_sample_value("kvgate_gateway_requests_total", {
            "pool": "demo", "tier": "normal", "outcome": "internal_error"}) in (None, 0)
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/readyz") as response:
            assert response.status == 503


async def test_an_outage_is_logged_once_per_streak_not_once_per_request(
    redis_factory: Callable[..., LocalRedis], caplog: pytest.LogCaptureFixture,
) -> None:
    """Every admit fails while Redis is down: each is counted, but the log says so once when
    it starts (then every 30 s) and once when it ends; a warning per request was thousands of
    lines a second at production rates. The same for the wake-up subscription's attempts."""
    server = redis_factory()
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 3}
    async with running_gateway(server.url) as gw:
        await gw.publish(Zone.GREEN, BIG)
        caplog.set_level(logging.INFO, logger="kvgate.gateway")
        server.kill()
        for _ in range(5):
            status, payload, _ = await _post(gw, body, who="normal")
            assert status == 503 and payload["error"]["code"] == "admission_unavailable"
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_gateway_redis_errors_total",
                                         {"op": "admit"}) == 5

        def lines(start: str) -> list[str]:
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]

        assert len(lines("admission store call failed: ")) == 1

        async def resubscribing() -> bool:  # the wake-up subscription retries with backoff
            value = registry.get_sample_value("kvgate_gateway_pubsub_reconnects_total")
            return (value or 0) >= 3

        await eventually(resubscribing, within_s=10, interval_s=0.05)
        assert len(lines("wake-up subscription failed: ")) == 1
        redis_factory(port=server.port)  # back (empty: admission answers, whatever it says)

        async def answered() -> bool:
            # A short deadline of its own: with no node published the request may queue.
            _, payload, _ = await _post(gw, body, who="normal",
                                        headers={"X-Request-Timeout": "1"})
            return bool(payload.get("error", {}).get("code") != "admission_unavailable")

        await eventually(answered, within_s=10, interval_s=0.1)
        assert len(lines("admission store call failed")) == 1  # neither again nor a count
        assert len(lines("admission store answers again after ")) == 1


async def test_script_cache_flush_is_survived(gw: Harness) -> None:
    client = gw.openai("vip")
    assert (await client.completions.create(model="demo", prompt="a", max_tokens=1)).choices
    await gw.redis.script_flush()
    assert (await client.completions.create(model="demo", prompt="b", max_tokens=1)).choices
    await gw.settled()
    stats = await gw.redis.hgetall(gw.store.keys.stats)
    assert int(stats[b"settled"]) == 2


async def test_operational_endpoints(gw: Harness) -> None:
    await gw.openai("vip").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/healthz") as response:
            assert response.status == 200
        async with http.get(gw.url + "/readyz") as response:
            assert response.status == 200 and (await response.json())["status"] == "ready"
        gc.collect(2)  # the gateway's app times every collection of its process
        async with http.get(gw.url + "/metrics") as response:
            text = await response.text()
        async with http.get(gw.url + "/openapi.json") as response:
            document = await response.json()
    assert 'kvgate_gateway_requests_total{outcome="ok",pool="demo",tier="vip"} 1.0' in text
    assert "kvgate_gateway_tokens_reserved_total" in text
    full = re.search(r'^kvgate_gateway_gc_pause_seconds_count\{generation="2"\} (\S+)$', text,
                     re.MULTILINE)
    assert full is not None and float(full.group(1)) >= 1, text
    assert "vip\"" in text and "tenant=" not in text  # no tenant label unless configured
    assert document["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
            "/healthz", "/readyz", "/metrics"} <= set(document["paths"])
    refs = _refs(document)
    assert refs and all(ref.startswith("#/components/schemas/") for ref in refs)
    assert {ref.rsplit("/", 1)[1] for ref in refs} <= set(document["components"]["schemas"])


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


async def test_openapi_document_is_valid(gw: Harness) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/openapi.json") as response:
        validator.validate(await response.json())


async def test_no_keys_or_prompt_text_in_logs(gw: Harness, caplog: pytest.LogCaptureFixture,
                                              ) -> None:
    secret_prompt = "the launch code is PURPLE-HIPPO-42"
    messages = _user(secret_prompt)
    caplog.set_level(logging.DEBUG)
    await gw.openai("vip").chat.completions.create(model="demo", messages=messages, max_tokens=2)
    stream = await gw.openai("normal").chat.completions.create(
        model="demo", messages=messages, max_tokens=2, stream=True)
    assert [c async for c in stream]
    with pytest.raises(openai.AuthenticationError):
        await gw.openai("sk-leaked-KEY-7731").chat.completions.create(
            model="demo", messages=messages)
    with pytest.raises(openai.BadRequestError):
        await gw.openai("small").chat.completions.create(
            model="demo", messages=messages, max_tokens=1000)
    await _post(gw, b'{"model": "demo", "messages": "' + secret_prompt.encode())
    await gw.settled()
    logged = caplog.text
    assert "task " in logged  # the gateway did log these requests
    for secret in (secret_prompt, "PURPLE-HIPPO", "sk-leaked-KEY-7731", *KEYS.values()):
        assert secret not in logged
