"""``python -m bench.sim``: one simulated vLLM node as a process.

The flags map one to one onto SimConfig (``config_to_argv`` is the inverse of
``config_from_args``, which bench.sim.cluster relies on). With ``--port 0`` the node picks a free
port; either way it prints one JSON line ``{"sim_ready": true, "host": ..., "port": ...}`` on
stdout once it serves, and logs only to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.common.serving import serve_until_signal
from bench.sim.app import SIM_RUNNER, create_app
from bench.sim.config import SimConfig
from bench.sim.timing import StepCosts

READY_KEY = "sim_ready"
_CRASH_EXIT_CODE = 137  # what an OOM-killed process reports (128 + SIGKILL)


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    c = StepCosts()
    p = argparse.ArgumentParser(prog="python -m bench.sim",
                                description="One simulated vLLM node (OpenAI API, /metrics).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=d.long_prefill_token_threshold,
                   help="prompt tokens one request may prefill per step (0: no cap)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="simulated seconds per wall-clock second")
    p.add_argument("--capacity-scale", type=float, default=d.capacity_scale,
                   help="fraction of a real GPU this node stands for")
    p.add_argument("--v0-metrics", action="store_true", help="expose V0 metric names")
    p.add_argument("--no-cache-config-info", action="store_true")
    p.add_argument("--engine-index", type=int, default=d.engine_index)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--output-fraction", type=float, default=d.output_fraction,
                   help="mean fraction of max_tokens generated when nothing forces the length")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--crash-after-full-s", type=float, default=None)
    p.add_argument("--crash-usage-threshold", type=float, default=d.crash_usage_threshold)
    p.add_argument("--crash-exit", action="store_true",
                   help="exit with status 137 when the node crashes (an OOM kill)")
    p.add_argument("--lag-window-s", type=float, default=d.lag_window_s)
    p.add_argument("--lag-tolerance-s", type=float, default=d.lag_tolerance_s)
    p.add_argument("--step-fixed-s", type=float, default=c.fixed_s)
    p.add_argument("--step-per-seq-s", type=float, default=c.per_seq_s)
    p.add_argument("--step-per-context-token-s", type=float, default=c.per_context_token_s)
    p.add_argument("--step-per-prefill-token-s", type=float, default=c.per_prefill_token_s)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--trace", type=Path, default=None,
                   help="append a JSON line per engine step and finished request to this file")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        time_scale=args.time_scale,
        capacity_scale=args.capacity_scale,
        v0_metrics=args.v0_metrics,
        cache_config_info=not args.no_cache_config_info,
        engine_index=args.engine_index,
        gpu_memory_utilization=args.gpu_memory_utilization,
        output_fraction=args.output_fraction,
        seed=args.seed,
        crash_after_full_s=args.crash_after_full_s,
        crash_usage_threshold=args.crash_usage_threshold,
        lag_window_s=args.lag_window_s,
        lag_tolerance_s=args.lag_tolerance_s,
        step_costs=StepCosts(
            fixed_s=args.step_fixed_s,
            per_seq_s=args.step_per_seq_s,
            per_context_token_s=args.step_per_context_token_s,
            per_prefill_token_s=args.step_per_prefill_token_s,
        ),
    )


def config_to_argv(config: SimConfig) -> list[str]:
    """Flags that make ``config_from_args`` rebuild ``config`` exactly."""
    c = config.step_costs
    argv = [
        "--model", config.model,
        "--num-gpu-blocks", str(config.num_gpu_blocks),
        "--block-size", str(config.block_size),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--long-prefill-token-threshold", str(config.long_prefill_token_threshold),
        "--max-model-len", str(config.max_model_len),
        "--scheduling-policy", config.scheduling_policy,
        "--time-scale", repr(config.time_scale),
        "--capacity-scale", repr(config.capacity_scale),
        "--engine-index", str(config.engine_index),
        "--gpu-memory-utilization", repr(config.gpu_memory_utilization),
        "--output-fraction", repr(config.output_fraction),
        "--seed", str(config.seed),
        "--crash-usage-threshold", repr(config.crash_usage_threshold),
        "--lag-window-s", repr(config.lag_window_s),
        "--lag-tolerance-s", repr(config.lag_tolerance_s),
        "--step-fixed-s", repr(c.fixed_s),
        "--step-per-seq-s", repr(c.per_seq_s),
        "--step-per-context-token-s", repr(c.per_context_token_s),
        "--step-per-prefill-token-s", repr(c.per_prefill_token_s),
    ]
    if config.v0_metrics:
        argv.append("--v0-metrics")
    if not config.cache_config_info:
        argv.append("--no-cache-config-info")
    if config.crash_after_full_s is not None:
        argv += ["--crash-after-full-s", repr(config.crash_after_full_s)]
    return argv


async def serve(config: SimConfig, host: str, port: int, *, crash_exit: bool = False,
                trace: Path | None = None) -> None:
    """Serve one node until SIGTERM/SIGINT."""
    app = create_app(config, trace)
    loop = asyncio.get_running_loop()
    if crash_exit:

        def die() -> None:
            # Give the woken handlers a moment to reset their connections, then die for real.
            loop.call_later(0.01, os._exit, _CRASH_EXIT_CODE)

        app[SIM_RUNNER].on_crash(die)
    await serve_until_signal(app, host, port, READY_KEY)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    coro = serve(config, args.host, args.port, crash_exit=args.crash_exit, trace=args.trace)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0
