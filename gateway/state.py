"""Typed application state: the keys handlers read and the runtime built at startup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from admission.config import Config
from admission.scripts import Scripts
from gateway.admit import Admitter
from gateway.auth import AdminToken, TenantDirectory
from gateway.metrics import GatewayMetrics
from gateway.pools import PoolRuntime
from gateway.proxy import Upstream
from gateway.settle import Settler
from gateway.shutdown import InFlight
from gateway.waiter import WakeHub


@dataclass(slots=True)
class Gateway:
    """Everything a request needs, built in the app's cleanup context (Redis, subscription,
    tokenizers, node client) and torn down with it."""

    id: str
    config: Config
    metrics: GatewayMetrics
    tenants: TenantDirectory
    pools: dict[str, PoolRuntime]
    redis: Any
    scripts: Scripts
    hub: WakeHub
    settler: Settler
    admitter: Admitter
    upstream: Upstream


CONFIG: Final = web.AppKey("kvgate_config", Config)
METRICS: Final = web.AppKey("kvgate_metrics", GatewayMetrics)
GATEWAY_ID: Final = web.AppKey("kvgate_gateway_id", str)
GATEWAY: Final = web.AppKey("kvgate_gateway", Gateway)
OPENAPI: Final = web.AppKey("kvgate_openapi", bytes)
ADMIN: Final = web.AppKey("kvgate_admin", AdminToken)
SETTLE_DRAIN: Final = web.AppKey("kvgate_settle_drain_s", float)
IN_FLIGHT: Final = web.AppKey("kvgate_in_flight", InFlight)
BACKEND_HEADERS: Final = web.AppKey("kvgate_backend_headers", dict[str, dict[str, str]])
"""Pool name -> headers carrying its backends' credentials (gateway.pools.backend_credentials)."""
