"""How long one engine step takes, calibrated to an 8B bf16 model on one H100.

The model is linear in what a step does:

    step = fixed + per_seq * seqs + per_context_token * context_read + per_prefill_token * prefill

* ``fixed`` (6.0 ms): reading ~16 GB of weights at ~3 TB/s is 5.3 ms (physics, VLLM-FACTS.md),
  plus launch and sampler overhead. Chosen so that a batch-1 decode step is ~6.6 ms, the
  *published* TPOT p50 of 6.5 ms at concurrency 1 (public concurrency sweep, vLLM 0.21, H100,
  short chats). The vLLM 0.6.0 blog's "~13 ms per output token at light load" and llm-d's
  10-15 ms batch-1 ITL are slower stacks; we sit at the fast end of the published range.
* ``per_seq`` (0.60 ms): per-sequence cost of a step (sampling, detokenisation, streaming in the
  API server, scheduler bookkeeping). *Fitted* so that a 64-sequence decode step with 1k tokens
  of context is ~47 ms, the published TPOT p50 at concurrency 64 in the same sweep. Residual:
  at concurrency 16 the model gives ~16 ms where the sweep measured 10.9 ms (we are ~50% slow
  there); throughput saturates near 1/per_seq = ~1,650 tok/s, the sweep's plateau being
  1,384 (c=16) and 1,312 (c=64) tok/s.
* ``per_context_token`` (43.7 ns): attention reads each cached token's KV once per decode step;
  128 KiB per token (Llama-3-8B bf16) at ~3 TB/s is 43.7 ns (physics *estimate*). A full 430k
  token cache adds ~19 ms per step, so latency also grows with how full the cache is.
* ``per_prefill_token`` (33.3 us): prefill is compute-bound at 25-35k tokens/s on an H100
  (*published* range, VLLM-FACTS.md); we take the middle, 30k tokens/s. The quadratic attention
  term of long prefills is ignored (it is small next to the MLP below ~16k tokens).

Resulting figures (see tests/test_sim_timing.py): TTFT of a 256-token prompt on an idle node
~15 ms (published p50 14 ms at concurrency 1; llm-d's profile says 60-120 ms); a 64-way decode
step ~47 ms; a full 8192-token prefill chunk ~280 ms.

Capacity scale ``k`` (0 < k <= 1): a scaled node is a k-slice of the real GPU. It holds k times
the blocks and sequences, and each unit of work costs 1/k as much time, so that a scaled node at
a given relative load shows the same KV fraction and the same latencies as the real one, with k
times fewer requests per second to simulate. Only the fixed cost stays unscaled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Coefficients of the step-time model, in seconds; see the module docstring for sources."""

    fixed_s: float = 0.0060
    per_seq_s: float = 0.00060
    per_context_token_s: float = 128 * 1024 / 3.0e12
    per_prefill_token_s: float = 1.0 / 30_000


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes."""

    num_seqs: int
    """Sequences with work in the step (decodes and prefill chunks)."""
    context_tokens: int
    """KV tokens already cached that the step's attention reads (sum over its sequences)."""
    prefill_tokens: int
    """Tokens computed as prefill (prompt chunks and recomputation after preemption)."""


def step_seconds(shape: StepShape, costs: StepCosts, capacity_scale: float = 1.0) -> float:
    """Simulated duration of a step of the given shape on a ``capacity_scale`` slice of a GPU."""
    if shape.num_seqs == 0:
        # An idle step still pays the launch: keeps a stalled scheduler from spinning.
        return costs.fixed_s
    variable = (
        costs.per_seq_s * shape.num_seqs
        + costs.per_context_token_s * shape.context_tokens
        + costs.per_prefill_token_s * shape.prefill_tokens
    )
    return costs.fixed_s + variable / capacity_scale


def decode_step_seconds(
    batch: int, context_per_seq: int, costs: StepCosts | None = None
) -> float:
    """A pure decode step: ``batch`` sequences, each with ``context_per_seq`` cached tokens."""
    # The one new token a decode computes is covered by per_seq, not billed as prefill.
    shape = StepShape(num_seqs=batch, context_tokens=batch * context_per_seq, prefill_tokens=0)
    return step_seconds(shape, costs or StepCosts())


def idle_ttft_seconds(prompt_tokens: int, costs: StepCosts | None = None) -> float:
    """TTFT of one prompt that fits one step on an idle node: a single prefill step."""
    shape = StepShape(num_seqs=1, context_tokens=0, prefill_tokens=prompt_tokens)
    return step_seconds(shape, costs or StepCosts())
