"""Retry budget: a token bucket that bounds the extra load retries can add.

Each first attempt earns a fraction of a token, each retry spends a whole one, and the bucket
holds at most `max_tokens`. Under sustained rejection a client therefore sends at most
`earn_per_request` extra attempts per logical request (plus the bucket's content), however many
attempts the per-request policy would allow: 10% by default, Google SRE's per-client ratio.
Backoff alone spreads retries in time; only a budget bounds their number.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Fraction of a token each logical request (first attempt) earns: retries <= 10% of requests.
EARN_PER_REQUEST = 0.1

# What one retry costs.
RETRY_COST = 1.0

# Bucket size, and its content at start. Full at start so a fresh client (a one-shot script)
# can still retry its first request; small so a long quiet spell cannot bank a retry burst.
MAX_TOKENS = 10.0


@dataclass(frozen=True, slots=True)
class BudgetStats:
    """A consistent snapshot of a budget's counters."""

    tokens: float
    first_attempts: int
    retries: int
    retries_denied: int


class RetryBudget:
    """Thread-safe retry token bucket; share one per client (or per process) to bound its load."""

    def __init__(
        self,
        *,
        earn_per_request: float = EARN_PER_REQUEST,
        retry_cost: float = RETRY_COST,
        max_tokens: float = MAX_TOKENS,
        initial_tokens: float | None = None,
    ) -> None:
        if earn_per_request < 0 or retry_cost <= 0 or max_tokens < 0:
            raise ValueError("earn_per_request >= 0, retry_cost > 0 and max_tokens >= 0 required")
        start = max_tokens if initial_tokens is None else initial_tokens
        if not 0 <= start <= max_tokens:
            raise ValueError("initial_tokens must be within [0, max_tokens]")
        self.earn_per_request = earn_per_request
        self.retry_cost = retry_cost
        self.max_tokens = max_tokens
        # A plain lock, never held across an await: the async transport can share it safely.
        self._lock = threading.Lock()
        self._tokens = start
        self._first_attempts = 0
        self._retries = 0
        self._retries_denied = 0

    def record_request(self) -> None:
        """A logical request made its first attempt: earn a fraction of a token."""
        with self._lock:
            self._first_attempts += 1
            self._tokens = min(self.max_tokens, self._tokens + self.earn_per_request)

    def try_spend(self) -> bool:
        """Take the cost of one retry; False (and counted) when the bucket cannot pay it."""
        with self._lock:
            # A small epsilon: ten earnings of 0.1 add up to 0.9999999999999999, not 1.0.
            if self._tokens + 1e-9 >= self.retry_cost:
                self._tokens = max(0.0, self._tokens - self.retry_cost)
                self._retries += 1
                return True
            self._retries_denied += 1
            return False

    def refund(self) -> None:
        """Give back what `try_spend` took for a retry that was then never sent (its backoff
        sleep was cancelled); it no longer counts among `retries` either."""
        with self._lock:
            self._tokens = min(self.max_tokens, self._tokens + self.retry_cost)
            self._retries = max(0, self._retries - 1)

    @property
    def tokens(self) -> float:
        with self._lock:
            return self._tokens

    @property
    def first_attempts(self) -> int:
        with self._lock:
            return self._first_attempts

    @property
    def retries(self) -> int:
        with self._lock:
            return self._retries

    @property
    def retries_denied(self) -> int:
        with self._lock:
            return self._retries_denied

    def stats(self) -> BudgetStats:
        with self._lock:
            return BudgetStats(
                tokens=self._tokens,
                first_attempts=self._first_attempts,
                retries=self._retries,
                retries_denied=self._retries_denied,
            )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"RetryBudget(tokens={s.tokens:.2f}, first_attempts={s.first_attempts}, "
            f"retries={s.retries}, retries_denied={s.retries_denied})"
        )
