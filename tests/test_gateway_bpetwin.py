"""The tiktoken twin counts exactly as HF `tokenizers` does, or is not used at all."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from gateway.bpetwin import SELF_CHECK_TEXTS, TwinEncoder, tiktoken_twin
from gateway.estimator import TokenCounter, load_tokenizer
from tests.properties import PROPERTIES, examples

# Text as clients send it: any code point but lone surrogates (the gateway refuses those).
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=300)
specials = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "'s"])


@pytest.fixture(scope="module")
def shipped() -> tuple[Tokenizer, TwinEncoder]:
    tokenizer = load_tokenizer()
    twin = tiktoken_twin(tokenizer)
    assert twin is not None, "the shipped Qwen2 tokenizer has a twin"
    return tokenizer, twin


def hf_count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_twin_is_built_once_per_tokenizer(shipped: tuple[Tokenizer, TwinEncoder]) -> None:
    tokenizer, twin = shipped
    assert tiktoken_twin(tokenizer) is twin
    assert TokenCounter(tokenizer).twin is twin
    assert TokenCounter(tokenizer, tiktoken=False).twin is None


def test_self_check_sample_counts_agree(shipped: tuple[Tokenizer, TwinEncoder]) -> None:
    tokenizer, twin = shipped
    assert twin.lengths(SELF_CHECK_TEXTS) == [hf_count(tokenizer, t) for t in SELF_CHECK_TEXTS]


@settings(PROPERTIES, max_examples=examples(300))
@given(st.lists(st.one_of(texts, specials), max_size=6).map("".join))
def test_any_text_counts_the_same(shipped: tuple[Tokenizer, TwinEncoder], text: str) -> None:
    tokenizer, twin = shipped
    assert twin.lengths([text]) == [hf_count(tokenizer, text)]


@settings(PROPERTIES, max_examples=examples(50))
@given(st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": texts,
}), min_size=1, max_size=5))
def test_chat_counts_are_the_same_with_and_without_the_twin(
    shipped: tuple[Tokenizer, TwinEncoder], messages: list[dict[str, str]]
) -> None:
    tokenizer, _ = shipped
    fast = TokenCounter(tokenizer, cache_entries=0)
    plain = TokenCounter(tokenizer, cache_entries=0, tiktoken=False)
    assert fast.twin is not None and plain.twin is None
    assert fast.count_chat(messages) == plain.count_chat(messages)


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(r" ?\w+|\s+|[^\s\w]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return tokenizer


def small_vocab() -> dict[str, int]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return {char: i for i, char in enumerate(sorted(alphabet))}


def test_a_small_byte_level_bpe_gets_a_twin() -> None:
    vocab = small_vocab()
    vocab["ab"] = len(vocab)
    vocab["abc"] = len(vocab)
    tokenizer = byte_level_bpe(vocab, [("a", "b"), ("ab", "c")])
    twin = tiktoken_twin(tokenizer)
    assert twin is not None
    for text in ("abc abcab", "cab, abc!", "ab  c"):
        assert twin.lengths([text]) == [hf_count(tokenizer, text)]


def test_merges_out_of_rank_order_get_no_twin() -> None:
    vocab = small_vocab()
    vocab["ab"] = len(vocab)
    vocab["bc"] = len(vocab)
    # "bc" has the higher rank but is listed first: HF merges "bc" first, tiktoken "ab".
    tokenizer = byte_level_bpe(vocab, [("b", "c"), ("a", "b")])
    assert tiktoken_twin(tokenizer) is None


def test_other_tokenizer_shapes_get_no_twin() -> None:
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tiktoken_twin(word_level) is None
    vocab = small_vocab()
    plain_byte_level = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    plain_byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert tiktoken_twin(plain_byte_level) is None


def test_the_shipped_tokenizer_json_has_the_twin_shape() -> None:
    spec = json.loads(load_tokenizer().to_str())
    assert spec["normalizer"] == {"type": "NFC"}
    assert [step["type"] for step in spec["pre_tokenizer"]["pretokenizers"]] == [
        "Split", "ByteLevel"]
