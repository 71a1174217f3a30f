"""The retry-storm bench's pure parts: its figure of merit and its copy of the OpenAI policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.perf.retry_storm import (
    GO_ARM,
    FixedDelayPolicy,
    KvgatePolicy,
    OpenAIDefaultPolicy,
    _hint_ms,
    _Round,
    arms,
    main,
    storm_figures,
)


def test_figures_tell_a_herd_from_an_even_return() -> None:
    # Everyone back the instant a 1 s hint expires: one bin of the (at least ten-bin) window.
    herd = storm_figures([1.0] * 1000, opened_s=1.0)
    assert (herd.peak, herd.arrivals) == (1000, 1000)
    assert herd.ratio == pytest.approx(10.0)
    assert (herd.start_s, herd.end_s) == pytest.approx((1.0, 2.0))
    assert herd.ratio_t0 == pytest.approx(11.0)  # 11 bins from T0 to 1.0 s, all in one
    assert herd.ratio_span == pytest.approx(1.0)  # first-to-last: a herd is its own mean
    # Back evenly over the second after the hint: flat, however long the silence before it.
    even = storm_figures([1.0 + (i + 0.5) / 1000 for i in range(1000)], opened_s=1.0)
    assert even.ratio == pytest.approx(1.0)
    assert even.ratio_t0 == pytest.approx(2.0)  # (h + s) / s: what counting the silence costs
    assert storm_figures([]).arrivals == 0


def test_return_window_edges() -> None:
    # Retries before the server allowed them (hints ignored) open the window themselves.
    fixed = storm_figures([0.5] * 1000 + [1.0] * 1000, opened_s=1.0)
    assert fixed.start_s == pytest.approx(0.5)
    assert fixed.ratio == pytest.approx(5.0)  # 2,000 over ten bins, 1,000 in the busiest
    # Without a hint it opens at T0; a return longer than the minimum sets its own end.
    long_even = storm_figures([(i + 0.5) * 3.0 / 3000 for i in range(3000)])
    assert (long_even.start_s, long_even.end_s) == pytest.approx((0.0, 3.0))
    assert long_even.ratio == pytest.approx(1.0)
    # Twice as dense in the first of three seconds: peak / mean = 2 / (4 / 3).
    front = [(i + 0.5) / 1000 for i in range(1000)] * 2 + [
        1.0 + (i + 0.5) * 2.0 / 2000 for i in range(2000)
    ]
    assert storm_figures(front).ratio == pytest.approx(1.5)


def test_gateway_scenario_spreads_hints_like_the_gateway() -> None:
    rnd = _Round(hint="gateway", seed=3)
    rnd.t0 = 10.0
    hints = [_hint_ms(rnd, 10.0) for _ in range(200)]
    assert all(h is not None and 1000 <= h <= 1250 for h in hints)
    assert len(set(hints)) > 50
    assert _hint_ms(_Round(hint="none"), 10.0) is None


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


def test_the_go_arm_runs_in_the_bench(tmp_path: Path) -> None:
    # The whole bench, Go arm only, small: the Go SDK's program is built, its clients are all
    # held at the server's barrier, rejected at T0, and come back after the hint.
    out = tmp_path / "storm.md"
    args = ["--clients", "50", "--repeats", "1", "--scenarios", "remaining",
            "--policies", GO_ARM, "--output", str(out)]
    assert main(args) == 0
    [row] = [line for line in out.read_text().splitlines() if line.startswith("| remaining |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["remaining", GO_ARM, "50"]  # one retry per client
    assert cells[-2:] == ["50", "0"]  # all served once the server recovered
    start, _ = cells[7].removesuffix(" s").split("-")
    assert float(start) >= 0.99  # nobody came back before the 1 s hint
    assert arms() == ["kvgate", GO_ARM, "openai", "fixed"]
