"""The OpenAPI 3.0 document of the gateway's public API, served at /openapi.json.

Request schemas list the fields the gateway itself reads or rewrites and allow any other
(they are forwarded to vLLM untouched). Every error response uses OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any

from admission.config import Config
from gateway.estimator import CHAT_ROLES

_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_JSON_ERROR = {"application/json": {"schema": _ERROR}}
_RETRY_HEADERS = {
    "Retry-After": {"description": "Seconds to wait before retrying (integer, rounded up).",
                    "schema": {"type": "integer", "minimum": 1}},
    "retry-after-ms": {"description": "Milliseconds to wait before retrying (read first by "
                       "the OpenAI SDKs).", "schema": {"type": "integer", "minimum": 1}},
}
_BACKPRESSURE_HEADERS = {
    **_RETRY_HEADERS,
    "X-RateLimit-Backpressure-Level": {
        "description": "Load zone of the model pool.",
        "schema": {"type": "string", "enum": ["GREEN", "YELLOW", "RED", "UNKNOWN"]}},
    "X-Queue-Depth": {"description": "Requests queued at this request's tier or above; "
                      "absent when the gateway could not read the queue (level UNKNOWN).",
                      "schema": {"type": "integer", "minimum": 0}},
    "X-RateLimit-Scope": {"description": "With the rate_limit_exceeded family, "
                          "insufficient_quota, and capacity_exceeded for a key at its cap of "
                          "queued requests: the limit that "
                          "refused the request ('key': the key's own; else the name of the "
                          "enclosing quota level that ran out).", "schema": {"type": "string"}},
}
_NO_RETRY = {"x-should-retry": {"description": "false: do not retry this request as sent.",
                                "schema": {"type": "string", "enum": ["false"]}}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _JSON_ERROR}
    if headers:
        out["headers"] = headers
    return out


def _message(roles: list[str], *, content_required: bool, nullable: bool,
             description: str | None = None) -> dict[str, Any]:
    """A chat message of `roles`: OpenAI's API requires `content` of every role but an
    assistant's, and takes null only from an assistant or a legacy function result."""
    content: dict[str, Any] = {"oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "object"}},
    ]}
    if nullable:
        content["nullable"] = True
    if description is not None:
        content["description"] = description
    return {
        "type": "object",
        "required": ["role", "content"] if content_required else ["role"],
        "properties": {
            "role": {"type": "string", "enum": roles},
            "content": content,
            "name": {"type": "string"},
            "tool_calls": {"type": "array", "items": {"type": "object"}},
        },
    }


_GENERATION_ERRORS = {
    "400": _error("Malformed request; or, with x-should-retry: false, one that can never "
                  "succeed as sent: prompt (or prompt + max_tokens) over the context length "
                  "(context_length_exceeded), max_tokens above the pool's limit "
                  "(max_tokens_too_large), or larger than the key's burst (exceeds_burst).",
                  _NO_RETRY),
    "401": _error("Missing or unknown API key."),
    "404": _error("Unknown model (pool)."),
    "408": _error("The request body did not arrive within gateway.request_read_timeout_ms "
                  "(request_timeout); the connection is closed."),
    "413": _error("Request body larger than the configured limit."),
    "417": _error("An Expect header other than 100-continue (expectation_failed)."),
    "429": _error("Backpressure: capacity_exceeded (pool saturated, queue full, queue "
                  "timeout, or the key's cap on queued requests: X-RateLimit-Scope 'key') or "
                  "the rate_limit_exceeded family (the key's token bucket; "
                  "rate_limit_exceeded_queued_tokens: its cap on queued tokens); or "
                  "insufficient_quota: a quota that never refills is spent (no retry hint, "
                  "x-should-retry: false, as a quota hint past 120 s also says).",
                  {**_BACKPRESSURE_HEADERS,
                   "x-should-retry": {"description": "false: do not retry this request as "
                                      "sent (the quota will not pay for it in any wait the "
                                      "SDKs make).", "schema": {"type": "string",
                                                                "enum": ["false"]}}}),
    "500": _error("admission_misconfigured: Redis refuses admission for good (credentials, "
                  "ACL, certificate; x-should-retry: false); internal_error: the gateway's "
                  "own failure.", _NO_RETRY),
    "502": _error("The inference node failed, or the request was routed to a node this "
                  "gateway does not know (unknown_node).", _RETRY_HEADERS),
    "503": _error("Admission store or inference node unavailable.", _RETRY_HEADERS),
}

_REQUEST_HEADERS = [
    {"name": "X-Priority", "in": "header", "required": False,
     "description": "Lower this request's priority below the key's tier (never raises it).",
     "schema": {"type": "string", "enum": ["vip", "normal", "batch", "0", "1", "2"]}},
    {"name": "X-Request-Timeout", "in": "header", "required": False,
     "description": "Seconds this client will wait for its request to leave the queue (the "
                    "OpenAI SDKs' x-stainless-read-timeout also counts, less a margin).",
     "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0}},
]

_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
                "retry_after_ms": {"type": "integer"},
            },
        }},
    },
    "StreamOptions": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean", "nullable": True}},
    },
    "ChatMessage": {
        "oneOf": [
            _message([r for r in CHAT_ROLES if r not in ("assistant", "function")],
                     content_required=True, nullable=False),
            _message(["assistant"], content_required=False, nullable=True,
                     description="content may be omitted or null only with tool_calls, "
                     "function_call, audio or refusal"),
            _message(["function"], content_required=True, nullable=True),
        ],
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "minItems": 1,
                         "items": {"$ref": "#/components/schemas/ChatMessage"}},
            "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
            "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
            "n": {"type": "integer", "minimum": 1, "maximum": 128, "nullable": True},
            "stream": {"type": "boolean", "nullable": True},
            "stream_options": {"$ref": "#/components/schemas/StreamOptions"},
            "tools": {"type": "array", "items": {"$ref": "#/components/schemas/Tool"}},
        },
        "additionalProperties": True,
    },
    "Tool": {
        "description": "A function tool (type function, the default), the kind vLLM serves; "
                       "a tool of another type (OpenAI's custom tools, without function) is "
                       "passed to the node as sent.",
        "anyOf": [
            {"type": "object", "required": ["function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string"}}},
            }},
            {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "not": {"enum": ["function"]}},
            }},
        ],
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string"}},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": {
                    "type": "array", "minItems": 1,
                    "items": {"type": "integer", "minimum": 0}}},
            ]},
            "max_tokens": {"type": "integer", "minimum": 0, "nullable": True,
                           "description": "0 only with echo: the prompt scored, nothing "
                                          "generated."},
            "n": {"type": "integer", "minimum": 1, "maximum": 128, "nullable": True},
            "best_of": {"type": "integer", "minimum": 1, "maximum": 128, "nullable": True},
            "stream": {"type": "boolean", "nullable": True},
            "stream_options": {"$ref": "#/components/schemas/StreamOptions"},
        },
        "additionalProperties": True,
    },
    "Usage": {
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
        },
    },
    "Completion": {
        "type": "object",
        "description": "vLLM's response (chat.completion or text_completion), relayed as is "
                       "but for `model`.",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "model": {"type": "string",
                      "description": "The model named in the request (the pool), also in "
                                     "every streamed chunk; the backend's served name when "
                                     "the pool sets echo_requested_model = false."},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["model"]},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
        },
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}, "detail": {"type": "string"}},
    },
}


def _generation(summary: str, schema: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "parameters": _REQUEST_HEADERS,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {
                "description": "The completion (JSON), or with stream=true a text/event-stream "
                               "of chunks ending with `data: [DONE]`.",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
                    # OpenAPI 3.0 cannot describe SSE framing; any event is allowed here.
                    "text/event-stream": {"schema": {
                        "description": "Server-sent events `data: <chunk JSON>`, one per "
                                       "chunk, the last `data: [DONE]`."}},
                },
            },
            **_GENERATION_ERRORS,
        },
    }}


def _status(summary: str, ok: str, failing: str | None = None) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": ok, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Status"}}}}}
    if failing:
        responses["503"] = {"description": failing, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Status"}}}}
    return {"get": {"summary": summary, "security": [], "responses": responses}}


def _schemas(config: Config) -> dict[str, Any]:
    """The request schemas name the configured pools as the values of `model`."""
    models = sorted(config.pools)
    schemas = {name: dict(schema) for name, schema in _SCHEMAS.items()}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = dict(schemas[name]["properties"])
        properties["model"] = {"type": "string", "enum": models,
                               "description": "A model pool of this gateway."}
        schemas[name]["properties"] = properties
    return schemas


def openapi_document(config: Config) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvgate gateway",
            "version": "0.1.0",
            "description": "OpenAI-compatible admission gateway in front of vLLM. Models: "
                           + ", ".join(sorted(config.pools)) + ".",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/v1/models": {"get": {
                "summary": "The model pools served",
                "security": [{"bearer": []}],
                "responses": {
                    "200": {"description": "Model list", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/ModelList"}}}},
                    "401": _error("Missing or unknown API key."),
                },
            }},
            "/v1/models/{model}": {"get": {
                "summary": "One model pool, as /v1/models lists it",
                "security": [{"bearer": []}],
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string", "enum": sorted(config.pools)}}],
                "responses": {
                    "200": {"description": "The model", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Model"}}}},
                    "401": _error("Missing or unknown API key."),
                    "404": _error("No such model pool (model_not_found)."),
                },
            }},
            "/healthz": _status("Liveness", "The process serves requests."),
            "/readyz": _status("Readiness", "Redis reachable and scripts loaded.",
                               "Not ready: Redis unreachable or scripts not loadable."),
            "/metrics": {"get": {
                "summary": "Prometheus metrics", "security": [],
                "responses": {"200": {"description": "Prometheus text format", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}},
            }},
            "/admin/pools": {"get": {
                "summary": "Inspection snapshot of every pool (what kvgate-inspect --json "
                           "shows); needs the admin token (gateway.admin_token_sha256)",
                "security": [{"admin": []}],
                "responses": {
                    "200": {"description": "Snapshot", "content": {"application/json": {
                        "schema": {"type": "object", "required": ["scheduler", "pools"]}}}},
                    "401": _error("Missing or wrong admin token."),
                    "403": _error("The admin API is disabled (no admin_token_sha256).",
                                  _NO_RETRY),
                    "503": _error("Redis unavailable.", _RETRY_HEADERS),
                },
            }},
            "/openapi.json": {"get": {
                "summary": "This document", "security": [],
                "responses": {"200": {"description": "OpenAPI 3.0 document", "content": {
                    "application/json": {"schema": {"type": "object"}}}}},
            }},
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "A tenant's API key."},
                "admin": {"type": "http", "scheme": "bearer",
                          "description": "The admin token (its SHA-256 is configured)."},
            },
            "schemas": _schemas(config),
        },
    }
