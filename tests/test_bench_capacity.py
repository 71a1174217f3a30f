"""The preemption-free maximum's oracle: its KV projection and the ideal replay."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable
from typing import TypeVar

import pytest

from admission.tiers import Tier
from bench.burst.capacity import _Node, ideal_replay, projected_peak_blocks
from bench.burst.frontier import Point, frontier_table
from bench.burst.workload import PlannedRequest
from bench.sim.config import SimConfig
from bench.sim.engine import Engine, SimRequest

T = TypeVar("T")

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


def test_a_node_dedicated_to_vip_spares_vip_the_long_prefills_and_costs_batch_throughput() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    rng = random.Random(5)
    requests = [
        PlannedRequest(i, "batch", Tier.BATCH, at=rng.uniform(0, 20),
                       prompt_tokens=rng.randint(3000, 6000), output_tokens=rng.randint(20, 100),
                       stream=False)
        for i in range(80)
    ]
    requests += _vip_chats(first_index=100)
    shared = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0))
    dedicated = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0), vip_nodes=1)
    assert dedicated.vip_nodes == 1 and dedicated.preemptions == 0
    assert dedicated.vip_ttft_burst[1] < shared.vip_ttft_burst[1]
    assert dedicated.total_tokens_per_s < shared.total_tokens_per_s


def _vip_chats(first_index: int) -> list[PlannedRequest]:
    """Short VIP chats, one every 0.25 s for 25 s."""
    return [PlannedRequest(first_index + i, "vip", Tier.VIP, at=0.25 * i, prompt_tokens=200,
                           output_tokens=20, stream=True) for i in range(100)]


def _mixed_requests(seed: int) -> list[PlannedRequest]:
    """Long documents and short-prompt Batch work, VIP chats throughout."""
    rng = random.Random(seed)
    requests = [
        PlannedRequest(i, "docs", Tier.BATCH, at=rng.uniform(0, 20),
                       prompt_tokens=rng.randint(3000, 6000), output_tokens=rng.randint(20, 100),
                       stream=False)
        for i in range(60)
    ]
    requests += [
        PlannedRequest(200 + i, "gen", Tier.BATCH, at=rng.uniform(0, 20),
                       prompt_tokens=rng.randint(50, 300), output_tokens=rng.randint(100, 400),
                       stream=False)
        for i in range(60)
    ]
    requests += _vip_chats(first_index=400)
    return requests


def _admission_time(engine: Engine, now: float) -> float:
    return now


def _record_admissions(monkeypatch: pytest.MonkeyPatch,
                       observe: Callable[[Engine, float], T],
                       ) -> list[list[tuple[T, SimRequest]]]:
    """Each node's admitted requests with what `observe` saw of the engine (and the time) as
    each came, in node order, as the replays that follow create their nodes."""
    nodes: list[list[tuple[T, SimRequest]]] = []

    class Recording(_Node):
        def __init__(self, config: SimConfig, kv_ceiling: float = 1.0) -> None:
            super().__init__(config, kv_ceiling)
            log: list[tuple[T, SimRequest]] = []
            nodes.append(log)
            add, engine = self.engine.add, self.engine

            def recording_add(req: SimRequest, now: float) -> None:
                log.append((observe(engine, now), req))
                add(req, now)

            self.engine.add = recording_add  # type: ignore[method-assign]

    monkeypatch.setattr("bench.burst.capacity._Node", Recording)
    return nodes


@pytest.mark.parametrize("output_max", [None, 250])
def test_guests_on_the_dedicated_node_have_short_prompts_and_respect_the_cap(
        monkeypatch: pytest.MonkeyPatch, output_max: int | None) -> None:
    admitted = _record_admissions(monkeypatch, _admission_time)
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    result = ideal_replay(config, 2, _mixed_requests(7), time_scale=1.0, window=(2.0, 20.0),
                          vip_nodes=1, guest_prompt_max=300, guest_cap=3,
                          guest_output_max=output_max)
    assert result.preemptions == 0
    guests = [r for _, r in admitted[0] if r.priority != int(Tier.VIP)]
    assert guests, "the dedicated node took no guest"
    assert all(r.prompt_tokens <= 300 for r in guests)
    longest = max(r.max_tokens for r in guests)
    assert longest <= 250 if output_max else longest > 250
    for r in guests:  # at most 3 guests alive on the dedicated node whenever one was admitted
        alive = [g for g in guests if g.arrival <= r.arrival
                 and (g.finish_time is None or g.finish_time > r.arrival)]
        assert len(alive) <= 3


def test_paced_guests_bring_the_dedicated_node_prompt_tokens_at_most_at_the_rate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents are allowed as guests here, so only the pacing keeps them off the dedicated node:
    after a guest of p prompt tokens it takes the next one p / rate seconds later at the
    earliest, and a demand above the rate meets that bound."""
    admitted = _record_admissions(monkeypatch, _admission_time)
    rate = 2000
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    result = ideal_replay(config, 2, _mixed_requests(5), time_scale=1.0, window=(2.0, 20.0),
                          vip_nodes=1, guest_prompt_max=8192, guest_rate=rate)
    assert result.preemptions == 0
    guests = [(at, r) for at, r in admitted[0] if r.priority != int(Tier.VIP)]
    assert any(r.prompt_tokens >= 3000 for _, r in guests), "no document was a guest"
    for (at, r), (next_at, _) in itertools.pairwise(guests):
        assert next_at >= at + r.prompt_tokens / rate - 1e-9
    # Most guests wait for the pace: the documents alone ask for ~12,000 tokens/s.
    paced = sum(1 for (at, r), (next_at, _) in itertools.pairwise(guests)
                if next_at - (at + r.prompt_tokens / rate) < 0.05)
    assert paced >= len(guests) // 2
    assert len(admitted[1]) > len(guests)  # the rest went to the shared node


def test_guest_cap_zero_is_the_vip_only_placement() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    requests = _mixed_requests(9)
    only = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0), vip_nodes=1)
    capped = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0), vip_nodes=1,
                          guest_prompt_max=300, guest_cap=0)
    assert capped == only


def test_a_kv_ceiling_holds_the_ideal_below_it_at_a_throughput_cost() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    requests = _mixed_requests(5)
    whole = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0))
    held = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0), kv_ceiling=0.6)
    assert whole.kv_peak > 0.6 >= held.kv_peak
    assert held.preemptions == 0
    assert held.total_tokens_per_s < whole.total_tokens_per_s


def test_strict_order_admits_each_tier_in_arrival_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    admitted: list[SimRequest] = []
    original_add = Engine.add

    def recording_add(self: Engine, req: SimRequest, now: float) -> None:
        admitted.append(req)
        original_add(self, req, now)

    monkeypatch.setattr(Engine, "add", recording_add)
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    # Unique Batch prompts, so that an admitted request names its planned one.
    requests = []
    for i, r in enumerate(sorted(_mixed_requests(4), key=lambda r: r.at)):
        if r.tier is Tier.BATCH:
            unique = 3000 + 20 * i if r.klass == "docs" else 50 + 2 * i
            r = dataclasses.replace(r, prompt_tokens=unique)
        requests.append(r)
    arrival = [r.prompt_tokens for r in requests if r.tier is Tier.BATCH]

    def batch_order(**options: bool) -> list[int]:
        admitted.clear()
        result = ideal_replay(config, 2, requests, time_scale=1.0, window=(2.0, 20.0),
                              **options)
        assert result.preemptions == 0
        return [r.prompt_tokens for r in admitted if r.priority == int(Tier.BATCH)]

    strict = batch_order(strict_order=True)
    free = batch_order()
    assert len(strict) >= 10  # not vacuous: the replay stops at the window's end
    assert strict == arrival[:len(strict)]
    assert free != arrival[:len(free)], "the default order never let a request go past"


def test_a_prefill_threshold_fleet_replays_without_preemption() -> None:
    config = SimConfig(capacity_scale=0.05, max_model_len=8192, long_prefill_token_threshold=512)
    result = ideal_replay(config, 2, _mixed_requests(11), time_scale=1.0, window=(2.0, 20.0))
    assert result.preemptions == 0 and result.total_tokens_per_s > 0


def test_point_specs_and_the_frontier_table() -> None:
    point = Point.parse("vip=1,n=512,k=16,t=1024,order=shared")
    assert point == Point(1, 512, 16, 1024, "shared")
    assert Point.parse("") == Point()
    with pytest.raises(ValueError):
        Point.parse("order=middle")
    assert Point.parse("vip=1,kv=0.79").kv_ceiling == 0.79
    assert Point.parse("fifo=1").strict_order and not Point.parse("fifo=0").strict_order
    assert Point.parse("vip=1,n=4096,o=1000,k=64").label == (
        "1 dedicated: VIP + prompts <= 4096 and outputs <= 1000, <= 64 guests")
    assert Point.parse("vip=1,n=9000,r=5000").label == (
        "1 dedicated: VIP + prompts <= 9000, no cap, paced at 5,000 prompt tokens/s")
    with pytest.raises(ValueError):
        Point.parse("kv=1.5")
    base = {"preset": "x", "guest_prompt_max": None, "guest_cap": None, "threshold": 0,
            "order": "dedicated", "kv_peak": 0.5, "mean_running": 10.0, "preemptions": 0}
    rows = [{**base, "vip_nodes": 0, "total_tokens_per_s": 100.0, "vip_ttft_base_p99": 100.0,
             "vip_ttft_burst_p99": 300.0},
            {**base, "vip_nodes": 1, "total_tokens_per_s": 90.0, "vip_ttft_base_p99": 100.0,
             "vip_ttft_burst_p99": 105.0}]
    # Held below a KV ceiling, a point still counts against the whole-cache maximum.
    rows.append({**base, "vip_nodes": 0, "kv_ceiling": 0.79, "total_tokens_per_s": 95.0,
                 "vip_ttft_base_p99": 100.0, "vip_ttft_burst_p99": 200.0})
    # Another baseline is another schedule: its points count against its own maximum.
    rows.append({**base, "vip_nodes": 0, "baseline_sim_s": 300.0, "total_tokens_per_s": 80.0,
                 "vip_ttft_base_p99": 100.0, "vip_ttft_burst_p99": 300.0})
    rows.append({**base, "vip_nodes": 1, "baseline_sim_s": 300.0, "total_tokens_per_s": 76.0,
                 "vip_ttft_base_p99": 100.0, "vip_ttft_burst_p99": 100.0})
    table = frontier_table(rows)
    assert ("| 1 dedicated to VIP only; baseline 300 s | 100 / 100 | x1.000 | 76 | 95.00% | yes |"
            in table)
    assert "| x3.000 |" in table and "| 100.00% | no |" in table
    assert "| x1.050 |" in table and "| 90.00% | yes |" in table
    assert "| no dedicated node; KV <= 79% | 100 / 200 | x2.000 | 95 | 95.00% | no |" in table


def test_a_running_bound_closes_the_dedicated_node_to_guests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each guest reaches the dedicated node only while it runs at most the bound; without the
    bound the same traffic takes it past it."""
    seen = _record_admissions(monkeypatch, lambda engine, _: engine.num_running)
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    kwargs = {"vip_nodes": 1, "guest_prompt_max": 300}
    bounded = ideal_replay(config, 2, _mixed_requests(4), time_scale=1.0, window=(2.0, 20.0),
                           guest_running=4, **kwargs)  # type: ignore[arg-type]
    dedicated_bounded = seen[0]
    free = ideal_replay(config, 2, _mixed_requests(4), time_scale=1.0, window=(2.0, 20.0),
                        **kwargs)  # type: ignore[arg-type]
    dedicated_free = seen[2]
    assert bounded.preemptions == free.preemptions == 0
    guests = [running for running, r in dedicated_bounded if r.priority != int(Tier.VIP)]
    assert guests and max(guests) <= 4
    assert max(running for running, r in dedicated_free if r.priority != int(Tier.VIP)) > 4


def test_the_dedicated_nodes_may_run_their_own_prefill_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    thresholds: list[int] = []

    class Recording(_Node):
        def __init__(self, config: SimConfig, kv_ceiling: float = 1.0) -> None:
            super().__init__(config, kv_ceiling)
            thresholds.append(self.engine.long_prefill_token_threshold)

    monkeypatch.setattr("bench.burst.capacity._Node", Recording)
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    requests = _mixed_requests(6)
    chunked = ideal_replay(config, 3, requests, time_scale=1.0, window=(2.0, 20.0),
                           vip_nodes=1, guest_prompt_max=8192, dedicated_threshold=256)
    # Scaled like the token budget: 256 x 0.05 = 12 tokens a step, on the dedicated node alone.
    assert thresholds == [12, 0, 0]
    whole = ideal_replay(config, 3, requests, time_scale=1.0, window=(2.0, 20.0),
                         vip_nodes=1, guest_prompt_max=8192)
    assert thresholds[3:] == [0, 0, 0]
    assert chunked.preemptions == whole.preemptions == 0
    # The dedicated node prefills documents 12 tokens a step: it serves less in the same time.
    assert chunked.total_tokens_per_s < whole.total_tokens_per_s
    assert Point.parse("vip=1,n=9000,r=6500,g=76,dt=2048").label == (
        "1 dedicated: VIP + prompts <= 9000, no cap, paced at 6,500 prompt tokens/s, none above 76 "
        "running; dedicated nodes' threshold 2048")


def test_a_running_cap_bounds_normal_and_batch_per_node_and_lets_vip_past(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whenever a node is given a request, it already runs fewer Normal and Batch sequences than
    the cap, unless the request is VIP: VIP is admitted past a full cap."""
    admitted = _record_admissions(monkeypatch, _admission_time)
    config = SimConfig(capacity_scale=0.05, max_model_len=8192)
    result = ideal_replay(config, 2, _mixed_requests(3), time_scale=1.0, window=(2.0, 20.0),
                          running_cap=2)
    assert result.preemptions == 0

    def others_alive(log: list[tuple[float, SimRequest]], i: int) -> int:
        at = log[i][0]
        return sum(1 for _, g in log[:i] if g.priority != int(Tier.VIP)
                   and (g.finish_time is None or g.finish_time > at))
    counts = [(r.priority == int(Tier.VIP), others_alive(log, i))
              for log in admitted for i, (_, r) in enumerate(log)]
    assert any(not vip for vip, _ in counts)
    assert all(n < 2 for vip, n in counts if not vip)
    assert any(n >= 2 for vip, n in counts if vip)
