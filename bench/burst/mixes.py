"""The traffic mixes the matrix runs: who sends what, and which class the burst multiplies.

Rates are per real GPU node per simulated second at 1x (bench.burst.workload). Every mix keeps the
VIP chats of the article's mix, so the VIP criteria read the same traffic in every mix; what
changes is the work the burst brings:

* ``article``: the source article's case. Long documents (8k-token prompts, short answers) and
  long generations (short prompts, up to 4,000 tokens out) at 400%: prefill-heavy.
* ``chat``: Normal chats at 400%: many short requests, the KV filled by concurrency.
* ``generation``: long generations at 400%: decode-heavy, the KV filled by growth.

All three use the same ``max_tokens`` mix (``REALISTIC``): fixed fractions, not chosen per seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from admission.tiers import Tier
from bench.burst.expconfig import Settings
from bench.burst.workload import DEFAULT_CLASSES, MaxTokensMix, Range, TrafficClass

REALISTIC = MaxTokensMix(none=0.2, cap=0.5, exact=0.3, cap_factor=4.0)
"""A fifth of clients send no ``max_tokens``, half a cap four times what they use, the rest the
exact length."""

_VIP_CHAT, _NORMAL_APP, _BATCH_DOCS, _BATCH_GEN = DEFAULT_CLASSES


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    summary: str
    classes: tuple[TrafficClass, ...]
    burst_factor: float = 4.0
    max_tokens: MaxTokensMix = REALISTIC


MIXES: dict[str, Mix] = {
    "article": Mix("article", "long documents and long generations (Batch) at 400%",
                   DEFAULT_CLASSES),
    "chat": Mix("chat", "Normal chats at 400%", (
        _VIP_CHAT,
        # Product chat: a system prompt and some history, answers of a few paragraphs.
        TrafficClass("normal-chat", Tier.NORMAL, rate=2.0, prompt=Range(150, 1500, log=True),
                     output=Range(50, 600, log=True), burst=True),
        dataclasses.replace(_BATCH_DOCS, burst=False),
    )),
    "generation": Mix("generation", "long generations (Batch) at 400%", (
        _VIP_CHAT,
        _NORMAL_APP,
        dataclasses.replace(_BATCH_GEN, rate=0.25),
    )),
}


def with_mix(settings: Settings, name: str) -> Settings:
    """``settings`` with mix ``name``'s classes, burst factor and ``max_tokens`` mix."""
    mix = MIXES[name]
    return dataclasses.replace(settings, classes=mix.classes, burst_factor=mix.burst_factor,
                               max_tokens=mix.max_tokens, mix=mix.name)
