"""From a request body to what admission needs (`W = T_in + T_out`) and what the node gets.

T_in is the real token count of the prompt (the pool's tokenizer, chat template applied);
T_out is the client's `max_completion_tokens` / `max_tokens` times the number of sequences, or
the pool's default, which is then written into the forwarded body so that the reservation is a
true bound; a chat whose context leaves less than the default gets none written (the node takes
the rest of its context by its own count, which a count of the gateway's could overshoot by a
token) and reserves the rest of the context its counted text leaves. Prompts that cannot fit
the context (by their counted tokens: the guess for images and other non-text parts is the
node's to judge) get vLLM's own 400 messages; these, and a `max_tokens` over the pool's
`max_max_tokens`, can never succeed as sent and say so with `x-should-retry: false` (a
malformed request is a plain 400: no client retries one).

The forwarded body differs from the client's in these places only: `model` (the served name),
`max_tokens` (when defaulted, where the context leaves room for the default),
`stream_options.include_usage` (always on when streaming, so the gateway learns exact usage),
`priority` (the tier, when the pool passes it; a client's own `priority` is never forwarded, or
it could raise itself inside the engine), and the engine's fields that belong to the operator,
not to one tenant among many (`ENGINE_ONLY`): the client's `request_id` and
`kv_transfer_params` are dropped, and its `cache_salt` is replaced by a digest of the tenant's
name and the salt, so that no tenant can name another's prefix-cache partition (and time its
hits).

A chat request's own `chat_template` (top level, or inside `chat_template_kwargs`, where vLLM
before 0.11 took it as the template too) is refused unless the pool sets
`accept_chat_template` (for nodes that trust request templates): the prompt is counted with
the pool's template, and a client's could be far longer than counted. The template's other
arguments a request sets (`documents`, `chat_template_kwargs`: vLLM merges the latter over
`tools` and `documents`) are counted into the prompt (`gateway.estimator`), so that the
reservation covers what the template may print of them.

The answer goes back with the client's own `model` (`Inbound.reply_model`) unless the pool
sets `echo_requested_model = false`: the client asked for the pool's name and compares the
answer with it; the served name is the deployment's business.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from admission.tiers import Tier
from gateway.answersize import whole_answer_limit
from gateway.chatparts import TEMPLATE_ITSELF
from gateway.errors import ApiError, bad_request, never_retry
from gateway.estimator import InvalidRequestError, estimate_cost
from gateway.pools import PoolRuntime

Kind = Literal["chat", "completion"]
ENGINE_ONLY = ("request_id", "kv_transfer_params")
"""Body fields vLLM acts on that a client must not set through a shared gateway: the engine's
request id (ids shared between tenants let one abort or collide with another's request; the
gateway's task id goes in X-Request-Id) and the disaggregated-prefill transfer instructions
(which peer to pull KV blocks from, which blocks), set by a router the operator runs."""
MAX_SEQUENCES = 128
ENGINE_BATCH = 128
"""Sequences an engine is taken to decode in the same steps (vLLM's `max_num_seqs` is 128 to
1,024 by GPU): a whole answer's silence allowance counts one wave of decode steps per this
many of its sequences."""
MAX_PROMPTS = 2048
"""Prompts of one /v1/completions batch: planning a count hashes each on the event loop (a 4 MB
body of a million one-character prompts held it for about 2 s, for every tenant)."""
MIN_TURN_TOKENS = 2
"""Tokens every chat message adds to the prompt at least, whatever its content: the markers
that open and close its turn in the chat template."""
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's code for a prompt (or prompt + max_tokens) over the model's context."""
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""`max_tokens` of a /v1/completions request that gives none, in the OpenAI API and in vLLM: the
gateway keeps it (or the pool's `default_max_tokens`, if lower), so that a completion through
the gateway is as long as without it and reserves no more."""


@dataclass(slots=True)
class Inbound:
    kind: Kind
    pool: PoolRuntime
    stream: bool
    client_wants_usage: bool
    """The client asked for the final usage chunk itself (else the gateway strips it)."""
    prompt_tokens: int
    max_tokens: int
    """T_out of the whole request: per-sequence limit x sequences."""
    reply_model: str | None = None
    """The `model` to write into the answer (the name the client sent), or None to relay the
    node's own (the pool's `echo_requested_model` is off)."""
    max_tokens_param: str = "max_tokens"
    """The field that sets T_out in the client's body (`max_completion_tokens` when a chat
    request used OpenAI's newer name), for the errors that ask to lower it."""
    usage_ceiling: int = 0
    """The most a node can truthfully report for this request: each prompt at the context
    length, plus T_out. A node's usage is charged up to this and no further (0: no bound)."""
    payload: bytes = b""
    """The body to forward (already rewritten), serialised as the node gets it (written once,
    before admission: `encode`). The decoded body itself is not kept: its Python objects take
    some 25 times its bytes (a 3.9 MB body of empty objects, 94 MB), for every request through
    its wait in the queue and its answer."""
    answer_limit: int = 0
    """The most bytes the node's whole (non-streamed) answer may take
    (`gateway.answersize.whole_answer_limit` of the forwarded body), computed while the body
    is still at hand."""
    steps: int = 0
    """The most decode steps the node may take on it: the per-sequence limit, once per
    `ENGINE_BATCH` of its sequences (they decode in the same steps). 0: `max_tokens`."""

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.max_tokens

    def whole_answer_s(self, s_per_step: float) -> float:
        """`whole_answer_s` of this request: how long its answer may take before its first
        byte reaches the client."""
        return whole_answer_s(self.stream, self.steps or self.max_tokens, s_per_step)


def whole_answer_s(stream: bool, steps: int, s_per_step: float) -> float:
    """The time a request's answer may take before its first byte reaches the client: none
    for a stream (its first token comes after the prefill), `steps` decode steps at
    `s_per_step` for a whole answer (the gateway's `upstream_ms_per_output_token`). Both the
    node's silence allowance (`gateway.proxy`) and the queue deadline an SDK's read timeout
    leaves (`gateway.handlers`) count it."""
    return 0.0 if stream else steps * s_per_step


def decode(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_request("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def encode(body: dict[str, Any]) -> bytes:
    """The forwarded body's bytes, or 400 `nesting_too_deep`.

    orjson reads JSON nested 1,024 levels deep but writes at most 254: a body between the two
    (a deep `response_format` schema, `metadata`, any field passed through) parses, and
    serialising it for the node would fail after admission, as a 500 that the SDKs retry
    twice. Serialised here, before admission, such a body is the client's 400."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise bad_request("The request body nests arrays and objects too deeply to be "
                          "forwarded (at most 254 levels).", code="nesting_too_deep") from None


def _int(body: Mapping[str, Any], name: str, *, minimum: int = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise bad_request(f"'{name}' must be an integer >= {minimum}.", param=name)
    return value


def _check_item_counts(kind: Kind, body: Mapping[str, Any], context_length: int) -> None:
    """Refuse, before a count walks them on the event loop, more prompts in a batch than
    `MAX_PROMPTS`, more messages than the context could hold (each adds its turn's markers at
    least: a 4 MB body of empty messages held the loop about half a second), and more content
    parts in a chat, tool definitions (`tools`, `chat_template_kwargs.tools`) or tool calls
    (over all its messages) than the context has tokens: each of these takes at least a token
    of the prompt, and each costs the count a step in Python (the tools a serialisation each:
    a 3 MB body of a million empty tools held the loop over 4 s)."""
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and (
                len(prompt) > MAX_PROMPTS):
            raise bad_request(f"A batch holds at most {MAX_PROMPTS} prompts; this one has "
                              f"{len(prompt)}.", param="prompt")
        return
    kwargs = body.get("chat_template_kwargs")
    for param, tools in (("tools", body.get("tools")),
                         ("chat_template_kwargs.tools",
                          kwargs.get("tools") if isinstance(kwargs, dict) else None)):
        if isinstance(tools, list) and len(tools) > context_length:
            raise _too_many(f"entries in '{param}'", context_length, len(tools), param)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) * MIN_TURN_TOKENS >= context_length:
        raise never_retry(
            400,
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"request has {len(messages)} messages, at least {len(messages) * MIN_TURN_TOKENS} "
            "input tokens. Please reduce the number of messages.",
            param="messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    parts = calls = 0
    for message in messages:
        if isinstance(message, dict):
            content, tool_calls = message.get("content"), message.get("tool_calls")
            if isinstance(content, list):
                parts += len(content)
            if isinstance(tool_calls, list):
                calls += len(tool_calls)
    if parts > context_length:
        raise bad_request(f"A chat holds at most {context_length} content parts (the model's "
                          f"context length); this one has {parts}.", param="messages")
    if calls > context_length:
        raise _too_many("tool calls over all its messages", context_length, calls, "messages")


def _too_many(what: str, bound: int, count: int, param: str) -> ApiError:
    """OpenAI's own refusal of a list over its length (`array_above_max_length`)."""
    return bad_request(f"A request may hold at most {bound} {what} (the model's context "
                       f"length: each takes at least a token of the prompt); this one has "
                       f"{count}.", param=param, code="array_above_max_length")


def _template_refused(param: str) -> ApiError:
    return never_retry(400, "This deployment does not accept a request's own 'chat_template'; "
                       "the model's template applies.", param=param,
                       code="chat_template_not_accepted")


def pool_of(body: Mapping[str, Any], pools: Mapping[str, PoolRuntime]) -> PoolRuntime:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", param="model")
    pool = pools.get(model)
    if pool is None:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")
    return pool


def tenant_salt(tenant: str, salt: object) -> str:
    """The `cache_salt` the node gets for a tenant's own: only the same tenant sending the
    same salt reaches the same partition of the prefix cache."""
    if not isinstance(salt, str) or not salt:
        raise bad_request("'cache_salt' must be a non-empty string.", param="cache_salt")
    return hashlib.sha256(f"{tenant}\0{salt}".encode("utf-8", "surrogatepass")).hexdigest()


@functools.lru_cache(maxsize=4096)
def tenant_default_salt(tenant: str) -> str:
    """The `cache_salt` of a tenant's requests that carry none, with the pool's
    `isolate_prefix_cache`: its own partition of the prefix cache, apart from every other
    tenant's and from each of its own salts (`tenant_salt` hashes a non-empty salt after the
    separator, this nothing). Without it, one tenant could learn from the time to its first
    token whether another had sent the same prefix."""
    return hashlib.sha256(f"{tenant}\0".encode("utf-8", "surrogatepass")).hexdigest()


async def parse_inbound(
    kind: Kind, raw: bytes, pools: Mapping[str, PoolRuntime], tier: Tier,
    tenant: str = "",
) -> Inbound:
    """`tenant`: the sender's name, which scopes its `cache_salt` and its token-count cache
    entries."""
    body = decode(raw)
    del raw  # the caller keeps no other reference: the bytes go while the body is counted
    pool = pool_of(body, pools)
    settings = pool.settings
    if body.get("cache_salt") is not None:
        body["cache_salt"] = tenant_salt(tenant, body["cache_salt"])
    elif settings.isolate_prefix_cache:
        body["cache_salt"] = tenant_default_salt(tenant)

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", param="stream_options")
        if options and not stream:
            # vLLM's rule: an empty object without streaming is accepted (some clients
            # always send one), options that could only apply to a stream are refused.
            raise bad_request("Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        include_usage = options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            # The node always gets True; a string such as "false" would otherwise read as a
            # request for the usage chunk.
            raise bad_request("'stream_options.include_usage' must be a boolean.",
                              param="stream_options.include_usage")

    n = _int(body, "n") or 1
    if n > MAX_SEQUENCES:
        raise bad_request(f"'n' must be at most {MAX_SEQUENCES}.", param="n")
    best_of = _int(body, "best_of") if kind == "completion" else None
    if best_of is not None and best_of > MAX_SEQUENCES:
        raise bad_request(f"'best_of' must be at most {MAX_SEQUENCES}.", param="best_of")
    if best_of is not None and best_of < n:
        # The node generates best_of candidates and returns the n best: fewer cannot be.
        raise bad_request(f"'best_of' must be at least 'n' (got best_of={best_of}, n={n}).",
                          param="best_of")
    sequences_per_prompt = n if best_of is None else best_of

    if kind == "chat":
        requested = body.get("max_completion_tokens")
        param = "max_completion_tokens"
        if requested is None:
            requested, param = body.get("max_tokens"), "max_tokens"
    else:
        requested, param = body.get("max_tokens"), "max_tokens"
    # A completion with `echo` and max_tokens 0 scores its prompt (the prompt's logprobs) and
    # generates nothing: OpenAI's API allows it and vLLM serves it (lm-eval's loglikelihood
    # requests). It reserves one output token, as vLLM schedules one.
    scoring = (kind == "completion" and type(requested) is int and requested == 0
               and body.get("echo") is True)
    if requested is not None and not scoring and (type(requested) is not int or requested < 1):
        raise bad_request(f"'{param}' must be a positive integer.", param=param)
    if requested is not None and requested > settings.max_max_tokens:
        raise never_retry(
            400,
            f"'{param}' is too large: {requested}. This deployment allows at most "
            f"{settings.max_max_tokens} output tokens per sequence.",
            param=param,
            code="max_tokens_too_large",
        )

    template_kwargs = body.get("chat_template_kwargs") if kind == "chat" else None
    if kind == "chat" and not settings.accept_chat_template:
        # The prompt is counted with the pool's template; the client's own could render the
        # same messages many times over and reserve a fraction of the KV it takes.
        if body.get("chat_template") is not None:
            raise _template_refused("chat_template")
        if isinstance(template_kwargs, dict) and template_kwargs.get(TEMPLATE_ITSELF) is not None:
            raise _template_refused(f"chat_template_kwargs.{TEMPLATE_ITSELF}")
    _check_item_counts(kind, body, settings.context_length)
    messages = body.get("messages")
    guessed = 0
    try:
        if kind == "chat":
            count, guessed = await pool.counter.count_chat_parts_async(
                messages, body.get("tools"), scope=tenant, documents=body.get("documents"),
                template_kwargs=template_kwargs)
            prompts = [count]
        else:
            prompts = await pool.counter.count_prompts_async(body.get("prompt"), scope=tenant)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param=exc.param, code=exc.code) from None

    limit = settings.context_length
    # Refusals rest on what was counted: the tokens of images and other non-text parts are a
    # declared guess (`non_text_part_tokens`), and a request the guess alone puts over the
    # context goes to the node, which knows their cost (and refuses it there if it must).
    # The reservation counts the guess.
    longest = max(prompts) - guessed
    if longest >= limit:
        raise never_retry(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{longest} input tokens. Please reduce the length of the input messages.",
            param="input_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if requested is not None and longest + requested > limit:
        raise never_retry(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {limit} tokens and your request has {longest} input "
            f"tokens ({requested} > {limit} - {longest}).",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    default = settings.default_max_tokens if kind == "chat" else min(
        COMPLETION_DEFAULT_MAX_TOKENS, settings.default_max_tokens)
    # The default output is sized on the whole estimate, guess included: on the counted part
    # alone it could make a request the node refuses, one that sent no max_tokens at all. Where
    # the guess leaves no room, on the counted part: the node then judges (a 400 the client can
    # act on, rather than a one-token answer cut short).
    room = limit - max(prompts)
    fits = room if room >= 1 else limit - longest
    # A chat near the context's end: written from the gateway's count, the default would be
    # refused whenever the node counts one token more (another template, another tokenizer),
    # a 400 naming a max_tokens the client never sent. None is written, and the node takes
    # the rest of its context by its own count: what the counted text leaves (images' guess
    # aside) bounds it, so that is reserved, and it bounds the usage charged. A completion
    # keeps its own: vLLM's default there is 16 whatever the room, which it would refuse.
    node_sized = requested is None and kind == "chat" and fits < default
    if requested is not None:
        per_sequence = max(1, requested)
    else:
        per_sequence = limit - longest if node_sized else min(default, fits)
    estimate = estimate_cost(
        # No prompt holds more than the context: a guess past it (a thousand tiny images)
        # would reserve tokens no node could ever hold.
        sum(min(p, limit) for p in prompts),
        per_sequence,
        default_max_tokens=settings.default_max_tokens,
        sequences=sequences_per_prompt * len(prompts),
    )

    requested_model = body["model"]
    body["model"] = pool.served_model
    if requested is None and not node_sized:
        body["max_tokens"] = per_sequence
    client_wants_usage = False
    if stream:
        client_wants_usage = bool(options and options.get("include_usage"))
        body["stream_options"] = {**(options or {}), "include_usage": True}
    body.pop("priority", None)
    for field in ENGINE_ONLY:
        body.pop(field, None)
    if settings.pass_priority:
        body["priority"] = int(tier)
    return Inbound(
        kind=kind,
        pool=pool,
        stream=bool(stream),
        client_wants_usage=client_wants_usage,
        prompt_tokens=estimate.t_in,
        max_tokens=estimate.t_out,
        reply_model=requested_model if settings.echo_requested_model else None,
        max_tokens_param=param,
        usage_ceiling=len(prompts) * limit + estimate.t_out,
        payload=encode(body),
        answer_limit=whole_answer_limit(body, prompt_tokens=estimate.t_in,
                                        output_tokens=estimate.t_out),
        # Sequences decode together up to the engine's running batch, in waves beyond it.
        steps=per_sequence * math.ceil(sequences_per_prompt * len(prompts) / ENGINE_BATCH),
    )
