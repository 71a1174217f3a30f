"""HTTP handlers: the two generation endpoints (auth, estimate, admit, proxy, settle) and the
operational ones (/v1/models, /v1/models/{model}, /healthz, /readyz, /metrics,
/openapi.json)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from admission.config import TenantSettings
from admission.errors import describe
from admission.scripts import ensure_ready
from admission.tiers import Tier
from gateway import metrics as m
from gateway.admit import STORE_ERRORS
from gateway.auth import PRIORITY_HEADER, effective_tier
from gateway.errors import ApiError, bad_request
from gateway.parse import Kind, parse_inbound, pool_of
from gateway.pools import PoolRuntime
from gateway.relay import Meter, Phase
from gateway.state import GATEWAY, METRICS, OPENAPI, Gateway

log = logging.getLogger("kvgate.gateway")

TIMEOUT_HEADER = "X-Request-Timeout"
"""Seconds the client is willing to wait for its request to leave the queue."""
MAX_CLIENT_TIMEOUT_S = 1e9
"""Larger values mean "no deadline of my own" (the tier's queue timeout applies); capped before
the conversion to ms, which would overflow for values like 1e308."""


SDK_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
"""The OpenAI SDKs send their read timeout (seconds) with every request: how long the client
waits for the first byte of the answer before it gives up and, by default, sends the request
again, to the back of the queue."""
SDK_TIMEOUT_MARGIN_S = 0.5
"""The queue deadline an SDK's read timeout leaves ends this long before it (or a tenth of it,
if more): the 429 (sent within `QUEUE_ANSWER_GRACE_S` of the deadline) and its hint must reach
the client while it still listens."""


def _sdk_deadline_ms(value: str | None, generation_s: float = 0.0) -> int | None:
    """The queue deadline an SDK's declared read timeout leaves, or None: no such header, or
    one that is not a positive number (the SDK's business, not a reason to refuse the request).
    A timeout of t seconds leaves t - max(`SDK_TIMEOUT_MARGIN_S`, t / 10) - `generation_s`,
    and at least t / 2.

    `generation_s`: how long the answer may take once the node has the request, when its first
    byte comes only then (a whole, non-streamed answer: `gateway.parse.whole_answer_s`).
    Without it the queue would take all the client waits for, and a request released near its
    deadline would be cut off by the client mid-generation, then sent again from the back of
    the queue. The floor keeps half the wait for the queue, so that a long `max_tokens` (whose
    estimate is a bound, far above most answers) never makes a request's deadline pass on
    arrival."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if not (seconds > 0 and math.isfinite(seconds)):
        return None
    seconds = min(seconds, MAX_CLIENT_TIMEOUT_S)
    left = max(seconds / 2,
               seconds - max(SDK_TIMEOUT_MARGIN_S, seconds / 10) - max(0.0, generation_s))
    return max(1, math.floor(left * 1000))


def client_deadline_ms(explicit: str | None, sdk_read_timeout: str | None, *,
                       generation_s: float = 0.0) -> int | None:
    """The client's own deadline for leaving the queue: the shorter of `X-Request-Timeout` and
    what an SDK's read timeout leaves (`generation_s` before it kept for a whole answer's
    generation: `_sdk_deadline_ms`); None when it states neither. `X-Request-Timeout` is the
    wait for the queue itself, as stated, and keeps nothing back."""
    return _shorter(_client_timeout_ms(explicit),
                    _sdk_deadline_ms(sdk_read_timeout, generation_s))


def _shorter(*deadlines_ms: int | None) -> int | None:
    stated = [ms for ms in deadlines_ms if ms is not None]
    return min(stated) if stated else None


def _client_timeout_ms(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise bad_request(f"{TIMEOUT_HEADER} must be a positive number of seconds.",
                          param=TIMEOUT_HEADER, code="invalid_timeout")
    return max(1, math.ceil(min(seconds, MAX_CLIENT_TIMEOUT_S) * 1000))


async def _read_body(request: web.Request, timeout_ms: int) -> bytes:
    """The request's body, or 408 `request_timeout` once reading it has taken `timeout_ms`:
    a client that sends its body byte by byte would otherwise hold its connection and this
    handler for as long as it likes. Over the app's `client_max_size`, 413 (aiohttp's own, as
    `request.read()` raises it).

    Read from the stream rather than with `request.read()`, which keeps the bytes on the
    request for as long as its handler runs (a queued request's whole wait, then its answer):
    the handler needs them only until they are parsed."""
    limit = request.client_max_size
    content = request.content
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            set_chunk_size = getattr(content, "set_read_chunk_size", None)  # older aiohttp: none
            if limit and set_chunk_size is not None:
                # As request.read() does: a compressed body decompresses in large chunks.
                set_chunk_size(limit)
            chunks: list[bytes] = []
            size = 0
            while chunk := await content.readany():
                chunks.append(chunk)
                size += len(chunk)
                if limit and size > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            return b"".join(chunks)
    except TimeoutError:
        # The rest of the body is still on its way: the connection cannot carry another request.
        raise ApiError(408, f"The request body did not arrive within {timeout_ms / 1000:g} s.",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except RequestPayloadError as exc:
        # A body aiohttp cannot decode (a Content-Encoding it does not match) is the client's
        # fault: as a 500 the SDKs would send it again, unchanged. The parser stopped inside
        # the body, so the connection cannot carry another request either. Marking the body
        # ended keeps aiohttp from reading it again after the answer (to drain it for the
        # next request) and logging this same failure as an unhandled exception.
        request.content.feed_eof()
        raise ApiError(400, f"The request body could not be read: {_payload_reason(exc)}",
                       code="invalid_body", headers={"Connection": "close"}) from None


def _payload_reason(exc: RequestPayloadError) -> str:
    # aiohttp's message is "400, message:\n  <reason>"; the reason alone reads better.
    cause = exc.__cause__
    message = getattr(cause, "message", None)
    return message if isinstance(message, str) and message else str(exc).split(":", 1)[-1].strip()


def _outcome_of(error: ApiError) -> str:
    if error.tag is not None:
        return error.tag
    if error.code == "admission_unavailable":
        return m.UNAVAILABLE
    if error.status >= 500:
        return m.UPSTREAM_ERROR
    return m.REJECTED


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    metrics = gw.metrics
    loop = asyncio.get_running_loop()
    started = loop.time()
    tenant = _tenant(gw, request)
    # A request refused before it names a pool is counted under pool "none", at the tier it
    # asked for when that much was valid (the tenant's own otherwise): a client that gets
    # every request wrong must show on the requests panel, not only in its own logs.
    tier = tenant.tier
    try:
        tier = effective_tier(tenant, request.headers.get(PRIORITY_HEADER))
        explicit_timeout_ms = _client_timeout_ms(request.headers.get(TIMEOUT_HEADER))
        # The raw body is handed over, not kept here: parse_inbound drops it once decoded.
        inbound = await parse_inbound(
            kind, await _read_body(request, gw.config.gateway.request_read_timeout_ms),
            gw.pools, tier, tenant.name)
    except (ApiError, web.HTTPRequestEntityTooLarge):
        labels = metrics.tier_labels("none", tier, tenant.name)
        metrics.child(metrics.requests, *labels, m.INVALID).inc()
        raise
    client_timeout_ms = _shorter(explicit_timeout_ms, _sdk_deadline_ms(
        request.headers.get(SDK_READ_TIMEOUT_HEADER),
        inbound.whole_answer_s(gw.upstream.whole_answer_s_per_token)))
    pool = inbound.pool
    outcome = m.REJECTED
    task_id: str | None = None
    meter: Meter | None = None
    in_flight = metrics.child(metrics.in_flight, pool.name)
    in_flight.inc()
    try:
        ticket = await gw.admitter.admit(inbound, tenant, tier, client_timeout_ms,
                                         arrived=started)
        task_id = ticket.task_id
        meter = Meter(inbound.prompt_tokens, ceiling=inbound.usage_ceiling)
        outcome = m.CLIENT_GONE
        try:
            response = await gw.upstream.forward(request, inbound, ticket, meter, started)
        finally:
            usage, cancelled = meter.finish_args()
            if ticket.admitted:
                gw.settler.finish(pool.store, ticket.task_id, usage, cancelled=cancelled,
                                  labels=ticket.labels, ttft_ms=meter.node_ttft_ms())
            if meter.first_byte_s is not None:
                metrics.child(metrics.ttft, pool.name, tier.label).observe(meter.first_byte_s)
            log.debug("task %s tenant=%s tier=%s pool=%s node=%s phase=%s usage=%s",
                      ticket.task_id, tenant.name, tier.label, pool.name, ticket.node,
                      meter.phase.value, usage)
        if response.status != 200:
            outcome = m.INVALID
        elif meter.phase is Phase.DONE:
            outcome = m.OK if ticket.admitted else m.FAIL_OPEN
        else:
            outcome = m.CLIENT_GONE if request.transport is None or (
                request.transport.is_closing()) else m.UPSTREAM_ERROR
        return response
    except ApiError as exc:
        outcome = _outcome_of(exc)
        if task_id is not None:
            exc.headers.setdefault("X-Request-Id", task_id)
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        # Cancelled: the client hung up while its request was queued or on its way to a node
        # (the runner cancels the handler), or the gateway is stopping and cut it off; or,
        # with the whole answer delivered, the client closed before the body's end.
        if meter is not None and meter.phase is Phase.DONE:
            outcome = m.OK if ticket.admitted else m.FAIL_OPEN
        else:
            outcome = m.SHUTTING_DOWN if gw.admitter.closing else m.CLIENT_GONE
        raise
    except Exception:
        outcome = m.INTERNAL_ERROR
        raise
    finally:
        in_flight.dec()
        labels = metrics.tier_labels(pool.name, tier, tenant.name)
        metrics.child(metrics.requests, *labels, outcome).inc()


def _tenant(gw: Gateway, request: web.Request) -> TenantSettings:
    """The request's tenant; a refused key is counted (by reason, never by key) first."""
    try:
        return gw.tenants.authenticate(request.headers.get("Authorization"))
    except ApiError as exc:
        gw.metrics.child(gw.metrics.auth_failures, exc.code or "invalid_api_key").inc()
        raise


_STARTED = int(time.time())
"""`created` of the model cards: when this gateway started serving its pools, the same on every
call (the pools have no creation date of their own)."""


def _model_card(name: str, pool: PoolRuntime, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "kvgate",
            "max_model_len": pool.settings.context_length}


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    _tenant(gw, request)
    data = [_model_card(name, pool, _STARTED) for name, pool in sorted(gw.pools.items())]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}),
                        content_type="application/json")


async def model(request: web.Request) -> web.Response:
    """One pool as `/v1/models` lists it (the OpenAI SDKs' `models.retrieve`)."""
    gw = request.app[GATEWAY]
    _tenant(gw, request)
    name = request.match_info["model"]
    pool = pool_of({"model": name}, gw.pools)  # the generation endpoints' 404 for a name
    return web.Response(body=orjson.dumps(_model_card(name, pool, _STARTED)),
                        content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def readyz(request: web.Request) -> web.Response:
    """503 unless Redis answers, holds the scripts, and runs one for each pool's keys, as the
    admits do: a user whose ACL lacks EVALSHA or the pools' keys passes a PING and a SCRIPT
    EXISTS, and a gateway reporting ready would answer every request 500
    `admission_misconfigured` (a rolling update with such a Secret would replace every
    healthy pod instead of stopping at the first one)."""
    gw = request.app[GATEWAY]
    try:
        await ensure_ready(gw.redis, gw.scripts)
        # Read-only (hint.lua), the pools at once: a probe's time stays one round trip.
        await asyncio.gather(*(pool.store.queue_view(Tier.VIP) for pool in gw.pools.values()))
    except STORE_ERRORS as exc:
        body = {"status": "not ready", "detail": f"redis: {describe(exc)}"}
        return web.Response(status=503, body=orjson.dumps(body),
                            content_type="application/json")
    return web.Response(body=b'{"status":"ready"}', content_type="application/json")


async def metrics_endpoint(request: web.Request) -> web.Response:
    # Rendered in a thread: a page of many pools and nodes takes hundreds of milliseconds of
    # Python, which on the event loop would hold every request the gateway serves.
    body = await asyncio.to_thread(request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")
