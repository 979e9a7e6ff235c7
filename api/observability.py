"""The API's metrics (prometheus-client, `GET /metrics`) and tracing (OpenTelemetry FastAPI
instrumentation; the trace id goes back in the `X-Trace-Id` response header).

  ragline_http_requests_total{method,route,status}
  ragline_http_request_duration_seconds{method,route,status}   until the response's headers are sent
                                                               (an SSE stream counts its first byte)
  ragline_jobs_accepted_total{kind}                            jobs started by a request (duplicates not)
  ragline_rate_limit_storage_errors_total                      requests let through unlimited: the shared
                                                               rate-limit counters did not answer

`route` is the route's template (`/v1/jobs/{job_id}`), never the raw path: one series per route.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

from ragline import metrics, tracing

TRACE_HEADER = "X-Trace-Id"

HTTP_REQUESTS = Counter("ragline_http_requests", "HTTP requests by route and status", ["method", "route", "status"])
HTTP_DURATION = Histogram("ragline_http_request_duration_seconds", "Time to the response's headers",
                          ["method", "route", "status"], buckets=metrics.DURATION_BUCKETS)
JOBS_ACCEPTED = Counter("ragline_jobs_accepted", "Jobs accepted by the API, by kind", ["kind"])
RATE_LIMIT_STORAGE_ERRORS = Counter("ragline_rate_limit_storage_errors",
                                    "Requests let through without a rate check: the rate-limit counters did not answer")

router = APIRouter(tags=["health"])


@router.get("/metrics", summary="Prometheus metrics of the API", response_class=Response)
def get_metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def job_accepted(kind: str) -> None:
    JOBS_ACCEPTED.labels(kind=kind).inc()


class HttpTelemetry:
    """Pure ASGI middleware (streams pass through untouched): counts and times each request by route
    template and status, and adds the trace id header. Runs inside the OpenTelemetry server span."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        seen = {"status": 500, "recorded": False}

        def record(status: int) -> None:
            if seen["recorded"]:
                return
            seen["recorded"] = True
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            labels = dict(method=scope["method"], route=route, status=str(status))
            HTTP_REQUESTS.labels(**labels).inc()
            HTTP_DURATION.labels(**labels).observe(time.perf_counter() - started)

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                trace_id = tracing.current_trace_id()
                if trace_id:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (TRACE_HEADER.lower().encode(), trace_id.encode())]}
                record(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            record(seen["status"])


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.add_middleware(HttpTelemetry)
    tracing.instrument_app(app)
