"""The retry policy: named constants and the pure delay function.

Everything here is deterministic given its inputs (randomness comes in as a callable), so the
distribution of delays can be tested without sleeping or patching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The first backoff window. One second, like Kubernetes APF, rather than the OpenAI SDK's 0.5 s:
# an LLM request holds KV-cache for seconds, so coming back sooner than that only meets the
# same full cache again.
BASE_DELAY_S = 1.0

# Largest backoff window (without a server hint). Matches the OpenAI SDK's cap of 8 s.
MAX_DELAY_S = 8.0

# Attempts per logical request, the first one included (Google SRE: at most 3 per request).
MAX_ATTEMPTS = 3

# Overall deadline for a logical request's retries: no attempt starts and no backoff sleep ends
# after it. It does not cut off a response already being received.
DEADLINE_S = 60.0

# A server hint above this means "not in any useful time": give up and report the 429 at once,
# as the OpenAI SDK does (its MAX_RETRY_AFTER_DELAY is 120 s as well).
MAX_RETRY_AFTER_S = 120.0

# When the server sends a hint, the jitter window above it is at least this fraction of the
# hint. Clients rejected in the same instant all receive (nearly) the same hint; if they all
# returned exactly when it expires they would recreate the burst that was just shed. Spreading
# the returns evenly over a window as long as the wait caps the returning rate at N / hint,
# the rate at which kvgate's gateway expects its queue to drain (its hint is the work ahead
# divided by the drain rate). A wider window only makes clients wait longer: the returns are
# already flat (bench/results/retry_storm.md), and the mean wait is (1 + HINT_SPREAD / 2) x h.
HINT_SPREAD = 1.0

# Statuses worth another attempt: the gateway's backpressure (429) and an unavailable gateway
# or node (503: Redis unreachable, a node unreachable, a gateway shutting down), which did not
# run the request. A 500 is a bug or a bad request in disguise; retrying it only adds load.
#
# Not 504, although the official OpenAI SDK retries it (it retries every status >= 500, and
# 408 and 409). kvgate's gateway never sends 504: one comes from a proxy in front of it that
# gave up waiting, and the gateway sends a whole answer's status line only with its last
# token, so the generation may still be running on a GPU. A retry runs it a second time and
# takes as long, into the same proxy timeout: up to MAX_ATTEMPTS times the GPU work, and no
# answer. That is the reason read timeouts are not retried either (transport.py); a 504 is
# a read timeout one hop further out. Where a 504 is known to mean the request never reached
# the gateway, add it to RetryPolicy.retryable_statuses, or have the proxy send
# x-should-retry: true.
RETRYABLE_STATUSES: frozenset[int] = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The knobs of the retry loop; the defaults are the module constants."""

    base_delay_s: float = BASE_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    max_attempts: int = MAX_ATTEMPTS
    deadline_s: float | None = DEADLINE_S
    max_retry_after_s: float = MAX_RETRY_AFTER_S
    hint_spread: float = HINT_SPREAD
    retryable_statuses: frozenset[int] = RETRYABLE_STATUSES

    def __post_init__(self) -> None:
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("base_delay_s and max_delay_s must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (1 means: never retry)")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError("deadline_s must be > 0 or None")
        if self.max_retry_after_s < 0 or self.hint_spread < 0:
            raise ValueError("max_retry_after_s and hint_spread must be >= 0")

    def delay(self, attempt: int, hint_s: float | None, rand: Callable[[], float]) -> float:
        return backoff_delay(
            attempt,
            base=self.base_delay_s,
            cap=self.max_delay_s,
            hint_s=hint_s,
            rand=rand,
            hint_spread=self.hint_spread,
        )


def backoff_window(attempt: int, *, base: float, cap: float) -> float:
    """min(cap, base * 2^attempt), without overflowing for absurd attempt numbers."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    # 2.0 ** 1100 overflows a float; any attempt past 64 is at the cap for sane inputs anyway.
    return min(cap, base * 2.0 ** min(attempt, 64))


def backoff_delay(
    attempt: int,
    *,
    base: float,
    cap: float,
    hint_s: float | None,
    rand: Callable[[], float],
    hint_spread: float = HINT_SPREAD,
) -> float:
    """Seconds to wait before retry number `attempt` + 1 (attempt 0 follows the first failure).

    Without a hint: full jitter, uniform on [0, min(cap, base * 2^attempt)].
    With a hint h: uniform on [h, h + W] where W = min(cap, max(base * 2^attempt, spread * h)),
    so the delay is never sooner than the server asked and the returns are still spread.
    `rand` returns a float uniform on [0, 1), e.g. `random.random`.
    """
    window = backoff_window(attempt, base=base, cap=cap)
    if hint_s is None or hint_s <= 0:
        return rand() * window
    window = min(cap, max(window, hint_spread * hint_s))
    return hint_s + rand() * window
