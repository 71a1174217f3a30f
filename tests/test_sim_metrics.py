"""/metrics exposition, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bench.sim.config import SimConfig
from bench.sim.engine import SimRequest
from bench.sim.metrics import make_registry, render
from bench.sim.runner import NodeRunner
from bench.sim.stats import TTFT_BUCKETS

MODEL = "sim/test-model"


def scrape(runner: NodeRunner) -> dict[str, list[Sample]]:
    text = render(make_registry(runner)).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def busy_runner(**overrides: object) -> NodeRunner:
    """A node with a preemption behind it, one request done and two in flight."""
    fields: dict[str, object] = {
        "model": MODEL, "num_gpu_blocks": 11, "block_size": 16, "max_model_len": 160,
    }
    fields.update(overrides)
    runner = NodeRunner(SimConfig(**fields))  # type: ignore[arg-type]
    engine = runner.engine
    now = 0.0
    done = SimRequest("done", prompt_tokens=10, max_tokens=2)
    engine.add(done, now)
    for _ in range(2):
        plan = engine.schedule(now)
        now += engine.step_seconds(plan)
        engine.complete(plan, now)
    for name in "abc":
        engine.add(SimRequest(name, prompt_tokens=48, max_tokens=50), now)
    for _ in range(2):
        plan = engine.schedule(now)
        now += engine.step_seconds(plan)
        engine.complete(plan, now)
    assert engine.stats.preemptions == 1
    return runner


def only(samples: list[Sample], name: str | None = None) -> Sample:
    matching = [s for s in samples if name is None or s.name == name]
    assert len(matching) == 1, matching
    return matching[0]


def test_v1_names_labels_and_values() -> None:
    runner = busy_runner()
    engine = runner.engine
    m = scrape(runner)
    labels = {"model_name": MODEL, "engine": "0"}

    usage = only(m["vllm:kv_cache_usage_perc"])
    assert usage.labels == labels
    assert usage.value == pytest.approx(engine.pool.used / 10)
    assert 0.0 < usage.value <= 1.0
    assert "vllm:gpu_cache_usage_perc" not in m

    assert only(m["vllm:num_requests_running"]).value == engine.num_running == 2
    assert only(m["vllm:num_requests_waiting"]).value == engine.num_waiting == 1
    assert only(m["vllm:num_preemptions"], "vllm:num_preemptions_total").value == 1
    # Every request's prompt counts once, at its first token; c's recomputation does not.
    assert only(m["vllm:prompt_tokens"], "vllm:prompt_tokens_total").value == 10 + 3 * 48
    assert only(m["vllm:generation_tokens"], "vllm:generation_tokens_total").value == (
        engine.stats.generation_tokens
    )
    success = {s.labels["finished_reason"]: s.value for s in m["vllm:request_success"]
               if s.name == "vllm:request_success_total"}
    assert success == {"stop": 0, "length": 1, "abort": 0}


def test_ttft_histogram_has_vllm_buckets_and_counts() -> None:
    runner = busy_runner()
    m = scrape(runner)
    samples = m["vllm:time_to_first_token_seconds"]
    bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
    assert bounds == [*TTFT_BUCKETS, float("inf")]
    count = only(samples, "vllm:time_to_first_token_seconds_count").value
    assert count == runner.engine.stats.ttft.count == 4
    buckets = [s.value for s in samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == count
    total = only(samples, "vllm:time_to_first_token_seconds_sum").value
    assert total == pytest.approx(runner.engine.stats.ttft.sum)
    for name in ("vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert only(m[name], name + "_count").value >= 1


def test_cache_config_info_carries_the_cache_shape() -> None:
    m = scrape(busy_runner(capacity_scale=1.0))
    info = only(m["vllm:cache_config_info"])
    assert info.value == 1.0
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "11"
    assert info.labels["engine"] == "0"
    assert "gpu_memory_utilization" in info.labels


def test_cache_config_info_can_be_omitted() -> None:
    m = scrape(busy_runner(cache_config_info=False))
    assert "vllm:cache_config_info" not in m
    assert "vllm:kv_cache_usage_perc" in m


def test_v0_names_have_no_engine_label() -> None:
    runner = busy_runner(v0_metrics=True)
    m = scrape(runner)
    assert "vllm:kv_cache_usage_perc" not in m
    usage = only(m["vllm:gpu_cache_usage_perc"])
    assert usage.labels == {"model_name": MODEL}
    assert usage.value == pytest.approx(runner.engine.kv_usage)
    assert "vllm:time_per_output_token_seconds" in m
    assert "vllm:inter_token_latency_seconds" not in m
    assert only(m["vllm:num_requests_swapped"]).value == 0
    info = only(m["vllm:cache_config_info"])
    assert "engine" not in info.labels
    for samples in m.values():
        for sample in samples:
            assert "engine" not in sample.labels


def test_two_nodes_in_one_process_keep_separate_registries() -> None:
    quiet = NodeRunner(SimConfig(model="other", num_gpu_blocks=11, max_model_len=160))
    busy = busy_runner()
    assert only(scrape(quiet)["vllm:num_preemptions"], "vllm:num_preemptions_total").value == 0
    assert only(scrape(busy)["vllm:num_preemptions"], "vllm:num_preemptions_total").value == 1


def test_simulator_health_is_exported() -> None:
    runner = busy_runner()
    runner.kv_usage_peak = 0.75
    runner.lag.record(0.25, wall=1e9)  # far in the future: inside any window ending "now"
    runner.lag.record(0.05, wall=1e9)
    assert runner.loop_lag_max_total() == 0.25
    m = scrape(runner)
    assert only(m["sim:loop_lag_seconds"]).value == 0.25
    assert only(m["sim:kv_cache_usage_peak"]).value == 0.75
    runner.reset_lag()
    assert runner.loop_lag_max_total() == 0.0
