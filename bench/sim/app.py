"""The HTTP face of a simulated node: vLLM's OpenAI-compatible routes, /health and /metrics.

Run the app with ``handler_cancellation=True`` (``bench.sim.cluster.serve_node`` and the CLI do)
so that a client hanging up on a non-streaming request aborts it in the engine at once, as
vLLM does; a streaming client that hangs up is noticed at the next write either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from bench.sim.config import SimConfig
from bench.sim.engine import SimRequest
from bench.sim.metrics import make_registry, render
from bench.sim.protocol import ApiError, Kind, ParsedRequest, parse_request, tokenize_count
from bench.sim.responses import (
    DONE,
    ResponseIds,
    full_response,
    generated_text,
    model_card,
    role_chunk,
    token_chunk,
    usage,
    usage_chunk,
)
from bench.sim.runner import EngineDeadError, NodeRunner, RequestHandle
from bench.sim.tokens import fake_token_ids
from bench.sim.trace import NodeTrace

log = logging.getLogger("bench.sim")

SIM_RUNNER: Final = web.AppKey("sim_runner", NodeRunner)
SIM_REGISTRY: Final = web.AppKey("sim_registry", CollectorRegistry)

# vLLM's EngineDeadError text: what clients of a node whose engine died actually read.
ENGINE_DEAD_MESSAGE = (
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)
_MAX_BODY_BYTES = 64 * 1024 * 1024


def create_app(config: SimConfig, trace_path: Path | None = None) -> web.Application:
    """One node: its engine task starts and stops with the application (``cleanup_ctx``).
    With ``trace_path``, every step and finished request is appended there (bench.sim.trace)."""
    app = web.Application(client_max_size=_MAX_BODY_BYTES)
    runner = NodeRunner(config, NodeTrace(trace_path) if trace_path is not None else None)
    app[SIM_RUNNER] = runner
    app[SIM_REGISTRY] = make_registry(runner)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[SIM_RUNNER].run(), name="sim-engine")
    task.add_done_callback(_report_engine_failure)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    trace = app[SIM_RUNNER].trace
    if trace is not None:
        trace.close()


def _report_engine_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("simulated engine loop failed", exc_info=task.exception())


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error(err: ApiError) -> web.Response:
    return web.Response(body=err.body(), status=err.status, content_type="application/json")


def _dead() -> web.Response:
    return _error(ApiError(500, ENGINE_DEAD_MESSAGE, err_type="InternalServerError"))


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    runner = request.app[SIM_RUNNER]
    config = runner.config
    try:
        parsed = parse_request(kind, await request.read(), request.headers, config)
    except ApiError as err:
        return _error(err)
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    req = SimRequest(
        request_id=request_id,
        prompt_tokens=parsed.prompt_tokens,
        max_tokens=parsed.max_tokens,
        eos_at=parsed.eos_at,
        priority=parsed.priority,
    )
    try:
        handle = runner.submit(req, streaming=parsed.stream)
    except EngineDeadError:
        return _dead()
    ids = ResponseIds.new(kind, config.model, request_id)
    try:
        if parsed.stream:
            return await _stream(request, handle, parsed, ids)
        while not handle.finished:
            await handle.wait()
        if req.finish_reason == "error":
            return _dead()
        assert req.finish_reason is not None
        text = generated_text(0, req.num_output, req.eos_at)
        body = full_response(ids, text, req.finish_reason, req.prompt_tokens, req.num_output)
        return web.Response(body=body, content_type="application/json")
    finally:
        if not handle.finished:
            runner.abort(handle)


async def _stream(
    request: web.Request, handle: RequestHandle, parsed: ParsedRequest, ids: ResponseIds
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    req = handle.req
    first = True
    try:
        while True:
            await handle.wait()
            if req.finish_reason == "error":
                # A dead engine takes its connections with it: the client sees a reset.
                if request.transport is not None:
                    request.transport.abort()
                return response
            produced = req.num_output
            finished = handle.finished
            if produced == handle.sent and not finished:
                continue
            parts: list[bytes] = []
            if first and ids.kind == "chat":
                parts.append(role_chunk(ids))
            first = False
            text = generated_text(handle.sent, produced, req.eos_at)
            running_usage = usage(req.prompt_tokens, produced) if parsed.continuous_usage else None
            parts.append(
                token_chunk(ids, text, req.finish_reason if finished else None, running_usage)
            )
            handle.sent = produced
            if finished:
                if parsed.include_usage:
                    parts.append(usage_chunk(ids, req.prompt_tokens, produced))
                parts.append(DONE)
            await response.write(b"".join(parts))
            if finished:
                break
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; _generate's finally aborts the request
    return response


async def _models(request: web.Request) -> web.Response:
    config = request.app[SIM_RUNNER].config
    card = model_card(config.model, config.max_model_len, int(time.time()))
    return _json({"object": "list", "data": [card]})


async def _tokenize(request: web.Request) -> web.Response:
    config = request.app[SIM_RUNNER].config
    try:
        count = tokenize_count(await request.read(), config)
    except ApiError as err:
        return _error(err)
    return _json(
        {"count": count, "max_model_len": config.max_model_len, "tokens": fake_token_ids(count)}
    )


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[SIM_RUNNER].crashed else 200)


async def _metrics(request: web.Request) -> web.Response:
    if request.app[SIM_RUNNER].crashed:
        return _dead()
    body = render(request.app[SIM_REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
