"""structlog setup: one line per event, with job ids bound where known (inside activities: job_id, step,
attempt, bound by temporal.telemetry.StepTelemetry) and the trace id of the current span."""

from __future__ import annotations

import logging

import structlog

from ragline.tracing import add_trace_id


def configure(level: str = "INFO", json: bool = False, *, redact: bool = False) -> None:
    """`redact` (RAGLINE_REDACT_PII): phone numbers, e-mail addresses and ID numbers are masked in
    every log line, whatever logged them (structlog events and the standard library's records)."""
    logging.basicConfig(level=level.upper(), format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    masking = []
    if redact:
        from ragline.redact import RedactingFilter, structlog_processor

        masking = [structlog_processor]
        for handler in logging.getLogger().handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, add_trace_id, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), *masking, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
    )
