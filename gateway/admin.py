"""The admin API: ``GET /admin/pools``, what `kvgate-inspect` shows, as JSON, behind a token.

The inspection snapshot names tenants, their bucket levels and queued counts, gateway ids and
node budgets: operators' data, not clients'. So it answers only to
``Authorization: Bearer <admin token>`` where ``gateway.admin_token_sha256`` holds the SHA-256
of that token (the token itself is never stored). The presented token is hashed and compared
with `hmac.compare_digest` (`gateway.auth.AdminToken`); a tenant's API key is not an admin
token.

- ``gateway.admin_token_sha256`` unset: 403 ``admin_disabled`` (the admin API is off).
- no bearer token: 401 ``missing_admin_token``; a wrong one: 401 ``invalid_admin_token``.
  Both are counted in ``kvgate_gateway_auth_failures_total`` under those reasons (never the
  token), so that guessing shows without the access log.

Both in OpenAI's error shape. ``/metrics``, ``/healthz``, ``/readyz`` and ``/openapi.json`` stay
open (probes and Prometheus scrape them; they hold no keys, prompts or tenant data unless
``gateway.tenant_metrics`` adds tenant names to the counters).
"""

from __future__ import annotations

from aiohttp import web

from admission.inspect_read import snapshot
from gateway.admit import STORE_ERRORS
from gateway.errors import ApiError, unavailable
from gateway.state import ADMIN, GATEWAY, METRICS

ADMIN_POOLS_PATH = "/admin/pools"


async def admin_pools(request: web.Request) -> web.Response:
    """Every pool's inspection snapshot (the JSON of `kvgate-inspect --json`)."""
    try:
        request.app[ADMIN].check(request.headers.get("Authorization"))
    except ApiError as exc:
        # Counted with the tenants' refused keys: a token being guessed must show somewhere
        # other than the access log, which may be off.
        if exc.status == 401 and exc.code is not None:
            request.app[METRICS].child(request.app[METRICS].auth_failures, exc.code).inc()
        raise
    gw = request.app[GATEWAY]
    try:
        snap = await snapshot(gw.redis, sorted(gw.pools), gw.config.tenants)
    except STORE_ERRORS as exc:
        gw.metrics.child(gw.metrics.redis_errors, "admin").inc()
        raise unavailable(f"Redis is unavailable ({type(exc).__name__}).",
                          code="admission_unavailable",
                          retry_ms=gw.config.gateway.unavailable_retry_ms) from None
    return web.Response(text=snap.to_json(), content_type="application/json")
