"""The preemption-free maximum's oracle: its KV projection and the ideal replay."""

from __future__ import annotations

import math
import random

import pytest

from admission.tiers import Tier
from bench.capacity import _Node, ideal_replay, projected_peak_blocks
from bench.sim.config import SimConfig
from bench.sim.engine import SimRequest
from bench.workload import PlannedRequest

BLOCK = 16


def _brute_peak(requests: list[tuple[int, int]]) -> int:
    """Step by step: each request holds ceil(tokens / 16) blocks until its last token."""
    horizon = max((left for _, left in requests), default=0)
    return max(
        (sum(-(-(c + t) // BLOCK) for c, left in requests if left > t) for t in range(horizon)),
        default=0,
    )


@pytest.mark.parametrize("seed", range(20))
def test_projection_bounds_the_step_by_step_peak_tightly(seed: int) -> None:
    rng = random.Random(seed)
    requests = [(rng.randint(1, 3000), rng.randint(1, 400)) for _ in range(rng.randint(1, 30))]
    exact = _brute_peak(requests)
    projected = projected_peak_blocks(requests, BLOCK)
    # An upper bound (never lets a preemption through), loose by at most a block a request.
    assert exact <= projected <= exact + len(requests)


def test_projection_of_nothing_is_zero() -> None:
    assert projected_peak_blocks([], BLOCK) == 0


@pytest.mark.parametrize("seed", range(30))
def test_node_fits_agrees_with_the_full_projection(seed: int) -> None:
    rng = random.Random(seed)
    config = SimConfig(capacity_scale=0.05, max_model_len=4096)
    node = _Node(config)
    for i in range(rng.randint(0, 12)):
        req = SimRequest(str(i), prompt_tokens=rng.randint(10, 2000),
                         max_tokens=rng.randint(1, 800))
        req.num_output = rng.randint(0, req.max_tokens - 1)
        node.live.append(req)
    node.refresh()
    shape = [(r.prompt_tokens + r.num_output, r.max_tokens - r.num_output) for r in node.live]
    for _ in range(20):
        prompt, output = rng.randint(10, 4000), rng.randint(1, 2000)
        expected = projected_peak_blocks([*shape, (prompt, output)], BLOCK) <= node.capacity
        assert node.fits(prompt, output) == expected, (prompt, output)


def test_ideal_replay_never_preempts_and_serves_an_overload_at_full_cache() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    rng = random.Random(3)
    # Three times more long requests than two small nodes hold, arriving within 20 s.
    requests = [
        PlannedRequest(i, "batch", Tier.BATCH, at=rng.uniform(0, 20),
                       prompt_tokens=rng.randint(2000, 6000), output_tokens=rng.randint(50, 500),
                       stream=False)
        for i in range(60)
    ]
    requests += [
        PlannedRequest(100 + i, "vip", Tier.VIP, at=0.5 * i, prompt_tokens=200, output_tokens=50,
                       stream=True)
        for i in range(60)
    ]
    result = ideal_replay(config, 2, requests, time_scale=1.0, window=(5.0, 30.0))
    assert result.preemptions == 0
    # VIP goes first: every VIP request got its first token, in finite time.
    assert all(math.isfinite(x) and x > 0 for x in (*result.vip_ttft_base,
                                                     *result.vip_ttft_burst))
    assert 0.9 <= result.kv_peak <= 1.0
    assert result.total_tokens_per_s > 0
    assert result.generation_tokens_per_s < result.total_tokens_per_s


def test_a_node_kept_for_vip_spares_vip_the_long_prefills_and_costs_batch_throughput() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    rng = random.Random(5)
    requests = [
        PlannedRequest(i, "batch", Tier.BATCH, at=rng.uniform(0, 20),
                       prompt_tokens=rng.randint(3000, 6000), output_tokens=rng.randint(20, 100),
                       stream=False)
        for i in range(80)
    ]
    requests += [
        PlannedRequest(100 + i, "vip", Tier.VIP, at=0.25 * i, prompt_tokens=200,
                       output_tokens=20, stream=True)
        for i in range(100)
    ]
    shared = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0))
    kept = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0), vip_nodes=1)
    assert kept.vip_nodes == 1 and kept.preemptions == 0
    assert kept.vip_ttft_burst[1] < shared.vip_ttft_burst[1]
    assert kept.total_tokens_per_s < shared.total_tokens_per_s
