"""Who is calling: an API key in `Authorization: Bearer <key>` or `X-API-Key`, looked up by its
sha256 in the keys file (ragline/keys.py). Every route but /healthz depends on `authenticate`.

401 `unauthenticated`: no key, or a key the file does not know. 403 `forbidden`: a member key on a
reviewer's route. 429 `rate_limited` with `Retry-After`: the key sent more than its requests per
minute (a moving window, `limits`; counters in RAGLINE_RATE_LIMIT_STORAGE).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated

import structlog
from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from limits import RateLimitItemPerMinute
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from api.errors import ApiError
from ragline.keys import KeyEntry, KeyRing, TenantLimits
from ragline.settings import Settings

log = structlog.get_logger("ragline.auth")

bearer_scheme = HTTPBearer(auto_error=False, description="`Authorization: Bearer <API key>`")
header_scheme = APIKeyHeader(name="X-API-Key", auto_error=False, description="The API key")


@dataclass(frozen=True)
class Caller:
    tenant: str
    role: str
    name: str
    key_id: str  # the first characters of the key's sha256: enough to tell keys apart in logs

    @property
    def who(self) -> str:
        return f"{self.name} ({self.tenant}, key {self.key_id})"


class Guard:
    """The keys and the rate limiter of one API process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = KeyRing(settings.effective_api_keys_file)
        self.limiter = MovingWindowRateLimiter(storage_from_string(settings.rate_limit_storage))

    def limits(self, tenant: str) -> TenantLimits:
        return self.keys.limits(tenant)

    def check_rate(self, entry: KeyEntry) -> None:
        per_minute = entry.requests_per_minute or self.settings.rate_limit_per_minute
        item = RateLimitItemPerMinute(per_minute)
        if self.limiter.hit(item, "key", entry.sha256):
            return
        reset, _ = self.limiter.get_window_stats(item, "key", entry.sha256)
        retry_after = max(1, math.ceil(reset - time.time()))
        raise ApiError(429, "rate_limited", f"more than {per_minute} requests per minute with this key; "
                       f"try again in {retry_after} s", headers={"Retry-After": str(retry_after)})


def _unauthenticated(message: str) -> ApiError:
    return ApiError(401, "unauthenticated", message, headers={"WWW-Authenticate": "Bearer"})


async def authenticate(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
    api_key: Annotated[str | None, Security(header_scheme)],
) -> Caller:
    key = api_key or (bearer.credentials if bearer else None)
    if not key:
        raise _unauthenticated("an API key is required: `Authorization: Bearer <key>` or `X-API-Key: <key>`")
    return admit(request, key)


def admit(request: Request, key: str) -> Caller:
    guard: Guard = request.app.state.guard
    entry = guard.keys.find(key)
    if entry is None:
        raise _unauthenticated("unknown API key")
    guard.check_rate(entry)
    caller = Caller(tenant=entry.tenant, role=entry.role, name=entry.name or entry.sha256[:8],
                    key_id=entry.sha256[:8])
    structlog.contextvars.bind_contextvars(tenant=caller.tenant, key=caller.key_id)
    return caller


async def require_reviewer(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    if caller.role != "reviewer":
        raise ApiError(403, "forbidden", "this needs a reviewer key (role = \"reviewer\" in the keys file)")
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]
ReviewerDep = Annotated[Caller, Depends(require_reviewer)]


async def get_guard(request: Request) -> Guard:
    return request.app.state.guard


GuardDep = Annotated[Guard, Depends(get_guard)]
