"""The simulated V1 engine, driven step by step without a clock or an event loop."""

from __future__ import annotations

import pytest

from bench.sim.config import SimConfig
from bench.sim.engine import Engine, RequestStatus, SimRequest, StepPlan, StepResult

BS = 16


def small_engine(usable_blocks: int = 10, **overrides: object) -> Engine:
    """An engine with ``usable_blocks`` blocks of 16 tokens (plus vLLM's reserved null block)."""
    fields: dict[str, object] = {
        "num_gpu_blocks": usable_blocks + 1,
        "block_size": BS,
        "max_model_len": usable_blocks * BS,
    }
    fields.update(overrides)
    return Engine(SimConfig(**fields))  # type: ignore[arg-type]


def new_request(name: str, prompt: int, max_tokens: int, **kw: object) -> SimRequest:
    return SimRequest(request_id=name, prompt_tokens=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


class Driver:
    """Runs steps back to back on a simulated clock, checking the accounting after each one."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.now = 0.0
        self.plans: list[StepPlan] = []
        self.used_in_step: list[int] = []

    def add(self, req: SimRequest) -> SimRequest:
        self.engine.add(req, self.now)
        return req

    def step(self) -> tuple[StepPlan, StepResult]:
        plan = self.engine.schedule(self.now)
        self.engine.check_invariants()
        self.used_in_step.append(self.engine.pool.used)
        self.now += self.engine.step_seconds(plan)
        result = self.engine.complete(plan, self.now)
        self.engine.check_invariants()
        self.plans.append(plan)
        return plan, result

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work():
                return
            self.step()
        raise AssertionError("engine did not drain")


def test_blocks_follow_tokens_and_are_all_returned() -> None:
    engine = small_engine()
    d = Driver(engine)
    req = d.add(new_request("a", prompt=20, max_tokens=14))

    d.step()  # prefill of 20 tokens: 2 blocks, first token sampled
    assert req.blocks == 2
    assert engine.pool.used == 2
    assert engine.kv_usage == pytest.approx(2 / 10)
    assert req.num_output == 1 and req.num_computed == 20

    while req.status is RequestStatus.RUNNING:
        d.step()
        if req.status is RequestStatus.RUNNING:
            # Blocks cover exactly the computed tokens: a new one only on crossing 16.
            assert req.blocks == -(-req.num_computed // BS)
    # Only the last decode computes token 33 (20 prompt + 13 generated): a third block, once.
    assert d.used_in_step == [2] * 13 + [3]
    assert req.finish_reason == "length"
    assert req.num_output == 14
    assert engine.pool.free == engine.pool.usable == 10
    assert engine.kv_usage == 0.0
    assert engine.stats.prompt_tokens == 20
    assert engine.stats.generation_tokens == 14
    assert engine.stats.finished["length"] == 1


def test_usage_counts_against_usable_blocks_like_vllm() -> None:
    # vLLM V1: usage = 1 - free / (num_gpu_blocks - 1); the null block is never usable.
    engine = Engine(SimConfig(num_gpu_blocks=101, block_size=16, max_model_len=1600))
    d = Driver(engine)
    d.add(new_request("a", prompt=16 * 25, max_tokens=5))
    d.step()
    assert engine.kv_usage == pytest.approx(0.25)


def test_eos_finishes_with_stop_at_exact_count() -> None:
    engine = small_engine()
    d = Driver(engine)
    req = d.add(new_request("a", prompt=10, max_tokens=50, eos_at=7))
    d.run_until_idle()
    assert req.finish_reason == "stop"
    assert req.num_output == 7
    assert engine.stats.finished == {"stop": 1, "length": 0, "abort": 0}


def test_chunked_prefill_respects_token_budget() -> None:
    engine = small_engine(usable_blocks=20, max_num_batched_tokens=32)
    d = Driver(engine)
    req = d.add(new_request("a", prompt=100, max_tokens=3))
    chunks = []
    while req.num_output == 0:
        plan, _ = d.step()
        chunks.append(plan.scheduled[0][1])
        assert req.blocks == -(-req.num_computed // BS)
    assert chunks == [32, 32, 32, 4]
    assert [p.shape.prefill_tokens for p in d.plans] == [32, 32, 32, 4]


def test_long_prefill_token_threshold_caps_each_chunk_and_leaves_the_budget_to_others() -> None:
    engine = small_engine(usable_blocks=40, max_num_batched_tokens=64,
                          long_prefill_token_threshold=24)
    d = Driver(engine)
    long = d.add(new_request("long", prompt=100, max_tokens=2))
    chunks = []
    while long.num_output == 0:
        plan, _ = d.step()
        chunks.append(dict(plan.scheduled)[long])
        if len(d.plans) == 1:
            # The rest of the budget goes to a request that arrives behind it.
            short = d.add(new_request("short", prompt=20, max_tokens=5))
        assert long.blocks == -(-long.num_computed // BS)
    # At most the threshold per step, though the budget (64) would take 64 at once.
    assert chunks == [24, 24, 24, 24, 4]
    assert d.plans[1].scheduled == [(long, 24), (short, 20)]
    assert d.plans[1].shape.prefill_tokens == 44
    d.run_until_idle()
    assert long.num_output == 2 and short.num_output == 5


def test_long_prefill_token_threshold_off_by_default_and_scaled_like_the_budget() -> None:
    assert SimConfig().long_prefill_token_threshold == 0
    assert Engine(SimConfig()).long_prefill_token_threshold == 0
    scaled = SimConfig(capacity_scale=0.25, long_prefill_token_threshold=1024)
    assert scaled.effective_long_prefill_token_threshold == 256
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SimConfig(long_prefill_token_threshold=-1)


def test_running_decodes_go_before_new_prefill_chunks() -> None:
    engine = small_engine(usable_blocks=40, max_num_batched_tokens=64)
    d = Driver(engine)
    first = d.add(new_request("a", prompt=10, max_tokens=20))
    d.step()
    second = d.add(new_request("b", prompt=300, max_tokens=2))
    plan, _ = d.step()
    assert plan.scheduled == [(first, 1), (second, 63)]
    assert plan.shape.prefill_tokens == 63
    assert plan.shape.num_seqs == 2


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = small_engine(usable_blocks=40, max_num_seqs=2)
    d = Driver(engine)
    reqs = [d.add(new_request(f"r{i}", prompt=8, max_tokens=4)) for i in range(3)]
    d.step()
    assert engine.num_running == 2
    assert engine.num_waiting == 1
    assert reqs[2].status is RequestStatus.WAITING
    d.run_until_idle()
    assert all(r.finish_reason == "length" and r.num_output == 4 for r in reqs)


def test_fcfs_preempts_most_recently_scheduled_not_the_requester() -> None:
    # Three requests of 3 blocks each fill 9 of 10 blocks. On the first decode, A takes the last
    # free block; B then needs one and the victim is C, the last of the running list.
    engine = small_engine()
    d = Driver(engine)
    a, b, c = (d.add(new_request(n, prompt=48, max_tokens=20)) for n in "abc")
    d.step()
    assert engine.pool.used == 9
    plan, _ = d.step()
    assert plan.preempted == [c]
    assert [r for r, _ in plan.scheduled] == [a, b]
    assert engine.stats.preemptions == 1
    assert c.status is RequestStatus.WAITING
    assert c.blocks == 0 and c.num_computed == 0
    assert c.num_output == 1, "tokens already generated are kept, not re-sent"
    assert engine.pool.used == 8


def test_preempted_request_is_recomputed_and_completes_with_exact_usage() -> None:
    engine = small_engine()
    d = Driver(engine)
    a = d.add(new_request("a", prompt=64, max_tokens=40))
    b = d.add(new_request("b", prompt=64, max_tokens=40))
    d.run_until_idle()

    assert engine.stats.preemptions == 1
    assert a.preemptions == 0 and b.preemptions == 1
    assert (a.finish_reason, a.num_output) == ("length", 40)
    assert (b.finish_reason, b.num_output) == ("length", 40)
    # Usage reports the prompt once; the recomputation shows only in computed tokens.
    assert engine.stats.prompt_tokens == 128
    assert engine.stats.generation_tokens == 80
    assert engine.stats.computed_tokens > 128 + 80
    assert engine.pool.free == engine.pool.usable
    # B was recomputed from scratch: one step prefilled its prompt plus its earlier output.
    recompute = [n for p in d.plans for r, n in p.scheduled if r is b and n > 1]
    assert recompute[0] == 64 and recompute[1] > 64


def test_waiting_request_is_never_admitted_by_preempting() -> None:
    engine = small_engine()
    d = Driver(engine)
    a = d.add(new_request("a", prompt=120, max_tokens=5))  # 8 blocks
    d.step()
    b = d.add(new_request("b", prompt=60, max_tokens=5))  # needs 4, only 2 free
    d.step()
    assert b.status is RequestStatus.WAITING
    assert a.status is RequestStatus.RUNNING
    assert engine.stats.preemptions == 0
    d.run_until_idle()
    assert b.finish_reason == "length" and engine.stats.preemptions == 0


def test_priority_policy_admits_by_priority_and_preempts_the_worst() -> None:
    engine = small_engine(scheduling_policy="priority")
    d = Driver(engine)
    a = d.add(new_request("a", prompt=48, max_tokens=20, priority=9))
    b = d.add(new_request("b", prompt=48, max_tokens=20, priority=0))
    c = d.add(new_request("c", prompt=48, max_tokens=20, priority=1))
    d.step()
    assert engine.running == [b, c, a]
    plan, _ = d.step()
    assert plan.preempted == [a]
    assert [r for r, _ in plan.scheduled] == [b, c]
    assert a.status is RequestStatus.WAITING and a.blocks == 0
    d.run_until_idle()
    assert all(r.num_output == 20 for r in (a, b, c))


@pytest.mark.parametrize(("policy", "expected_victim"), [("priority", "a"), ("fcfs", "c")])
def test_preemption_victim_by_policy(policy: str, expected_victim: str) -> None:
    # A low-priority request was admitted first, on an idle node; two better ones came later.
    # FCFS preempts the most recently scheduled (c); priority preempts the worst (a), which was
    # already scheduled in this step, so its token budget is handed back.
    engine = small_engine(scheduling_policy=policy)
    d = Driver(engine)
    a = d.add(new_request("a", prompt=48, max_tokens=20, priority=5 if policy == "priority" else 0))
    d.step()
    b = d.add(new_request("b", prompt=48, max_tokens=20))
    c = d.add(new_request("c", prompt=40, max_tokens=20, priority=1 if policy == "priority" else 0))
    d.step()
    assert engine.running == [a, b, c]
    assert engine.pool.free == 0
    plan, _ = d.step()
    victims = {"a": a, "c": c}
    assert plan.preempted == [victims[expected_victim]]
    assert victims[expected_victim].status is RequestStatus.WAITING
    assert engine.stats.preemptions == 1
    scheduled = [r.request_id for r, _ in plan.scheduled]
    assert expected_victim not in scheduled
    assert plan.shape.num_seqs == len(scheduled)
    d.run_until_idle()
    assert all(r.num_output == 20 for r in (a, b, c))


def test_priority_waiting_queue_orders_by_priority_then_arrival() -> None:
    engine = small_engine(scheduling_policy="priority", max_num_seqs=1)
    d = Driver(engine)
    late = d.add(new_request("batch", prompt=8, max_tokens=2, priority=5))
    d.now = 1.0
    vip = d.add(new_request("vip", prompt=8, max_tokens=2, priority=0))
    d.step()
    assert engine.running == [vip]
    d.run_until_idle()
    assert late.first_scheduled is not None and vip.first_scheduled is not None
    assert vip.first_scheduled < late.first_scheduled


def test_abort_frees_blocks_and_counts() -> None:
    engine = small_engine()
    d = Driver(engine)
    running = d.add(new_request("run", prompt=40, max_tokens=30))
    d.step()
    waiting = d.add(new_request("wait", prompt=140, max_tokens=5))
    assert engine.abort(running, d.now)
    assert engine.pool.used == 0
    assert engine.abort(waiting, d.now)
    assert engine.num_waiting == 0 and engine.num_running == 0
    assert not engine.abort(waiting, d.now), "aborting twice is a no-op"
    assert engine.stats.finished["abort"] == 2
    assert not engine.has_work()


def test_abort_between_schedule_and_complete_is_ignored_by_the_step() -> None:
    engine = small_engine()
    req = new_request("a", prompt=20, max_tokens=5)
    engine.add(req, 0.0)
    plan = engine.schedule(0.0)
    engine.abort(req, 0.001)
    result = engine.complete(plan, 0.01)
    assert result.emitted == [] and req.num_output == 0
    engine.check_invariants()
    assert engine.pool.used == 0


def test_fail_all_releases_everything() -> None:
    engine = small_engine()
    d = Driver(engine)
    reqs = [d.add(new_request(n, prompt=40, max_tokens=9)) for n in "ab"]
    d.step()
    victims = engine.fail_all(d.now)
    assert set(map(id, victims)) == set(map(id, reqs))
    assert all(r.finish_reason == "error" for r in reqs)
    assert engine.pool.used == 0 and not engine.has_work()


def test_latency_histograms_observe_each_token() -> None:
    engine = small_engine()
    d = Driver(engine)
    d.add(new_request("a", prompt=30, max_tokens=6))
    d.add(new_request("b", prompt=30, max_tokens=4))
    d.run_until_idle()
    stats = engine.stats
    assert stats.ttft.count == 2
    assert stats.itl.count == (6 - 1) + (4 - 1)
    assert stats.e2e.count == 2 and stats.queue_time.count == 2
    # Both prefills run in the first step, so both TTFTs equal that step's duration.
    assert stats.ttft.sum == pytest.approx(2 * engine.step_seconds(d.plans[0]))


def test_latency_histograms_are_in_the_clients_wall_seconds() -> None:
    """A node on a clock 8x faster answers 8x sooner: its histograms hold an eighth of the
    simulated latencies, the unit its clients (and a leader comparing step times with
    gateway-timed first tokens) measure in."""
    sums = []
    for scale in (1.0, 8.0):
        engine = small_engine(time_scale=scale)
        d = Driver(engine)
        d.add(new_request("a", prompt=30, max_tokens=6))
        d.run_until_idle()
        sums.append((engine.stats.ttft.sum, engine.stats.itl.sum, engine.stats.e2e.sum))
    assert sums[1] == pytest.approx(tuple(x / 8 for x in sums[0]))


def test_config_rejects_a_cache_smaller_than_one_request() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SimConfig(num_gpu_blocks=10, block_size=16, max_model_len=1000)


def test_capacity_scale_shrinks_the_node() -> None:
    config = SimConfig(num_gpu_blocks=27_000, max_num_seqs=1024, max_num_batched_tokens=8192,
                       capacity_scale=0.25)
    engine = Engine(config)
    assert engine.pool.usable == 6749
    assert engine.max_num_seqs == 256
    assert engine.max_num_batched_tokens == 2048
