"""Drop-in for the official `openai` SDK: same client classes, kvgate's retry policy underneath.

The SDK's own retries are switched off (`max_retries=0`) and an httpx client whose transport
is a RetryTransport takes their place, so existing code changes only where it builds its
client. `openai` is an optional dependency: it is imported when a factory is called.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from .budget import RetryBudget
from .policy import RetryPolicy
from .proxies import async_transport, sync_transport
from .transport import AsyncRetryTransport, RetryTransport

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

ClientT = TypeVar("ClientT", bound="OpenAI | AsyncOpenAI")

# The OpenAI SDK's own defaults (10 min overall, 5 s to connect; 1000 connections, 100 kept
# alive), restated because a custom transport owns its pool and the SDK's are not applied.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
DEFAULT_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
# Redirects are not followed (the SDK's own client follows them): httpx turns a POST answered
# 301 or 302 into a GET without its body, which the gateway answers 405, hiding the redirect.
# Unfollowed, the 3xx reaches the caller as the SDK's APIStatusError, its Location in
# `exc.response.headers`.
FOLLOW_REDIRECTS = False


def _require_openai() -> None:
    if importlib.util.find_spec("openai") is None:
        raise ImportError(
            "the openai drop-in needs the openai package: pip install 'kvgate-client[openai]'"
        )


def wrap(
    cls: type[ClientT],
    *,
    policy: RetryPolicy | None = None,
    budget: RetryBudget | None = None,
    retry_transport: RetryTransport | AsyncRetryTransport | None = None,
    limits: httpx.Limits | None = None,
    **kwargs: Any,
) -> ClientT:
    """Build `cls` (OpenAI, AsyncOpenAI, AzureOpenAI, ...) with kvgate's retries.

    `kwargs` go to the class unchanged (api_key, base_url, organization, ...). Pass a `budget`
    to share one retry budget among several clients or to read its counters; pass a ready
    `retry_transport` to control everything (inner transport, clock, sleep) yourself.
    """
    _require_openai()
    import openai as openai_sdk

    if kwargs.get("max_retries", 0) != 0:
        raise TypeError(
            "max_retries must stay 0: the SDK's retries would run on top of kvgate's policy "
            "(configure RetryPolicy.max_attempts instead)"
        )
    if "http_client" in kwargs:
        raise TypeError("http_client is built by kvgate_client; pass retry_transport instead")
    kwargs["max_retries"] = 0
    is_async = issubclass(cls, openai_sdk.AsyncOpenAI)
    if retry_transport is not None:
        if policy is not None or budget is not None or limits is not None:
            raise TypeError("pass either retry_transport or policy/budget/limits, not both")
        if is_async != isinstance(retry_transport, AsyncRetryTransport):
            raise TypeError(f"{cls.__name__} needs a{'n Async' if is_async else ' '}RetryTransport")
    pool = limits if limits is not None else DEFAULT_LIMITS
    if is_async:
        atransport = (
            retry_transport
            if isinstance(retry_transport, AsyncRetryTransport)
            else (
                AsyncRetryTransport(async_transport(pool), policy=policy, budget=budget)
            )
        )
        kwargs["http_client"] = httpx.AsyncClient(
            transport=atransport, timeout=DEFAULT_TIMEOUT, follow_redirects=FOLLOW_REDIRECTS
        )
    else:
        stransport = (
            retry_transport
            if isinstance(retry_transport, RetryTransport)
            else (RetryTransport(sync_transport(pool), policy=policy, budget=budget))
        )
        kwargs["http_client"] = httpx.Client(
            transport=stransport, timeout=DEFAULT_TIMEOUT, follow_redirects=FOLLOW_REDIRECTS
        )
    client = cls(**kwargs)
    _guard_copies(client)
    return client


def _guard_copies(client: Any) -> None:
    """Make the client's `copy` and `with_options` (the SDK's way to change one setting for a
    few calls) refuse `max_retries` other than 0, as the factory does: the copy shares the
    transport, so the SDK's retries would run on top of kvgate's (up to the product of both
    counts per call), and on statuses and timeouts that kvgate deliberately does not retry."""
    original = client.copy

    def copy(**changes: Any) -> Any:
        retries = changes.get("max_retries")
        if isinstance(retries, int) and retries != 0:
            raise TypeError(
                "max_retries must stay 0: the SDK's retries would run on top of kvgate's "
                "policy (configure RetryPolicy.max_attempts instead)"
            )
        copied = original(**changes)
        _guard_copies(copied)
        return copied

    # Instance attributes: the SDK's class is left as it is for clients kvgate did not build.
    client.copy = copy
    client.with_options = copy


def openai(
    *,
    policy: RetryPolicy | None = None,
    budget: RetryBudget | None = None,
    retry_transport: RetryTransport | None = None,
    limits: httpx.Limits | None = None,
    **kwargs: Any,
) -> OpenAI:
    """`openai.OpenAI(**kwargs)` with kvgate's retry policy."""
    _require_openai()
    from openai import OpenAI

    return wrap(
        OpenAI,
        policy=policy,
        budget=budget,
        retry_transport=retry_transport,
        limits=limits,
        **kwargs,
    )


def async_openai(
    *,
    policy: RetryPolicy | None = None,
    budget: RetryBudget | None = None,
    retry_transport: AsyncRetryTransport | None = None,
    limits: httpx.Limits | None = None,
    **kwargs: Any,
) -> AsyncOpenAI:
    """`openai.AsyncOpenAI(**kwargs)` with kvgate's retry policy."""
    _require_openai()
    from openai import AsyncOpenAI

    return wrap(
        AsyncOpenAI,
        policy=policy,
        budget=budget,
        retry_transport=retry_transport,
        limits=limits,
        **kwargs,
    )
