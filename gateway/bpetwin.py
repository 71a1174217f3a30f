"""A tiktoken twin of a byte-level BPE `tokenizer.json`: the same counts, about 2.7x faster.

Counting tokens is the one CPU-heavy step of admission (HF `tokenizers` took 0.34 ms for a
~850-byte mixed Chinese/English message here; tiktoken 0.13 ms on the same vocabulary). Most
current models ship a byte-level BPE (Qwen2/2.5/3, Llama 3, GPT-2 family) whose tokenizer.json
tiktoken can run as is: the vocabulary as rank per byte string, the pre-tokenizer's split regex,
the added tokens as specials. A twin is built only when the tokenizer has exactly that shape, and
used only when it then counts a built-in sample (scripts, code, emoji, combining marks, special
tokens, whitespace runs) exactly as HF does; otherwise the counter stays on HF `tokenizers`.

Why the counts agree: tiktoken merges the adjacent pair whose concatenation has the lowest rank,
HF the pair listed first in `merges`. They pick the same pair when the merges are listed in the
rank order of their results, which is checked. tiktoken is an optional dependency (the `fast`
extra); without it nothing changes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import unicodedata
from collections.abc import Sequence
from typing import Any

import orjson
from tokenizers import Tokenizer

log = logging.getLogger("kvgate.gateway")

__all__ = ["SELF_CHECK_TEXTS", "TwinEncoder", "bytes_to_unicode", "tiktoken_twin"]

SELF_CHECK_TEXTS: tuple[str, ...] = (
    "Hello, world! I'LL be there; they've said it's fine.",
    "大模型推理网关在请求进入 vLLM 之前，用模型自己的分词器估算 KV-Cache 占用 (T_in + T_out)。",  # noqa: RUF001
    "def admit(tenant: str) -> bool:\n    return bucket[tenant] >= 42\n\n\n\tpass\r\n",
    "Emoji 👩‍👩‍👧‍👦 and flags 🇫🇷, math ∑x² ≈ 3.14159, numbers 1234567890 12,345.67",
    "Combining: e\u0301 a\u0308 n\u0303, precomposed: é ä ñ, Hangul 한국어, Кириллица, العربية",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>tail",
    "   leading spaces,\t\ttabs,  double  spaces and trailing   \n\n  \n",
    "URL https://example.com/a?b=c&d=e#f, email a.b@example.org, path /usr/local/bin",
)

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet HF ByteLevel uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codepoints = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codepoints, strict=True)}


class TwinEncoder:
    """Counts with tiktoken; thread-safe (tiktoken releases the GIL while encoding)."""

    __slots__ = ("_encoding", "_nfc")

    def __init__(self, encoding: Any, nfc: bool) -> None:
        self._encoding = encoding
        self._nfc = nfc

    def lengths(self, texts: Sequence[str]) -> list[int]:
        encode = self._encoding.encode
        if self._nfc:
            texts = [unicodedata.normalize("NFC", text) for text in texts]
        return [len(encode(text, allowed_special="all")) for text in texts]


def _split_pattern(pre: Any) -> str | None:
    """The regex of a `Sequence[Split(regex, Isolated), ByteLevel(use_regex=false)]`."""
    if not isinstance(pre, dict) or pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
            or split.get("invert") or byte_level.get("type") != "ByteLevel"
            or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space")):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return regex if isinstance(regex, str) else None


def _build(tokenizer: Tokenizer) -> TwinEncoder | None:
    try:
        import tiktoken
    except ImportError:
        return None
    spec = orjson.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if (model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback")
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
            or normalizer not in (None, {"type": "NFC"})):
        return None
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    try:
        ranks = {bytes(byte_of[c] for c in token): rank for token, rank in model["vocab"].items()}
    except KeyError:
        return None  # a token outside the byte-level alphabet
    if len(ranks) != len(model["vocab"]):
        return None
    merged_ranks = []
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged_ranks.append(model["vocab"].get(left + right, -1))
    if any(b <= a for a, b in itertools.pairwise(merged_ranks)):
        return None  # merge priority differs from rank order: tiktoken would merge differently
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    try:
        encoding = tiktoken.Encoding(
            "kvgate-twin", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except ValueError:
        return None
    twin = TwinEncoder(encoding, nfc=normalizer is not None)
    reference = [len(e) for e in tokenizer.encode_batch(
        list(SELF_CHECK_TEXTS), add_special_tokens=False)]
    if twin.lengths(SELF_CHECK_TEXTS) != reference:
        log.warning("tiktoken counts differ from the tokenizer's on the self-check sample; "
                    "counting with HF tokenizers")
        return None
    return twin


_twins: dict[int, tuple[Tokenizer, TwinEncoder | None]] = {}
_twins_lock = threading.Lock()


def tiktoken_twin(tokenizer: Tokenizer) -> TwinEncoder | None:
    """The tokenizer's twin, built once per tokenizer object; None where none can be trusted."""
    with _twins_lock:
        found = _twins.get(id(tokenizer))
        if found is None or found[0] is not tokenizer:
            found = _twins[id(tokenizer)] = (tokenizer, _build(tokenizer))
        return found[1]
