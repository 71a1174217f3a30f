"""The simulator's HTTP API over real loopback sockets (one node in the test's event loop)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.cluster import LocalNode, serve_node
from bench.sim.config import SimConfig
from bench.sim.protocol import OUTPUT_TOKENS_HEADER
from bench.sim.tokens import chat_prompt_tokens, completion_prompt_tokens

MODEL = "sim/llama-8b"
# 1000 simulated seconds per wall second: a 7 ms step takes 7 us, so tests finish at once.
FAST: dict[str, Any] = {
    "model": MODEL, "num_gpu_blocks": 2001, "max_model_len": 4096, "time_scale": 1000.0,
}
HELLO = [{"role": "user", "content": "Hello, simulated world!"}]
HELLO_TOKENS = chat_prompt_tokens(["Hello, simulated world!"])
TIMEOUT = 10.0


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def node() -> AsyncIterator[LocalNode]:
    async with serve_node(SimConfig(**FAST)) as n:
        yield n


def sse_events(text: str) -> list[str]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               **headers: str) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw)


async def test_chat_reports_exact_usage(node: LocalNode, session: aiohttp.ClientSession) -> None:
    status, body = await post(session, node.url + "/v1/chat/completions",
                              {"model": MODEL, "messages": HELLO, "max_tokens": 12})
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert body["usage"] == {"prompt_tokens": HELLO_TOKENS, "completion_tokens": 12,
                             "total_tokens": HELLO_TOKENS + 12}
    stats = node.runner.engine.stats
    assert stats.prompt_tokens == HELLO_TOKENS and stats.generation_tokens == 12


async def test_completions_default_and_forced_lengths(
    node: LocalNode, session: aiohttp.ClientSession
) -> None:
    url = node.url + "/v1/completions"
    status, body = await post(session, url, {"prompt": "abcdefgh"})
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["prompt_tokens"] == completion_prompt_tokens("abcdefgh")
    assert body["choices"][0]["finish_reason"] == "length"

    status, body = await post(session, url, {"prompt": "abcdefgh", "max_tokens": 50},
                              **{OUTPUT_TOKENS_HEADER: "5"})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_chat_without_max_tokens_runs_to_the_context_limit(
    session: aiohttp.ClientSession,
) -> None:
    async with serve_node(SimConfig(**{**FAST, "max_model_len": 64})) as small:
        status, body = await post(session, small.url + "/v1/chat/completions",
                                  {"messages": HELLO})
    assert status == 200
    assert body["usage"]["total_tokens"] == 64
    assert body["usage"]["completion_tokens"] == 64 - HELLO_TOKENS
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_without_usage(node: LocalNode, session: aiohttp.ClientSession) -> None:
    async with session.post(node.url + "/v1/chat/completions",
                            json={"messages": HELLO, "max_tokens": 6, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    _, full = await post(session, node.url + "/v1/chat/completions",
                         {"messages": HELLO, "max_tokens": 6})
    assert text == full["choices"][0]["message"]["content"]


async def test_streams_with_include_usage_end_with_a_usage_chunk(
    node: LocalNode, session: aiohttp.ClientSession
) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/completions", {"prompt": "abcdefgh"}),
    ):
        request = {**body, "max_tokens": 9, "stream": True,
                   "stream_options": {"include_usage": True}}
        async with session.post(node.url + path, json=request,
                                headers={OUTPUT_TOKENS_HEADER: "4"}) as resp:
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        last = orjson.loads(events[-2])
        assert last["choices"] == []
        prompt = HELLO_TOKENS if "chat" in path else completion_prompt_tokens("abcdefgh")
        assert last["usage"] == {"prompt_tokens": prompt, "completion_tokens": 4,
                                 "total_tokens": prompt + 4}
        final = orjson.loads(events[-3])
        assert final["choices"][0]["finish_reason"] == "stop"
        assert all("usage" not in orjson.loads(e) for e in events[:-2])


async def test_error_shapes(node: LocalNode, session: aiohttp.ClientSession) -> None:
    url = node.url + "/v1/chat/completions"
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"messages": HELLO, "stream_options": {"include_usage": True}}, 400,
         "Stream options can only be defined when `stream=True`."),
        ({"messages": [{"role": "user", "content": "x" * 20_000}]}, 400,
         "This model's maximum context length is 4096 tokens. However, your request has "
         f"{chat_prompt_tokens(['x' * 20_000])} input tokens."),
        ({"model": "nope", "messages": HELLO}, 404, "The model `nope` does not exist."),
        ({"messages": HELLO, "priority": 1}, 400, "Priority scheduling is not enabled"),
    ]
    for body, status, needle in cases:
        got_status, got = await post(session, url, body)
        assert got_status == status
        assert set(got["error"]) == {"message", "type", "param", "code"}
        assert got["error"]["code"] == status
        assert needle in got["error"]["message"]
    async with session.post(url, data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    assert node.runner.engine.stats.finished == {"stop": 0, "length": 0, "abort": 0}


async def test_priority_accepted_by_a_priority_node(session: aiohttp.ClientSession) -> None:
    async with serve_node(SimConfig(**FAST, scheduling_policy="priority")) as pnode:
        status, body = await post(session, pnode.url + "/v1/chat/completions",
                                  {"messages": HELLO, "max_tokens": 2, "priority": 5})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


async def test_models_health_tokenize_and_metrics(
    node: LocalNode, session: aiohttp.ClientSession
) -> None:
    async with session.get(node.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 4096

    async with session.get(node.url + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""

    status, tok = await post(session, node.url + "/tokenize", {"messages": HELLO})
    assert status == 200 and tok["count"] == HELLO_TOKENS == len(tok["tokens"])

    await post(session, node.url + "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
    async with session.get(node.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    usage = families["vllm:kv_cache_usage_perc"].samples[0]
    assert usage.labels == {"model_name": MODEL, "engine": "0"}
    assert usage.value == 0.0
    gen = families["vllm:generation_tokens"].samples[0]
    assert gen.value == 3
    assert families["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"] == "2001"


async def test_concurrent_overload_preempts_and_still_reports_exact_usage(
    session: aiohttp.ClientSession,
) -> None:
    # 40 usable blocks (640 tokens); ten requests each growing to ~13 blocks must preempt.
    config = SimConfig(model=MODEL, num_gpu_blocks=41, max_model_len=640, time_scale=1000.0)
    prompts = [f"request {i} " + "y" * (300 + 8 * i) for i in range(10)]
    async with serve_node(config) as small:
        results = await asyncio.gather(*(
            post(session, small.url + "/v1/completions",
                 {"prompt": p, "max_tokens": 120}, **{OUTPUT_TOKENS_HEADER: "100"})
            for p in prompts
        ))
        stats = small.runner.engine.stats
        assert stats.preemptions > 0
        assert small.runner.engine.pool.used == 0
    for prompt, (status, body) in zip(prompts, results, strict=True):
        assert status == 200
        assert body["usage"]["prompt_tokens"] == completion_prompt_tokens(prompt)
        assert body["usage"]["completion_tokens"] == 100
        assert body["choices"][0]["finish_reason"] == "stop"
    assert stats.finished["stop"] == 10
    assert stats.generation_tokens == 1000


async def test_stream_pushes_tokens_early_and_disconnect_aborts(
    session: aiohttp.ClientSession,
) -> None:
    # Real time: 2000 tokens would take ~13 s, so the request is surely still running.
    async with serve_node(SimConfig(**{**FAST, "time_scale": 1.0})) as live:
        engine = live.runner.engine
        resp = await session.post(live.url + "/v1/chat/completions",
                                  json={"messages": HELLO, "max_tokens": 2000, "stream": True})
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        assert engine.num_running == 1 and engine.pool.used > 0
        assert sum(engine.stats.finished.values()) == 0
        resp.close()
        async with asyncio.timeout(TIMEOUT):
            await live.runner.wait_until(lambda: engine.stats.finished["abort"] == 1)
        assert engine.pool.used == 0 and not engine.has_work()


async def test_non_stream_disconnect_aborts(session: aiohttp.ClientSession) -> None:
    async with serve_node(SimConfig(**{**FAST, "time_scale": 1.0})) as live:
        engine = live.runner.engine
        pending = asyncio.create_task(post(session, live.url + "/v1/chat/completions",
                                           {"messages": HELLO, "max_tokens": 2000}))
        async with asyncio.timeout(TIMEOUT):
            await live.runner.wait_until(lambda: engine.num_running == 1)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        async with asyncio.timeout(TIMEOUT):
            await live.runner.wait_until(lambda: engine.stats.finished["abort"] == 1)
        assert engine.pool.used == 0


CRASHY: dict[str, Any] = {
    **FAST, "num_gpu_blocks": 11, "max_model_len": 160,
    "crash_after_full_s": 0.0, "crash_usage_threshold": 0.5,
}
BIG_PROMPT = "z" * 400  # ~101 tokens: 7 of 10 blocks, above the 0.5 threshold


async def test_crash_fails_requests_and_kills_health(session: aiohttp.ClientSession) -> None:
    async with serve_node(SimConfig(**CRASHY)) as doomed:
        status, body = await post(session, doomed.url + "/v1/completions",
                                  {"prompt": BIG_PROMPT, "max_tokens": 20})
        assert status == 500
        assert body["error"]["code"] == 500 and body["error"]["type"] == "InternalServerError"
        assert doomed.runner.crashed
        async with session.get(doomed.url + "/health") as resp:
            assert resp.status == 503
        async with session.get(doomed.url + "/metrics") as resp:
            assert resp.status == 500
        status, body = await post(session, doomed.url + "/v1/completions", {"prompt": "a"})
        assert status == 500


async def test_crash_resets_streaming_connections(session: aiohttp.ClientSession) -> None:
    async with serve_node(SimConfig(**CRASHY)) as doomed:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(doomed.url + "/v1/completions",
                                    json={"prompt": BIG_PROMPT, "max_tokens": 20,
                                          "stream": True}) as resp:
                await resp.read()
        assert doomed.runner.crashed


async def test_trace_records_each_step_and_the_finished_request(tmp_path: Path) -> None:
    trace = tmp_path / "node0-trace.jsonl"
    async with serve_node(SimConfig(**FAST), trace=trace) as n, aiohttp.ClientSession() as s:
        status, _ = await post(s, n.url + "/v1/chat/completions",
                               {"model": MODEL, "messages": HELLO, "max_tokens": 5},
                               **{"X-Request-Id": "task-1"})
        assert status == 200
    rows = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    [req] = [r for r in rows if r["k"] == "r"]
    steps = [r for r in rows if r["k"] == "s"]
    assert (req["id"], req["prompt"], req["out"], req["reason"]) == (
        "task-1", HELLO_TOKENS, 5, "length")
    assert req["arr"] <= req["sched"] <= req["first"] <= req["end"]
    assert (req["run0"], req["wait0"]) == (0, 0)
    # One step per generated token; the first carried the whole prompt as prefill.
    assert len(steps) == 5
    assert steps[0]["p"] == HELLO_TOKENS
    assert all(s["n"] == 1 and s["d"] > 0 for s in steps)
