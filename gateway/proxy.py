"""Forwarding an admitted request to its node and learning what it really cost.

Streaming responses pass through event by event as they arrive: nothing is held back except
the incomplete tail of an SSE event. The gateway always asks the node for
`stream_options.include_usage`, reads the exact usage from the final chunk, and drops that
chunk when the client did not ask for it. Token chunks are counted on the way, so that when a
stream ends early (client gone, node failed) the tokens generated so far can be charged:
prompt + one per chunk that carried output (vLLM sends one token per chunk unless it batches
them with --stream-interval; a batched chunk is then undercounted).

The answer names the model the client asked for (`Inbound.reply_model`), in a whole body and
in every streamed chunk: a chunk whose `model` differs is re-serialised on its own as soon as
its event is complete, so echoing the name holds nothing back either.

Failures before a response: 503 (node unreachable) or 502 (node error, timeout, broken
connection), both with Retry-After, and the reservation refunded. A node's own 4xx (e.g. its
context-length check) keeps its status, message and param, in OpenAI's error shape
(`node_client_error`), except 401, 403 and 404: the client's key and model were valid for
kvgate, so those refuse the gateway (its `backend_api_key_env`, its `served_model_name`) and
become 502 `upstream_rejected`, as does the 400 of an engine refusing the `priority` that
`pass_priority` wrote; a 200 that is no OpenAI answer (a page of another server, a
JSON body to a streamed request), and any status but 200 outside 4xx and 5xx (a redirect, a
204), is a 502 `upstream_malformed_answer`. A failure mid-stream
ends the stream with an error event, as vLLM itself does; a node's own error event is relayed
in OpenAI's shape too (`node_stream_error`), so that the SDKs raise it whatever vLLM version
sent it, and the task ends cancelled, charged what was generated. Once the request is written
to the node, a client that leaves is charged what the node did so far (at least the prompt),
even before the node's answer has begun: a whole answer's headers come only with its last
token.

The node is trusted no further than it must be: its usage is charged up to what the request
could have used (`Meter.ceiling`), one SSE event is held up to `MAX_EVENT_BYTES` (then the
stream ends as broken), a whole answer up to what the request can produce
(`gateway.answersize`; then 502 `upstream_oversized_answer`), an error answer up to
`ERROR_BODY_BYTES` (the rest is dropped), and a client that reads nothing for
`upstream_timeout_ms` is dropped like one that left (`gateway.clientio`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping

import orjson
from aiohttp import web

from gateway.admit import Ticket
from gateway.clientio import ClientStalled, StallGuard, end_within
from gateway.errors import ApiError, jittered, unavailable
from gateway.metrics import GatewayMetrics
from gateway.nodeclient import (
    AnswerTooLarge,
    NodeClient,
    NodeError,
    NodeResponse,
    NodeStuck,
    NodeTimeout,
    NodeUnreachable,
)
from gateway.nodeerrors import ERROR_BODY_BYTES, error_message, node_client_error
from gateway.parse import Inbound
from gateway.relay import EventTooLarge, Meter, Phase, SseRelay, rename_model

log = logging.getLogger("kvgate.gateway")

_ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# Client headers never forwarded: hop-by-hop, credentials, framing, the gateway's own, and
# vLLM's X-data-parallel-rank (the operator's routing inside a data-parallel engine). Those
# describing the client's body go too: aiohttp has already undone its Content-Encoding and the
# gateway sends JSON of its own, so a forwarded `Content-Encoding: gzip` (or a digest of the
# client's bytes) would make the node reject a body that is plain and rewritten.
_DROP_HEADERS = frozenset({
    "host", "authorization", "content-length", "content-type", "connection", "keep-alive",
    "proxy-authorization", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "cookie", "accept-encoding", "expect", "x-priority", "x-request-timeout", "x-request-id",
    "content-encoding", "content-md5", "digest", "content-digest", "repr-digest",
    "x-data-parallel-rank",
})
_DONE = b"data: [DONE]\n\n"
NODE_REJECTIONS = frozenset({401, 403, 404})
"""A node's statuses that mean the gateway, not the client, is refused: its credentials, or the
model name it writes into the request."""
PRIORITY_REFUSED = "priority scheduling is not enabled"
"""In vLLM's 400 to a `priority` sent to an engine without `--scheduling-policy priority`
("Got priority 1 but Priority scheduling is not enabled."): with `pass_priority` the gateway
wrote that field, so the 400 is the deployment's, not the client's."""


def forwarded_headers(request: web.Request, task_id: str,
                      backend: Mapping[str, str] | None = None) -> dict[str, str]:
    """The client's headers a node may see (never its Authorization: that is kvgate's key),
    then `backend`'s (the pool's credentials for its nodes)."""
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",
               "X-Request-Id": task_id}
    for name, value in request.headers.items():
        if name.lower() not in _DROP_HEADERS and not name.lower().startswith("proxy-"):
            headers[name] = value
    if backend:
        headers.update(backend)
    return headers


class Upstream:
    def __init__(
        self,
        client: NodeClient,
        metrics: GatewayMetrics,
        *,
        jitter: float,
        whole_answer_s_per_token: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.jitter = jitter
        self.whole_answer_s_per_token = whole_answer_s_per_token
        self.rng = rng or random.Random()
        self._logged: set[tuple[str, int]] = set()
        """(node, HTTP status) of the configuration problems logged: once each."""

    def _failed(self, ticket: Ticket, kind: str, status: int, message: str, *,
                logged: bool = True, retry: bool | None = None) -> ApiError:
        """Counted each time; logged per task unless the caller logs it its own way.

        `retry` tells clients whether to send the request again (`x-should-retry`, which the
        OpenAI SDKs and kvgate's obey over their status rules): True where the node did no
        work and another attempt can pass (the OpenAI SDKs would retry a 502 anyway, kvgate's
        only when told), False where no retry can pass (no retry hint then); None leaves it
        to the status, for failures after which the node may still be generating."""
        self.metrics.child(self.metrics.upstream_errors, ticket.pool.name, ticket.node, kind).inc()
        if logged:
            log.warning("task %s: node %s failed: %s", ticket.task_id, ticket.node, kind)
        if retry is False:
            return ApiError(status, message, type_="server_error", code=f"upstream_{kind}",
                            headers={"x-should-retry": "false"})
        error = unavailable(message, code=f"upstream_{kind}",
                            retry_ms=jittered(1000, self.jitter, self.rng), status=status)
        if retry:
            error.headers["x-should-retry"] = "true"
        return error

    def _timed_out(self, ticket: Ticket, exc: NodeTimeout) -> ApiError:
        """The node sent nothing for the silence limit, before or inside a whole answer; or
        the gateway ended the exchange on a node the leader judged stuck, which the client
        may send again at once: the node is out of the pool, so a retry lands elsewhere, and
        the closed connection tells it to drop the request."""
        if isinstance(exc, NodeStuck):
            return self._failed(ticket, "stuck", 502,
                                f"The inference node is stuck ({exc}); your request was ended "
                                "there and may be sent again.", retry=True)
        return self._failed(ticket, "timeout", 502,
                            f"The inference node timed out: {exc}. Please retry.")

    def _rejected(self, ticket: Ticket, status: int, message: str | None,
                  check: str = "the pool's backend_api_key_env and served_model_name against "
                  "the node's --api-key and --served-model-name") -> ApiError:
        """A node that refuses what the gateway itself added to the request: the client's
        key and model were valid for kvgate, so the node's status would blame the client.
        The pool's credentials (`backend_api_key_env`) or its `served_model_name` disagree
        with the node's (401, 403, 404), or the tier sent as `priority` to a node without
        priority scheduling; logged once per node and status, counted each time."""
        if (ticket.node, status) not in self._logged:
            self._logged.add((ticket.node, status))
            log.error("pool %s: node %s refused the gateway's request with HTTP %d (%s): check "
                      "%s", ticket.pool.name, ticket.node, status, message or "no message",
                      check)
        return self._failed(
            ticket, "rejected", 502,
            f"The inference node refused the gateway's request (HTTP {status}): a server-side "
            "configuration problem, not your API key or model. A retry cannot pass until the "
            "deployment is fixed.",
            logged=False, retry=False)

    def _malformed(self, ticket: Ticket, upstream: NodeResponse, meter: Meter,
                   what: str) -> ApiError:
        """An answer the gateway cannot read as an OpenAI answer (a 200 of another shape, or a
        status no OpenAI answer has): most often a node URL that leads to another server (a
        proxy's or a load balancer's page or redirect), or a server that ignores `stream`.
        Relayed, it would reach the SDKs as a success they fail to parse, with a parse error
        instead of an API error, or as an error of the client's. Refunded in full (the
        gateway cannot tell what it cost, and the node it expected may have done nothing);
        logged once per node."""
        upstream.close()
        meter.phase = Phase.PENDING
        if (ticket.node, 200) not in self._logged:
            self._logged.add((ticket.node, 200))
            log.error("pool %s: node %s sent %s: check that its URL leads to a vLLM "
                      "OpenAI-compatible server", ticket.pool.name, ticket.node, what)
        return self._failed(
            ticket, "malformed_answer", 502,
            f"The inference node sent {what}, not an OpenAI answer. Please retry.",
            logged=False)

    async def forward(
        self, request: web.Request, inbound: Inbound, ticket: Ticket, meter: Meter,
        started: float,
    ) -> web.StreamResponse:
        read_timeout_s = self.client.read_timeout_s
        meter.sent_s = asyncio.get_running_loop().time() - started
        # A streamed answer is never quiet for long on a live node; a whole one is quiet until
        # the last token, so a long generation must not read as a dead node. Its sequences (n, a
        # batch's prompts) decode in the same steps: the allowance is per step, not per token
        # of them all (n = 128 made a hung node's hold 128 times longer).
        read_timeout_s += inbound.whole_answer_s(self.whole_answer_s_per_token)

        def sent(on_a_connection: bool) -> None:
            # From here the node may be working on it: a client that leaves while the node has
            # not answered yet (a whole answer's headers come with its last token) is charged;
            # one that leaves while a connection is still being opened is not.
            meter.phase = Phase.SENT if on_a_connection else Phase.PENDING

        try:
            upstream = await self.client.post(
                ticket.url, _ROUTES[inbound.kind], inbound.payload,
                forwarded_headers(request, ticket.task_id, ticket.pool.backend_headers),
                read_timeout_s=read_timeout_s, on_sent=sent,
            )
        except NodeUnreachable:
            meter.phase = Phase.PENDING
            raise self._failed(ticket, "unreachable", 503,
                               "The inference node is unreachable. Please retry.") from None
        except NodeTimeout as exc:
            meter.phase = Phase.PENDING
            raise self._timed_out(ticket, exc) from None
        except NodeError as exc:
            meter.phase = Phase.PENDING
            raise self._failed(ticket, "error", 502,
                               f"The inference node failed ({type(exc).__name__}). "
                               "Please retry.") from None
        except Exception:
            meter.phase = Phase.PENDING  # the gateway's own failure: the client pays nothing
            raise
        try:
            if upstream.status != 200:
                return await self._relay_error(upstream, ticket, meter)
            if inbound.stream:
                return await self._stream(request, upstream, inbound, ticket, meter, started)
            return await self._whole(request, upstream, inbound, ticket, meter)
        except BaseException:
            upstream.close()  # abort the generation on the node
            raise
        finally:
            upstream.release()

    async def _relay_error(
        self, upstream: NodeResponse, ticket: Ticket, meter: Meter
    ) -> web.StreamResponse:
        if not 400 <= upstream.status <= 599:
            # Only a node's 4xx is the request's fault, and its 5xx a failure of its own;
            # another 2xx or a 3xx (a proxy redirecting http to https, a 204, a 201 with an
            # error in it) would reach the SDKs as a bodiless success or as the client's.
            # (Interim 1xx answers never get here: the node client skips them.)
            raise self._malformed(ticket, upstream, meter, f"an HTTP {upstream.status} answer")
        try:
            body = await upstream.read_prefix(ERROR_BODY_BYTES)
        except NodeError:
            body = b""
        meter.phase = Phase.PENDING  # nothing generated: refund in full
        if upstream.status in NODE_REJECTIONS:
            raise self._rejected(ticket, upstream.status, error_message(body))
        if upstream.status == 400 and ticket.pool.settings.pass_priority:
            message = error_message(body)
            if message is not None and PRIORITY_REFUSED in message.lower():
                raise self._rejected(ticket, 400, message, "the pool's pass_priority: the "
                                     "node needs --scheduling-policy priority for it")
        if upstream.status >= 500 or upstream.status == 429:
            message = error_message(body) or f"HTTP {upstream.status}"
            raise self._failed(ticket, "error", 502,
                               f"The inference node failed: {message}. Please retry.",
                               retry=True)
        error = node_client_error(upstream.status, body)
        error.headers["X-Request-Id"] = ticket.task_id
        return error.response()

    async def _whole(
        self, request: web.Request, upstream: NodeResponse, inbound: Inbound, ticket: Ticket,
        meter: Meter,
    ) -> web.StreamResponse:
        limit = inbound.answer_limit
        try:
            body = await upstream.read(limit)
        except AnswerTooLarge:
            # Charged as any broken answer (the phase stays SENT): the node did work.
            raise self._failed(ticket, "oversized_answer", 502,
                               f"The inference node's answer exceeded {limit} bytes, more than "
                               "this request can produce. Please retry.") from None
        except NodeTimeout as exc:
            if isinstance(exc, NodeStuck):
                meter.phase = Phase.PENDING  # nothing came of it: the client pays nothing
            raise self._timed_out(ticket, exc) from None
        except NodeError:
            raise self._failed(ticket, "error", 502,
                               "The inference node broke off its answer. Please retry.") from None
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise self._malformed(ticket, upstream, meter,
                                  "a whole answer that is not a JSON object")
        meter.take_usage(parsed.get("usage"))
        if rename_model(parsed, inbound.reply_model):
            body = orjson.dumps(parsed)
        if meter.exact_total is None:
            # A whole answer without its usage: charged what it reserved (the prompt alone
            # would let a full generation go free, and read as a light request to the
            # scheduler's learned usage ratio).
            meter.completion_tokens = inbound.max_tokens
        response = web.Response(
            body=body,
            headers={"Content-Type": upstream.headers.get("content-type", "application/json"),
                     "X-Request-Id": ticket.task_id},
        )
        try:
            await end_within(request, response, self.client.read_timeout_s)
        except ClientStalled as exc:
            log.info("task %s: %s; dropped", ticket.task_id, exc)
            return response  # charged as a client gone: the answer never reached it
        meter.phase = Phase.DONE
        return response

    async def _stream(
        self, request: web.Request, upstream: NodeResponse, inbound: Inbound,
        ticket: Ticket, meter: Meter, started: float,
    ) -> web.StreamResponse:
        declared = upstream.headers.get("content-type", "text/event-stream")
        if not declared.lower().lstrip().startswith("text/event-stream"):
            raise self._malformed(ticket, upstream, meter, f"a {declared.split(';')[0]!r} answer "
                                  "to a streamed request")
        response = web.StreamResponse(headers={
            "Content-Type": declared,
            "Cache-Control": "no-cache",
            "X-Request-Id": ticket.task_id,
        })
        relay = SseRelay(meter, strip_usage=not inbound.client_wants_usage,
                         reply_model=inbound.reply_model)
        loop = asyncio.get_running_loop()
        patience_s = self.client.read_timeout_s
        guard = StallGuard(request, patience_s)
        try:
            await response.prepare(request)
            broken: ApiError | None = None
            try:
                async for data in upstream.iter_any():
                    out = relay.feed(data)
                    if out:
                        if meter.first_byte_s is None:
                            meter.first_byte_s = loop.time() - started
                        await guard.write(response, out)
                        if relay.ended and relay.failed is None:
                            # Delivered, even if the client leaves before the body's end.
                            meter.phase = Phase.DONE
            except NodeError as exc:
                # After its last event the answer is whole: a connection that then breaks
                # (or stays open past the silence limit) costs the client nothing.
                if not relay.ended:
                    kind = _stream_failure(exc)
                    broken = _stream_error(kind, exc)
                    if kind == "stuck" and meter.first_byte_s is None:
                        meter.phase = Phase.PENDING  # nothing came of it: nothing to pay
                    self.metrics.child(
                        self.metrics.upstream_errors, ticket.pool.name, ticket.node, kind).inc()
                    log.warning("task %s: stream from node %s broke off (%s)", ticket.task_id,
                                ticket.node, type(exc).__name__)
            tail = relay.flush()
            if broken is not None:
                # The node broke off inside an event (its tail: an event begun, never ended):
                # dropped, as it can never be completed. Sent before the error event, it would
                # run into it and make one event that is not JSON, on which the SDKs raise a
                # JSON decoding error instead of the API error that follows.
                tail = b"data: " + orjson.dumps(broken.body()) + b"\n\n" + _DONE
            if tail:
                await guard.write(response, tail)
            await end_within(request, response, patience_s)
        except ConnectionResetError as exc:
            # The client left (without handler cancellation) or stopped reading
            # (`ClientStalled`): abort the node's work.
            if isinstance(exc, ClientStalled):
                log.info("task %s: %s; dropped", ticket.task_id, exc)
            upstream.close()
            return response
        finally:
            guard.close()
        if relay.failed is not None:
            log.warning("task %s: node %s ended the stream with an error (%s)", ticket.task_id,
                        ticket.node, relay.failed.code or relay.failed.status)
        elif broken is None:
            meter.phase = Phase.DONE
        return response


def _stream_failure(exc: NodeError) -> str:
    """The `kind` counted for a stream the node failed before its end."""
    if isinstance(exc, NodeStuck):
        return "stuck"
    if isinstance(exc, NodeTimeout):
        return "timeout"
    return "oversized_event" if isinstance(exc, EventTooLarge) else "broken_stream"


def _stream_error(kind: str, exc: NodeError) -> ApiError:
    """The error event that ends such a stream: a node gone quiet, or judged stuck, says so,
    as the same failure of a whole answer does."""
    if kind == "stuck":
        return ApiError(502, f"The inference node is stuck ({exc}); the stream was cut.",
                        type_="server_error", code="upstream_stuck")
    if kind == "timeout":
        return ApiError(502, f"The inference node timed out: {exc}; the stream was cut.",
                        type_="server_error", code="upstream_timeout")
    return ApiError(502, "The inference node broke off the stream.", type_="server_error",
                    code="upstream_broken_stream")
