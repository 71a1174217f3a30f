"""Request cost estimation: `W = T_in + T_out` with T_in from the model's own tokenizer.

T_in is counted on the prompt as the chat template lays it out (ChatML, as Qwen2 uses it), with HF
`tokenizers` reading a local `tokenizer.json` (or `.json.gz`); nothing here touches the network.
The default tokenizer is the Qwen2 vocabulary shipped in `gateway/assets`. Byte-level BPE
vocabularies are encoded by their tiktoken twin when one checks out (`gateway.bpetwin`): the same
counts, about 2.7x faster.

Chat history is re-sent on every turn, so each message's token count is cached under a hash of
its rendered text, keyed by the sending tenant (a cached count is fast, and across tenants the
speed would tell one whether another sent the same text): a conversation costs one hash per
old message and one encode per new one.
That per-message split is exact, not an approximation: every message is delimited by the special
tokens `<|im_start|>`/`<|im_end|>`, which the tokenizer never merges across, so the count of the
whole prompt is the sum of the counts of its messages.

What is approximate, by design, and documented where it happens:
- non-text content parts (images, audio, files) cost a declared fixed number of tokens;
- tool calls and tool results follow the shape of Qwen2.5's template, `tools` definitions are
  counted as their JSON plus a fixed allowance for the template's instructions;
- other arguments of the template (a chat's `documents`, and whatever `chat_template_kwargs`
  holds besides numbers and booleans: vLLM merges it over the template's arguments, `tools`
  and `documents` included) are counted as their JSON (`tools` there as the request's own
  are, instructions included), whether the template prints them or not;
- `name` on a message is validated but not counted: Qwen's template drops it.
The gateway settles real usage after the response, so these only move the reservation.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import hashlib
import importlib.resources
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gateway.bpetwin import TwinEncoder, tiktoken_twin
from gateway.chatparts import (
    InvalidRequestError,
    check_content_given,
    render_tool_calls,
    render_tool_list,
    render_tools,
    template_arguments,
    to_json,
    token_ids_length,
)
from gateway.countcache import CountCache

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_TOKENIZER_ASSET",
    "ChatFormat",
    "CostEstimate",
    "CounterStats",
    "InvalidRequestError",
    "TokenCounter",
    "estimate_cost",
    "load_tokenizer",
]

DEFAULT_TOKENIZER_ASSET = "qwen2-tokenizer.json.gz"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""Roles a chat message may have (OpenAI's); any other is refused before it reaches a node."""
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_GZIP_MAGIC = b"\x1f\x8b"
# Parts whose text the template pastes into the prompt; vLLM joins a message's text parts with
# "\n" when the template expects a string.
_TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
}


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """How a chat request becomes prompt text (ChatML, Qwen2 flavour) and what is not text."""

    # Qwen2/2.5-Instruct templates insert a system turn when the conversation has none
    # ("You are a helpful assistant." / "You are Qwen, created by Alibaba Cloud. ..."); set it
    # per pool to match the served model's template exactly. None: no implicit system turn.
    default_system_prompt: str | None = None
    # One image/audio/video/file part. Vision models expand such a part into a resolution-
    # dependent number of placeholder tokens (Qwen2-VL: ~1,300 for a 1024x1024 image); 1,024 is a
    # middle figure, not a bound. The reservation is corrected when the request settles.
    non_text_part_tokens: int = 1024
    # Qwen2.5's template wraps `tools` in ~90 tokens of instructions (measured with its text);
    # rounded up so the estimate errs high.
    tools_overhead_tokens: int = 96


@dataclass(frozen=True, slots=True)
class CostEstimate:
    t_in: int
    t_out: int
    # True when the client gave no limit: the gateway must write `t_out` into the forwarded
    # request as max_tokens, or the reservation is not a bound.
    t_out_defaulted: bool

    @property
    def weight(self) -> int:
        return self.t_in + self.t_out


def estimate_cost(
    t_in: int, max_tokens: object, *, default_max_tokens: int, sequences: int = 1
) -> CostEstimate:
    """`W = T_in + T_out`; `sequences` is how many completions share T_out (n x prompts)."""
    if max_tokens is None:
        return CostEstimate(t_in, default_max_tokens * sequences, True)
    if type(max_tokens) is not int or max_tokens < 1:
        raise InvalidRequestError("max_tokens must be a positive integer", param="max_tokens")
    return CostEstimate(t_in, max_tokens * sequences, False)


def _scope(name: str) -> bytes:
    """A cache scope as blake2b's key (at most 64 bytes: a longer name is hashed first)."""
    data = name.encode()
    return data if len(data) <= 64 else hashlib.blake2b(data).digest()


@dataclass(slots=True)
class CounterStats:
    hits: int = 0
    misses: int = 0
    encoded_texts: int = 0
    encoded_bytes: int = 0
    offloaded: int = 0


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str | None) -> Tokenizer:
    if path is None:
        asset = importlib.resources.files("gateway.assets").joinpath(DEFAULT_TOKENIZER_ASSET)
        data = asset.read_bytes()
    else:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        data = file.read_bytes()
    if data[:2] == _GZIP_MAGIC:
        data = gzip.decompress(data)
    return Tokenizer.from_str(data.decode("utf-8"))


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """A tokenizer.json (plain, gzip, or a model directory holding one); None: shipped Qwen2.

    Loaded tokenizers are shared per path: encoding is thread-safe and the vocabulary is large.
    """
    return _load_tokenizer_cached(None if path is None else os.fspath(Path(path).resolve()))


@dataclass(slots=True)
class _Plan:
    """What a count still needs after validation and cache look-ups.

    A chat is one slot; a batch of completion prompts has one slot per prompt. A slot's count is
    its fixed tokens plus the counts of its texts, each found in the cache or still to encode.
    """

    fixed: list[int] = field(default_factory=list)
    slot_keys: list[list[bytes]] = field(default_factory=list)
    known: dict[bytes, int] = field(default_factory=dict)
    missing: dict[bytes, str] = field(default_factory=dict)
    miss_bytes: int = 0
    hits: int = 0
    guessed: int = 0
    """Of the fixed tokens, those of non-text parts: a declared figure, not a count."""
    scope: bytes = b""
    """Whose cache entries the plan reads and writes (a tenant's name; b"": shared)."""

    def new_slot(self, fixed: int = 0) -> None:
        self.fixed.append(fixed)
        self.slot_keys.append([])


def _digest(kind: bytes, data: bytes, scope: bytes = b"") -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=kind, key=scope).digest()


def _utf8(text: str, param: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates survive some JSON parsers; the tokenizer cannot take them.
        raise InvalidRequestError(f"{param} is not valid Unicode text", param=param) from None


class TokenCounter:
    """Counts prompt tokens with one model's tokenizer; thread-safe, one per model pool."""

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        chat_format: ChatFormat | None = None,
        cache_entries: int = 1 << 16,
        offload_bytes: int = 2048,
        executor: Executor | None = None,
        tiktoken: bool = True,
    ) -> None:
        """`offload_bytes`: async counts whose uncached text exceeds this run in `executor`
        (None: the loop's default); below it a thread hop costs more than the encode.
        `tiktoken`: count with the tokenizer's tiktoken twin where one exists and agrees
        (`gateway.bpetwin`)."""
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        self.chat_format = chat_format if chat_format is not None else ChatFormat()
        self.offload_bytes = offload_bytes
        self.stats = CounterStats()
        self._executor = executor
        self._cache = CountCache(cache_entries)
        self._stats_lock = threading.Lock()
        # tokenizers >= 0.20 can skip computing offsets, which counting never needs (~25% faster).
        self._encode_batch = getattr(
            self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch
        )
        self.twin: TwinEncoder | None = (
            tiktoken_twin(self.tokenizer)
            if tiktoken and isinstance(self.tokenizer, Tokenizer) else None
        )
        self._generation_prompt_tokens = self._encode_lengths([f"{IM_START}assistant\n"])[0]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str] | None = None, **options: Any) -> TokenCounter:
        return cls(load_tokenizer(path), **options)

    @property
    def cached_entries(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()

    # -- public counting API ----------------------------------------------------------------

    def count_text(self, text: str) -> int:
        """Tokens of raw text, special tokens in it recognised as such (as vLLM does)."""
        if not isinstance(text, str):
            raise InvalidRequestError("text must be a string")
        return self._finish(self._plan_texts([text], "text"))[0]

    def count_chat(self, messages: object, tools: object = None, *, documents: object = None,
                   template_kwargs: object = None) -> int:
        """T_in of a chat request: ChatML turns plus the assistant generation prompt, and the
        arguments the template gets besides them (`tools`, `documents`, the request's
        `chat_template_kwargs`)."""
        return sum(self._finish(self._plan_chat(messages, tools, documents=documents,
                                                template_kwargs=template_kwargs)))

    def count_prompts(self, prompt: object) -> list[int]:
        """T_in of each prompt of a /v1/completions request (a list of prompts is a batch)."""
        return self._finish(self._plan_prompt(prompt))

    def count_prompt(self, prompt: object) -> int:
        return sum(self.count_prompts(prompt))

    async def count_chat_async(self, messages: object, tools: object = None) -> int:
        return (await self.count_chat_parts_async(messages, tools))[0]

    async def count_chat_parts_async(self, messages: object, tools: object = None, *,
                                     scope: str = "", documents: object = None,
                                     template_kwargs: object = None) -> tuple[int, int]:
        """(T_in, the part of it guessed for non-text parts): a request may be refused on the
        counted part only (an image's real cost is the model's, often far below the guess).
        `scope` (a tenant's name) keeps its cached counts apart from everyone else's: how long
        a count takes must not tell one tenant whether another sent the same text.
        `documents`, `template_kwargs`: as for `count_chat`."""
        plan = self._plan_chat(messages, tools, _scope(scope), documents=documents,
                               template_kwargs=template_kwargs)
        return sum(await self._finish_async(plan)), plan.guessed

    async def count_prompts_async(self, prompt: object, *, scope: str = "") -> list[int]:
        """T_in of each prompt; `scope` as for `count_chat_parts_async`."""
        return await self._finish_async(self._plan_prompt(prompt, _scope(scope)))

    async def count_prompt_async(self, prompt: object) -> int:
        return sum(await self.count_prompts_async(prompt))

    # -- planning: validation, rendering, cache look-ups (cheap, on the caller's thread) ----------

    def _lookup(self, plan: _Plan, kind: bytes, text: str, param: str) -> None:
        data = _utf8(text, param)
        key = _digest(kind, data, plan.scope)
        plan.slot_keys[-1].append(key)
        if key in plan.known or key in plan.missing:
            return  # a text repeated within one request is looked up and encoded once
        cached = self._cache.get(key)
        if cached is not None:
            plan.known[key] = cached
            plan.hits += 1
        else:
            plan.missing[key] = text
            plan.miss_bytes += len(data)

    def _plan_texts(self, texts: Sequence[str], param: str, scope: bytes = b"") -> _Plan:
        plan = _Plan(scope=scope)
        for i, text in enumerate(texts):
            plan.new_slot()
            self._lookup(plan, b"text", text, f"{param}[{i}]" if len(texts) > 1 else param)
        return plan

    def _plan_prompt(self, prompt: object, scope: bytes = b"") -> _Plan:
        if isinstance(prompt, str):
            return self._plan_texts([prompt], "prompt", scope)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids, and not empty",
                param="prompt",
            )
        first = prompt[0]
        if isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise InvalidRequestError("prompt mixes strings with other types", param="prompt")
            return self._plan_texts(prompt, "prompt", scope)
        plan = _Plan(scope=scope)
        if isinstance(first, list):
            for i, ids in enumerate(prompt):
                plan.new_slot(token_ids_length(ids, f"prompt[{i}]"))
        else:
            plan.new_slot(token_ids_length(prompt, "prompt"))
        return plan

    def _plan_chat(self, messages: object, tools: object, scope: bytes = b"", *,
                   documents: object = None, template_kwargs: object = None) -> _Plan:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        plan = _Plan(scope=scope)
        plan.new_slot(self._generation_prompt_tokens)
        fmt = self.chat_format
        first_role = messages[0].get("role") if isinstance(messages[0], dict) else None
        if fmt.default_system_prompt is not None and first_role != "system":
            turn = f"{IM_START}system\n{fmt.default_system_prompt}{IM_END}\n"
            self._lookup(plan, b"turn", turn, "messages")
        for i, message in enumerate(messages):
            turn, extra = self._render_message(message, f"messages[{i}]")
            plan.fixed[0] += extra
            plan.guessed += extra
            self._lookup(plan, b"turn", turn, f"messages[{i}]")
        tools_counted = False
        if tools is not None:
            rendered = render_tools(tools)
            if tools:  # the template tests `if tools`: an empty list adds nothing, like none
                plan.fixed[0] += fmt.tools_overhead_tokens
                tools_counted = True
                self._lookup(plan, b"tools", rendered, "tools")
        if documents is not None:
            self._lookup(plan, b"template", to_json(documents, "documents"), "documents")
        merged_tools, others = template_arguments(template_kwargs)
        if merged_tools is not None:
            # Rendered in place of the request's own `tools` (counted too, which errs high),
            # with the template's instructions for tools.
            if merged_tools and not tools_counted:
                plan.fixed[0] += fmt.tools_overhead_tokens
            self._lookup(plan, b"tools",
                         render_tool_list(merged_tools, "chat_template_kwargs.tools"),
                         "chat_template_kwargs.tools")
        if others:
            self._lookup(plan, b"template", to_json(others, "chat_template_kwargs"),
                         "chat_template_kwargs")
        return plan

    def _render_message(self, message: object, param: str) -> tuple[str, int]:
        """(ChatML text of one turn, tokens of its non-text parts)."""
        if not isinstance(message, dict):
            raise InvalidRequestError("each message must be an object", param=param)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"role must be one of {', '.join(CHAT_ROLES)}", param=f"{param}.role")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError("name must be a string", param=f"{param}.name")
        check_content_given(role, message, f"{param}.content")
        content, extra = self._render_content(message.get("content"), f"{param}.content")
        if role == "tool":
            # Qwen2.5 presents a tool's result as a user turn wrapped in <tool_response> tags
            # (consecutive results share one turn there; counted separately here, a few tokens
            # high).
            return f"{IM_START}user\n<tool_response>\n{content}\n</tool_response>{IM_END}\n", extra
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            content += render_tool_calls(tool_calls, f"{param}.tool_calls")
        if role == "function":  # legacy OpenAI function result: shaped like a tool result
            return f"{IM_START}user\n<tool_response>\n{content}\n</tool_response>{IM_END}\n", extra
        return f"{IM_START}{role}\n{content}{IM_END}\n", extra

    def _render_content(self, content: object, param: str) -> tuple[str, int]:
        if isinstance(content, str):
            return content, 0
        if content is None:  # allowed by check_content_given: a turn without text
            return "", 0
        if not isinstance(content, list):
            raise InvalidRequestError("content must be a string or a list of parts", param=param)
        texts: list[str] = []
        extra = 0
        for j, part in enumerate(content):
            where = f"{param}[{j}]"
            if isinstance(part, str):  # tolerated by vLLM and some clients
                texts.append(part)
                continue
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequestError("content part must be an object with a type", param=where)
            text_field = _TEXT_PART_FIELDS.get(part["type"])
            if text_field is None:
                extra += self.chat_format.non_text_part_tokens
                continue
            text = part.get(text_field)
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"{text_field} must be a string", param=f"{where}.{text_field}"
                )
            texts.append(text)
        return "\n".join(texts), extra

    # -- encoding: the only expensive step ------------------------------------------------------

    def _encode_lengths(self, texts: list[str]) -> list[int]:
        if self.twin is not None:
            return self.twin.lengths(texts)
        return [len(encoding) for encoding in self._encode_batch(texts, add_special_tokens=False)]

    def _store(self, plan: _Plan, lengths: list[int], offloaded: bool) -> list[int]:
        fresh = list(zip(plan.missing, lengths, strict=True))
        self._cache.put_many(fresh)
        with self._stats_lock:
            self.stats.hits += plan.hits
            self.stats.misses += len(fresh)
            self.stats.encoded_texts += len(fresh)
            self.stats.encoded_bytes += plan.miss_bytes
            self.stats.offloaded += offloaded
        counts = plan.known
        counts.update(fresh)
        return [
            fixed + sum(counts[key] for key in keys)
            for fixed, keys in zip(plan.fixed, plan.slot_keys, strict=True)
        ]

    def _finish(self, plan: _Plan) -> list[int]:
        texts = list(plan.missing.values())
        return self._store(plan, self._encode_lengths(texts) if texts else [], offloaded=False)

    async def _finish_async(self, plan: _Plan) -> list[int]:
        if plan.miss_bytes <= self.offload_bytes:
            return self._finish(plan)
        loop = asyncio.get_running_loop()
        texts = list(plan.missing.values())
        # Both encoders release the GIL while encoding, so the loop keeps serving meanwhile.
        lengths = await loop.run_in_executor(self._executor, self._encode_lengths, texts)
        return self._store(plan, lengths, offloaded=True)
