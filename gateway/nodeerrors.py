"""A node's errors in OpenAI's shape: its 4xx answers, and the error events that end a stream.

OpenAI's SDKs raise an error from its `type` and `code`; vLLM's differ (an exception class as
the type, the HTTP status as an integer code), so the gateway rewrites them, keeping the
node's status, message and param.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import OPENAI_ERROR_TYPES, ApiError, client_error_type

NODE_TEXT_LIMIT = 1000
"""Characters of a node's error body kept as the message when it is not a JSON error (an HTML
page from a proxy in front of the node, say)."""
ERROR_BODY_BYTES = 64 << 10
"""The most of a node's error answer (a status other than 200) the gateway reads; the rest is
dropped with the connection. vLLM's JSON errors are well under a kilobyte, so no real one is
cut; a body cut here is no longer JSON and its first `NODE_TEXT_LIMIT` characters become the
message. Unbounded, a node could make the gateway hold any amount for one error."""


def node_client_error(status: int, body: bytes) -> ApiError:
    """A node's 4xx answer in OpenAI's error shape, its status, message and param kept.

    vLLM (and bench.sim) answer e.g. ``{"error": {"message": ..., "type": "BadRequestError",
    "param": "n", "code": 400}}``: an exception class as the type and the HTTP status as an
    integer code, neither of which OpenAI clients expect. The type becomes OpenAI's for the
    status (`invalid_request_error` for 400 and 422) unless the node's is one of OpenAI's
    already; the code is kept when it is a string, else null. A body that is not a JSON error
    becomes the message, cut to `NODE_TEXT_LIMIT` characters.
    """
    fields = _node_error_fields(body)
    if fields is None:
        text = body.decode("utf-8", "replace").strip()[:NODE_TEXT_LIMIT]
        return ApiError(status, text or f"The inference node answered HTTP {status}.",
                        type_=client_error_type(status))
    return _openai_error(status, fields["message"], fields)


def node_stream_error(chunk: dict[str, Any]) -> ApiError | None:
    """A node's error event in a stream, in OpenAI's error shape; None when `chunk` is none.

    vLLM ends a failed stream with one: ``{"error": {"message", "type": "BadRequestError",
    "param", "code": 400}}``, or before 0.10 the same fields at the top level with
    ``"object": "error"``, which the OpenAI SDKs do not recognise as an error at all. The
    status is the node's integer code (500 when it has none); type and code follow
    `node_client_error`'s rules, a 5xx's type being `server_error`.
    """
    error = chunk.get("error")
    if isinstance(error, dict):
        fields: dict[str, Any] = error
    elif isinstance(error, str):
        fields = {"message": error}
    elif chunk.get("object") == "error":
        fields = chunk
    else:
        return None
    status = fields.get("code")
    if type(status) is not int or not 400 <= status <= 599:
        status = 500
    message = fields.get("message")
    if not (isinstance(message, str) and message):
        message = "The inference node failed during the stream."
    return _openai_error(status, message[:NODE_TEXT_LIMIT], fields)


def _openai_error(status: int, message: str, fields: dict[str, Any]) -> ApiError:
    node_type, param, code = fields.get("type"), fields.get("param"), fields.get("code")
    if not (isinstance(node_type, str) and node_type in OPENAI_ERROR_TYPES):
        node_type = client_error_type(status) if status < 500 else "server_error"
    return ApiError(
        status, message, type_=node_type,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) and code else None,
    )


def _node_error_fields(body: bytes) -> dict[str, Any] | None:
    """The error object of a node's JSON error body: the one under `error`, the body itself
    (older vLLM: ``{"object": "error", "message": ...}``), or a bare string under `error` or
    `detail` (FastAPI) as its message. None when no message is found."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    for fields in (error, parsed, {"message": error}, {"message": parsed.get("detail")}):
        if isinstance(fields, dict) and isinstance(fields.get("message"), str) and (
                fields["message"]):
            return fields
    return None


def error_message(body: bytes) -> str | None:
    """A node's error message, cut short for a 502's own message (None: none found)."""
    fields = _node_error_fields(body)
    return None if fields is None else str(fields["message"])[:200]
