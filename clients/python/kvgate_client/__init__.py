"""kvgate client SDK: retries that back off with full jitter, honour the server's hints, stay
within a retry budget and a deadline; as httpx transports, as a drop-in for the official
`openai` SDK, and as a small standalone client.

    import kvgate_client
    client = kvgate_client.openai(base_url="http://gateway:8080/v1", api_key="...")
"""

from __future__ import annotations

from .budget import BudgetStats, RetryBudget
from .client import AsyncKvgateClient, AsyncStream, KvgateClient, Stream
from .errors import (
    APIConnectionError,
    APIStatusError,
    IncompleteStreamError,
    InvalidResponseError,
    KvgateError,
    RateLimitError,
    StreamError,
)
from .hints import RetryHints, parse_hints, parse_retry_after, parse_should_retry
from .openai_compat import async_openai, openai, wrap
from .policy import (
    BASE_DELAY_S,
    DEADLINE_S,
    HINT_SPREAD,
    MAX_ATTEMPTS,
    MAX_DELAY_S,
    MAX_RETRY_AFTER_S,
    RETRYABLE_STATUSES,
    RetryPolicy,
    backoff_delay,
    backoff_window,
)
from .retrying import Decision, Retrier, RetryState, RetryStats
from .transport import (
    CONNECTION_ERRORS,
    READ_TIMEOUT_HEADER,
    REQUEST_TIMEOUT_HEADER,
    RETRY_COUNT_HEADER,
    AsyncRetryTransport,
    RetryTransport,
)

__version__ = "0.1.0"

__all__ = [
    "BASE_DELAY_S",
    "CONNECTION_ERRORS",
    "DEADLINE_S",
    "HINT_SPREAD",
    "MAX_ATTEMPTS",
    "MAX_DELAY_S",
    "MAX_RETRY_AFTER_S",
    "READ_TIMEOUT_HEADER",
    "REQUEST_TIMEOUT_HEADER",
    "RETRYABLE_STATUSES",
    "RETRY_COUNT_HEADER",
    "APIConnectionError",
    "APIStatusError",
    "AsyncKvgateClient",
    "AsyncRetryTransport",
    "AsyncStream",
    "BudgetStats",
    "Decision",
    "IncompleteStreamError",
    "InvalidResponseError",
    "KvgateClient",
    "KvgateError",
    "RateLimitError",
    "Retrier",
    "RetryBudget",
    "RetryHints",
    "RetryPolicy",
    "RetryState",
    "RetryStats",
    "RetryTransport",
    "Stream",
    "StreamError",
    "__version__",
    "async_openai",
    "backoff_delay",
    "backoff_window",
    "openai",
    "parse_hints",
    "parse_retry_after",
    "parse_should_retry",
    "wrap",
]
