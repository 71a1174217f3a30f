"""`examples/local.toml` as shipped, run for real: requests it can never serve as sent get a 400
with `x-should-retry: false`, and neither kvgate's SDK nor the official one sends them twice.

The stack is the one the file's header describes, on loopback: a redis-server of this module,
two vLLM-speaking backends serving the file's `served_model_name`, `python -m scheduler` and
`python -m gateway`, all given the example file with only the Redis URL and the backends'
addresses changed. Attempts are counted at both ends: by the client (its transport, its retry
counters) and by the gateway (`kvgate_gateway_requests_total`, one per request it handled).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvgate_client
from bench.common.localredis import start_redis
from kvgate_client import RetryPolicy, RetryTransport, retrying
from tests.live import Processes

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "local.toml"
MESSAGES: list[Any] = [{"role": "user", "content": "Summarise the plot of Hamlet."}]
# A policy that would retry a 400: only the gateway's header can stop it.
RETRIES_400 = RetryPolicy(retryable_statuses=frozenset({400, 429, 503, 504}))


@dataclass
class Stack:
    url: str
    config: dict[str, Any]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with EXAMPLE.open("rb") as f:
        data = tomllib.load(f)
    server = start_redis()
    procs = Processes()
    try:
        pool = data["pools"][0]
        for i, backend in enumerate(pool["backends"]):
            _, url = procs.instant_backend(f"example-node-{i}", model=pool["served_model_name"])
            backend["url"] = url
        data["redis"]["url"] = server.url
        config = procs.write_config(data, "local.toml")
        procs.scheduler(config, "example-scheduler")
        gateway = procs.gateway(config, "example-gateway", redis_url=server.url)
        yield Stack(gateway.url, data)
        assert gateway.child.alive(), "the gateway died: " + gateway.child.log_tail()
    finally:
        procs.cleanup()
        server.stop()


def tenant(stack: Stack, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(t for t in stack.config["tenants"] if t["name"] == name)
    return found


def handled(stack: Stack) -> int:
    """Completion requests the gateway has answered, whatever the outcome."""
    text = httpx.get(stack.url + "/metrics").text
    return int(sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvgate_gateway_requests"
        for sample in family.samples if sample.name == "kvgate_gateway_requests_total"
    ))


class Counting(httpx.BaseTransport):
    """The real transport, counting what goes on the wire."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


# (key, max_tokens, status, code): the two ways the example refuses a request for good.
NEVER = {
    # 8,192 output tokens are within the pool's max_max_tokens, but prompt + 8,192 is more
    # than the trial key's burst (4,096 tokens): its bucket can never hold the request.
    "exceeds_burst": ("sk-demo-trial", 8192, 400, "exceeds_burst"),
    # Over the pool's max_max_tokens (8,192), from any key.
    "max_tokens_too_large": ("sk-demo-vip", 9000, 400, "max_tokens_too_large"),
}


def test_the_example_makes_the_never_retry_cases_reachable(stack: Stack) -> None:
    pool = stack.config["pools"][0]
    trial = tenant(stack, "trial")
    assert pool["max_max_tokens"] == 8192 < 9000
    # An ordinary request of the trial key fits (the pool's default output), a maximal one
    # cannot: the rejection below is about size, not a key that is always refused.
    assert trial["burst"] < 8192 and pool["default_max_tokens"] + 100 < trial["burst"]
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-demo-trial",
                       max_retries=0) as client:
        done = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=16)
    assert done.usage is not None and done.usage.completion_tokens == 16
    assert done.model == "demo"  # the name asked for, not the served one


@pytest.mark.parametrize("policy", [RetryPolicy(), RETRIES_400], ids=["default", "retries-400"])
@pytest.mark.parametrize("case", sorted(NEVER))
def test_kvgate_sdk_does_not_retry_a_request_that_can_never_succeed(
    stack: Stack, case: str, policy: RetryPolicy
) -> None:
    key, max_tokens, status, code = NEVER[case]
    wire = Counting()
    transport = RetryTransport(wire, policy=policy)
    before = handled(stack)
    with (kvgate_client.KvgateClient(stack.url + "/v1", key, retry_transport=transport) as client,
          pytest.raises(kvgate_client.APIStatusError) as info):
        client.chat("demo", MESSAGES, max_tokens=max_tokens)
    error = info.value
    assert (error.status_code, error.code) == (status, code)
    assert error.type == "invalid_request_error"
    assert error.headers["x-should-retry"] == "false"
    assert "retry-after" not in error.headers  # nothing to come back for
    assert wire.sent == 1
    assert handled(stack) - before == 1
    stats = client.stats()
    assert (stats.requests, stats.attempts, stats.retries) == (1, 1, 0)
    # Stopped by the header, not by the status table.
    assert stats.outcomes == {retrying.SERVER_SAID_NO: 1}


@pytest.mark.parametrize("case", sorted(NEVER))
def test_kvgate_openai_drop_in_does_not_retry_either(stack: Stack, case: str) -> None:
    key, max_tokens, status, code = NEVER[case]
    transport = RetryTransport(policy=RETRIES_400)
    before = handled(stack)
    with (kvgate_client.openai(base_url=stack.url + "/v1", api_key=key,
                               retry_transport=transport) as client,
          pytest.raises(openai.BadRequestError) as info):
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=max_tokens)
    assert (info.value.status_code, info.value.code) == (status, code)
    assert info.value.response.headers["x-should-retry"] == "false"
    assert handled(stack) - before == 1
    assert transport.stats().outcomes == {retrying.SERVER_SAID_NO: 1}


@pytest.mark.parametrize("case", sorted(NEVER))
def test_the_official_openai_sdk_makes_one_attempt(stack: Stack, case: str) -> None:
    """The SDK reads `x-should-retry` before its status table (which would not retry a 400
    either): with max_retries=2 it still sends the request once."""
    key, max_tokens, status, code = NEVER[case]
    wire = Counting()
    # openai 3.x annotates http_client as its httpx2 client and accepts a classic httpx one.
    http: dict[str, Any] = {"http_client": httpx.Client(transport=wire)}
    before = handled(stack)
    with (openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=2, **http) as client,
          pytest.raises(openai.BadRequestError) as info):
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=max_tokens)
    assert (info.value.status_code, info.value.code) == (status, code)
    assert info.value.response.headers["x-should-retry"] == "false"
    assert wire.sent == 1
    assert handled(stack) - before == 1
