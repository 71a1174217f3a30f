"""Tenants: `Authorization: Bearer <key>` -> tenant -> tier, and per-request priority lowering.

Only SHA-256 digests of keys are configured. A presented key is hashed, its digest looked up in
a table of the configured ones, and the entry found (or, for an unknown key, a digest of no
key) compared with it once by `hmac.compare_digest`: the same work for a known key and an
unknown one, whatever the number of keys. The lookup's time depends only on the presented
key's digest, which its sender chose: learning a configured key from it would take a SHA-256
preimage. (Comparing every configured digest on every request cost 0.5 ms a request at 10,000
keys.) Keys never reach a log line or an error message.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from admission.config import TenantSettings
from admission.tiers import Tier
from gateway.errors import ApiError, never_retry

PRIORITY_HEADER = "X-Priority"
"""Lowers a request's tier below its tenant's (`normal`, `batch`, or 0..2); never raises it."""


_NO_KEY = hashlib.sha256(b"no key: the comparison of an unknown key's digest").digest()
"""What an unknown key's digest is compared with, so that it costs a known key's work."""


class TenantDirectory:
    def __init__(self, tenants: Iterable[TenantSettings]) -> None:
        self._by_digest: dict[bytes, tuple[bytes, TenantSettings]] = {
            d: (d, tenant) for tenant in tenants
            for d in (bytes.fromhex(digest) for digest in tenant.key_sha256)
        }

    def __len__(self) -> int:
        return len(self._by_digest)

    def authenticate(self, authorization: str | None) -> TenantSettings:
        key = _bearer(authorization)
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        expected, tenant = self._by_digest.get(digest, (_NO_KEY, None))
        found = tenant if hmac.compare_digest(expected, digest) else None
        if found is None:
            raise ApiError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found


def _bearer(authorization: str | None) -> str:
    if authorization is not None:
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() == "bearer" and key:
            return key
    raise ApiError(
        401,
        "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
        code="missing_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def effective_tier(tenant: TenantSettings, requested: str | None) -> Tier:
    """The tenant's tier, or a lower one if the request asks for it; asking for a higher tier
    than the tenant's is not an error, it just has no effect."""
    if requested is None:
        return tenant.tier
    value = requested.strip()
    try:
        tier = Tier(int(value)) if value.isdigit() else Tier.parse(value)
    except ValueError:
        raise ApiError(
            400,
            f"{PRIORITY_HEADER} must be one of vip, normal, batch (or 0, 1, 2).",
            param=PRIORITY_HEADER,
            code="invalid_priority",
        ) from None
    return max(tier, tenant.tier)


class AdminToken:
    """Checks `Authorization` headers against the configured SHA-256 of the admin token."""

    def __init__(self, token_sha256: str | None) -> None:
        self._digest = bytes.fromhex(token_sha256) if token_sha256 else None

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def check(self, authorization: str | None) -> None:
        """Returns when the header carries the admin token; raises ApiError otherwise."""
        if self._digest is None:
            raise never_retry(403, "The admin API is disabled: gateway.admin_token_sha256 is "
                              "not set.", code="admin_disabled", type_="invalid_request_error")
        token = ""
        if authorization is not None:
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() == "bearer":
                token = value.strip()
        if not token:
            raise ApiError(401, "This endpoint needs the admin token: send it as "
                           "'Authorization: Bearer <token>'.", code="missing_admin_token",
                           headers={"WWW-Authenticate": "Bearer"})
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        if not hmac.compare_digest(self._digest, digest):
            raise ApiError(401, "Incorrect admin token.", code="invalid_admin_token",
                           headers={"WWW-Authenticate": "Bearer"})
