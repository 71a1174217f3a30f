"""``/metrics`` with vLLM's names and labels, from a per-node registry.

Values are read from the engine when scraped (a custom collector), so several nodes can live in
one process without sharing prometheus_client's global registry, and engine steps pay nothing
for metrics. Names and buckets follow vllm/v1/metrics/loggers.py; with ``v0_metrics`` the node
speaks like a V0 server instead (``vllm:gpu_cache_usage_perc``,
``vllm:time_per_output_token_seconds``, no ``engine`` label).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from bench.sim.runner import NodeRunner
from bench.sim.stats import FINISH_REASONS, Histogram


class NodeCollector(Collector):
    def __init__(self, runner: NodeRunner) -> None:
        self.runner = runner
        config = runner.config
        self.v0 = config.v0_metrics
        if self.v0:
            self.label_names: list[str] = ["model_name"]
            self.label_values: list[str] = [config.model]
        else:
            self.label_names = ["model_name", "engine"]
            self.label_values = [config.model, str(config.engine_index)]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self.label_names)
        family.add_metric(self.label_values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.label_names)
        family.add_metric(self.label_values, value)
        return family

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=self.label_names)
        family.add_metric(self.label_values, hist.cumulative(), hist.sum)
        return family

    def collect(self) -> Iterable[Metric]:
        runner = self.runner
        engine = runner.engine
        stats = engine.stats
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.num_waiting,
        )
        if self.v0:
            yield self._gauge(
                "vllm:num_requests_swapped",
                "Number of requests swapped to CPU.",
                0,
            )
            yield self._gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                engine.kv_usage,
            )
        else:
            yield self._gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                engine.kv_usage,
            )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.preemptions,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*self.label_names, "finished_reason"],
        )
        for reason in FINISH_REASONS:
            success.add_metric([*self.label_values, reason], stats.finished[reason])
        yield success
        yield self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stats.ttft,
        )
        if self.v0:
            yield self._histogram(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                stats.itl,
            )
        else:
            yield self._histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                stats.itl,
            )
        yield self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            stats.e2e,
        )
        yield self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            stats.queue_time,
        )
        if runner.config.cache_config_info:
            yield self._cache_config_info()
        # Not vLLM's: the simulator's own health, so an experiment can disqualify itself.
        yield self._gauge(
            "sim:loop_lag_seconds",
            "Simulator event-loop lag, maximum over the lag window (wall-clock seconds).",
            runner.loop_lag_max(),
        )
        yield self._gauge(
            "sim:kv_cache_usage_peak",
            "Highest KV-cache usage reached by any engine step since start (0..1).",
            runner.kv_usage_peak,
        )
        yield self._gauge(
            "sim:time_scale", "Simulated seconds per wall-clock second.", runner.config.time_scale
        )
        # The node's own clock, so that a reader can pair counters with the simulated time
        # they cover exactly (a scrape answered late still reads a consistent pair).
        yield self._gauge(
            "sim:clock_seconds", "Simulated seconds since the node started.", runner.sim_now()
        )
        yield self._counter(
            "sim:computed_tokens",
            "Tokens run through the model, recomputation after preemption included.",
            stats.computed_tokens,
        )

    def _cache_config_info(self) -> GaugeMetricFamily:
        config = self.runner.config
        info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "False",
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "is_attention_free": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.effective_num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "sliding_window": "None",
            "swap_space_bytes": "4294967296",
        }
        if not self.v0:
            info["engine"] = str(config.engine_index)
        family = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        family.add_metric(list(info.values()), 1.0)
        return family


def make_registry(runner: NodeRunner) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(runner))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
