"""The retry-storm bench's pure parts: its figure of merit and its copy of the OpenAI policy."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from bench.retry_storm import (
    FixedDelayPolicy,
    KvgatePolicy,
    OpenAIDefaultPolicy,
    storm_figures,
)


def test_figures_tell_a_herd_from_an_even_return() -> None:
    herd = storm_figures([1.0] * 1000)
    assert (herd.peak, herd.arrivals) == (1000, 1000)
    assert herd.ratio == pytest.approx(11.0)  # 11 bins from T0 to 1.0 s, all in one
    even = storm_figures([(i + 0.5) / 1000 for i in range(1000)])
    assert even.ratio == pytest.approx(1.0)
    assert storm_figures([]).arrivals == 0


def _sdk_delay(remaining: int, headers: dict[str, str], u: float) -> float:
    """The installed SDK's own computation (private API; skip if it has moved)."""
    base_client: Any = pytest.importorskip("openai._base_client")
    models: Any = pytest.importorskip("openai._models")
    client = openai.OpenAI(api_key="x", max_retries=2)
    options = models.FinalRequestOptions.construct(method="post", url="/x")
    headers_cls = getattr(base_client, "httpx2", httpx)
    original = base_client.random
    base_client.random = lambda: u
    try:
        delay: float = client._calculate_retry_timeout(
            remaining, options, headers_cls.Headers(headers)
        )
    except (AttributeError, TypeError) as exc:  # pragma: no cover - depends on the SDK version
        pytest.skip(f"openai's private retry API changed: {exc!r}")
    finally:
        base_client.random = original
    return delay


@pytest.mark.parametrize("headers", [{}, {"retry-after-ms": "1500"}, {"retry-after": "2"}])
@pytest.mark.parametrize("u", [0.0, 0.37, 0.99])
def test_openai_copy_matches_the_sdk(headers: dict[str, str], u: float) -> None:
    ours = OpenAIDefaultPolicy(lambda: u)
    for retries_taken in range(OpenAIDefaultPolicy.MAX_RETRIES):
        expected = _sdk_delay(OpenAIDefaultPolicy.MAX_RETRIES - retries_taken, headers, u)
        assert ours.next_delay(429, headers) == pytest.approx(expected)
    assert ours.next_delay(429, headers) is None  # max_retries=2 spent


def test_openai_copy_gives_up_like_the_sdk() -> None:
    assert OpenAIDefaultPolicy(lambda: 0.5).next_delay(400, {}) is None
    assert OpenAIDefaultPolicy(lambda: 0.5).next_delay(429, {"retry-after": "121"}) is None
    assert OpenAIDefaultPolicy(lambda: 0.5).next_delay(429, {"x-should-retry": "false"}) is None
    assert OpenAIDefaultPolicy(lambda: 0.5).next_delay(500, {}) == pytest.approx(0.4375)


def test_other_policies() -> None:
    fixed = FixedDelayPolicy()
    assert [fixed.next_delay(429, {}) for _ in range(3)] == [0.5, 0.5, None]
    ours = KvgatePolicy(lambda: 0.5)
    assert ours.next_delay(429, {"retry-after-ms": "1000"}) == pytest.approx(1.5)
