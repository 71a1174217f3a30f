"""Parsing and validating OpenAI requests the way vLLM's server does, and its error shape.

Only what changes the engine's work or the response's shape is interpreted; sampling knobs
(temperature, top_p, stop, ...) are accepted and ignored, since the text does not matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import orjson

from bench.sim.config import SimConfig
from bench.sim.tokens import (
    chat_prompt_tokens,
    completion_prompt_tokens,
    eos_position,
    message_text,
)

Kind = Literal["chat", "completion"]

OUTPUT_TOKENS_HEADER = "X-Sim-Output-Tokens"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, *, err_type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, err_type=self.err_type, param=self.param)


_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


def error_body(
    status: int, message: str, *, err_type: str | None = None, param: str | None = None
) -> bytes:
    error = {
        "message": message,
        "type": err_type or _TYPES.get(status, "InternalServerError"),
        "param": param,
        "code": status,
    }
    return orjson.dumps({"error": error})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    prompt_tokens: int
    max_tokens: int
    eos_at: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int


def decode_body(raw: bytes) -> dict[str, object]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _int_field(body: Mapping[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer.", param=name)
    return value


def _prompt_tokens(kind: Kind, body: Mapping[str, object]) -> int:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list.", param="messages")
        contents: list[str] = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, "Each message needs a string 'role'.", param="messages")
            try:
                contents.append(message_text(message.get("content")))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages") from exc
        return chat_prompt_tokens(contents)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return completion_prompt_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return completion_prompt_tokens(prompt)
    raise ApiError(
        400,
        "'prompt' must be a string or a list of token ids (the simulator serves one prompt "
        "per request).",
        param="prompt",
    )


def parse_request(
    kind: Kind,
    raw: bytes,
    headers: Mapping[str, str],
    config: SimConfig,
) -> ParsedRequest:
    """Validate in vLLM's order: schema, model, length, then engine-side checks."""
    body = decode_body(raw)

    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    continuous_usage = bool(options and options.get("continuous_usage_stats"))
    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise ApiError(400, "The simulator supports n=1 only.", param="n")
    priority = _int_field(body, "priority") or 0
    if kind == "chat":
        requested = _int_field(body, "max_completion_tokens")
        if requested is None:
            requested = _int_field(body, "max_tokens")
    elif "max_tokens" in body:
        requested = _int_field(body, "max_tokens")
    else:
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS
    ignore_eos = body.get("ignore_eos") is True

    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    prompt_tokens = _prompt_tokens(kind, body)
    limit = config.max_model_len
    if prompt_tokens >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="input_tokens",
        )
    if requested is not None and prompt_tokens + requested > limit:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {limit} tokens and your request has {prompt_tokens} "
            f"input tokens ({requested} > {limit} - {prompt_tokens}).",
            param="max_tokens",
        )
    max_tokens = requested if requested is not None else limit - prompt_tokens
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.",
                       param="max_tokens")

    if priority != 0 and config.scheduling_policy != "priority":
        raise ApiError(400, f"Got priority {priority} but Priority scheduling is not enabled.")

    forced = _forced_output(headers)
    eos_at = eos_position(
        max_tokens=max_tokens,
        forced=forced,
        ignore_eos=ignore_eos,
        output_fraction=config.output_fraction,
        seed=config.seed,
        body=raw,
    )
    return ParsedRequest(
        kind=kind,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        eos_at=eos_at,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        priority=priority,
    )


def _forced_output(headers: Mapping[str, str]) -> int | None:
    value = headers.get(OUTPUT_TOKENS_HEADER)
    if value is None:
        return None
    try:
        forced = int(value)
    except ValueError:
        forced = 0
    if forced < 1:
        raise ApiError(400, f"{OUTPUT_TOKENS_HEADER} must be a positive integer, got {value!r}.")
    return forced


def tokenize_count(raw: bytes, config: SimConfig) -> int:
    """Prompt tokens for ``/tokenize``: a body with ``messages`` (chat) or ``prompt``."""
    body = decode_body(raw)
    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    return _prompt_tokens("chat" if "messages" in body else "completion", body)
