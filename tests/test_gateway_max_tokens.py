"""The `max_tokens` the gateway writes for a request that names none, and the request fields it
passes as vLLM takes them: the session's redis-server, the gateway's app and an instant backend
over loopback (tests.gateway_harness), with the official OpenAI SDK."""

from __future__ import annotations

from typing import Any

from admission.tiers import Zone
from gateway.estimator import ChatFormat, TokenCounter
from tests.gateway_harness import running_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Say hi."}]
CONTEXT = 4096
"""The harness's pools' context_length and its backend's max_model_len."""


def _default_1024(data: dict[str, Any]) -> None:
    data["pools"][0]["default_max_tokens"] = 1024


async def test_a_chat_near_the_context_without_max_tokens_is_served_when_the_node_counts_more(
    redis_url: str,
) -> None:
    """A chat that sends no max_tokens where the context leaves less than the pool's default:
    a node whose template adds a few tokens (here a default system turn) refused the
    max_tokens the gateway wrote from its own count, naming a field the client never sent.
    None is written there; the node takes the rest of its context, which is what is reserved
    and bounds the charge."""
    node_counter = TokenCounter(chat_format=ChatFormat(
        default_system_prompt="You are a helpful assistant."))
    async with running_gateway(redis_url, backend_options={"counter": node_counter},
                               adjust=_default_1024) as gw:
        await gw.publish(Zone.GREEN)
        sdk = gw.openai("batch")
        raw = await sdk.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": "word " * 3500}])
        answer = raw.parse()
        assert answer.usage is not None and answer.usage.total_tokens == CONTEXT
        assert "max_tokens" not in gw.backends[0].received[-1].body
        await gw.settled()
        record = await gw.task(raw.headers["x-request-id"])
        assert int(record["cost"]) == CONTEXT  # the counted prompt and the rest of the context
        # With room for the default, it is written: the reservation stays a true bound.
        await sdk.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "word " * 100}])
        assert gw.backends[0].received[-1].body["max_tokens"] == 1024


async def test_a_completion_near_the_context_keeps_a_written_max_tokens(redis_url: str) -> None:
    """A /v1/completions request naming none gets vLLM's default of 16 there, which an engine
    refuses where the context leaves less: the gateway writes what is left instead."""
    async with running_gateway(redis_url, adjust=_default_1024) as gw:
        await gw.publish(Zone.GREEN)
        sdk = gw.openai("batch")
        prompt = "word " * (CONTEXT - 10)
        prompt_tokens = gw.backends[0].counter.count_prompts(prompt)[0]
        room = CONTEXT - prompt_tokens
        assert 0 < room < 16
        completion = await sdk.completions.create(model="demo", prompt=prompt)
        assert completion.usage is not None and completion.usage.completion_tokens == room
        assert gw.backends[0].received[-1].body["max_tokens"] == room


async def test_empty_stream_options_without_stream_are_accepted_as_vllm_does(
    redis_url: str,
) -> None:
    # Some clients always send the object; vLLM refuses only options that need a stream
    # (test_gateway_errors has that refusal).
    async with running_gateway(redis_url) as gw:
        await gw.publish(Zone.GREEN)
        answer = await gw.openai("vip").chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=3, stream_options={})
        assert answer.choices and answer.usage is not None
        assert gw.backends[0].received[-1].body["stream_options"] == {}
