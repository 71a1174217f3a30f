"""The burst experiment's traffic: tenant classes, the load profile, and a seeded schedule.

Everything is stated at *real scale*, per real GPU node and per simulated second, and scaled to
the simulated fleet in one place (``Scale``), as bench.sim.timing prescribes: a node at
capacity scale ``k`` takes ``k`` times the requests per (simulated) second, and a simulation at
time scale ``ts`` runs ``ts`` simulated seconds per wall-clock second, so a rate of ``r`` per
real node per simulated second becomes ``r * k * ts * nodes`` per wall-clock second.

Request sizes are not scaled (a request is a request), only how many there are.

The schedule is drawn once from a seeded RNG before any arm runs, so every arm of an experiment
faces exactly the same requests at the same intended times.

Prompt text: words of three letters joined by spaces ("the and for ..."). Each word is one
token for the gateway's Qwen2 tokenizer (checked against it) and four bytes, i.e. one token, for
the simulator's bytes/4 rule, so gateway estimates and engine usage agree on prompt sizes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from admission.tiers import Tier

# Single-token words for both counters (see the module docstring).
_WORDS = [
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was",
    "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old",
    "see", "two", "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use",
]
# A chat of one user message costs 1 (BOS) + 5 (message header) + 4 (generation prompt)
# simulator tokens around its text; bench.sim.tokens.chat_prompt_tokens.
CHAT_OVERHEAD_TOKENS = 10


@dataclass(frozen=True, slots=True)
class Range:
    """A size drawn uniformly (``log=False``) or log-uniformly from ``[lo, hi]``."""

    lo: int
    hi: int
    log: bool = False

    def draw(self, rng: random.Random) -> int:
        if self.log:
            return round(math.exp(rng.uniform(math.log(self.lo), math.log(self.hi))))
        return rng.randint(self.lo, self.hi)

    @property
    def mean(self) -> float:
        if self.log and self.hi > self.lo:
            return (self.hi - self.lo) / math.log(self.hi / self.lo)
        return (self.lo + self.hi) / 2


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """One simulated tenant: a tier, an arrival rate at baseline and request shapes."""

    name: str
    tier: Tier
    rate: float
    """Arrivals per simulated second per real GPU node at baseline (1x)."""
    prompt: Range
    """Prompt tokens (the simulator's count of the whole chat)."""
    output: Range
    """Exact output tokens (forced with X-Sim-Output-Tokens; max_tokens is set to it)."""
    stream: bool = True
    burst: bool = False
    """Whether the burst multiplies this class (the "long-text" traffic)."""


DEFAULT_CLASSES: tuple[TrafficClass, ...] = (
    # Interactive chat of paying users: a system prompt and a short history, short answers.
    TrafficClass("vip-chat", Tier.VIP, rate=1.2, prompt=Range(150, 600),
                 output=Range(100, 300)),
    # Online product traffic, mixed: chats to mid-size retrieval prompts, answers of all sizes.
    TrafficClass("normal-app", Tier.NORMAL, rate=0.6, prompt=Range(100, 4000, log=True),
                 output=Range(50, 1000, log=True)),
    # Offline summarisation: ~32 KB documents (8k tokens), short answers.
    TrafficClass("batch-docs", Tier.BATCH, rate=0.5, prompt=Range(7600, 8400),
                 output=Range(20, 200), stream=False, burst=True),
    # Offline generation: short prompts, long outputs of up to 4,000 tokens.
    TrafficClass("batch-gen", Tier.BATCH, rate=0.07, prompt=Range(50, 300),
                 output=Range(1000, 4000), stream=False, burst=True),
)


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float
    """Wall-clock seconds."""
    burst_factor: float
    """Multiplier of the burst classes' rates (1 = baseline; 4 = the 400% burst)."""


@dataclass(frozen=True, slots=True)
class Profile:
    phases: tuple[Phase, ...]
    drain_factor: float = 2.0
    """After the last phase, keep the arm alive for up to this many burst durations so that
    deferred work can finish (the bar: every Batch request done within twice the burst)."""

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def window(self, name: str) -> tuple[float, float]:
        """Start and end (wall seconds from the arm's start) of the first phase so named."""
        t = 0.0
        for p in self.phases:
            if p.name == name:
                return t, t + p.duration_s
            t += p.duration_s
        raise KeyError(name)

    @property
    def burst_s(self) -> float:
        start, end = self.window("burst")
        return end - start

    def phase_at(self, t: float) -> str:
        acc = 0.0
        for p in self.phases:
            acc += p.duration_s
            if t < acc:
                return p.name
        return "drain"


def burst_profile(baseline_s: float, burst_s: float, after_s: float,
                  factor: float = 4.0) -> Profile:
    """1x baseline, then ``factor`` x the burst classes, then 1x again."""
    return Profile((Phase("baseline", baseline_s, 1.0), Phase("burst", burst_s, factor),
                    Phase("after", after_s, 1.0)))


@dataclass(frozen=True, slots=True)
class Scale:
    nodes: int
    capacity_scale: float
    time_scale: float

    def wall_rate(self, rate: float) -> float:
        """A real-scale rate per node per simulated second, in requests per wall second."""
        return rate * self.capacity_scale * self.time_scale * self.nodes


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    klass: str
    tier: Tier
    at: float
    """Intended send time, wall seconds from the arm's start."""
    prompt_tokens: int
    output_tokens: int
    stream: bool


@dataclass(slots=True)
class Schedule:
    requests: list[PlannedRequest] = field(default_factory=list)

    def count(self, klass: str | None = None) -> int:
        return sum(1 for r in self.requests if klass is None or r.klass == klass)


def plan(
    profile: Profile,
    classes: Sequence[TrafficClass],
    scale: Scale,
    seed: int,
) -> Schedule:
    """Poisson arrivals per class, phase by phase; deterministic for a given seed."""
    out: list[PlannedRequest] = []
    for ci, klass in enumerate(classes):
        # One stream of randomness per class: adding a class does not reshuffle the others.
        rng = random.Random(f"{seed}:{ci}:{klass.name}")
        start = 0.0
        for phase in profile.phases:
            factor = phase.burst_factor if klass.burst else 1.0
            rate = scale.wall_rate(klass.rate * factor)
            end = start + phase.duration_s
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                out.append(PlannedRequest(
                    index=0, klass=klass.name, tier=klass.tier, at=t,
                    prompt_tokens=klass.prompt.draw(rng), output_tokens=klass.output.draw(rng),
                    stream=klass.stream,
                ))
            start = end
    out.sort(key=lambda r: (r.at, r.klass))
    return Schedule([
        PlannedRequest(i, r.klass, r.tier, r.at, r.prompt_tokens, r.output_tokens, r.stream)
        for i, r in enumerate(out)
    ])


def prompt_text(tokens: int) -> str:
    """User-message text whose chat costs ``tokens`` simulator tokens (at least 1 word)."""
    words = max(1, tokens - CHAT_OVERHEAD_TOKENS)
    # A fixed cycle, not random words: the text does not matter, only its size, and slicing a
    # cached string keeps 32 KB prompts cheap to build at hundreds of requests per second.
    return _text_of(words)


_CYCLE = " ".join(_WORDS)
_CYCLE_WORDS = len(_WORDS)
_cache: dict[int, str] = {}


def _text_of(words: int) -> str:
    cached = _cache.get(words)
    if cached is not None:
        return cached
    reps = -(-words // _CYCLE_WORDS)
    text = " ".join([_CYCLE] * reps)
    # Each word is 3 letters + 1 space; cut at a word boundary.
    text = text[: 4 * words - 1]
    if len(_cache) < 20_000:
        _cache[words] = text
    return text


def offered_work(classes: Sequence[TrafficClass],
                 factors: Mapping[str, float] | None = None) -> dict[str, float]:
    """Mean tokens per simulated second per real node (prompt and output), by class."""
    out = {}
    for c in classes:
        f = (factors or {}).get(c.name, 1.0)
        out[c.name] = c.rate * f * (c.prompt.mean + c.output.mean)
    return out
