"""Every 4xx/5xx answer has the same JSON body: {"error": {"code", "message", ...}}."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from fastapi import FastAPI, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from temporalio.client import WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode

from ragline import audit
from temporal.codec import CodecError


log = structlog.get_logger("ragline.api")
# Files one upload may carry (POST /v1/documents): more are refused 413 too_many_files, here too when
# Starlette's form parser stops at its own cap first.
MAX_FILES_PER_REQUEST = 50


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra
        self.headers = headers


# When a client should try again after a 503 (Temporal, or every worker, out of reach: a restart or a
# deployment takes seconds) or a 504; HTTP clients and proxies read it from `Retry-After`.
RETRY_AFTER = {"Retry-After": "5"}


def temporal_unavailable(exc: Exception | None = None) -> ApiError:
    return ApiError(503, "temporal_unavailable",
                    "the workflow service (Temporal) is not reachable, so no work can be recorded; try again shortly",
                    headers=RETRY_AFTER, reason=str(exc) if exc else None)


def _readable(error: dict) -> str:
    """Pydantic's message, or one a caller can act on where Pydantic's speaks of Python classes."""
    if "Expected UploadFile" in error["msg"]:  # a form field sent as text where a file part belongs
        return "must be a file part (curl: -F files=@path/to/file), not a text value"
    if tuple(error["loc"]) == ("body",):  # the body as a whole: none, or JSON that is no object
        if error["type"] == "missing":
            return "required: send a JSON object (the request had no body)"
        return f"must be a JSON object ({error['msg']})"
    return error["msg"]


def _body(code: str, message: str, **extra: Any) -> dict:
    return {"error": {"code": code, "message": message, **{k: v for k, v in extra.items() if v is not None}}}


def error_body(exc: ApiError) -> dict:
    return _body(exc.code, exc.message, **exc.extra)


def _unsupported_media(request: Request) -> str | None:
    """The media type the route reads its body as, when the request declared another one (FastAPI reads
    such a body as missing or as text, and would answer with the shape errors that follow from that)."""
    body = getattr(request.scope.get("route"), "body_field", None)
    sent = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if body is None or not sent:
        return None
    if isinstance(body.field_info, params.Form):  # a form may come either way (only multipart carries files)
        expected, accepted = "multipart/form-data", sent in ("multipart/form-data", "application/x-www-form-urlencoded")
    else:
        expected, accepted = "application/json", sent == "application/json" or sent.endswith("+json")
    return None if accepted else expected


AUDIT_ACTION = "ragline_audit_action"
F = TypeVar("F", bound=Callable[..., Any])


def audited(action: str) -> Callable[[F], F]:
    """Marks a route whose requests the audit log records (ragline/audit.py) as `action`: one refused before
    the route runs (its body or query fails validation) is recorded too, as `refused: <code>`."""
    def mark(endpoint: F) -> F:
        setattr(endpoint, AUDIT_ACTION, action)
        return endpoint
    return mark


def _audit_refused(request: Request, code: str) -> None:
    route = request.scope.get("route")
    action = getattr(getattr(route, "endpoint", None), AUDIT_ACTION, None)
    caller = getattr(request.state, "caller", None)
    if action is None or caller is None:  # not audited, or refused before its key was known (401 says why)
        return
    params = request.path_params
    audit.record(request.app.state.settings, action=action, outcome=f"refused: {code}",
                 job_id=params.get("job_id") or params.get("document_id") or "", **caller.on_record)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if expected := _unsupported_media(request):
            _audit_refused(request, "unsupported_media_type")
            return JSONResponse(_body("unsupported_media_type", f"send the body as {expected} (Content-Type: "
                                      f"{request.headers.get('content-type') or 'none'} was sent)"), status_code=415)
        problems = [{"field": "body", "message": f"not valid JSON (at character {e['loc'][-1]}): "
                                                 f"{(e.get('ctx') or {}).get('error', e['msg'])}"}
                    if e["type"] == "json_invalid" else
                    # The body as a whole (none sent, or not an object) is named "body", not "".
                    {"field": ".".join(str(p) for p in e["loc"] if p != "body") or "body", "message": _readable(e)}
                    for e in exc.errors()]
        message = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
        # A bad collection name or session id keeps its own code, whichever check caught it.
        code = next((f"invalid_{name}" for name in ("collection", "session_id")
                     if problems and all(p["field"].endswith(name) for p in problems)), "invalid_request")
        _audit_refused(request, code)
        return JSONResponse(_body(code, message, problems=problems), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keeps the exception's headers; a 405's `Allow` lists every method of the path, across routes
        # (Starlette names only those of the first route whose path matched).
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 400 and str(exc.detail).startswith("Too many files"):
            # Starlette's own cap on a form's files (1,000), far above ours: the same answer as ours.
            return JSONResponse(_body("too_many_files", f"at most {MAX_FILES_PER_REQUEST} files per request"),
                                status_code=413)
        if exc.status_code == 400:
            # FastAPI's answer to a body it cannot decode (not UTF-8, nested too deep), or Starlette's to a
            # multipart body it cannot parse (no boundary, a broken part): a bad request body like any other,
            # and the OpenAPI documents that as 422. (The API's own 400s, empty_file, are ApiErrors.)
            reason = "" if exc.detail == "There was an error parsing the body" else f": {exc.detail}"
            message = f"the body could not be read as JSON (UTF-8) or a form{reason}"
            return JSONResponse(_body("invalid_request", message,
                                      problems=[{"field": "body", "message": f"unreadable{reason}"}]), status_code=422)
        if exc.status_code == 405:
            methods = {m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
                       if any(route.matches({**request.scope, "method": m})[0] == Match.FULL
                              for route in request.app.router.routes)}
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(Exception)  # anything else: still the JSON error body (Starlette logs it)
    @app.exception_handler(RuntimeError)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A lazy Temporal client that cannot connect raises a plain RuntimeError.
        if isinstance(exc, RuntimeError) and "Failed client connect" in str(exc):
            err = temporal_unavailable(exc)
            return JSONResponse(_body(err.code, err.message, reason=str(exc)), status_code=503, headers=err.headers)
        log.exception("unhandled error")
        return JSONResponse(_body("internal_error", "an unexpected error occurred; see the API log"),
                            status_code=500)

    @app.exception_handler(CodecError)
    async def _unreadable(_: Request, exc: CodecError) -> JSONResponse:
        # Data encrypted with a key this process lacks: the API and the workers do not share one codec
        # keys file, or a key was dropped while histories still need it. An operator's fix, not the caller's.
        log.error("job data unreadable", error=str(exc))
        return JSONResponse(_body("payload_unreadable", f"this job's data cannot be decrypted here ({exc}); the API "
                                  "and every worker must share RAGLINE_CODEC_KEYS_FILE and keep old keys while "
                                  "histories need them"), status_code=500)

    @app.exception_handler(WorkflowUpdateRPCTimeoutOrCancelledError)
    async def _update_timeout(_: Request, exc: WorkflowUpdateRPCTimeoutOrCancelledError) -> JSONResponse:
        return JSONResponse(_body(
            "temporal_timeout",
            "the workflow service did not confirm the request in time (Temporal slow, or no worker); send it "
            "again, with the same Idempotency-Key to be sure it runs once"), status_code=504, headers=RETRY_AFTER)

    @app.exception_handler(RPCError)
    async def _rpc(request: Request, exc: RPCError) -> JSONResponse:
        if exc.status == RPCStatusCode.UNAVAILABLE:
            err = temporal_unavailable(exc)
            if (job := getattr(request.state, "starting", None)) is not None:
                # A connection lost as the start went out may have recorded it: "nothing recorded" would have a
                # caller without a key send it again, and run it twice.
                return JSONResponse(_body(err.code, "the workflow service (Temporal) is not reachable: this request "
                                          "was most likely not recorded, but a connection lost as it went out may "
                                          f"have recorded it; look at {job['status_url']} before sending it again "
                                          "without an Idempotency-Key. Sent again with the same Idempotency-Key, it "
                                          "is recorded once", reason=str(exc), **job),
                                    status_code=503, headers=err.headers)
            return JSONResponse(_body(err.code, err.message, reason=str(exc)), status_code=503, headers=err.headers)
        if exc.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
            return JSONResponse(_timed_out(request, exc), status_code=504, headers=RETRY_AFTER)
        return JSONResponse(_body("temporal_error", str(exc)), status_code=502)


def _timed_out(request: Request, exc: RPCError) -> dict:
    """Temporal had the request but did not answer in time. A read (or a signal: a cancel, a decision, which
    Ragline takes once) can simply be sent again, but a job's start may have been recorded all the same:
    "not reachable, nothing recorded" (503) would have the caller send it again and, without an
    Idempotency-Key, run the work twice."""
    job = getattr(request.state, "starting", None)
    if job is None:  # nothing was being started (a read, a search, or a check before the start)
        return _body("temporal_timeout", "the workflow service (Temporal) did not answer in time; try again shortly",
                     reason=str(exc))
    return _body("temporal_timeout", "the workflow service (Temporal) did not answer in time: the request may "
                 f"have been recorded all the same; look at {job['status_url']} before sending it again (if it "
                 "still answers 404 some seconds later, it was not). Sent again with the same Idempotency-Key, it "
                 "is recorded once", reason=str(exc), **job)
