"""Tool lists too long to count are refused on their length, before a count walks them (a real
gateway on loopback, the session's redis-server).

Counting a chat renders and serialises every tool definition and every tool call on the event
loop: a 3 MB body of a million empty tools in `chat_template_kwargs.tools` held it for over
4 s, every tenant's requests with it. Each entry takes at least a token of the prompt, so no
list longer than the context can be served: `tools`, `chat_template_kwargs.tools` and the tool
calls of all the messages together are refused past `context_length` entries, as content parts
are (400, OpenAI's `array_above_max_length`, `param` naming the list), and a list at the bound
is counted like any other request (and, each entry costing a token at least, refused on its
count).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.state import GATEWAY
from tests.gateway_harness import KEYS, POOL, hostile_gateway

USER = {"role": "user", "content": "What is the weather?"}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
CALL = {"id": "call-0", "type": "function", "function": {"name": "weather", "arguments": "{}"}}


async def _never(request: web.Request) -> web.StreamResponse:
    raise AssertionError("nothing must reach the node")


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/chat/completions", json={"model": POOL, "max_tokens": 8, **body},
            headers={"Authorization": f"Bearer {KEYS['normal']}"}) as response:
        return response.status, orjson.loads(await response.read())


def _tools(n: int) -> dict[str, Any]:
    return {"messages": [USER], "tools": [TOOL] * n}


def _template_tools(n: int) -> dict[str, Any]:
    return {"messages": [USER], "chat_template_kwargs": {"tools": [{}] * n}}


def _tool_calls(n: int) -> dict[str, Any]:
    """`n` tool calls over two assistant turns: the bound is on all of a chat's calls."""
    first = n // 2
    return {"messages": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL] * first},
        {"role": "tool", "tool_call_id": "call-0", "content": "sunny"},
        {"role": "assistant", "content": None, "tool_calls": [CALL] * (n - first)},
    ]}


@pytest.mark.parametrize(("body", "param"), [
    pytest.param(_tools, "tools", id="tools"),
    pytest.param(_template_tools, "chat_template_kwargs.tools", id="template-tools"),
    pytest.param(_tool_calls, "messages", id="tool-calls"),
])
async def test_a_tool_list_longer_than_the_context_is_refused_before_counting(
    redis_url: str, redis_client: Any, body: Callable[[int], dict[str, Any]], param: str,
) -> None:
    async with hostile_gateway(redis_url, _never) as (url, app):
        pool = app[GATEWAY].pools[POOL]
        counter, limit = pool.counter, pool.settings.context_length

        def counted() -> tuple[int, int]:
            return counter.stats.hits, counter.stats.misses

        before = counted()
        status, answer = await _post(url, body(limit + 1))
        error = answer["error"]
        assert status == 400, answer
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == (param, "array_above_max_length")
        assert str(limit) in error["message"] and str(limit + 1) in error["message"]
        assert counted() == before  # refused on the list's length alone

        # At the bound the parser takes it: it is counted, and its entries' tokens (one at
        # least each) put it over the context.
        status, answer = await _post(url, body(limit))
        assert status == 400, answer
        assert answer["error"]["code"] == "context_length_exceeded"
        assert counted() != before
