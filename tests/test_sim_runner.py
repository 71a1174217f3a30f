"""The real-time driver: notifications, the OOM crash, and the loop-lag monitor."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from bench.sim.config import SimConfig
from bench.sim.engine import SimRequest
from bench.sim.runner import EngineDeadError, LagMonitor, NodeRunner

TIMEOUT = 10.0


@contextlib.asynccontextmanager
async def running(config: SimConfig) -> AsyncIterator[NodeRunner]:
    runner = NodeRunner(config)
    task = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def overload_config(crash_after: float | None) -> SimConfig:
    # 40 usable blocks; ten 100-token prompts growing by 100 tokens each cannot all fit.
    return SimConfig(num_gpu_blocks=41, max_model_len=640, time_scale=1000.0,
                     crash_after_full_s=crash_after, crash_usage_threshold=1.0)


async def test_handles_wake_per_token_when_streaming_and_once_otherwise() -> None:
    async with running(SimConfig(time_scale=1000.0)) as runner:
        streamed = runner.submit(SimRequest("s", prompt_tokens=10, max_tokens=5), streaming=True)
        batch = runner.submit(SimRequest("b", prompt_tokens=10, max_tokens=5), streaming=False)
        wakeups = 0
        async with asyncio.timeout(TIMEOUT):
            while not streamed.finished:
                await streamed.wait()
                wakeups += 1
            await batch.wait()
        assert batch.finished
        assert wakeups >= 2, "a streaming handle is woken as tokens arrive"
        assert streamed.req.num_output == batch.req.num_output == 5


@pytest.mark.parametrize(("crash_after", "crashes"), [(0.0, True), (1e6, False)])
async def test_node_dies_after_time_spent_full(crash_after: float, crashes: bool) -> None:
    async with running(overload_config(crash_after)) as runner:
        handles = [
            runner.submit(SimRequest(f"r{i}", prompt_tokens=100, max_tokens=100),
                          streaming=False)
            for i in range(10)
        ]
        async with asyncio.timeout(TIMEOUT):
            await runner.wait_until(
                lambda: runner.crashed or all(h.finished for h in handles)
            )
        assert runner.crashed is crashes
        reasons = {h.req.finish_reason for h in handles}
        if crashes:
            assert "error" in reasons
            assert runner.engine.pool.used == 0 and not runner.engine.has_work()
            with pytest.raises(EngineDeadError):
                runner.submit(SimRequest("late", prompt_tokens=1, max_tokens=1), streaming=False)
        else:
            assert reasons == {"length"}
            assert runner.engine.stats.preemptions > 0
            assert runner.kv_usage_peak == 1.0


async def test_crash_callbacks_run_once() -> None:
    calls: list[str] = []
    async with running(SimConfig(time_scale=1000.0)) as runner:
        runner.on_crash(lambda: calls.append("dead"))
        handle = runner.submit(SimRequest("a", prompt_tokens=10, max_tokens=10_000),
                               streaming=True)
        runner.crash()
        runner.crash()
        async with asyncio.timeout(TIMEOUT):
            await handle.wait()
        assert handle.req.finish_reason == "error"
    assert calls == ["dead"]


def test_lag_monitor_reports_the_window_maximum() -> None:
    monitor = LagMonitor(window_s=5.0)
    monitor.record(0.020, wall=100.2)
    monitor.record(0.200, wall=101.5)
    monitor.record(0.010, wall=101.7)
    assert monitor.window_max(101.9) == 0.200
    assert monitor.window_max(106.0) == 0.200
    assert monitor.window_max(107.1) == 0.0
    monitor.record(0.001, wall=110.0)
    assert monitor.window_max(110.0) == 0.001
    assert monitor.max_total == 0.200
