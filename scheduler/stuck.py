"""Judging a node's engine stuck: it holds requests and makes no progress, while its API server
still answers `/metrics`.

vLLM's engine sends its scheduler's figures (KV usage, running and waiting counts) with every
step, outputs or not, and its token counters (prompt tokens, generated tokens, the inter-token
histogram's count) as tokens come out; an engine hung inside a step sends nothing more, and its
page freezes (scheduler.scrape reads each engine's figures, `EngineFigures`). A decode step
moves the token counters, and a long prompt's prefill, which moves no counter until it ends,
allocates cache blocks for each chunk and so moves the KV usage.

A node is judged stuck when both hold:

- one of its engines (a data-parallel server labels each one's samples) reports requests
  running or waiting and has not changed any of its figures for `stuck_after_ms`, across good
  readings only (a node whose scrapes fail is ejected for that, not judged stuck);
- a task kvgate released to the node at least `stuck_after_ms` ago has not ended (the pool's
  running index). vLLM's page can keep counting requests that were all aborted, with no step
  to correct it (an idle engine takes none): without this, a healthy idle node whose last
  requests' clients left would be judged stuck, and, given no work, never change again. A
  dead gateway's tasks stay in the index until its lease expires and the reaper runs, so
  `stuck_after_ms` must be longer than that (admission.configchecks), and no node is judged
  until a lease and one reap interval have passed since the last Redis failure
  (`PoolScheduler.may_judge_stuck`, scheduler.service `judging_allowed`).

Once judged, it stays stuck while such an engine stays unchanged, whether or not kvgate still
has tasks there (the gateways end them once `nodes_out` says so: gateway.stucknodes), and
while its scrapes fail (its stillness is measured to its last good reading). It rejoins at
the first reading at which every engine that holds requests has changed, or none
holds any (a restarted engine's counters start again). A new leader keeps a node the last one
published stuck out from its first reading, if that reading shows an engine holding requests,
until it changes (`inherit`). Never judged stuck: a page with neither the generated-token
counter nor the histogram (not a page this judgement was made for), and an engine that froze
while idle (its frozen page says it holds nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scrape import EngineFigures, NodeMetrics


@dataclass(slots=True)
class _Node:
    progress: dict[str, EngineFigures] | None = None
    """Its engines' figures at the last good reading, by engine label."""
    moved_at: dict[str, float] = field(default_factory=dict)
    """Per engine, when (monotonic) its figures last changed or it held no request."""
    read_at: float = 0.0
    """When (monotonic) the last good reading was taken."""
    inherit: bool = False
    """The last leader published it stuck (`StuckWatch.inherit`)."""
    stuck: bool = False
    """Judged stuck, until its still engines change."""


class StuckWatch:
    """The per-node bookkeeping of one pool's poller; `after_s` 0: nothing is ever stuck."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._nodes: dict[str, _Node] = {}

    def reading(self, name: str, m: NodeMetrics, at: float) -> None:
        """A good reading of node `name`, taken at monotonic time `at`."""
        node = self._nodes.setdefault(name, _Node())
        last = node.progress
        moved: dict[str, float] = {}
        for engine in m.engines:
            if last is None and node.inherit and engine.busy:
                moved[engine.engine] = at - self.after_s
                node.stuck = True
            elif last is None or engine != last.get(engine.engine) or not engine.busy:
                moved[engine.engine] = at
            else:
                moved[engine.engine] = node.moved_at[engine.engine]
        node.moved_at, node.inherit, node.read_at = moved, False, at
        node.progress = {e.engine: e for e in m.engines}

    def still_s(self, name: str, m: NodeMetrics | None, last_good: float) -> float:
        """How long the node's stillest engine that holds requests has not changed, to its
        last good reading (0 while none is still, or its page counts no decoded token)."""
        node = self._nodes.get(name)
        if node is None or m is None or not m.shows_decoding:
            return 0.0
        return max((last_good - node.moved_at.get(e.engine, last_good)
                    for e in m.engines if e.busy), default=0.0)

    def stuck(self, name: str, still_s: float) -> bool:
        """Judged stuck and still so."""
        node = self._nodes.get(name)
        if node is None or not node.stuck:
            return False
        if self.after_s <= 0 or still_s < self.after_s:
            node.stuck = False
        return node.stuck

    def candidate(self, name: str, still_s: float) -> bool:
        """Still long enough to be judged stuck, not judged yet: `judge` it with the pool's
        running index."""
        node = self._nodes.get(name)
        return (self.after_s > 0 and still_s >= self.after_s
                and node is not None and not node.stuck)

    def judge(self, name: str) -> None:
        """A candidate that also holds a task kvgate released `after_s` ago or more."""
        node = self._nodes.get(name)
        if node is not None:
            node.stuck = True

    def inherit(self, names: Iterable[str]) -> None:
        """Nodes the last leader published stuck, for a new leader: stuck from its first
        reading (or the one it already took: a scrape begun in an earlier term may end first)
        if that shows an engine holding requests."""
        for name in names:
            node = self._nodes.setdefault(name, _Node())
            if node.progress is None:
                node.inherit = True
                continue
            for engine in node.progress.values():
                if engine.busy:
                    node.moved_at[engine.engine] = min(node.moved_at[engine.engine],
                                                       node.read_at - self.after_s)
                    node.stuck = True

    def forget(self) -> None:
        self._nodes.clear()
