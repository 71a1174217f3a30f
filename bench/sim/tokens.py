"""Token counts and output lengths: deterministic stand-ins for a tokenizer and a sampler.

Counting rule (the text's content does not matter, its size does):

* a piece of text is ``ceil(len(utf8 bytes) / 4)`` tokens (BPE vocabularies average close to
  four bytes per token on English);
* a completion prompt string is that plus 1 (the BOS token); a prompt given as token ids is
  exactly that many tokens;
* a chat is 1 (BOS) + for each message ``5 + text tokens of its content`` (the Llama-3
  header ``<|start_header_id|>role<|end_header_id|>\\n\\n`` and ``<|eot_id|>``) + 4 for the
  assistant generation prompt. Content may be a string, ``None`` or a list of parts, whose
  ``text`` fields are concatenated.

Output length: a request generates ``max_tokens`` tokens (finish "length") unless an EOS comes
first (finish "stop"). The EOS position is, in order of precedence: the ``X-Sim-Output-Tokens``
header (exact; the EOS is the last generated token, so usage shows exactly that many), none when
the body sets ``ignore_eos``, otherwise a draw from Beta(2f, 2(1-f)) scaled to ``max_tokens``
(mean fraction f = the node's ``output_fraction``; f = 1 disables EOS), seeded by the node's
seed and a hash of the request body so a replayed request behaves the same.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

BOS_TOKENS = 1
CHAT_MESSAGE_OVERHEAD = 5
CHAT_GENERATION_PROMPT = 4

# What a generated token "says": fixed words, so responses are readable and sizes predictable.
_WORDS = (" the", " cache", " holds", " a", " token", " per", " block", " of", " sixteen", ".")


def text_tokens(text: str) -> int:
    return (len(text.encode()) + 3) // 4


def completion_prompt_tokens(prompt: str | Sequence[int]) -> int:
    if isinstance(prompt, str):
        return BOS_TOKENS + text_tokens(prompt)
    return len(prompt)


def message_text(content: object) -> str:
    """The text of a chat message's ``content``; raises ValueError on shapes vLLM rejects."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise ValueError("each content part must be an object with a string 'text'")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise ValueError("message content must be a string, a list of parts or null")


def chat_prompt_tokens(contents: Sequence[str]) -> int:
    body = sum(CHAT_MESSAGE_OVERHEAD + text_tokens(text) for text in contents)
    return BOS_TOKENS + body + CHAT_GENERATION_PROMPT


def token_text(index: int) -> str:
    return _WORDS[index % len(_WORDS)]


def fake_token_ids(count: int) -> list[int]:
    """Ids for ``/tokenize``: only their number is meaningful."""
    return [1000 + (i * 7919) % 30000 for i in range(count)]


def eos_position(
    *,
    max_tokens: int,
    forced: int | None,
    ignore_eos: bool,
    output_fraction: float,
    seed: int,
    body: bytes,
) -> int | None:
    """How many tokens are generated before the EOS (inclusive), or None to run to max_tokens."""
    if forced is not None:
        return forced if forced < max_tokens else None
    if ignore_eos or output_fraction >= 1.0:
        return None
    digest = hashlib.blake2b(body, digest_size=8, key=seed.to_bytes(8, "big", signed=True))
    rng = random.Random(int.from_bytes(digest.digest(), "big"))
    fraction = rng.betavariate(2.0 * output_fraction, 2.0 * (1.0 - output_fraction))
    position = max(1, math.ceil(fraction * max_tokens))
    return position if position < max_tokens else None
