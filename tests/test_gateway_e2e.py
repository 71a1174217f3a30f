"""End to end through the official OpenAI SDK: gateway, redis-server and an instant backend,
all on real sockets. Exact usage is checked in Redis (task record, tenant bucket)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from admission.tiers import Zone
from gateway.estimator import ChatFormat, TokenCounter
from gateway.state import METRICS
from tests.gateway_harness import BIG, Harness, running_gateway, sha

DAILY = "sk-test-daily"
SLOW = "sk-test-slow"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> Any:
    async with running_gateway(redis_url) as harness:
        await harness.publish(Zone.GREEN)
        await harness.freeze_clock()
        yield harness


async def _expected_prompt(gw: Harness, messages: list[Any]) -> int:
    return gw.gateway.pools["demo"].counter.count_chat(messages)


async def test_chat_non_streaming_settles_exact_usage(gw: Harness) -> None:
    raw = await gw.openai("vip").chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=20)
    completion = raw.parse()
    task_id = raw.headers["x-request-id"]
    assert completion.choices[0].message.content
    assert completion.usage is not None
    prompt = await _expected_prompt(gw, MESSAGES)
    assert completion.usage.prompt_tokens == prompt
    assert completion.usage.completion_tokens == 20
    await gw.settled()
    record = await gw.task(task_id)
    assert record["state"] == "settled"
    assert int(record["usage"]) == completion.usage.total_tokens == prompt + 20
    assert int(record["cost"]) == prompt + 20  # reservation: prompt + max_tokens
    assert record["tier"] == "0" and record["tenant"] == "vip"
    # The bucket (full before; clock frozen: no refill) was charged exactly the usage.
    assert await gw.bucket("vip") == 1_000_000 - (prompt + 20)
    stats = await gw.redis.hgetall(gw.store.keys.stats)
    assert int(stats[b"fast_path"]) == 1  # released by the admit call itself
    forwarded = gw.backends[0].received[-1].body
    assert forwarded["model"] == "demo" and forwarded["max_tokens"] == 20
    assert "stream_options" not in forwarded and "priority" not in forwarded


async def test_bucket_charged_exactly_the_usage(gw: Harness) -> None:
    client = gw.openai("normal")
    first = await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5)
    await gw.settled()
    level = await gw.bucket("normal")
    second = await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5)
    await gw.settled()
    assert first.usage is not None and second.usage is not None
    assert level - await gw.bucket("normal") == second.usage.total_tokens
    assert level == 1_000_000 - first.usage.total_tokens


async def test_default_max_tokens_is_written_into_the_forwarded_body(gw: Harness) -> None:
    raw = await gw.openai("vip").chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES)
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 64
    assert gw.backends[0].received[-1].body["max_tokens"] == 64  # the pool's default
    await gw.settled()
    record = await gw.task(raw.headers["x-request-id"])
    assert int(record["cost"]) == completion.usage.prompt_tokens + 64


async def test_a_completion_without_max_tokens_keeps_the_apis_default_of_16(gw: Harness) -> None:
    # The OpenAI API and vLLM stop a /v1/completions request that names no max_tokens at 16
    # tokens; the pool's default (64 here) is for chats, which have no such default.
    raw = await gw.openai("vip").completions.with_raw_response.create(model="demo", prompt="hi")
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 16
    assert gw.backends[0].received[-1].body["max_tokens"] == 16
    await gw.settled()
    record = await gw.task(raw.headers["x-request-id"])
    assert int(record["cost"]) == completion.usage.prompt_tokens + 16


async def test_chat_stream_strips_the_usage_chunk_the_client_did_not_ask_for(gw: Harness) -> None:
    raw = await gw.openai("vip").chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=7, stream=True)
    task_id = raw.headers["x-request-id"]
    chunks = [chunk async for chunk in raw.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(f" t{i}" for i in range(7))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk reached the client
    forwarded = gw.backends[0].received[-1].body
    assert forwarded["stream_options"] == {"include_usage": True}
    await gw.settled()
    record = await gw.task(task_id)
    assert int(record["usage"]) == await _expected_prompt(gw, MESSAGES) + 7


async def test_chat_stream_keeps_the_usage_chunk_when_asked(gw: Harness) -> None:
    raw = await gw.openai("vip").chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in raw.parse()]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 4
    await gw.settled()
    record = await gw.task(raw.headers["x-request-id"])
    assert int(record["usage"]) == usage.total_tokens


async def test_completions_non_streaming_and_streaming(gw: Harness) -> None:
    client = gw.openai("normal")
    raw = await client.completions.with_raw_response.create(
        model="demo", prompt="Once upon a time", max_tokens=6)
    done = raw.parse()
    assert done.choices[0].text == "".join(f" t{i}" for i in range(6))
    assert done.usage is not None
    prompt = gw.gateway.pools["demo"].counter.count_prompt("Once upon a time")
    assert done.usage.prompt_tokens == prompt
    stream_raw = await client.completions.with_raw_response.create(
        model="demo", prompt="Once upon a time", max_tokens=3, stream=True)
    pieces = [c.choices[0].text async for c in stream_raw.parse() if c.choices]
    assert "".join(pieces) == " t0 t1 t2"
    await gw.settled()
    assert int((await gw.task(raw.headers["x-request-id"]))["usage"]) == prompt + 6
    assert int((await gw.task(stream_raw.headers["x-request-id"]))["usage"]) == prompt + 3


async def test_unknown_key_raises_authentication_error(gw: Harness) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        await gw.openai("sk-not-a-key").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=1)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    assert "sk-not-a-key" not in info.value.response.text
    assert gw.backends[0].received == []


async def test_refused_keys_are_counted_by_reason_never_by_key(gw: Harness) -> None:
    def refused(reason: str) -> float | None:
        return gw.app[METRICS].registry.get_sample_value(
            "kvgate_gateway_auth_failures_total", {"reason": reason})

    assert refused("invalid_api_key") == 0 and refused("missing_api_key") == 0
    for _ in range(3):
        with pytest.raises(openai.AuthenticationError):
            await gw.openai("sk-guessed-key").models.list()
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + "/v1/chat/completions", json={"model": "demo"}) as response:
        assert response.status == 401
    assert refused("invalid_api_key") == 3 and refused("missing_api_key") == 1
    assert b"sk-guessed-key" not in generate_latest(gw.app[METRICS].registry)


async def test_quota_429_is_a_rate_limit_error_with_the_exact_refill_time(gw: Harness) -> None:
    client = gw.openai("small")  # burst 1,000 tokens, refill 10 tokens/s
    first = await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=500)
    assert first.usage is not None
    await gw.settled()
    level = await gw.bucket("small")
    assert level == 1000 - first.usage.total_tokens
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=500)
    headers = info.value.response.headers
    cost = first.usage.total_tokens  # the same request again
    exact_ms = (cost - level) * 1000 / 10  # tokens missing / rate, in ms
    retry_ms = int(headers["retry-after-ms"])
    assert exact_ms <= retry_ms <= exact_ms * 1.25 + 1
    assert int(headers["retry-after"]) == -(-retry_ms // 1000)
    assert headers["x-ratelimit-backpressure-level"] == "GREEN"
    assert int(headers["x-queue-depth"]) == 0
    body = info.value.response.json()["error"]
    assert body["code"] == "rate_limit_exceeded" and body["retry_after_ms"] == retry_ms
    assert "this API key's bucket" in body["message"]
    assert set(body) >= {"message", "type", "param", "code"}
    assert await gw.bucket("small") == level  # a rejection charges nothing


async def test_priority_header_lowers_but_never_raises(gw: Harness) -> None:
    lowered = await gw.openai("normal").chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=1, extra_headers={"X-Priority": "batch"})
    raised = await gw.openai("batch").chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=1, extra_headers={"X-Priority": "vip"})
    await gw.settled()
    assert (await gw.task(lowered.headers["x-request-id"]))["tier"] == "2"
    assert (await gw.task(raised.headers["x-request-id"]))["tier"] == "2"
    with pytest.raises(openai.BadRequestError):
        await gw.openai("vip").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=1, extra_headers={"X-Priority": "top"})


async def test_pass_priority_forwards_the_tier(redis_url: str,
                                               redis_client: aioredis.Redis) -> None:
    def adjust(data: dict[str, Any]) -> None:
        data["pools"][0]["pass_priority"] = True
        data["pools"][0]["served_model_name"] = "served-name"

    async with running_gateway(redis_url, adjust=adjust,
                               backend_options={"model": "served-name"}) as gw:
        await gw.publish(Zone.GREEN, BIG)
        await gw.openai("batch").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=1, extra_body={"priority": -5})
        body = gw.backends[0].received[-1].body
        assert body["priority"] == 2  # the tier, not the client's -5
        assert body["model"] == "served-name"


async def test_models_lists_the_pools(gw: Harness) -> None:
    models = await gw.openai("batch").models.list()
    assert [m.id for m in models.data] == ["demo"]


async def test_models_retrieve_answers_one_pool_as_listed(gw: Harness) -> None:
    client = gw.openai("batch")
    listed = (await client.models.with_raw_response.list()).http_response.json()["data"][0]
    raw = await client.models.with_raw_response.retrieve("demo")
    assert raw.parse().id == "demo"
    model = raw.http_response.json()
    assert abs(model.pop("created") - listed.pop("created")) <= 2  # both: time of the answer
    assert model == listed == {
        "id": "demo", "object": "model", "owned_by": "kvgate", "max_model_len": 4096}
    # Unknown names, one with a slash as served model names have (sent as %2F): OpenAI's 404.
    for name in ("gpt-9", "meta-llama/Llama-3.1-8B"):
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve(name)
        error = info.value.response.json()["error"]
        assert error == {"message": f"The model `{name}` does not exist.",
                         "type": "invalid_request_error", "param": "model",
                         "code": "model_not_found"}
    with pytest.raises(openai.AuthenticationError):
        await gw.openai("sk-not-a-key").models.retrieve("demo")


async def test_tenant_label_only_when_configured(redis_url: str,
                                                 redis_client: aioredis.Redis) -> None:
    async with running_gateway(redis_url, tenant_metrics=True) as gw:
        await gw.publish(Zone.GREEN, BIG)
        await gw.openai("batch").completions.create(model="demo", prompt="x", max_tokens=1)
        count = gw.gateway.metrics.registry.get_sample_value(
            "kvgate_gateway_requests_total",
            {"pool": "demo", "tier": "batch", "tenant": "batch", "outcome": "ok"})
        assert count == 1


async def test_a_whole_answer_may_be_quiet_longer_the_more_tokens_it_may_generate(
    redis_url: str, redis_client: aioredis.Redis,
) -> None:
    """200 ms of silence plus 10 ms per output token: a node that answers after 600 ms is
    waited for when the request may generate 100 tokens (1.2 s), not when it may generate 20
    (0.4 s)."""
    async with running_gateway(redis_url, backend_options={"whole_answer_delay_ms": 600},
                               upstream_timeout_ms=200, upstream_ms_per_output_token=10) as gw:
        await gw.publish(Zone.GREEN)
        sdk = gw.openai("batch")
        answer = await sdk.chat.completions.create(model="demo", messages=MESSAGES,
                                                   max_tokens=100)
        assert answer.usage is not None and answer.usage.completion_tokens == 100
        with pytest.raises(openai.APIStatusError) as info:
            await sdk.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=20)
        assert info.value.status_code == 502
        assert info.value.code == "upstream_timeout"
        assert "the node sent nothing for" in info.value.message
        # The node may still be generating: the status decides, not a promise that a retry
        # is cheap.
        assert "x-should-retry" not in info.value.response.headers


async def test_a_stream_gets_no_allowance_for_its_length(
    redis_url: str, redis_client: aioredis.Redis,
) -> None:
    """A live node sends a token every step, so a stream that goes quiet fails after
    `upstream_timeout_ms` whatever its `max_tokens` (here 500: 5.2 s if it counted)."""
    async with running_gateway(redis_url, backend_options={"hold_after": 1},
                               upstream_timeout_ms=200, upstream_ms_per_output_token=10) as gw:
        await gw.publish(Zone.GREEN)
        loop = asyncio.get_running_loop()
        started = loop.time()
        stream = await gw.openai("batch").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=500, stream=True)
        received = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                received.append(chunk)
        elapsed = loop.time() - started
        text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
        assert text == " t0"  # the one token the node sent before it went quiet
        # Said as a timeout, as the same node's whole answer would be, not as a broken stream.
        assert info.value.code == "upstream_timeout"
        assert "timed out: the node sent nothing for 0.2 s" in info.value.message
        assert 0.2 <= elapsed < 2.0, elapsed


async def test_a_vip_streams_first_token_is_counted_for_its_node(gw: Harness) -> None:
    """The release control's signal: with the leader's objective in the state hash, a streamed
    VIP answer counts one first token on its node (within the objective: none over it); a
    Normal one and a non-streamed VIP one count nothing (tests/test_core_prefill_control.py counts
    those over the objective)."""
    await gw.publish(Zone.GREEN, extra={"vip_ttft_objective_ms": 60_000})
    stream = await gw.openai("vip").chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=3, stream=True)
    _ = [chunk async for chunk in stream]
    normal = await gw.openai("normal").chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=3, stream=True)
    _ = [chunk async for chunk in normal]
    await gw.openai("vip").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3)
    await gw.settled()
    raw: dict[Any, Any] = await gw.redis.hgetall(gw.store.keys.node_vip_ttft)
    counts = {bytes(k).decode(): int(v) for k, v in raw.items()}
    # ...and in one 10% bucket of milliseconds (scheduler.calm learns the calm P99 from them).
    buckets = {k: v for k, v in counts.items() if k.startswith("h")}
    assert {k: v for k, v in counts.items() if k not in buckets} == {"node-0:n": 1}
    assert list(buckets.values()) == [1]


async def test_an_allowance_used_up_for_hours_stops_the_sdks_retries(redis_url: str) -> None:
    """A daily allowance used up at noon (UTC, Redis' clock) returns at midnight, past what an
    SDK waits for (120 s): the 429's hint is the reset, hours away, with `x-should-retry:
    false`, and the official SDK, left to its default of two retries, gives up at once instead
    of asking twice more. Used up 30 s before midnight, the same refusal is an ordinary 429
    whose hint covers the wait."""

    def daily_tenant(data: dict[str, Any]) -> None:
        data["tenants"].append({"name": "daily", "tier": "normal", "key_sha256": [sha(DAILY)],
                                "rate": 1_000_000, "burst": 60, "max_queued": 10,
                                "daily_tokens": 60})

    async with running_gateway(redis_url, adjust=daily_tenant) as gw:
        await gw.publish(Zone.GREEN)
        sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=DAILY)  # 2 retries
        registry = gw.gateway.metrics.registry
        labels = {"pool": "demo", "tier": "normal", "outcome": "rejected"}
        try:
            for day, before_midnight_s in ((20_000, 12 * 3600), (20_001, 30)):
                await gw.redis.hset(gw.store.keys.clock, "frozen_us",
                                    ((day + 1) * 86_400 - before_midnight_s) * 1_000_000)
                await sdk.chat.completions.create(model="demo", messages=MESSAGES,
                                                  max_tokens=20)  # most of the day's 60
                await gw.settled()
                rejected = registry.get_sample_value("kvgate_gateway_requests_total", labels)
                if before_midnight_s > 60:
                    with pytest.raises(openai.RateLimitError) as refused:
                        await sdk.chat.completions.create(model="demo", messages=MESSAGES,
                                                          max_tokens=20)
                    headers = refused.value.response.headers
                    assert headers["x-should-retry"] == "false"
                    # The reset itself, not a capped minute.
                    assert int(headers["retry-after-ms"]) >= before_midnight_s * 1000
                    assert "daily token allowance" in refused.value.message
                    assert registry.get_sample_value(
                        "kvgate_gateway_requests_total", labels) == (rejected or 0) + 1
                    continue
                async with aiohttp.ClientSession() as http, http.post(
                        gw.url + "/v1/chat/completions", headers={
                            "Authorization": f"Bearer {DAILY}"}, json={
                            "model": "demo", "messages": MESSAGES, "max_tokens": 20}) as answer:
                    assert answer.status == 429
                    assert "x-should-retry" not in answer.headers
                    assert 30 <= int(answer.headers["Retry-After"]) <= 60
        finally:
            await sdk.close()


@pytest.mark.parametrize(("rate", "retries"), [(10, True), (1, False)])
async def test_a_bucket_refusal_hints_its_exact_refill_even_past_a_minute(
    redis_url: str, rate: int, retries: bool,
) -> None:
    """A token bucket's refill time is arithmetic, not an estimate: the 429 carries it whole.
    At 10 tokens/s the second request's tokens come back in about 90 s, which the SDKs wait
    for (a hint capped at 60 s sent them back a minute early, twice, for two more refusals);
    at 1 token/s in about 15 minutes, past what they wait for, and the answer says so."""

    def slow_tenant(data: dict[str, Any]) -> None:
        # A name of its own per case: the buckets outlive the gateway in the shared Redis.
        data["tenants"].append({"name": f"slow-{rate}", "tier": "normal",
                                "key_sha256": [sha(SLOW)],
                                "rate": rate, "burst": 1_000, "max_queued": 10})

    async with running_gateway(redis_url, adjust=slow_tenant) as gw:
        await gw.publish(Zone.GREEN)
        async with aiohttp.ClientSession() as http:
            statuses = []
            for _ in range(2):
                async with http.post(gw.url + "/v1/chat/completions", headers={
                        "Authorization": f"Bearer {SLOW}"}, json={
                        "model": "demo", "messages": MESSAGES, "max_tokens": 900}) as answer:
                    statuses.append(answer.status)
                    body = await answer.json()
                    if statuses == [429]:
                        break
                    headers = answer.headers
        assert statuses == [200, 429], (statuses, body)
        assert body["error"]["code"] == "rate_limit_exceeded"
        found = re.search(r"refills enough in (\d+) ms", body["error"]["message"])
        assert found is not None
        exact_ms = int(found[1])
        assert exact_ms > 60_000
        hint_ms = int(headers["retry-after-ms"])
        assert exact_ms <= hint_ms <= exact_ms * 1.25 + 1
        assert int(headers["Retry-After"]) == -(-hint_ms // 1000)
        if retries:
            assert hint_ms <= 120_000 and "x-should-retry" not in headers
        else:
            assert hint_ms > 120_000 and headers["x-should-retry"] == "false"


async def test_a_completion_may_score_its_prompt_with_echo_and_no_tokens(gw: Harness) -> None:
    """`echo` with `max_tokens` 0 asks for the prompt's logprobs and no generation (lm-eval's
    loglikelihood requests): OpenAI's API and vLLM allow it; it was refused as a bad
    max_tokens. Without `echo`, 0 is still refused."""
    await gw.publish(Zone.GREEN)
    sdk = gw.openai("batch")
    scored = await sdk.completions.create(model="demo", prompt="The capital of France is Paris",
                                          max_tokens=0, echo=True, logprobs=1)
    assert scored.choices
    forwarded = gw.backends[0].received[-1].body
    assert forwarded["max_tokens"] == 0 and forwarded["echo"] is True
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.completions.create(model="demo", prompt="x", max_tokens=0)
    assert refused.value.param == "max_tokens"


async def test_images_are_not_refused_on_the_guess_of_their_tokens(redis_url: str) -> None:
    """Each image counts a declared 1,024 tokens (the reservation's guess; a model's real cost
    for a small one is a few dozen): four thumbnails and a word, on a 4,096-token pool, were
    refused as over the context, for good (`x-should-retry: false`). Refusals rest on what was
    counted; the node (here one that charges 600 tokens an image) judges the images. A text too
    long is still refused."""
    node_counter = TokenCounter(chat_format=ChatFormat(non_text_part_tokens=600))

    def default_1024(data: dict[str, Any]) -> None:
        data["pools"][0]["default_max_tokens"] = 1024

    async with running_gateway(redis_url, backend_options={"counter": node_counter},
                               adjust=default_1024) as gw:
        await _images_are_judged_by_the_node(gw)


async def _images_are_judged_by_the_node(gw: Harness) -> None:
    await gw.publish(Zone.GREEN)
    image = {"type": "image_url",
             "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}
    sdk = gw.openai("batch")
    thumbnails: list[Any] = [{"type": "text", "text": "describe"}, *[image] * 4]
    answer = await sdk.chat.completions.create(
        model="demo", max_tokens=10, messages=[{"role": "user", "content": thumbnails}])
    assert answer.choices
    assert len(gw.backends[0].received[-1].body["messages"][0]["content"]) == 5
    # Sent without max_tokens where the context leaves less than the pool's default (1,024):
    # none is written, and the node takes the rest of its context by its own count. Written
    # from the gateway's estimate (about 60 here, the image's guess included), it would be
    # whatever the gateway thought; written from the text alone (the guess leaving no room),
    # the node refused a request it could serve.
    # What the node may take is bounded by what the text leaves, so that is what is reserved
    # and what bounds the charge, for each of n sequences (a bound from the estimate, the
    # guess included, undercharged three sequences that each took the node's rest).
    for words, n in ((3000, 1), (3450, 1), (3000, 3)):
        near: list[Any] = [{"type": "text", "text": "word " * words}, image]
        raw = await sdk.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": near}], n=n)
        answer = raw.parse()
        assert answer.choices and answer.usage is not None
        assert "max_tokens" not in gw.backends[0].received[-1].body
        node_prompt = answer.usage.prompt_tokens
        assert answer.usage.total_tokens == node_prompt + n * (4096 - node_prompt)
        await gw.settled()
        record = await gw.task(raw.headers["x-request-id"])
        assert int(record["usage"]) == answer.usage.total_tokens  # charged in full
    with pytest.raises(openai.BadRequestError) as refused:
        long_text: list[Any] = [{"type": "text", "text": "word " * 5000}, image]
        await sdk.chat.completions.create(
            model="demo", max_tokens=10, messages=[{"role": "user", "content": long_text}])
    assert refused.value.code == "context_length_exceeded"


async def test_a_whole_answers_allowance_counts_decode_steps_not_every_sequences_tokens(
    redis_url: str,
) -> None:
    """n sequences decode in the same steps: 20 tokens at n = 4 take 20 steps. The allowance
    (200 ms + 10 ms a token) counted 80 and waited 1 s for a node silent for 600 ms; with n =
    128 and 4,096 tokens, a hung node held its reservation for hours."""
    async with running_gateway(redis_url, backend_options={"whole_answer_delay_ms": 600},
                               upstream_timeout_ms=200, upstream_ms_per_output_token=10) as gw:
        await gw.publish(Zone.GREEN)
        sdk = gw.openai("batch")
        answer = await sdk.chat.completions.create(model="demo", messages=MESSAGES,
                                                   max_tokens=100)  # 1.2 s: waited for
        assert answer.choices
        with pytest.raises(openai.APIStatusError) as info:
            await sdk.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=20,
                                              n=4)  # 0.4 s, not 1 s
        assert info.value.status_code == 502 and info.value.code == "upstream_timeout"
