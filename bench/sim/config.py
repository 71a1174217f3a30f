"""Configuration of one simulated vLLM node."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from bench.sim.timing import StepCosts

SchedulingPolicy = Literal["fcfs", "priority"]

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything a node needs; the CLI flags of ``python -m bench.sim`` map onto it one to one.

    Defaults describe an 8B bf16 model on an 80 GB H100 at 0.9 memory utilisation: about 27k
    blocks of 16 tokens (estimate, VLLM-FACTS.md) and vLLM's defaults for >= 70 GiB GPUs
    (``max_num_seqs`` 1024, ``max_num_batched_tokens`` 8192).
    """

    model: str = DEFAULT_MODEL
    num_gpu_blocks: int = 27_000
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    """vLLM V1's cap on the prompt tokens one request computes in a step (0: off, vLLM's default
    when ``max_num_partial_prefills`` is 1): a long prompt is then prefilled over several steps,
    leaving the rest of each step's token budget to other requests."""
    max_model_len: int = 32_768
    scheduling_policy: SchedulingPolicy = "fcfs"

    time_scale: float = 1.0
    """Simulated seconds per wall-clock second (0.5: the simulation runs at half speed)."""
    capacity_scale: float = 1.0
    """Fraction of a real GPU this node stands for; see bench.sim.timing."""

    v0_metrics: bool = False
    """Expose V0 names (``vllm:gpu_cache_usage_perc``, no ``engine`` label)."""
    cache_config_info: bool = True
    engine_index: int = 0
    gpu_memory_utilization: float = 0.9

    output_fraction: float = 1.0
    """Mean fraction of ``max_tokens`` generated when nothing forces the length; 1 = no EOS."""
    seed: int = 0

    crash_after_full_s: float | None = None
    """Die after this many simulated seconds spent continuously "full" (None: never)."""
    crash_usage_threshold: float = 0.99
    """KV usage at or above which a step counts as full (a step that preempts always does)."""

    lag_window_s: float = 10.0
    """Wall-clock window over which ``sim:loop_lag_seconds`` reports the maximum lag."""
    lag_tolerance_s: float = 0.002
    """Wall-clock lateness the engine absorbs without shifting its simulated schedule."""

    step_costs: StepCosts = field(default_factory=StepCosts)

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid SimConfig: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        out: list[str] = []
        if not self.model:
            out.append("model must not be empty")
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1")
        if self.long_prefill_token_threshold < 0:
            out.append("long_prefill_token_threshold must be >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            out.append("scheduling_policy must be 'fcfs' or 'priority'")
        if not self.time_scale > 0:
            out.append("time_scale must be > 0")
        if not 0 < self.capacity_scale <= 1:
            out.append("capacity_scale must be in (0, 1]")
        if not 0 < self.output_fraction <= 1:
            out.append("output_fraction must be in (0, 1]")
        if self.crash_after_full_s is not None and self.crash_after_full_s < 0:
            out.append("crash_after_full_s must be >= 0")
        if not 0 < self.crash_usage_threshold <= 1:
            out.append("crash_usage_threshold must be in (0, 1]")
        if out:
            return out
        if self.effective_num_gpu_blocks < 2:
            out.append("capacity_scale leaves fewer than 2 GPU blocks")
        # vLLM refuses to start when one maximal request cannot fit in the cache; so do we, since
        # such a request would wait forever.
        capacity = self.usable_blocks * self.block_size
        if self.max_model_len > capacity:
            out.append(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache holds "
                f"({capacity} tokens in {self.usable_blocks} usable blocks)"
            )
        return out

    @property
    def effective_num_gpu_blocks(self) -> int:
        return max(1, math.floor(self.num_gpu_blocks * self.capacity_scale))

    @property
    def usable_blocks(self) -> int:
        # vLLM V1 reserves one block as the "null block"; usage is counted against the rest.
        return self.effective_num_gpu_blocks - 1

    @property
    def effective_max_num_seqs(self) -> int:
        return max(1, math.floor(self.max_num_seqs * self.capacity_scale))

    @property
    def effective_max_num_batched_tokens(self) -> int:
        return max(1, math.floor(self.max_num_batched_tokens * self.capacity_scale))

    @property
    def effective_long_prefill_token_threshold(self) -> int:
        # Scaled like the token budget, so a scaled node splits a prompt into as many steps of
        # the same duration as the real one; 0 stays off.
        if self.long_prefill_token_threshold == 0:
            return 0
        return max(1, math.floor(self.long_prefill_token_threshold * self.capacity_scale))
