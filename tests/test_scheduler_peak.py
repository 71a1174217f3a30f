"""The peak-over-time projection of released tasks, against a step-by-step reference model."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from admission.config import EngineSettings
from admission.reads import RunningMember
from scheduler.budget import (
    FRESH_READING,
    EngineReading,
    RunningTask,
    _decode_rate,
    peak_usage,
    plan_node,
    unmeasured_count,
)
from scheduler.running import running_task, tasks_by_node
from scheduler.scrape import NodeMetrics, NodeView
from tests.properties import PROPERTIES, examples

ENGINE = EngineSettings()
"""The shipped `[pools.engine]` timings."""
DISPATCH_US = ENGINE.dispatch_us
PREFILL_US_PER_TOKEN = ENGINE.prefill_us_per_token


def task(prompt_tokens: int, max_tokens: int, arrived_us: int) -> RunningTask:
    return running_task(prompt_tokens, max_tokens, arrived_us, PREFILL_US_PER_TOKEN)


one_task = st.builds(task, st.integers(0, 9_000), st.integers(0, 4_000),
                     st.integers(-300_000, 300_000_000))
tasks_strategy = st.lists(one_task, min_size=1, max_size=40)
readings = st.builds(EngineReading, st.integers(0, 10), st.none() | st.integers(0, 40),
                     st.integers(0, 1_000_000))


def reference_unseen(tasks: list[RunningTask], reading: EngineReading) -> list[RunningTask]:
    """The tasks the reading cannot hold, one at a time from the youngest arrival: it arrived
    after the reading; or the engine's queue and the tasks it does not count as running take
    it; or it is the one being prefilled (something queued, or within its prefill allowance
    when read)."""
    youngest_first = sorted(tasks, key=lambda t: t.arrived_us)
    unseen = [t for t in youngest_first if t.arrived_us <= reading.age_us]
    rest = youngest_first[len(unseen):]
    running_slots = len(rest) if reading.running is None else reading.running
    queued = min(len(rest), max(reading.waiting, len(rest) - running_slots))
    unseen += rest[:queued]
    rest = rest[queued:]
    if rest and (reading.waiting > 0 or rest[0].age_us <= reading.age_us):
        unseen.append(rest[0])
    return unseen


def reference_peak(tasks: list[RunningTask], ours_now: float,
                   reading: EngineReading = FRESH_READING) -> float:
    """Calibrate the tasks the reading holds by bisection, then decode one step at a time
    until every task has ended; the others start from their prompt."""
    unseen = reference_unseen(tasks, reading)
    started = sorted(tasks, key=lambda t: t.arrived_us)[len(unseen):]
    prompts = sum(t.prompt_tokens for t in started)
    generated = min(max(0.0, ours_now - prompts),
                    float(sum(t.max_tokens for t in started if t.age_us > 0)))

    def made(rate: float) -> float:
        return sum(min(t.max_tokens, t.age_us * rate) for t in started)

    lo, hi = 0.0, 1.0
    while made(hi) < generated and hi < 1e12:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if made(mid) < generated else (lo, mid)
    rate = hi if generated > 0 else 0.0
    live = [(t.prompt_tokens + min(t.max_tokens, t.age_us * rate),
             t.max_tokens - min(t.max_tokens, t.age_us * rate)) for t in started]
    live += [(t.prompt_tokens, t.max_tokens) for t in unseen]
    # Bisection leaves the rate a hair above the solution: compare with a tolerance.
    peak = sum(size for size, _ in live)
    step = 0
    while any(left > step for _, left in live):
        # Continuous steps: a task with a fraction of a token left still grows to its end.
        nxt = min(left for _, left in live if left > step)
        peak = max(peak, sum(size + nxt for size, left in live if left >= nxt))
        step = nxt  # type: ignore[assignment]
    # Never below what the cache holds now and the prompts still to come.
    peak = max(peak, ours_now + sum(t.prompt_tokens for t in unseen))
    return min(peak, sum(t.prompt_tokens + t.max_tokens for t in tasks))


@settings(PROPERTIES, max_examples=examples(200))
@given(tasks_strategy, st.floats(0, 1), readings)
def test_peak_matches_the_step_by_step_reference(tasks: list[RunningTask], share: float,
                                                 reading: EngineReading) -> None:
    total = sum(t.prompt_tokens + t.max_tokens for t in tasks)
    ours_now = share * total
    youngest_first = sorted(tasks, key=lambda t: t.arrived_us)
    assert unmeasured_count(youngest_first, reading) == len(reference_unseen(tasks, reading))
    assert peak_usage(tasks, ours_now, reading) == pytest.approx(
        reference_peak(tasks, ours_now, reading), rel=1e-6, abs=1e-3)


@settings(PROPERTIES, max_examples=examples(300))
@given(tasks_strategy, st.floats(0, 1))
# More usage than the tasks' ages explain (the younger one is within its prefill allowance),
# nothing unmeasured: the peak is still what the cache holds now.
@example([task(0, 1, 1), task(1, 1, 2)], 0.75)
def test_peak_is_bounded_by_now_and_by_final_sizes(tasks: list[RunningTask], share: float) -> None:
    prompts = sum(t.prompt_tokens for t in tasks)
    final = sum(t.prompt_tokens + t.max_tokens for t in tasks)
    ours_now = share * final
    peak = peak_usage(tasks, ours_now)
    assert peak <= final + 1e-6
    assert peak >= max(ours_now, prompts) - 1e-6


@settings(PROPERTIES, max_examples=examples(300))
@given(tasks_strategy, st.floats(0, 1), st.integers(0, 9_000), st.integers(0, 4_000), readings)
# The peak was 2 with the cache holding 3 (the younger task within its prefill allowance, so
# its tokens unexplained), and the floor "now plus the prompts to come" applied only when
# some task was unmeasured: a task of cost 0 lifted the peak to 3.
@example([task(0, 1, 1), task(1, 1, 2)], 0.75, 0, 0, FRESH_READING)
def test_a_new_task_raises_the_peak_by_at_most_its_cost(
        tasks: list[RunningTask], share: float, prompt: int, out: int,
        reading: EngineReading) -> None:
    # What keeps the budget sound: the gateways may add any task of cost W <= budget - R.
    ours_now = share * sum(t.prompt_tokens + t.max_tokens for t in tasks)
    before = peak_usage(tasks, ours_now, reading)
    # Released since the last scrape: not in the measurement, no progress yet.
    after = peak_usage([*tasks, task(prompt, out, -1)], ours_now, reading)
    assert after <= before + prompt + out + 1e-6


@settings(PROPERTIES, max_examples=examples(200))
@given(tasks_strategy, st.floats(0, 1))
def test_decode_rate_explains_the_generated_tokens(tasks: list[RunningTask], share: float) -> None:
    generated = share * sum(t.max_tokens for t in tasks if t.age_us > 0)
    if generated <= 0:
        return
    rate = _decode_rate(tasks, generated)
    assert sum(min(t.max_tokens, t.age_us * rate) for t in tasks) == pytest.approx(
        generated, rel=1e-9, abs=1e-6)


def test_half_done_generations_project_well_below_their_final_sizes() -> None:
    # 100 generations of 4,000 tokens released one per 0.8 s, decoding 50 tokens/s: the
    # oldest is nearly done. Their final sizes sum to 400k + prompts; the node will never
    # hold that, since each ends as a new one starts.
    tasks = [task(200, 4_000, i * 800_000 + 200 * PREFILL_US_PER_TOKEN) for i in range(100)]
    generated = sum(i * 40 for i in range(100))
    peak = peak_usage(tasks, 100 * 200 + generated)
    final = 100 * 4_200
    assert peak < 0.6 * final
    assert peak >= 100 * 200 + generated


def test_fresh_tasks_of_equal_length_peak_at_their_final_size() -> None:
    tasks = [task(1_000, 500, -1) for _ in range(10)]
    assert peak_usage(tasks, 0.0) == pytest.approx(15_000)


def test_plan_node_budget_grows_with_the_peak_projection() -> None:
    metrics = NodeMetrics(0.3, "vllm:kv_cache_usage_perc", 100, 0, 0.0, 1_000_000, 16)
    node = NodeView("n", metrics, 1_000_000, False, False, 0.0, 1, "")
    tasks = [task(200, 4_000, i * 800_000 + 200 * PREFILL_US_PER_TOKEN) for i in range(100)]
    reserved = 100 * 4_200
    final = plan_node(node, reserved=reserved, factor=1.0, kv_target=0.78, stale_policy="full",
                      dispatch_us=DISPATCH_US)
    peak = plan_node(node, reserved=reserved, factor=1.0, kv_target=0.78, stale_policy="full",
                     running=tasks, dispatch_us=DISPATCH_US)
    assert peak.projected < final.projected
    assert final.budget is not None and peak.budget is not None
    assert peak.budget > final.budget
    # Reservations the index does not know count in full: nothing is gained from them.
    unknown = plan_node(node, reserved=reserved, factor=1.0, kv_target=0.78,
                        stale_policy="full", running=[], dispatch_us=DISPATCH_US)
    assert unknown.budget == final.budget


@settings(PROPERTIES, max_examples=examples(300))
@given(st.lists(one_task, max_size=40), st.integers(0, 50_000), st.floats(0, 1),
       st.integers(1_000, 2_000_000), readings, st.floats(0.2, 1), st.floats(0.3, 0.95),
       st.floats(0, 1), st.floats(0, 1))
# The peak_usage case above at the node: the cache holds 3 of 4 reserved tokens, the tasks
# explain 2; a task of cost 0 must leave the budget and the projection as they were.
@example([task(0, 1, 1), task(1, 1, 2)], 0, 0.0003, 10_000, FRESH_READING, 1.0, 0.5, 0.0, 0.0)
def test_what_the_budget_allows_keeps_the_next_projection_under_the_target(
        tasks: list[RunningTask], unindexed: int, usage: float, capacity: int,
        reading: EngineReading, factor: float, kv_target: float, a: float, b: float) -> None:
    # The budget's guarantee: the gateways may add any task of cost W <= budget - R, and with
    # the same measurement the next plan projects at most f x W more, so never past the target.
    reserved = sum(t.prompt_tokens + t.max_tokens for t in tasks) + unindexed
    running = reading.running if reading.running is not None else len(tasks)
    metrics = NodeMetrics(usage, "vllm:kv_cache_usage_perc", running, reading.waiting, 0.0,
                          capacity, 16)
    node = NodeView("n", metrics, capacity, False, False, reading.age_us / 1e6, 1, "")
    before = plan_node(node, reserved=reserved, factor=factor, kv_target=kv_target,
                       stale_policy="full", running=tasks, dispatch_us=DISPATCH_US)
    assert before.budget is not None
    room = max(0, before.budget - reserved)
    prompt = int(a * room)
    out = int(b * (room - prompt))
    after = plan_node(node, reserved=reserved + prompt + out, factor=factor,
                      kv_target=kv_target, stale_policy="full",
                      running=[*tasks, task(prompt, out, -DISPATCH_US)],  # released now
                      dispatch_us=DISPATCH_US)
    tolerance = 1e-6 * (capacity + reserved)
    assert after.projected * capacity <= (
        before.projected * capacity + factor * (prompt + out) + tolerance)
    if before.projected <= kv_target:
        assert after.projected * capacity <= kv_target * capacity + tolerance


def test_requests_waiting_in_the_engine_do_not_hide_the_progress_of_the_decoding_ones() -> None:
    # 50 generations of 4,000 tokens at uniform progress, and 40 fresh 8k-token documents the
    # engine has not prefilled yet (it reports 40 waiting): the cache holds the generations'
    # prompts and output so far, not the documents.
    allowance = 8_000 * PREFILL_US_PER_TOKEN
    gens = [task(200, 4_000, 1_000_000 + i * 3_200_000 + 200 * PREFILL_US_PER_TOKEN)
            for i in range(50)]
    docs = [task(8_000, 100, allowance + i * 10_000) for i in range(40)]
    generated = sum(min(4_000, (1 + i * 3.2) * 50) for i in range(50))
    ours_now = 50 * 200 + generated
    peak = peak_usage([*gens, *docs], ours_now, EngineReading(waiting=40))
    assert peak >= ours_now + 40 * 8_000  # now, once the documents are prefilled
    # Or the engine runs the 50 generations only: the documents are not in the cache either.
    running_only = peak_usage([*gens, *docs], ours_now, EngineReading(running=50))
    assert running_only >= ours_now + 40 * 8_000
    # Without either count the documents' prompts swallow the generated tokens in the
    # calibration: the generations look fresh and the projection falls short of that floor.
    assert peak_usage([*gens, *docs], ours_now) < ours_now + 40 * 8_000


def test_documents_prefilled_within_their_allowance_are_not_counted_twice() -> None:
    # The same generations, and 10 documents that reached the engine 300 ms ago: within the
    # 528 ms prefill allowance, but the engine reports all 60 running and none waiting, so the
    # documents' prompts are in the measurement already.
    gens = [task(200, 4_000, 1_000_000 + i * 3_200_000 + 200 * PREFILL_US_PER_TOKEN)
            for i in range(50)]
    docs = [task(8_000, 100, 300_000) for _ in range(10)]
    generated = sum(min(4_000, (1 + i * 3.2) * 50) for i in range(50))
    ours_now = 50 * 200 + generated + 10 * 8_000
    read_50_ms_ago = EngineReading(waiting=0, running=60, age_us=50_000)
    peak = peak_usage([*gens, *docs], ours_now, read_50_ms_ago)
    # One document may still be in its last prefill chunk: at most one counted again.
    assert peak < ours_now + 2 * 8_000
    assert peak >= ours_now
    # Read before they arrived, they are all unmeasured.
    read_before = EngineReading(waiting=0, running=50, age_us=400_000)
    assert peak_usage([*gens, *docs], ours_now - 10 * 8_000, read_before) >= ours_now


@settings(PROPERTIES, max_examples=examples(200))
@given(tasks_strategy, st.floats(0, 1), readings)
def test_tasks_the_reading_cannot_hold_count_from_their_full_prompt(
        tasks: list[RunningTask], share: float, reading: EngineReading) -> None:
    final = sum(t.prompt_tokens + t.max_tokens for t in tasks)
    ours_now = share * final
    queued = reference_unseen(tasks, reading)
    peak = peak_usage(tasks, ours_now, reading)
    assert peak >= min(final, ours_now + sum(t.prompt_tokens for t in queued)) - 1e-6
    assert peak <= final + 1e-6


def test_running_index_members_are_parsed_once_and_forgotten_when_they_leave() -> None:
    now = 10_000_000
    members = [(b"n1 100 50 t1", 1_000_000.0), (b"n2 200 80 t2", 2_000_000.0),
               (b"garbage", 3_000_000.0)]
    by_node, known = tasks_by_node(members, now, {}, ENGINE)
    def arrived(released: int) -> int:
        return now - released - DISPATCH_US

    assert by_node == {"n1": [task(100, 50, arrived(1_000_000))],
                       "n2": [task(200, 80, arrived(2_000_000))]}
    # What was parsed is used as it is on the next tick (ages move with `now`); a member that
    # left the index leaves the cache too.
    known[b"n1 100 50 t1"] = RunningMember("n1", 100, 50,
                                           now - DISPATCH_US - 100 * PREFILL_US_PER_TOKEN - 5)
    later, known = tasks_by_node(members[:1] + members[2:], now + 10, known, ENGINE)
    assert later == {"n1": [RunningTask(100, 50, 15, 100 * PREFILL_US_PER_TOKEN + 15)]}
    assert set(known) == {b"n1 100 50 t1", b"garbage"}


def test_the_pool_engine_timings_set_the_allowances() -> None:
    # A pool whose engines prefill at 100 µs a token behind a 40 ms dispatch: a task released
    # 1 s ago reached its engine 960 ms ago and decodes after its 300-token prompt's 30 ms.
    engine = EngineSettings(dispatch_ms=40, prefill_us_per_token=100)
    now = 10_000_000
    by_node, _ = tasks_by_node([(b"n1 300 50 t1", float(now - 1_000_000))], now, {}, engine)
    assert by_node == {"n1": [RunningTask(300, 50, 960_000 - 30_000, 960_000)]}
    # The shipped timings give the same task other ages.
    shipped, _ = tasks_by_node([(b"n1 300 50 t1", float(now - 1_000_000))], now, {}, ENGINE)
    assert shipped == {"n1": [RunningTask(300, 50, 750_000 - 300 * 66, 750_000)]}
