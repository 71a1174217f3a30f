"""The learned VIP objective (scheduler.calm) against plain Python: the finish script's 10%
buckets, the calm histogram's deltas and decay, and the objective it gives."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.calm import (
    BUCKET_RATIO,
    CALM_TAU_S,
    MIN_SAMPLES,
    CalmBaseline,
    quantile,
)


def bucket_of(ms: float) -> int:
    """The finish script's bucket (lua/finish.lua), in Python."""
    return 0 if ms < 1 else min(120, math.floor(math.log(ms) / math.log(BUCKET_RATIO)))


def histogram(samples: list[float]) -> dict[int, int]:
    out: dict[int, int] = {}
    for ms in samples:
        out[bucket_of(ms)] = out.get(bucket_of(ms), 0) + 1
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(1.2, 50_000.0), min_size=1, max_size=400),
       st.sampled_from([0.5, 0.9, 0.99]))
def test_the_quantile_is_within_one_bucket_of_the_samples_quantile(samples: list[float],
                                                                    q: float) -> None:
    exact = sorted(samples)[max(0, math.ceil(q * len(samples)) - 1)]
    estimate = quantile(histogram(samples), q)
    assert estimate is not None
    assert exact / BUCKET_RATIO <= estimate <= exact * BUCKET_RATIO


def test_an_empty_histogram_has_no_quantile() -> None:
    assert quantile({}, 0.99) is None
    assert quantile({3: 0.0}, 0.99) is None


def test_only_calm_intervals_are_learned_and_the_objective_waits_for_enough_of_them() -> None:
    calm = CalmBaseline(1.2, 250, 0.0)
    counts: dict[int, int] = {}
    calm.observe(counts, True, 0.0)
    # A flood: busy intervals are not learned, however many first tokens they report.
    counts[bucket_of(900)] = 500
    calm.observe(counts, False, 1.0)
    calm.observe(counts, False, 2.0)
    assert calm.samples == 0 and calm.objective_ms() == 250
    # The interval from a busy poll to a calm one is not calm either.
    counts[bucket_of(900)] += 50
    calm.observe(counts, True, 3.0)
    assert calm.samples == 0
    # Calm: first tokens around 100 ms; the configured objective until MIN_SAMPLES of them.
    step = 5
    t = 3.0
    while calm.samples + step < MIN_SAMPLES:
        t += 1.0
        counts[bucket_of(100)] = counts.get(bucket_of(100), 0) + step
        calm.observe(counts, True, t)
        assert calm.objective_ms() == 250
    t += 1.0
    counts[bucket_of(100)] += 2 * step
    calm.observe(counts, True, t)
    learned = calm.calm_ms()
    assert learned is not None and 100 / BUCKET_RATIO <= learned <= 100 * BUCKET_RATIO
    assert calm.objective_ms() == round(1.2 * learned)
    # vip_slowdown 0: the configured objective, whatever was learned.
    calm.slowdown = 0.0
    assert calm.objective_ms() == 250


def test_the_histogram_decays_and_a_reset_counter_is_not_a_delta() -> None:
    calm = CalmBaseline(1.2, 250, 0.0)
    calm.observe({10: 0}, True, 0.0)
    calm.observe({10: 100}, True, 1.0)
    calm.observe({10: 100}, True, 1.0 + CALM_TAU_S)
    assert math.isclose(calm.histogram[10], 100 / math.e, rel_tol=1e-9)
    # Redis flushed: the counts start again from below; nothing is learned from that poll.
    calm.observe({10: 3}, True, 1.0 + CALM_TAU_S)
    assert math.isclose(calm.histogram[10], 100 / math.e, rel_tol=1e-9)
    calm.observe({10: 13}, True, 1.0 + CALM_TAU_S)
    assert math.isclose(calm.histogram[10], 100 / math.e + 10, rel_tol=1e-9)


def test_a_new_term_starts_the_deltas_again() -> None:
    """The counts a leader read in its last term, minutes ago, are not the start of an
    interval: the first poll of a new term only starts the deltas."""
    calm = CalmBaseline(1.2, 250, 0.0)
    calm.observe({10: 0}, True, 0.0)
    calm.observe({10: 30}, True, 1.0)
    calm.restart()
    calm.observe({10: 900}, True, 100.0)
    calm.observe({10: 910}, True, 101.0)
    assert math.isclose(calm.samples, 30 * math.exp(-100 / CALM_TAU_S) + 10, rel_tol=1e-9)


def test_calm_counts_only_once_it_has_lasted_the_settle_time() -> None:
    """After a flood the batches it left are still decoding: the first `settle_s` of calm
    are not learned."""
    calm = CalmBaseline(1.2, 250, 5.0)
    total = 0
    for i in range(20):
        total += 10
        calm.observe({10: total}, i >= 3, float(i))
    # Calm from t=3: intervals starting at t=8 or later count, i.e. those ending at 9..19
    # (less the decay of the 11 s since the first of them).
    assert math.isclose(calm.samples, 110, rel_tol=0.01)
    # What the release control is told (it learns the calm step time then): settled from the
    # poll at which calm has lasted 5 s, until the pool is not calm, or a new term begins.
    assert calm.settled(19.0)
    probe = CalmBaseline(1.2, 250, 5.0)
    seen = []
    for i in range(12):
        probe.observe({}, i not in (0, 9), float(i))
        seen.append(probe.settled(float(i)))
    assert seen == [False] * 6 + [True] * 3 + [False] * 3
    probe.restart()
    probe.observe({}, True, 12.0)
    assert not probe.settled(12.0)


def test_a_flood_that_queues_nothing_does_not_ratchet_the_objective_up() -> None:
    """Calm first tokens around 100 ms, then a flood the admission lets through (nothing
    queued, the zone GREEN): its chats get slower a little at a time, each just under the
    objective of the moment. Only the first tail first token of the flood is learned."""
    calm = CalmBaseline(1.2, 250, 1.0)
    counts: dict[int, int] = {}
    t = 0.0
    for i in range(200):  # 20 s of calm, ten first tokens a second between 95 and 105 ms
        t += 0.1
        bucket = bucket_of(95 + i % 11)
        counts[bucket] = counts.get(bucket, 0) + 1
        calm.observe(counts, True, t)
    learned = calm.objective_ms()
    assert 1.2 * 105 / BUCKET_RATIO <= learned <= 1.2 * 105 * BUCKET_RATIO
    ms = 100.0
    for _ in range(300):  # 30 s of flood: each chat 1% slower than the last
        t += 0.1
        ms *= 1.01
        bucket = bucket_of(min(ms, calm.objective_ms() - 1))
        counts[bucket] = counts.get(bucket, 0) + 1
        calm.observe(counts, True, t)
    assert calm.objective_ms() <= learned * BUCKET_RATIO
    # Calm again after the settle time, one first token in a hundred in the tail: those are
    # learned too (the tail is not trimmed).
    for i in range(1_000):
        t += 0.1
        bucket = bucket_of(200 if i % 100 == 99 else 95 + i % 11)
        counts[bucket] = counts.get(bucket, 0) + 1
        calm.observe(counts, True, t)
    tail = calm.histogram.get(bucket_of(200), 0.0)
    assert tail >= 10 * math.exp(-100.0 / CALM_TAU_S) - 1e-9
