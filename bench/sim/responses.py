"""Response bodies and SSE chunks in vLLM's OpenAI-compatible shapes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import orjson

from bench.sim.protocol import Kind
from bench.sim.tokens import token_text

DONE = b"data: [DONE]\n\n"


def sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def generated_text(start: int, end: int, eos_at: int | None) -> str:
    """Text of output tokens ``start..end-1``; an EOS token has no text, as in vLLM."""
    if eos_at is not None and end >= eos_at:
        end = eos_at - 1
    return "".join(token_text(i) for i in range(start, max(start, end)))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


@dataclass(slots=True)
class ResponseIds:
    kind: Kind
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: Kind, model: str, request_id: str | None = None) -> ResponseIds:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return cls(kind, prefix + (request_id or uuid.uuid4().hex), int(time.time()), model)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def envelope(self, choices: list[object]) -> dict[str, object]:
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def full_response(
    ids: ResponseIds, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> bytes:
    choice: dict[str, object]
    if ids.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": ids.id,
            "object": obj,
            "created": ids.created,
            "model": ids.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }
    )


def role_chunk(ids: ResponseIds) -> bytes:
    """The chat stream's first chunk; vLLM sends it with the first output, not at once."""
    delta = {"role": "assistant", "content": ""}
    return sse(ids.envelope([{"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": None}]))


def token_chunk(
    ids: ResponseIds,
    text: str,
    finish_reason: str | None,
    chunk_usage: dict[str, int] | None = None,
) -> bytes:
    """Tokens generated since the last chunk (vLLM V1 merges them when the client lags)."""
    choice: dict[str, object]
    if ids.kind == "chat":
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    payload = ids.envelope([choice])
    if chunk_usage is not None:
        payload["usage"] = chunk_usage
    return sse(payload)


def usage_chunk(ids: ResponseIds, prompt_tokens: int, completion_tokens: int) -> bytes:
    payload = ids.envelope([])
    payload["usage"] = usage(prompt_tokens, completion_tokens)
    return sse(payload)


def model_card(model: str, max_model_len: int, created: int) -> dict[str, object]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
