"""An instant backend speaking vLLM's OpenAI-compatible API, for tests and the overhead benchmark.

    python -m bench.common.instant_backend [--port 0] [--model demo] [--output-tokens N]
        [--token-interval-ms MS] [--kv-usage F] [--settable-metrics]

Generation takes no time: chat and text completions, streaming (one token per chunk, the final
usage chunk with `stream_options.include_usage`) or not, with exact usage (prompt tokens counted
with the shipped Qwen2 tokenizer and template, as the gateway counts them). Also `/v1/models`,
`/health`, and `/metrics` with vLLM's metric names (an idle node, whose KV cache reads
`--kv-usage`, 0 by default). `--token-interval-ms` spaces
a stream's tokens that far apart (the first comes at once), so that many streams stay open at
the same time, as they do in front of a real engine (the memory benchmark holds 2,000).

With `--settable-metrics` the engine state /metrics reports can be changed while it runs, for
the tests that hold a node at a given usage and watch what the scheduler and gateways do
there: ``PUT /lab/metrics`` with any of ``{"kv_usage": 0.84, "running": 300, "waiting": 0}``
(a fraction 0..1; sequence counts, which are 0 otherwise). It is a laboratory control, off
unless asked for: nothing shipped listens on /lab.

For tests, in-process: every forwarded body and header set is recorded; `hold_after` makes a
stream stop after that many tokens until `gate` is set (a deterministic "mid-stream" moment);
`aborted` is set when a client leaves a stream before its end; `fail_status` answers every
generation with that status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web

from gateway.estimator import InvalidRequestError, TokenCounter

DONE = b"data: [DONE]\n\n"


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class InstantBackend:
    model: str = "demo"
    max_model_len: int = 32_768
    output_tokens: int | None = None
    """Tokens generated per sequence; None: exactly max_tokens (16 for completions by default)."""
    hold_after: int | None = None
    token_interval_ms: float = 0.0
    """Pause between two tokens of a stream (0: none)."""
    whole_answer_delay_ms: float = 0.0
    """A non-streamed answer is sent this long after the request (0: at once): a generation
    that is silent until it is done."""
    fail_status: int | None = None
    kv_usage: float = 0.0
    """What /metrics reports as `vllm:kv_cache_usage_perc` (fraction of the cache)."""
    running: int = 0
    """What /metrics reports as `vllm:num_requests_running`."""
    waiting: int = 0
    """What /metrics reports as `vllm:num_requests_waiting`."""
    settable_metrics: bool = False
    """Serve ``PUT /lab/metrics`` (sets `kv_usage`, `running`, `waiting`)."""
    record: bool = True
    counter: TokenCounter = field(default_factory=TokenCounter)
    received: list[Received] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a stream reached `hold_after` and waits for `gate`."""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    end_gate: asyncio.Event | None = None
    """When set to an event, a stream's body ends (after `data: [DONE]`) only once it is set:
    a node slow to end its body after its last event."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app[BACKEND] = self
        app.router.add_post("/v1/chat/completions", _chat)
        app.router.add_post("/v1/completions", _completions)
        app.router.add_get("/v1/models", _models)
        app.router.add_get("/health", _health)
        app.router.add_get("/metrics", _metrics)
        if self.settable_metrics:
            app.router.add_put("/lab/metrics", _set_metrics)
        return app


BACKEND: Final = web.AppKey("instant_backend", InstantBackend)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
    body = {"error": {"message": message, "type": kinds.get(status, "InternalServerError"),
                      "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    backend = request.app[BACKEND]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "Invalid JSON body")
    if backend.record:
        backend.received.append(Received(request.path, body, dict(request.headers)))
    if backend.fail_status is not None:
        return _error(backend.fail_status, "EngineCore encountered an issue.")
    if body.get("model") not in (None, backend.model):
        return _error(404, f"The model `{body.get('model')}` does not exist.", "model")
    try:
        if chat:
            prompts = [backend.counter.count_chat(body.get("messages"), body.get("tools"))]
        else:
            prompts = backend.counter.count_prompts(body.get("prompt"))
    except InvalidRequestError as exc:
        return _error(400, exc.message, exc.param)
    n = body.get("n") or 1
    if chat:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = backend.max_model_len - max(prompts)
    if max(prompts) + max_tokens > backend.max_model_len:
        return _error(400, f"This model's maximum context length is {backend.max_model_len} "
                      "tokens.", "max_tokens")
    produced = max_tokens if backend.output_tokens is None else min(max_tokens,
                                                                    backend.output_tokens)
    prompt_tokens = sum(prompts)
    sequences = n * len(prompts)
    completion_tokens = produced * sequences
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    finish = "length" if produced == max_tokens else "stop"
    if not body.get("stream"):
        if backend.whole_answer_delay_ms:
            await asyncio.sleep(backend.whole_answer_delay_ms / 1000)
        if chat:
            choices: list[dict[str, Any]] = [
                {"index": i, "message": {"role": "assistant", "content": _text(0, produced)},
                 "logprobs": None, "finish_reason": finish} for i in range(sequences)]
        else:
            choices = [{"index": i, "text": _text(0, produced), "logprobs": None,
                        "finish_reason": finish} for i in range(sequences)]
        payload = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                   "created": created, "model": backend.model, "choices": choices,
                   "usage": _usage(prompt_tokens, completion_tokens)}
        return web.Response(body=orjson.dumps(payload), content_type="application/json")
    options = body.get("stream_options") or {}
    return await _stream(request, backend, chat, rid, created, sequences, produced, finish,
                         prompt_tokens, include_usage=bool(options.get("include_usage")))


def _text(start: int, end: int) -> str:
    return "".join(f" t{i}" for i in range(start, end))


async def _stream(
    request: web.Request, backend: InstantBackend, chat: bool, rid: str, created: int,
    sequences: int, produced: int, finish: str, prompt_tokens: int, *, include_usage: bool,
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                   "model": backend.model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def token(index: int, i: int) -> dict[str, Any]:
        reason = finish if i == produced - 1 else None
        if chat:
            return {"index": index, "delta": {"content": f" t{i}"}, "logprobs": None,
                    "finish_reason": reason}
        return {"index": index, "text": f" t{i}", "logprobs": None, "finish_reason": reason}

    try:
        if chat:
            await response.write(b"".join(
                chunk([{"index": s, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]) for s in range(sequences)))
        for i in range(produced):
            if i and backend.token_interval_ms > 0:
                await asyncio.sleep(backend.token_interval_ms / 1000)
            if backend.hold_after is not None and i == backend.hold_after:
                backend.held.set()
                await backend.gate.wait()
            await response.write(b"".join(chunk([token(s, i)]) for s in range(sequences)))
        tail = b""
        if include_usage:
            tail += chunk([], _usage(prompt_tokens, produced * sequences))
        await response.write(tail + DONE)
        if backend.end_gate is not None:
            await backend.end_gate.wait()
        await response.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        backend.aborted.set()
        raise
    return response


async def _models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    card = {"id": backend.model, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "max_model_len": backend.max_model_len}
    return web.Response(body=orjson.dumps({"object": "list", "data": [card]}),
                        content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response()


_LAB_FIELDS: Final = {"kv_usage": float, "running": int, "waiting": int}


async def _set_metrics(request: web.Request) -> web.Response:
    try:
        fields = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "Invalid JSON body")
    if not isinstance(fields, dict) or not fields or set(fields) - set(_LAB_FIELDS):
        return _error(400, f"Expected an object with some of {sorted(_LAB_FIELDS)}")
    for name, value in fields.items():
        kind = _LAB_FIELDS[name]
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or (kind is int and not isinstance(value, int)) or value < 0
                or (name == "kv_usage" and value > 1)):
            bound = "a number between 0 and 1" if kind is float else "a whole number >= 0"
            return _error(400, f"{name} must be {bound}", name)
    backend = request.app[BACKEND]
    for name, value in fields.items():
        setattr(backend, name, _LAB_FIELDS[name](value))
    state = {name: getattr(backend, name) for name in _LAB_FIELDS}
    return web.Response(body=orjson.dumps(state), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    labels = f'engine="0",model_name="{backend.model}"'
    text = (
        f"vllm:kv_cache_usage_perc{{{labels}}} {backend.kv_usage!r}\n"
        f"vllm:num_requests_running{{{labels}}} {float(backend.running)!r}\n"
        f"vllm:num_requests_waiting{{{labels}}} {float(backend.waiting)!r}\n"
        f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
        f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="27000"}} 1.0\n'
    )
    return web.Response(text=text, content_type="text/plain")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.common.instant_backend")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="demo")
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--token-interval-ms", type=float, default=0.0,
                   help="pause between two tokens of a stream (default 0: none)")
    p.add_argument("--kv-usage", type=float, default=0.0,
                   help="KV cache usage /metrics reports, a fraction (default 0)")
    p.add_argument("--settable-metrics", action="store_true",
                   help="serve PUT /lab/metrics to change the reported KV usage and sequence "
                        "counts (lab only)")
    args = p.parse_args(argv)
    if args.token_interval_ms < 0:
        p.error("--token-interval-ms must be >= 0")
    if not 0 <= args.kv_usage <= 1:
        p.error("--kv-usage must be between 0 and 1")
    backend = InstantBackend(model=args.model, output_tokens=args.output_tokens, record=False,
                             token_interval_ms=args.token_interval_ms, kv_usage=args.kv_usage,
                             settable_metrics=args.settable_metrics)

    async def serve() -> None:
        runner = web.AppRunner(backend.app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, backlog=2048)
        await site.start()
        port = runner.addresses[0][1]
        print(f"instant backend listening on http://{args.host}:{port}", flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()

    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
