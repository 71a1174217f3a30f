"""How large a node's whole (non-streamed) answer may be before the gateway stops reading it.

A node is trusted no further than it must be: a buggy or hostile one could send an endless
body, and the gateway would hold it all in memory. The bound follows from the request, since
legitimate answers differ by orders of magnitude: a plain 1,000-token answer is some 10 KB, the
same with 20 alternatives' logprobs per token about 2 MB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ANSWER_BASE_BYTES = 1 << 20
"""A whole answer's room besides its tokens (ids, usage, each choice's keys: vLLM's take a few
hundred bytes per choice, so this leaves kilobytes per choice even at `n` = 128)."""
TOKEN_BYTES = 1 << 10
"""Room per token, JSON-escaped. The limit is on the whole answer, so the tokens' average
counts, not the longest: the bundled Qwen2 vocabulary's tokens average 6.4 bytes, and even its
longest (128 bytes) takes at most 768 characters, were every byte a `\\u00XX` escape."""
LOGPROB_ENTRY_BYTES = 1536
"""Room per logprob entry (chat: `{"token", "logprob", "bytes"}`; the completions shape is
smaller): its text at most 768 characters, `bytes` at most 512 (128 bytes), logprob and keys
under 70; typical entries take 70 to 100."""
MAX_LOGPROBS = 20
"""Alternatives counted per token: OpenAI's most `top_logprobs`, vLLM's default
`--max-logprobs`."""
_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
_PROMPT_FIELDS = ("echo", "prompt_logprobs", "return_token_ids")
"""Body fields that have vLLM return the prompt's tokens (text, logprobs or ids) per choice."""


def whole_answer_limit(body: Mapping[str, Any], *, prompt_tokens: int,
                       output_tokens: int) -> int:
    """The most bytes a node's whole (non-streamed) answer to `body` may take; past it the
    answer ends as broken (502 `upstream_oversized_answer`) instead of being held.

    `ANSWER_BASE_BYTES`, plus per token the answer can carry `TOKEN_BYTES` and, when the body
    asks for logprobs of any kind, `MAX_LOGPROBS` + 1 entries of `LOGPROB_ENTRY_BYTES`. The
    answer carries `output_tokens` (`max_tokens` times the sequences) and, when the body has
    the node return the prompt (`_PROMPT_FIELDS`), `prompt_tokens` once per choice (`n`).
    So a 1,000-token answer may take 2 MiB, or 33 MiB with logprobs, where vLLM's takes some
    10 KB, or 2 MB with 20 alternatives per token."""
    def asks(name: str) -> bool:
        value = body.get(name)  # `"logprobs": 0` asks for the chosen tokens' own
        return value is not None and value is not False

    per_token = TOKEN_BYTES
    if any(asks(name) for name in _LOGPROB_FIELDS):
        per_token += (MAX_LOGPROBS + 1) * LOGPROB_ENTRY_BYTES
    tokens = output_tokens
    if any(asks(name) for name in _PROMPT_FIELDS):
        n = body.get("n")
        tokens += prompt_tokens * (n if type(n) is int and n > 0 else 1)
    return ANSWER_BASE_BYTES + tokens * per_token
