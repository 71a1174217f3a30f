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

import dataclasses
import math
import random
from collections.abc import Sequence
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
class MaxTokensMix:
    """What clients put in ``max_tokens``: nothing (the server's default: vLLM gives the rest of
    the context), a cap ``cap_factor`` times the real output (clients ask for more than they
    use), or exactly the real output. Fractions of requests, the same for every class; the
    real output is forced either way (the simulator's ``X-Sim-Output-Tokens``), so the work is
    the same and only what the client declares differs."""

    none: float = 0.2
    cap: float = 0.5
    exact: float = 0.3
    cap_factor: float = 4.0

    def __post_init__(self) -> None:
        if min(self.none, self.cap, self.exact) < 0 or not math.isclose(
                self.none + self.cap + self.exact, 1.0, abs_tol=1e-9):
            raise ValueError("max_tokens fractions must be >= 0 and sum to 1")
        if self.cap_factor < 1:
            raise ValueError("cap_factor must be >= 1")

    def draw(self, rng: random.Random) -> str:
        u = rng.random()
        if u < self.none:
            return "none"
        return "cap" if u < self.none + self.cap else "exact"

    def describe(self) -> str:
        return (f"none {self.none:.0%}, a cap of {self.cap_factor:g}x the output "
                f"{self.cap:.0%}, exact {self.exact:.0%}")


EXACT_MAX_TOKENS = MaxTokensMix(none=0.0, cap=0.0, exact=1.0)
"""Every client sends its exact output length (the estimator's best case)."""


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
    ask: str = "exact"
    """What the client sends as ``max_tokens``: "exact", "cap" (``cap_tokens``) or "none"."""
    cap_tokens: int = 0

    @property
    def max_tokens(self) -> int | None:
        """The ``max_tokens`` field of the request (None: left out)."""
        if self.ask == "none":
            return None
        return self.cap_tokens if self.ask == "cap" else self.output_tokens


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
    max_tokens: MaxTokensMix = EXACT_MAX_TOKENS,
    max_model_len: int = 16_384,
) -> Schedule:
    """Poisson arrivals per class, phase by phase; deterministic for a given seed. A cap is
    shortened to what the context leaves (a longer one is a 400 in vLLM and in kvgate)."""
    out: list[PlannedRequest] = []
    for ci, klass in enumerate(classes):
        # One stream of randomness per class: adding a class does not reshuffle the others,
        # and what clients ask for has its own stream, so it leaves sizes and times alone.
        rng = random.Random(f"{seed}:{ci}:{klass.name}")
        asks = random.Random(f"{seed}:{ci}:{klass.name}:max_tokens")
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
                prompt, output = klass.prompt.draw(rng), klass.output.draw(rng)
                cap = min(math.ceil(max_tokens.cap_factor * output), max_model_len - prompt)
                out.append(PlannedRequest(
                    index=0, klass=klass.name, tier=klass.tier, at=t, prompt_tokens=prompt,
                    output_tokens=output, stream=klass.stream, ask=max_tokens.draw(asks),
                    cap_tokens=max(output, cap),
                ))
            start = end
    out.sort(key=lambda r: (r.at, r.klass))
    return Schedule([dataclasses.replace(r, index=i) for i, r in enumerate(out)])


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
