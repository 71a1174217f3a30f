"""Every error the gateway answers, in OpenAI's shape, and the 429 backpressure protocol.

Body: ``{"error": {"message", "type", "param", "code"}}`` (plus ``retry_after_ms`` when the
client should come back). Retry hints come from the admission state and are spread upward by
jitter so that clients rejected together do not return together::

    HTTP/1.1 429 Too Many Requests
    Retry-After: 4                          integer seconds, ceil (RFC 9110)
    retry-after-ms: 3500                    read first by the official OpenAI SDKs
    X-RateLimit-Backpressure-Level: RED     the pool's load zone
    X-Queue-Depth: 142                      tasks queued at the request's tier or above
                                            (absent when Redis could not be read)
    X-RateLimit-Scope: key                  which limit refused it (a tenant's own limits:
                                            key; a quota of an enclosing level: its name)

Capacity hints never exceed 60 s: past a minute a fresh look at the pool beats any estimate. A
quota's hint is its exact refill (or reset) time, however long; past the 120 s the OpenAI SDKs
wait for, it also says ``x-should-retry: false``, as does a 429 ``insufficient_quota`` (a
quota that never refills, spent: OpenAI's status and type for it).

A request that can never succeed as sent, whatever the load, gets a 4xx (a 429 only for
``insufficient_quota``) with ``x-should-retry: false`` and no retry hint (`never_retry`): 400
``context_length_exceeded``, ``max_tokens_too_large``, ``exceeds_burst`` and
``chat_template_not_accepted``, and 403
``admin_disabled``. The header is what stops a client whose policy retries 4xx
(kvgate_client's ``retryable_statuses`` can include them); the official SDKs read it before
their status table. Malformed requests (bad JSON, wrong types, unknown model or key)
are plain 4xx: no client retries those.

Redis failing admission is a 503 ``admission_unavailable`` with a retry hint while the failure
can pass (unreachable, timing out, failing over, loading: `admission.errors.is_transient`), and
a 500 ``admission_misconfigured`` with ``x-should-retry: false`` and no hint while Redis answers
and refuses the same way every time (wrong credentials, an ACL, a key of the wrong type, a
failing script): only an operator ends that.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping

import orjson
from aiohttp import HttpVersion11, web
from aiohttp.typedefs import Handler

from admission.hints import MAX_RETRY_MS as MAX_RETRY_MS  # the cap on every capacity hint

log = logging.getLogger("kvgate.gateway")

# Codes of the 429 protocol: the pool is full (capacity), or a limit of the tenant is reached
# (the rate_limit_exceeded family: its token bucket, or its cap on queued tokens).
CAPACITY_EXCEEDED = "capacity_exceeded"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
QUEUED_TOKENS_EXCEEDED = "rate_limit_exceeded_queued_tokens"
SCOPE_HEADER = "X-RateLimit-Scope"
KEY_SCOPE = "key"
"""The scope of the tenant's own limits (its bucket, its caps)."""

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
OPENAI_ERROR_TYPES = frozenset({*_TYPES.values(), "server_error"})
"""The error types the gateway answers with, all of them OpenAI's."""


def client_error_type(status: int) -> str:
    """OpenAI's error type for a 4xx status; one the table lacks is still the request's fault."""
    return _TYPES.get(status, "invalid_request_error")


class ApiError(Exception):
    """An answer other than success; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.retry_after_ms = retry_after_ms
        self.tag: str | None = None
        """What happened, for metrics (e.g. 'queue_timeout'); not sent."""
        if retry_after_ms is not None:
            self.headers.update(retry_headers(retry_after_ms))

    def body(self) -> dict[str, object]:
        error: dict[str, object] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        if self.retry_after_ms is not None:
            error["retry_after_ms"] = self.retry_after_ms
        return {"error": error}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=orjson.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def retry_headers(retry_ms: int) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(retry_ms / 1000))), "retry-after-ms": str(retry_ms)}


SHUTDOWN_RETRY_MS = 1000
"""Retry hint of a stopping gateway's 503 `gateway_shutting_down`: the other gateways are up,
the request only needs a new one."""


def jittered(retry_ms: int, jitter: float, rng: random.Random, *,
             cap: int | None = MAX_RETRY_MS) -> int:
    """`retry_ms` spread upward by 0..`jitter` of itself, at least 1 ms, at most `cap` (60 s
    by default; None: no cap, for a quota's exact refill time, whose spread is then at most
    `jitter` of a minute: clients a day away need not come back hours late to be spread).

    Upward only: a quota hint is the bucket's exact refill time, and coming back sooner
    would only earn another 429. A capped hint whose spread would pass the cap starts lower
    instead (at cap / (1 + jitter)): clamped, every client told to wait that long would be
    told the cap to the millisecond, and would come back together. Such a hint is an
    estimate already cut short by the cap, not an exact time.
    """
    base = max(1, retry_ms)
    if cap is None:
        return math.ceil(base + min(base, MAX_RETRY_MS) * jitter * rng.random())
    low = min(base, cap / (1 + jitter))
    return max(1, min(cap, math.ceil(low + low * jitter * rng.random())))


def too_many_requests(
    code: str, message: str, *, retry_ms: int, zone: str, depth: int | None,
    scope: str | None = None,
) -> ApiError:
    """`depth` None: unknown (Redis could not be read), and the header is left out rather
    than reading 0 with a deep queue."""
    headers = {"X-RateLimit-Backpressure-Level": zone}
    if depth is not None:
        headers["X-Queue-Depth"] = str(depth)
    if scope is not None:
        headers[SCOPE_HEADER] = scope
    return ApiError(429, message, code=code, retry_after_ms=retry_ms, headers=headers)


SDK_MAX_RETRY_AFTER_MS = 120_000
"""The longest Retry-After the OpenAI SDKs wait for before retrying (the kvgate SDKs' default
`max_retry_after_s` too, though their 60 s retry deadline comes first); a quota refusal whose
refill is further away says not to retry."""


def quota_refusal(scope: str, limit: str | None, cost: int, retry_after_ms: int | None,
                  hint: Callable[[int], int], *, zone: str, depth: int) -> ApiError:
    """The refusal by a quota level (`scope`: key, or team:<name>) that cannot pay `cost`
    tokens now: its `limit` (daily, monthly, held, or None: the bucket) refills or resets in
    `retry_after_ms` (None: never); `hint` spreads that time for the headers."""
    # Possessive, so that it reads before "bucket", "allowance" and "quota" alike.
    team = scope.partition(":")[2]
    whose = "This API key's" if scope == KEY_SCOPE else f"Team {team}'s"
    shared = "" if scope == KEY_SCOPE else f" (shared by every key of team {team})"
    if retry_after_ms is None:
        # OpenAI's answer to a spent quota: a 429 of type insufficient_quota (the SDKs
        # raise RateLimitError), which the header keeps them from retrying.
        error = never_retry(
            429, f"{whose} token quota{shared} is exhausted and does not refill.",
            code="insufficient_quota", type_="insufficient_quota")
        error.headers[SCOPE_HEADER] = scope
        return error
    if limit in ("daily", "monthly"):
        what = (f"{whose} {limit} token allowance{shared} is used up: this "
                f"request needs {cost} tokens; the allowance resets in "
                f"{retry_after_ms} ms.")
    elif limit == "held":
        what = (f"{whose} token quota{shared} does not refill and cannot pay the "
                f"{cost} tokens this request needs now; requests still queued "
                "or running under it give back what they do not use when they end.")
    else:
        what = (f"Token rate limit exceeded at {scope}: "
                f"{whose[0].lower()}{whose[1:]} bucket{shared} cannot pay the "
                f"{cost} tokens this request needs; it refills enough in "
                f"{retry_after_ms} ms.")
    # The quota's own refill (or reset) time, exact and uncapped: a capacity hint is an
    # estimate that a fresh look may beat, a bucket's refill is arithmetic. Capped at
    # 60 s, an SDK would come back after a minute, twice, for two more refusals.
    refill_ms = hint(retry_after_ms)
    error = too_many_requests(RATE_LIMIT_EXCEEDED, what, retry_ms=refill_ms, zone=zone,
                              depth=depth, scope=scope)
    if refill_ms > SDK_MAX_RETRY_AFTER_MS:
        # Past what the SDKs wait for: said outright (the OpenAI SDK stops on such a
        # hint by itself, a client of its own may not).
        error.headers["x-should-retry"] = "false"
    return error


def never_retry(status: int, message: str, *, code: str, param: str | None = None,
                type_: str | None = None) -> ApiError:
    """A request that cannot succeed as sent, whatever the load: clients must not retry it."""
    return ApiError(status, message, type_=type_, code=code, param=param,
                    headers={"x-should-retry": "false"})


def unavailable(message: str, *, code: str, retry_ms: int, status: int = 503,
                headers: Mapping[str, str] | None = None) -> ApiError:
    return ApiError(status, message, type_="server_error", code=code, retry_after_ms=retry_ms,
                    headers=headers)


def shutting_down(what: str, retry_ms: int,
                  headers: Mapping[str, str] | None = None) -> ApiError:
    """A stopping gateway's 503 `gateway_shutting_down` for a request it will not answer
    (`what` it had done with it): retryable at once, on another gateway."""
    return unavailable(f"This gateway is shutting down and {what}. Please retry: another "
                       "gateway takes it.", code="gateway_shutting_down", retry_ms=retry_ms,
                       headers=headers)


ADMISSION_MISCONFIGURED = "admission_misconfigured"


def admission_misconfigured() -> ApiError:
    """The answer while Redis refuses admission for good. Not retryable: a retry hint would
    bring every client back, again and again, for a fault no wait repairs."""
    return ApiError(500, "The admission service is misconfigured and refuses every request "
                    "until an operator fixes it. Retrying will not help.", type_="server_error",
                    code=ADMISSION_MISCONFIGURED, headers={"x-should-retry": "false"})


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_HTTP_CODES = {
    404: ("Not found: {path}", "not_found"),
    405: ("Method {method} is not allowed on {path}", "method_not_allowed"),
    413: ("Request body too large. {text}", "request_too_large"),
}


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> web.Response:
    template, code = _HTTP_CODES.get(exc.status, ("{reason}", None))
    message = template.format(
        path=request.path, method=request.method, text=exc.text or "", reason=exc.reason
    )
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    error = ApiError(exc.status, message, code=code, headers=headers)
    return error.response()


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' `Expect` handler: `100-continue` is answered as aiohttp does; any other
    expectation is a 417 in OpenAI's shape. aiohttp runs this before the middlewares, so its own
    refusal reached clients as plain text that no SDK parses."""
    expect = request.headers.get("Expect", "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # Not the answer's bytes: the answer's own size starts after them.
        request.writer.output_size = 0
        return None
    return ApiError(417, "The request's Expect header asks for something other than "
                    "100-continue, which is the one expectation this server meets.",
                    code="expectation_failed", param="Expect").response()


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns aiohttp's own errors (404, 405, 413, ...) and unexpected failures into the
    OpenAI error shape; handlers raise `ApiError` for everything they decide themselves."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(request, exc)
    except ConnectionResetError as exc:
        # The client went away while we wrote to it: nothing can be answered.
        log.debug("client connection lost on %s: %s", request.path, type(exc).__name__)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "Internal error in the gateway.", type_="server_error",
                        code="internal_error").response()
