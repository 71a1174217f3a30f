"""The engine's counters and histograms, kept as plain numbers and exported at scrape time.

prometheus_client's own metric objects take a lock per observation and live in a registry;
an engine step observes thousands of inter-token latencies, so we keep cheap arrays here and
let the collector in bench.sim.metrics turn them into metric families when scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class Histogram:
    """A Prometheus-style histogram: ``le`` buckets, a sum and a count."""

    __slots__ = ("_counts", "buckets", "count", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left finds the first bound >= value, i.e. the smallest bucket with value <= le.
        self._counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, as exposition needs them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.buckets, self._counts, strict=False):
            running += n
            out.append((_le(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass(slots=True)
class EngineStats:
    """Monotonic totals since the node started."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0
    """Every token the engine ran through the model, recomputation after preemption included."""
    preemptions: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
