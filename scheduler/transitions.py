"""The leader's log of what changes in a pool, one line per change and never one per poll:
a node ejected (its scrapes failed `eject_after_failures` times in a row, or its engine is
stuck: scheduler.scrape) and back, and the pool entering and leaving RED.

The gauges (`kvgate_scheduler_node_ejected`, `kvgate_scheduler_zone`) say the same at every
scrape; these lines say when, and why, for whoever reads the leader's log. A new leadership
starts afresh (`reset`): the new leader logs the ejected nodes and the RED zone it finds, so
its log is complete without its predecessor's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from admission.tiers import Zone
from scheduler.scrape import NodeView

log = logging.getLogger("kvgate.scheduler.pool")


class TransitionLog:
    def __init__(self, pool: str, eject_after: int, red: float) -> None:
        self.pool = pool
        self.eject_after = eject_after
        self.red = red
        self.ejected: set[str] = set()
        self.stuck: set[str] = set()
        """Of the ejected, those ejected as stuck (their rejoining is logged as a move)."""
        self.in_red = False

    def reset(self) -> None:
        self.ejected.clear()
        self.stuck.clear()
        self.in_red = False

    def observe(self, views: Iterable[NodeView], zone: Zone, usage: float | None) -> None:
        """Log what changed since the last call: a WARNING for each node newly ejected and for
        the pool entering RED, an INFO for each node back and for the pool leaving RED."""
        for view in views:
            frozen = view.metrics if view.stuck else None
            # Logged again when the reason changes (failed scrapes <-> stuck): the line in the
            # log must say why the node is out now.
            if view.ejected and (view.name not in self.ejected or (frozen is not None) != (
                    view.name in self.stuck)):
                self.ejected.add(view.name)
                if frozen is not None and view.frozen:
                    self.stuck.add(view.name)
                    log.warning("pool %s: node %s ejected as stuck: its page has not changed "
                                "for %.0f s, not even for the requests sent to it since; no "
                                "work goes to it until its page changes", self.pool, view.name,
                                view.frozen_s)
                elif frozen is not None:
                    self.stuck.add(view.name)
                    log.warning("pool %s: node %s ejected as stuck: its engine holds %d "
                                "running and %d waiting requests and its page has not changed "
                                "for %.0f s; no work goes to it until it changes or is idle",
                                self.pool, view.name, frozen.running, frozen.waiting,
                                view.still_s)
                else:
                    self.stuck.discard(view.name)
                    log.warning("pool %s: node %s ejected after %d failed scrapes in a row "
                                "(last: %s); no work goes to it until it answers", self.pool,
                                view.name, self.eject_after, view.error or "unknown")
            elif not view.ejected and view.name in self.ejected:
                self.ejected.discard(view.name)
                if view.name in self.stuck:
                    self.stuck.discard(view.name)
                    log.info("pool %s: node %s moves again and rejoins the pool", self.pool,
                             view.name)
                else:
                    log.info("pool %s: node %s answers again and rejoins the pool", self.pool,
                             view.name)
        red = zone is Zone.RED
        if red and not self.in_red:
            why = ("no usable node" if usage is None
                   else f"usage {usage:.3f} at or above red {self.red:g}")
            log.warning("pool %s entered RED (%s): Normal and Batch requests get 429",
                        self.pool, why)
        elif self.in_red and not red:
            figure = "" if usage is None else f", usage {usage:.3f}"
            log.info("pool %s left RED for %s%s", self.pool, zone.value, figure)
        self.in_red = red
