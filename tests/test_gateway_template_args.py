"""What a chat request gives its template besides the messages reserves KV as the prompt does.

vLLM renders the template with the request's `tools` and `documents`, then merges the
request's `chat_template_kwargs` over those arguments: tools or documents put there reach the
prompt just as well, and a `chat_template` there replaced the template itself before vLLM
0.11. A real gateway on a socket, the session's redis-server, the pool's real token counter;
what a request reserved is read from its task record.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from gateway.estimator import ChatFormat
from tests.gateway_harness import BIG, POOL, Harness, running_gateway

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": f"lookup_{i}",
    "description": f"Looks up fact number {i} about a city, its weather and its history. " * 4,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}} for i in range(12)]
DOCUMENTS = [{"title": f"Report {i}", "text": f"Paris saw {i} mm of rain on day {i}. " * 20}
             for i in range(10)]


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> Any:
    async with running_gateway(redis_url) as harness:
        await harness.publish(Zone.GREEN, BIG)
        yield harness


async def _post(gw: Harness, **fields: Any) -> tuple[int, dict[str, Any], Any]:
    body = {"model": POOL, "messages": MESSAGES, "max_tokens": 8, **fields}
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + "/v1/chat/completions", json=body, headers=gw.auth("vip")) as response:
        return response.status, orjson.loads(await response.read()), response.headers


async def _reserved_prompt(gw: Harness, **fields: Any) -> int:
    """The prompt tokens a request with `fields` reserved (admitted, answered)."""
    status, payload, headers = await _post(gw, **fields)
    assert status == 200, payload
    return int((await gw.task(headers["X-Request-Id"]))["prompt_tokens"])


async def test_tools_inside_chat_template_kwargs_reserve_as_much_as_at_top_level(
    gw: Harness,
) -> None:
    counter = gw.gateway.pools[POOL].counter
    bare = counter.count_chat(MESSAGES)
    with_tools = counter.count_chat(MESSAGES, TOOLS)
    assert with_tools - bare > 1_000  # the tools are most of the prompt
    assert await _reserved_prompt(gw) == bare
    assert await _reserved_prompt(gw, tools=TOOLS) == with_tools
    # The same tools where vLLM merges them over the template's arguments: the same count,
    # the template's instructions for tools included.
    assert await _reserved_prompt(
        gw, chat_template_kwargs={"tools": TOOLS, "enable_thinking": False}) == with_tools
    # Flags and numbers steer the template: they cost nothing of their own.
    assert await _reserved_prompt(
        gw, chat_template_kwargs={"enable_thinking": True, "budget": 512, "x": None}) == bare
    # Both: counted twice (vLLM renders the merged ones only), but the instructions once.
    both = await _reserved_prompt(gw, tools=TOOLS, chat_template_kwargs={"tools": TOOLS})
    assert both == 2 * with_tools - bare - ChatFormat().tools_overhead_tokens


@pytest.mark.parametrize("where", ["top", "kwargs"])
async def test_documents_and_other_template_arguments_reserve_their_text(
    gw: Harness, where: str,
) -> None:
    counter = gw.gateway.pools[POOL].counter
    bare = counter.count_chat(MESSAGES)
    text = counter.count_text("".join(d["text"] for d in DOCUMENTS))
    fields: dict[str, Any] = ({"documents": DOCUMENTS} if where == "top"
                              else {"chat_template_kwargs": {"documents": DOCUMENTS}})
    reserved = await _reserved_prompt(gw, **fields)
    # Counted as their JSON: the text and a few tokens for the keys around it.
    assert text <= reserved - bare <= text * 1.5, (reserved - bare, text)
    # Whatever else the kwargs hold that a template may print is counted likewise.
    persona = "You answer in verse. " * 200
    reserved = await _reserved_prompt(gw, chat_template_kwargs={
        "persona": persona, "enable_thinking": False})
    assert counter.count_text(persona) <= reserved - bare <= counter.count_text(persona) + 10


async def test_a_template_given_through_chat_template_kwargs_is_refused_too(
    redis_url: str, redis_client: aioredis.Redis,
) -> None:
    template = "{% for i in range(100) %}{% for m in messages %}{{ m.content }}{% endfor %}" \
               "{% endfor %}"
    async with running_gateway(redis_url) as gw:
        await gw.publish(Zone.GREEN, BIG)
        for kwargs, param in (({"chat_template": template}, "chat_template_kwargs.chat_template"),
                              ("not an object", "chat_template_kwargs")):
            status, payload, headers = await _post(gw, chat_template_kwargs=kwargs)
            assert status == 400, payload
            error = payload["error"]
            assert error["param"] == param
            if param.endswith(".chat_template"):
                assert error["code"] == "chat_template_not_accepted"
                assert headers.get("x-should-retry") == "false"
        assert gw.backends[0].received == []

    def accept(data: dict[str, Any]) -> None:
        data["pools"][0]["accept_chat_template"] = True

    async with running_gateway(redis_url, adjust=accept) as gw:
        await gw.publish(Zone.GREEN, BIG)
        status, payload, _ = await _post(gw, chat_template_kwargs={"chat_template": template})
        assert status == 200, payload
        forwarded = gw.backends[0].received[-1].body["chat_template_kwargs"]
        assert forwarded == {"chat_template": template}
