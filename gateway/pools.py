"""What the gateway holds per model pool: its settings, store, token counter and backends."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from admission.config import PoolSettings
from admission.store import PoolStore
from gateway.estimator import TokenCounter


@dataclass(slots=True)
class PoolRuntime:
    settings: PoolSettings
    store: PoolStore
    counter: TokenCounter
    urls: dict[str, str] = field(default_factory=dict)
    """Backend name (the node name the scripts and the scheduler use) -> base URL."""
    _round_robin: itertools.cycle[str] | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            self.urls = {b.name: b.url for b in self.settings.backends}
        self._round_robin = itertools.cycle(sorted(self.urls)) if self.urls else None

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def served_model(self) -> str:
        return self.settings.served_model_name or self.settings.name

    def url(self, node: str) -> str | None:
        return self.urls.get(node)

    def any_node(self) -> str | None:
        """A backend chosen without Redis (fail-open): round robin over the pool."""
        return next(self._round_robin) if self._round_robin is not None else None
