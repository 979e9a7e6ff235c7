"""Who is calling: an API key in `Authorization: Bearer <key>` or `X-API-Key`, looked up by its
sha256 in the keys file (ragline/keys.py). Every route but /healthz depends on `authenticate`.

401 `unauthenticated`: no key, or a key the file does not know. 403 `forbidden`: a member key on a
reviewer's route, or a codec key (the codec endpoint's only) on any route. 429 `rate_limited` with `Retry-After`: the key sent more than its requests per
minute (a moving window, `limits`; counters in RAGLINE_RATE_LIMIT_STORAGE: this process's memory, or a
Redis that every API process shares).

When the shared counters cannot be reached, requests are let through rather than refused: a rate limit
protects the service, and an outage of its counters must not become an outage of the API. After a
failure the counters are left alone for RAGLINE_RATE_LIMIT_STORAGE_PAUSE seconds, so that only one
request in that time pays the connection timeout (RAGLINE_RATE_LIMIT_STORAGE_TIMEOUT). Each request let
through counts in `ragline_rate_limit_storage_errors_total` (alert RaglineRateLimitsNotEnforced) and
/healthz says `degraded`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import structlog
from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from limits import RateLimitItemPerMinute
from limits.aio.storage import Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string
from temporalio.common import Priority

from api.errors import ApiError
from api.observability import RATE_LIMIT_STORAGE_ERRORS
from ragline.keys import KeyEntry, KeyRing, TenantLimits
from ragline.settings import Settings
from temporal import policies

log = structlog.get_logger("ragline.auth")

bearer_scheme = HTTPBearer(auto_error=False, description="`Authorization: Bearer <API key>`")
header_scheme = APIKeyHeader(name="X-API-Key", auto_error=False, description="The API key")


@dataclass(frozen=True)
class Caller:
    tenant: str
    role: str
    name: str
    key_id: str  # the first characters of the key's sha256: enough to tell keys apart in logs
    sha256: str  # the whole digest: a long-lived request (an event stream) looks the key up again by it
    fairness_weight: float | None = None  # `[tenants.<name>] fairness_weight` (policies.fair_share)

    @property
    def who(self) -> str:
        return f"{self.name} ({self.tenant}, key {self.key_id})"

    @property
    def is_reviewer(self) -> bool:
        """A reviewer key (an operator's too) may decide reviews, operate dead-lettered jobs and read what
        a review withholds from members, all within its tenant."""
        return self.role in ("reviewer", "operator")

    @property
    def may_use_codec(self) -> bool:
        """An operator key may also use the codec endpoint: the payload keys are the deployment's, so it
        reads every tenant's payloads. A codec key (the one the Web UI hands every browser) may do only that."""
        return self.role in ("operator", "codec")

    @property
    def priority(self) -> Priority:
        """What every job this caller starts runs with: its tenant's fair share (policies.fair_share)."""
        return policies.fair_share(self.tenant, self.fairness_weight)

    @property
    def on_record(self) -> dict[str, str]:
        """Who acted, as the audit log records it (ragline/audit.py)."""
        return {"tenant": self.tenant, "key": self.key_id, "key_name": self.name}


# At most one warning per this many seconds while the counters are unreachable (a busy API would
# otherwise log one per request).
STORAGE_WARNING_EVERY_SECONDS = 30.0


def rate_limit_storage(settings: Settings) -> Storage:
    """The async `limits` storage behind RAGLINE_RATE_LIMIT_STORAGE: memory:// (this process) or a Redis
    URL, through redis-py's asyncio client, with its errors raised as `StorageError`."""
    uri = settings.rate_limit_storage
    if uri.startswith("memory://"):
        return storage_from_string("async+memory://")
    timeout = settings.rate_limit_storage_timeout
    return storage_from_string(f"async+{uri}", implementation="redispy", wrap_exceptions=True,
                               socket_timeout=timeout, socket_connect_timeout=timeout)


def shown_address(uri: str) -> str:
    """The storage URL without its user-info and its query (either may hold a password: `?password=`),
    for /healthz and logs."""
    scheme, sep, rest = uri.partition("://")
    at, query = rest.rfind("@"), re.search(r"[?#]", rest)
    if query and at > query.start():  # an `@` in the query, or a `?` in a password not %-encoded: unclear
        return f"{scheme}{sep}…"
    return f"{scheme}{sep}{rest[at + 1:query.start() if query else None]}"


class Guard:
    """The keys and the rate limiter of one API process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = KeyRing(settings.effective_api_keys_file)
        self.storage = rate_limit_storage(settings)
        self.limiter = MovingWindowRateLimiter(self.storage)
        self.shared = not settings.rate_limit_storage.startswith("memory://")
        self._skip_until = float("-inf")
        self._warned_at = float("-inf")

    def limits(self, tenant: str) -> TenantLimits:
        return self.keys.limits(tenant)

    async def check_rate(self, entry: KeyEntry) -> None:
        per_minute = entry.requests_per_minute or self.settings.rate_limit_per_minute
        item = RateLimitItemPerMinute(per_minute)
        if time.monotonic() < self._skip_until:
            RATE_LIMIT_STORAGE_ERRORS.inc()
            return
        try:
            if await self.limiter.hit(item, "key", entry.sha256):
                return
            reset, _ = await self.limiter.get_window_stats(item, "key", entry.sha256)
        except StorageError as exc:
            self._counters_unreachable(exc)
            return
        retry_after = max(1, math.ceil(reset - time.time()))
        raise ApiError(429, "rate_limited", f"more than {per_minute} requests per minute with this key; "
                       f"try again in {retry_after} s", headers={"Retry-After": str(retry_after)})

    async def counters_reachable(self) -> bool:
        """Asks the counters directly (/healthz); an answer ends the pause after a failure at once."""
        try:
            reachable = await self.storage.check()
        except Exception:  # noqa: BLE001 - any failure to answer is "unreachable"
            reachable = False
        if reachable:
            self._skip_until = float("-inf")
        return reachable

    def _counters_unreachable(self, exc: StorageError) -> None:
        RATE_LIMIT_STORAGE_ERRORS.inc()
        now = time.monotonic()
        self._skip_until = now + self.settings.rate_limit_storage_pause
        if now - self._warned_at >= STORAGE_WARNING_EVERY_SECONDS:
            self._warned_at = now
            log.warning("rate limits not enforced: their counters are unreachable",
                        storage=shown_address(self.settings.rate_limit_storage), error=str(exc.storage_error))


KEY_REQUIRED = "an API key is required: `Authorization: Bearer <key>` or `X-API-Key: <key>`"
UNKNOWN_KEY = "unknown API key"
RATE_COUNTED = "ragline_rate_counted"  # request state: the body limit already counted this request's rate


def unauthenticated(message: str) -> ApiError:
    return ApiError(401, "unauthenticated", message, headers={"WWW-Authenticate": "Bearer"})


def key_required(headers: Mapping[str, str]) -> str:
    """KEY_REQUIRED, saying first what was wrong when a key's header came without a key: `"Authorization: Bearer
    $KEY"` with KEY unset (a new terminal) sends `Bearer` alone, and the bare key without `Bearer ` is a common
    slip. The header's value is never repeated: it may be a key."""
    authorization = headers.get("authorization")
    if headers.get("x-api-key") is not None:
        return f"the X-API-Key header is empty (is $KEY set?); {KEY_REQUIRED}"
    if authorization is not None:
        if authorization.strip().partition(" ")[0].lower() == "bearer":
            return f"the Authorization header holds `Bearer` and no key after it (is $KEY set?); {KEY_REQUIRED}"
        return f"the Authorization header is not `Bearer <key>`; {KEY_REQUIRED}"
    return KEY_REQUIRED


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries, read as `authenticate` reads it (for a check made before FastAPI
    has parsed the request: api/limits.py)."""
    if key := headers.get("x-api-key"):
        return key
    scheme, _, credentials = (headers.get("authorization") or "").partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


async def authenticate(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
    api_key: Annotated[str | None, Security(header_scheme)],
) -> Caller:
    if api_key and bearer and bearer.credentials != api_key:
        # Which one was meant? Acting as either could act as the wrong tenant.
        raise ApiError(401, "conflicting_keys", "the request carries two different API keys (X-API-Key and "
                                                "Authorization): send one", headers={"WWW-Authenticate": "Bearer"})
    key = api_key or (bearer.credentials if bearer else None)
    if not key:
        raise unauthenticated(key_required(request.headers))
    caller = await admit(request, key)
    if caller.role == "codec":
        raise codec_key_refused()
    return caller


def codec_key_refused() -> ApiError:
    return ApiError(403, "forbidden", "a codec key may only call the codec endpoint (/codec)")


async def admit(request: Request, key: str) -> Caller:
    guard: Guard = request.app.state.guard
    entry = guard.keys.find(key)
    if entry is None:
        raise unauthenticated(UNKNOWN_KEY)
    if not request.scope.get("state", {}).get(RATE_COUNTED):  # an upload is counted before its body is read
        await guard.check_rate(entry)
    weight = guard.keys.limits(entry.tenant, refresh=False).fairness_weight
    caller = Caller(tenant=entry.tenant, role=entry.role, name=entry.name or entry.sha256[:8],
                    key_id=entry.sha256[:8], sha256=entry.sha256, fairness_weight=weight)
    structlog.contextvars.bind_contextvars(tenant=caller.tenant, key=caller.key_id)
    # Who sent it, for the audit of a request refused before its route runs (a body that fails validation).
    request.state.caller = caller
    return caller


def still_valid(guard: Guard, caller: Caller) -> bool:
    """Whether the caller's key is still in the keys file, for the same tenant and role (a request that
    outlives its key check, an event stream, asks again: a revoked key must stop reading)."""
    entry = guard.keys.by_digest(caller.sha256)
    return entry is not None and entry.tenant == caller.tenant and entry.role == caller.role


def reviewer_only(caller: Caller) -> Caller:
    """A route that audits its decisions checks the role inside its audit block: a member's try is recorded."""
    if not caller.is_reviewer:
        raise ApiError(403, "forbidden",
                       "this needs a reviewer key (role = \"reviewer\" or \"operator\" in the keys file)")
    return caller


async def require_reviewer(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    return reviewer_only(caller)


CallerDep = Annotated[Caller, Depends(authenticate)]
ReviewerDep = Annotated[Caller, Depends(require_reviewer)]


async def get_guard(request: Request) -> Guard:
    return request.app.state.guard


GuardDep = Annotated[Guard, Depends(get_guard)]
