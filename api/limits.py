"""Request bodies are bounded before anything reads them.

FastAPI reads a route's whole body (and spools uploaded files to disk) before it runs the route's
dependencies, the API key check among them. So a body is read only for a known API key (401
otherwise, also before a malformed body could be judged), a body over its route's limit is refused
from its Content-Length alone (413), and one sent without a length is read only up to the limit.
A codec key (the Web UI's, which every browser gets) is refused here (403), before its body is read.
A body over SMALL_BODY_BYTES (an upload) is read only within the key's rate limit (429 first); the
route's own key check (api/auth.py) then applies the key's role, and the rate limit to the others."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import (RATE_COUNTED, UNKNOWN_KEY, Guard, codec_key_refused, key_required, presented_key,
                      unauthenticated)
from api.errors import ApiError, error_body
from ragline.keys import TenantLimits

# A JSON body (a chat message, an agent's goal, a review) fits in this many bytes with room to spare.
SMALL_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Cap:
    """A body limit in bytes, and what sets it (the 413 says so)."""
    bytes: int
    source: str


# A limit that depends on the key's tenant (its `[tenants.<name>]` table in the keys file).
TenantCap = Callable[[TenantLimits], Cap]


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, *, limits: Mapping[str, int | TenantCap], guard: Callable[[], Guard]) -> None:
        """`limits`: the body limit of a path (POST), where it is not SMALL_BODY_BYTES: bytes, or a
        function of the tenant's limits."""
        self.app = app
        self.limits = limits
        self.guard = guard

    def _cap(self, path: str, tenant: str) -> Cap:
        limit = self.limits.get(path, SMALL_BODY_BYTES)
        if callable(limit):
            # As of the key's lookup a moment ago, which re-read the keys file if it had changed.
            return limit(self.guard().keys.limits(tenant, refresh=False))
        return Cap(limit, "this route's limit")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /codec checks its operator key (in its path for the Web UI) before it reads a body, and bounds its
        # bodies itself (RAGLINE_CODEC_MAX_BODY_MB: histories' payloads, not these limits).
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") or \
                not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        key = presented_key(headers)
        entry = self.guard().keys.find(key) if key is not None else None
        if entry is None:
            await _refuse(unauthenticated(key_required(headers) if key is None else UNKNOWN_KEY), scope, receive, send)
            return
        if entry.role == "codec":  # refused by every /v1 route: not worth reading a body for
            await _refuse(codec_key_refused(), scope, receive, send)
            return
        cap = self._cap(scope["path"], entry.tenant)
        length = (headers.get("content-length") or "").strip() or None  # the server keeps trailing spaces
        if length is not None and length.isdigit() and int(length) <= SMALL_BODY_BYTES:
            await self.app(scope, receive, send)  # the server reads no more than the length says
            return
        if length is not None and (not length.isdigit() or int(length) > cap.bytes):
            await _refuse(too_large(cap), scope, receive, send)
            return
        # A key over its rate must not get a large body read and spooled to disk first, again and again.
        try:
            await self.guard().check_rate(entry)
        except ApiError as exc:
            await _refuse(exc, scope, receive, send)
            return
        scope.setdefault("state", {})[RATE_COUNTED] = True  # counted once: admit() does not count it again
        await self._counted(scope, receive, send, cap)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, cap: Cap) -> None:
        """A body without a length (chunked) is cut off at the limit: the route's answer is replaced by 413."""
        received = 0
        over = False
        started = False

        async def limited() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap.bytes:
                    over = True
                    raise _TooLarge
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if over:
                return  # whatever the route made of a cut-off body
            started = True
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except _TooLarge:
            pass
        if over and not started:
            await _refuse(too_large(cap), scope, receive, send)


def too_large(cap: Cap) -> ApiError:
    return ApiError(413, "body_too_large", f"the request body is over {cap.bytes} bytes ({cap.source})")


async def _refuse(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(error_body(error), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)
