"""What the gateway holds per model pool: its settings, store, token counter and backends."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from admission.config import Config, ConfigError, PoolSettings
from admission.store import PoolStore
from gateway.estimator import TokenCounter


@dataclass(slots=True)
class PoolRuntime:
    settings: PoolSettings
    store: PoolStore
    counter: TokenCounter
    urls: dict[str, str] = field(default_factory=dict)
    """Backend name (the node name the scripts and the scheduler use) -> base URL."""
    backend_headers: dict[str, str] = field(default_factory=dict)
    """Sent to every backend of the pool with each request: its credentials, if any."""
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


def backend_credentials(config: Config, env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Pool name -> the headers that carry its backends' API key, read from the environment
    variable each pool names (`backend_api_key_env`). A variable that is unset or empty is a
    configuration error at start: every request would otherwise reach the nodes without it
    and be refused there."""
    headers: dict[str, dict[str, str]] = {}
    for i, (name, pool) in enumerate(config.pools.items()):
        variable = pool.backend_api_key_env
        if variable is None:
            headers[name] = {}
            continue
        key = env.get(variable, "").strip()
        if not key:
            raise ConfigError(f"pools[{i}].backend_api_key_env: names {variable}, which is "
                              "not set (or empty) in the gateway's environment")
        if any(c in key for c in "\r\n"):
            raise ConfigError(f"{variable}: holds a line break (the API key of pools[{i}], "
                              "whose backend_api_key_env names it)", variable=variable)
        headers[name] = {"Authorization": f"Bearer {key}"}
    return headers
