"""structlog setup: one line per event, with job ids bound where known (inside activities: job_id, step,
attempt, bound by temporal.telemetry.StepTelemetry) and the trace id of the current span; and the
Temporal SDK's reports of expected activity failures cut to one line, without a traceback."""

from __future__ import annotations

import logging

import structlog
from temporalio.exceptions import ApplicationError

from ragline.errors import non_retryable_types
from ragline.tracing import add_trace_id

# The logger the Temporal SDK reports failed activity attempts on ("Completing activity as failed").
SDK_ACTIVITY_LOGGER = "temporalio.activity"


class ExpectedFailureFilter(logging.Filter):
    """The SDK logs every failed activity attempt with its traceback. For an error our taxonomy never
    retries (ragline/errors.py: an encrypted PDF, a document without text, a refused model request, an
    agent's tool call still malformed after its correction) that reads as a crash, although the job fails
    as it should, with its reason: such a record becomes one line (activity, job, error type, reason).
    A bug or a retryable failure keeps its traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.expected = non_retryable_types()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ApplicationError) and error.non_retryable and error.type in self.expected:
            activity = getattr(record, "temporal_activity", None) or {}  # the SDK's extra on its records
            record.msg = "activity %s of job %s failed, not retried: %s: %s"
            record.args = (activity.get("activity_type"), activity.get("workflow_id"), error.type, error.message)
            record.exc_info = record.exc_text = None
        return True


def configure(level: str = "INFO", json: bool = False, *, redact: bool = False) -> None:
    """`redact` (RAGLINE_REDACT_PII): phone numbers, e-mail addresses and ID numbers are masked in
    every log line, whatever logged them (structlog events and the standard library's records)."""
    logging.basicConfig(level=level.upper(), format="%(message)s")
    sdk_activity = logging.getLogger(SDK_ACTIVITY_LOGGER)
    if not any(isinstance(f, ExpectedFailureFilter) for f in sdk_activity.filters):
        sdk_activity.addFilter(ExpectedFailureFilter())
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
