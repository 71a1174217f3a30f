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
until it changes (`inherit`).

An engine that froze while idle says it holds nothing, and its page stays still: a healthy
idle engine's does too. What tells them apart is a request sent to it: an engine that takes
one steps, and its token counters move. So a node is also judged stuck, as a frozen page,
when none of its page has changed for `stuck_after_ms` and it holds a task kvgate released
more than `FROZEN_SLACK_S` after the page last changed, as a good reading taken at least
`stuck_after_ms` after the release shows (Poller.judge_stuck; none while its readings are
stale), and, with probes on, a probe sent then has gone unanswered (scheduler.probe: a live
server can hold a request in its front end that long, fetching a video). A reading that
shows a request's work ends after its release, so a request the engine took leaves the page's
last change after its release, however slowly its client reads the answer. It stays stuck
until the page changes. Not judged that way: a data-parallel server whose other
engines go on stepping (the page changes; which engine a request went to is not on it), and a
page with neither the generated-token counter nor the histogram (a request of one token could
leave no trace between two readings). Nor does a new leader inherit a frozen page that shows
nothing held: the first requests it sends there are judged afresh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scrape import EngineFigures, NodeMetrics

FROZEN_SLACK_S = 0.1
"""A task counts against a frozen page only if released this long after its last change: the
release is stamped on the pool clock (Redis TIME) and the change on the leader's, matched by
`ClockMatch` no later than it was, to within the fastest round trip of its recent samples."""
CLOCK_SAMPLES_S = 10.0
"""How long a `ClockMatch` sample is kept: long enough to hold one that came back fast, short
enough that the two clocks' rates (NTP slews Redis's by at most 0.05%) cannot part them by
more than a few milliseconds."""


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
    changed_at: float = 0.0
    """When (monotonic) the page last changed (any engine's figures, busy or not), or was
    first read."""
    frozen_since: float | None = None
    """Judged stuck as a frozen page (`judge_frozen`): the `changed_at` it was judged on. It
    stays stuck until the page changes."""


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
        progress = {e.engine: e for e in m.engines}
        if progress != last:
            node.changed_at = at
        node.moved_at, node.inherit, node.read_at = moved, False, at
        node.progress = progress

    def still_s(self, name: str, m: NodeMetrics | None, last_good: float) -> float:
        """How long the node's stillest engine that holds requests has not changed, to its
        last good reading (0 while none is still, or its page counts no decoded token)."""
        node = self._nodes.get(name)
        if node is None or m is None or not m.shows_decoding:
            return 0.0
        return max((last_good - node.moved_at.get(e.engine, last_good)
                    for e in m.engines if e.busy), default=0.0)

    def frozen_s(self, name: str, m: NodeMetrics | None, last_good: float) -> float:
        """How long none of the node's page has changed, to its last good reading (0 for a
        page that counts no decoded token)."""
        node = self._nodes.get(name)
        if node is None or m is None or not m.shows_decoding or node.progress is None:
            return 0.0
        return last_good - node.changed_at

    def stuck(self, name: str, still_s: float) -> bool:
        """Judged stuck and still so."""
        node = self._nodes.get(name)
        if node is None or not node.stuck:
            return False
        if node.frozen_since is not None:
            moved = node.changed_at != node.frozen_since
        else:
            moved = still_s < self.after_s
        if self.after_s <= 0 or moved:
            node.stuck, node.frozen_since = False, None
        return node.stuck

    def frozen(self, name: str) -> bool:
        """Judged stuck as a frozen page, and still so."""
        node = self._nodes.get(name)
        return node is not None and node.stuck and node.frozen_since is not None

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

    def frozen_candidate(self, name: str, frozen_s: float) -> bool:
        """A page that has not changed for `after_s`, not judged yet: judged if the latest
        release among the node's tasks old enough (Poller.judge_stuck: `after_s` plus the
        reading's lag) counts (`frozen_release`), and a probe sent since went unanswered."""
        node = self._nodes.get(name)
        return (self.after_s > 0 and frozen_s >= self.after_s
                and node is not None and not node.stuck)

    def frozen_release(self, name: str, latest_release: float) -> float | None:
        """`latest_release` (monotonic, the leader's clock), if it counts against the frozen
        page: more than FROZEN_SLACK_S after the page last changed; else None. The caller
        reads releases old enough that the node's last good reading came `after_s` after
        them (Poller.judge_stuck)."""
        node = self._nodes.get(name)
        if node is None or latest_release <= node.changed_at + FROZEN_SLACK_S:
            return None
        return latest_release

    def judge_frozen(self, name: str) -> None:
        """A frozen candidate with a release that counts (`frozen_release`), and, if probes
        are on, a probe sent since then unanswered."""
        node = self._nodes.get(name)
        if node is not None:
            node.stuck, node.frozen_since = True, node.changed_at

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


def latest_by_node(releases: Iterable[tuple[str, int]], cutoff_us: int) -> dict[str, int]:
    """Of (node, released_us) pairs, each node's latest release at or before `cutoff_us`."""
    latest: dict[str, int] = {}
    for node, released_us in releases:
        if released_us <= cutoff_us and released_us > latest.get(node, -1):
            latest[node] = released_us
    return latest


class ClockMatch:
    """The pool clock (Redis TIME, µs) on this process's monotonic clock, for comparing a
    task's release with the time of a reading.

    Each sample pairs a Redis time with the local clock read before the call that returned
    it was sent: so the local reading comes no later than the Redis time, and each sample's
    offset (local minus pool) is at most the true one. The greatest offset of recent samples
    is the closest, and a release matched with it comes no later than it was: on the side on
    which a frozen page is judged less often. (The matched release is also the time after
    which a confirming probe must have started, `Prober.hung`: one started up to a round trip
    before the true release may count, which a node that does not answer it is judged on
    rightly all the same.) After a failover to a server whose
    clock runs ahead, the old samples would err the other way: the pool clears them while it
    may not judge (`clear`)."""

    def __init__(self, keep_s: float = CLOCK_SAMPLES_S) -> None:
        self.keep_s = keep_s
        self._samples: deque[tuple[float, float]] = deque()
        """(local time, offset), offsets decreasing: a sample with a smaller offset than a
        later one's can never be the greatest again, and is dropped."""

    def sample(self, pool_us: int, local_before_s: float) -> None:
        """A Redis time, and the local clock read before the call that returned it."""
        offset = local_before_s - pool_us / 1_000_000
        while self._samples and self._samples[-1][1] <= offset:
            self._samples.pop()
        self._samples.append((local_before_s, offset))
        while self._samples[0][0] < local_before_s - self.keep_s:
            self._samples.popleft()

    def local(self, pool_us: int) -> float | None:
        """`pool_us` on the local clock; None before the first sample."""
        if not self._samples:
            return None
        return pool_us / 1_000_000 + self._samples[0][1]

    def clear(self) -> None:
        self._samples.clear()
