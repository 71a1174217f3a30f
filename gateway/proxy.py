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
become 502 `upstream_rejected`. A failure mid-stream ends the stream with an error event, as
vLLM itself does; a node's own error event is relayed in OpenAI's shape too
(`node_stream_error`), so that the SDKs raise it whatever vLLM version sent it, and the task
ends cancelled, charged what was generated. Once the request is written to the node, a client
that leaves is charged what the node did so far (at least the prompt), even before the node's
answer has begun: a whole answer's headers come only with its last token.

The node is trusted no further than it must be: its usage is charged up to what the request
could have used (`Meter.ceiling`), one SSE event is held up to `MAX_EVENT_BYTES` (then the
stream ends as broken), a whole answer up to what the request can produce
(`gateway.answersize`; then 502 `upstream_oversized_answer`), an error answer up to
`ERROR_BODY_BYTES` (the rest is dropped), and a client that reads nothing for
`upstream_timeout_ms` is dropped like one that left (`gateway.clientio`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from gateway.admit import Ticket
from gateway.answersize import whole_answer_limit
from gateway.clientio import ClientStalled, StallGuard, end_within
from gateway.errors import ApiError, jittered, unavailable
from gateway.metrics import GatewayMetrics
from gateway.nodeclient import AnswerTooLarge, NodeClient, NodeError, NodeResponse, NodeUnreachable
from gateway.nodeerrors import ERROR_BODY_BYTES, error_message, node_client_error, node_stream_error
from gateway.parse import Inbound

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


class Phase(enum.Enum):
    PENDING = "pending"
    """Not sent yet, or refused before any response: nothing was generated."""
    SENT = "sent"
    """The node has the request; its answer has not completed."""
    DONE = "done"
    """The whole answer reached the client."""


@dataclass(slots=True)
class Meter:
    """What a request has cost so far; the settle is computed from it when the request ends."""

    prompt_tokens: int
    completion_tokens: int = 0
    exact_total: int | None = None
    phase: Phase = Phase.PENDING
    first_byte_s: float | None = None
    sent_s: float | None = None
    """When the request was sent to its node, seconds after its arrival."""
    ceiling: int = 0
    """The most the usage can be (`Inbound.usage_ceiling`; 0: no bound). The node's figures
    are its word: unbounded, one absurd report drains the tenant's bucket, pushes its fair
    order out of reach, or overflows the finish script's integer arithmetic halfway."""

    def node_ttft_ms(self) -> int | None:
        """ms from the dispatch to the node until the first token (None: no first token): the
        leader's release control counts VIP ones per node (scheduler.control)."""
        if self.first_byte_s is None or self.sent_s is None:
            return None
        return max(0, round((self.first_byte_s - self.sent_s) * 1000))

    def finish_args(self) -> tuple[int | None, bool]:
        """(usage to charge or None for a full refund, whether the task ends 'cancelled')."""
        if self.phase is Phase.PENDING:
            return None, True
        used = self.exact_total
        if used is None:
            used = self.prompt_tokens + self.completion_tokens
        used = max(0, used)
        if self.ceiling > 0:
            used = min(used, self.ceiling)
        return used, self.phase is not Phase.DONE

    def take_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        total = usage.get("total_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            self.prompt_tokens = prompt
            self.completion_tokens = completion
            self.exact_total = total if isinstance(total, int) else prompt + completion
        elif isinstance(total, int):
            self.exact_total = total  # the total alone is still the node's count


MAX_EVENT_BYTES = 4 << 20
"""The longest SSE event the relay holds while it waits for the event's end. vLLM's events
are one token's chunk (kilobytes even with logprobs); a node that sends more without a blank
line is broken, and holding its bytes would let it grow the gateway without bound."""


class EventTooLarge(NodeError):
    """The node sent more than `MAX_EVENT_BYTES` without ending an event."""


class SseRelay:
    """Splits an SSE byte stream into events, counts output, drops the usage-only chunk, and
    writes the client's model name into each chunk (`reply_model`, None: left as sent)."""

    __slots__ = ("_cr", "_held", "_parts", "_reply_model", "_strip_usage", "failed", "meter")

    def __init__(self, meter: Meter, *, strip_usage: bool, reply_model: str | None = None) -> None:
        self._parts: list[bytes] = []
        """The incomplete event's bytes, in the pieces they came in: joined once, when the
        event ends (joining on every piece would cost the square of the event's length)."""
        self._held = 0
        self._cr = False
        """The last piece ended in a CR, held back: its LF may start the next one."""
        self._strip_usage = strip_usage
        self._reply_model = reply_model
        self.meter = meter
        self.failed: ApiError | None = None
        """The node's error event, when it sent one: the generation ended on it."""

    def feed(self, data: bytes) -> bytes:
        """Bytes to send now: every complete event received so far, minus dropped ones.
        Raises `EventTooLarge` when an event grows past `MAX_EVENT_BYTES` unfinished.

        Lines may end in CRLF (SSE allows it; vLLM sends LF): they are relayed as LF, so
        that an event's end is found, counted and renamed whatever the node's framing."""
        if self._cr:
            data, self._cr = b"\r" + data, False
        if data.endswith(b"\r"):
            data, self._cr = data[:-1], True
        if b"\r\n" in data:
            data = data.replace(b"\r\n", b"\n")
        if not data:
            return b""  # (a read of a lone CR, held) an empty piece would hide an event's end
        if self._parts:
            if b"\n\n" not in data and not (
                    data[:1] == b"\n" and self._parts[-1][-1:] == b"\n"):
                self._hold(data)
                return b""
            data = b"".join(self._parts) + data
            self._parts.clear()
            self._held = 0
        end = data.rfind(b"\n\n")
        if end < 0:
            self._hold(data)
            return b""
        cut = end + 2
        complete = data[:cut]
        if cut < len(data):
            self._parts.append(data[cut:])
            self._held = len(data) - cut
        events = complete.split(b"\n\n")
        events.pop()  # the empty string after the last separator
        sent = [self._relay(event) for event in events]
        if all(out is event for out, event in zip(sent, events, strict=True)):
            return complete  # nothing dropped or rewritten: the bytes as they came
        return b"".join(out + b"\n\n" for out in sent if out is not None)

    def _hold(self, data: bytes) -> None:
        self._held += len(data)
        if self._held > MAX_EVENT_BYTES:
            self._parts.clear()
            self._held = 0
            raise EventTooLarge(f"the node sent over {MAX_EVENT_BYTES} bytes in one event")
        self._parts.append(data)

    def flush(self) -> bytes:
        """Whatever trails the last complete event (a well-formed stream leaves nothing)."""
        tail = b"".join(self._parts) + (b"\r" if self._cr else b"")
        self._parts.clear()
        self._held = 0
        self._cr = False
        return tail

    def _relay(self, event: bytes) -> bytes | None:
        """The event to send (itself when unchanged), or None to drop it. `[DONE]`, comments
        and anything that is not one JSON object pass untouched."""
        if not event.startswith(b"data:"):
            return event
        payload = event[5:].strip()
        if payload == b"[DONE]" or not payload.startswith(b"{"):
            return event
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(chunk, dict):
            return event
        if "error" in chunk or chunk.get("object") == "error":
            error = node_stream_error(chunk)
            if error is not None:
                self.failed = error
                return b"data: " + orjson.dumps(error.body())
        meter = self.meter
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if choices:
            if usage is None:
                for choice in choices:
                    if _carries_output(choice):
                        meter.completion_tokens += 1
            else:  # continuous usage stats: exact so far
                meter.take_usage(usage)
        elif usage is not None:
            meter.take_usage(usage)
            if self._strip_usage:
                return None
        if _rename(chunk, self._reply_model):
            return b"data: " + orjson.dumps(chunk)
        return event


def _rename(answer: dict[str, Any], model: str | None) -> bool:
    """Writes `model` into the answer's own `model` field when it names another; only an
    existing string field is replaced (an error object has none and gets none)."""
    if model is None:
        return False
    current = answer.get("model")
    if not isinstance(current, str) or current == model:
        return False
    answer["model"] = model
    return True


def _carries_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    # vLLM's reasoning field was `reasoning_content`, and is `reasoning` since early 2026.
    return isinstance(delta, dict) and bool(
        delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
        or delta.get("tool_calls")
    )


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
        self._rejections_logged: set[tuple[str, int]] = set()

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

    def _rejected(self, ticket: Ticket, status: int, message: str | None) -> ApiError:
        """A node that refuses the gateway's request as unauthorized or unknown: the client's
        key and model were valid for kvgate, so the node's status would blame the client.
        The pool's credentials (`backend_api_key_env`) or its `served_model_name` disagree
        with the node's; logged once per node and status, counted each time."""
        if (ticket.node, status) not in self._rejections_logged:
            self._rejections_logged.add((ticket.node, status))
            log.error("pool %s: node %s refused the gateway's request with HTTP %d (%s): check "
                      "the pool's backend_api_key_env and served_model_name against the node's "
                      "--api-key and --served-model-name", ticket.pool.name, ticket.node, status,
                      message or "no message")
        return self._failed(
            ticket, "rejected", 502,
            f"The inference node refused the gateway's request (HTTP {status}): a server-side "
            "configuration problem, not your API key or model. A retry cannot pass until the "
            "deployment is fixed.",
            logged=False, retry=False)

    async def forward(
        self, request: web.Request, inbound: Inbound, ticket: Ticket, meter: Meter,
        started: float,
    ) -> web.StreamResponse:
        read_timeout_s = self.client.read_timeout_s
        meter.sent_s = asyncio.get_running_loop().time() - started
        if not inbound.stream:
            # A streamed answer is never quiet for long on a live node; a whole one is quiet
            # until the last token, so a long generation must not read as a dead node. Its
            # sequences (n, a batch's prompts) decode in the same steps: the allowance is per
            # step, not per token of them all (n = 128 made a hung node's hold 128 times longer).
            read_timeout_s += (inbound.steps or inbound.max_tokens) * self.whole_answer_s_per_token

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
        try:
            body = await upstream.read_prefix(ERROR_BODY_BYTES)
        except NodeError:
            body = b""
        meter.phase = Phase.PENDING  # nothing generated: refund in full
        if upstream.status in NODE_REJECTIONS:
            raise self._rejected(ticket, upstream.status, error_message(body))
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
        limit = whole_answer_limit(inbound.body, prompt_tokens=inbound.prompt_tokens,
                                   output_tokens=inbound.max_tokens)
        try:
            body = await upstream.read(limit)
        except AnswerTooLarge:
            # Charged as any broken answer (the phase stays SENT): the node did work.
            raise self._failed(ticket, "oversized_answer", 502,
                               f"The inference node's answer exceeded {limit} bytes, more than "
                               "this request can produce. Please retry.") from None
        except NodeError:
            raise self._failed(ticket, "error", 502,
                               "The inference node broke off its answer. Please retry.") from None
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            meter.take_usage(parsed.get("usage"))
            if _rename(parsed, inbound.reply_model):
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
        response = web.StreamResponse(headers={
            "Content-Type": upstream.headers.get("content-type", "text/event-stream"),
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
            broken = False
            try:
                async for data in upstream.iter_any():
                    out = relay.feed(data)
                    if out:
                        if meter.first_byte_s is None:
                            meter.first_byte_s = loop.time() - started
                        await guard.write(response, out)
            except NodeError as exc:
                broken = True
                kind = "timeout" if isinstance(exc, TimeoutError) else (
                    "oversized_event" if isinstance(exc, EventTooLarge) else "broken_stream")
                self.metrics.child(
                    self.metrics.upstream_errors, ticket.pool.name, ticket.node, kind).inc()
                log.warning("task %s: stream from node %s broke off (%s)", ticket.task_id,
                            ticket.node, type(exc).__name__)
            tail = relay.flush()
            if broken:
                # The node broke off inside an event (its tail: an event begun, never ended):
                # dropped, as it can never be completed. Sent before the error event, it would
                # run into it and make one event that is not JSON, on which the SDKs raise a
                # JSON decoding error instead of the API error that follows.
                error = ApiError(502, "The inference node broke off the stream.",
                                 type_="server_error", code="upstream_broken_stream")
                tail = b"data: " + orjson.dumps(error.body()) + b"\n\n" + _DONE
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
        elif not broken:
            meter.phase = Phase.DONE
        return response
