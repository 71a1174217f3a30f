"""Errors of the admission core."""

from __future__ import annotations


class AdmissionError(Exception):
    """Base of everything this package raises on purpose."""


class ScriptReplyError(AdmissionError):
    """A script answered in a shape this version does not understand (mixed deployments)."""


class FencedError(AdmissionError):
    """A scheduler wrote with an epoch older than the pool's: it is no longer the leader."""

    def __init__(self, pool: str, epoch: int, current: int) -> None:
        super().__init__(f"pool {pool}: epoch {epoch} is fenced out by epoch {current}")
        self.pool = pool
        self.epoch = epoch
        self.current = current
