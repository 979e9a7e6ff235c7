"""structlog setup: one line per event, with job ids bound where known (inside activities: job_id, step,
attempt, bound by temporal.telemetry.StepTelemetry) and the trace id of the current span."""

from __future__ import annotations

import logging

import structlog

from ragline.tracing import add_trace_id


def configure(level: str = "INFO", json: bool = False) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, add_trace_id, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
    )
