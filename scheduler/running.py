"""The pool's running index as the leader reads it: one member per task released and not yet
ended, "<node> <prompt tokens> <max tokens> <task>" scored by its release time
(admission.reads.running_member). The budgets read it as tasks that decode once their prompt is
prefilled (scheduler.budget); the release control as prompt tokens per node and age
(scheduler.control)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from admission.config import EngineSettings
from admission.reads import RunningMember, running_member
from scheduler.budget import RunningTask


def running_task(prompt_tokens: int, max_tokens: int, arrived_us: int, prefill_us_per_token: int
                 ) -> RunningTask:
    """A task `arrived_us` after it may have reached its engine: it decodes once its prompt is
    prefilled, `prefill_us_per_token` for each prompt token (`[pools.engine]`)."""
    return RunningTask(prompt_tokens, max_tokens,
                       max(0, arrived_us - prompt_tokens * prefill_us_per_token), arrived_us)


Indexed = RunningMember | None
"""A running-index member parsed (None: a format this version did not write)."""


def tasks_by_node(members: Sequence[tuple[Any, Any]], now_us: int, known: dict[Any, Indexed],
                  engine: EngineSettings
                  ) -> tuple[dict[str, list[RunningTask]], dict[Any, Indexed]]:
    """Released tasks by node, from the running index's (member, released µs) pairs, and the
    parsed members to pass as `known` next time: a member never changes while its task runs,
    and the leader reads thousands of them on every tick."""
    parsed: dict[Any, Indexed] = {}
    out: dict[str, list[RunningTask]] = {}
    for raw, released_us in members:
        entry = known[raw] if raw in known else running_member(raw, released_us)
        parsed[raw] = entry
        if entry is None:
            continue  # counted at full size instead (plan_node's unindexed reservations)
        node, prompt_tokens, max_tokens, released_at = entry
        task = running_task(prompt_tokens, max_tokens,
                            now_us - released_at - engine.dispatch_us,
                            engine.prefill_us_per_token)
        tasks = out.get(node)
        if tasks is None:
            out[node] = [task]
        else:
            tasks.append(task)
    return out, parsed


def prefill_tasks(indexed: Mapping[Any, Indexed], now_us: int
                  ) -> dict[str, list[tuple[Any, int, float]]]:
    """(member, prompt tokens, seconds since release) of each parsed member, by node: what the
    release control reads (scheduler.control)."""
    out: dict[str, list[tuple[Any, int, float]]] = {}
    for member, entry in indexed.items():
        if entry is not None:
            age_s = (now_us - entry.released_us) / 1_000_000
            out.setdefault(entry.node, []).append((member, entry.prompt_tokens, age_s))
    return out
