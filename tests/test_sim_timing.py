"""Calibration of the step-time model against the published 8B-on-H100 figures (no wall clock)."""

from __future__ import annotations

import pytest

from bench.sim.config import SimConfig
from bench.sim.engine import Engine, SimRequest
from bench.sim.timing import (
    StepCosts,
    StepShape,
    decode_step_seconds,
    idle_ttft_seconds,
    step_seconds,
)


def test_ttft_at_batch_one_is_tens_of_ms() -> None:
    # Published: TTFT p50 14 ms at concurrency 1 (short chats); llm-d: 60-120 ms for 256 tokens.
    ttft = idle_ttft_seconds(256)
    assert 0.010 <= ttft <= 0.100
    assert ttft == pytest.approx(0.015, abs=0.003)


def test_inter_token_latency_at_low_batch_is_6_to_15_ms() -> None:
    assert 0.006 <= decode_step_seconds(1, 512) <= 0.015
    assert 0.006 <= decode_step_seconds(4, 1024) <= 0.015


def test_decode_step_at_batch_64_is_about_50_ms() -> None:
    # Published: TPOT p50 47 ms at concurrency 64.
    assert 0.040 <= decode_step_seconds(64, 1024) <= 0.060


def test_ttft_under_batch_64_is_about_90_ms() -> None:
    # A request arriving during a 64-way decode step waits on average half of it, then rides
    # the next step with its prefill. Published: TTFT p50 87 ms at concurrency 64.
    decode = decode_step_seconds(64, 1024)
    with_prefill = step_seconds(
        StepShape(num_seqs=65, context_tokens=64 * 1024, prefill_tokens=256), StepCosts()
    )
    ttft = decode / 2 + with_prefill
    assert 0.060 <= ttft <= 0.120


def test_prefill_throughput_is_25_to_35k_tokens_per_second() -> None:
    seconds = idle_ttft_seconds(8192)
    assert 25_000 <= 8192 / seconds <= 35_000


def test_step_time_grows_with_batch_and_context() -> None:
    steps = [decode_step_seconds(b, 1024) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps) and len(set(steps)) == 4
    assert decode_step_seconds(64, 8192) > decode_step_seconds(64, 1024)


def test_capacity_scaled_node_matches_the_full_node_at_equal_relative_load() -> None:
    costs = StepCosts()
    full = StepShape(num_seqs=64, context_tokens=64_000, prefill_tokens=800)
    quarter = StepShape(num_seqs=16, context_tokens=16_000, prefill_tokens=200)
    assert step_seconds(quarter, costs, 0.25) == pytest.approx(step_seconds(full, costs))


def test_engine_plans_produce_the_calibrated_durations() -> None:
    engine = Engine(SimConfig())
    engine.add(SimRequest("a", prompt_tokens=256, max_tokens=4), 0.0)
    plan = engine.schedule(0.0)
    assert engine.step_seconds(plan) == pytest.approx(idle_ttft_seconds(256))
    engine.complete(plan, engine.step_seconds(plan))
    decode = engine.schedule(1.0)
    assert decode.shape == StepShape(num_seqs=1, context_tokens=256, prefill_tokens=0)
    assert engine.step_seconds(decode) == pytest.approx(decode_step_seconds(1, 256))
