"""structlog setup: one line per event, with job ids bound where known (inside activities: job_id, step,
attempt, bound by temporal.telemetry.StepTelemetry; in the API: tenant, key) and the trace id of the
current span. The standard library's records (uvicorn's access lines, the HTTP client's, pypdf's, the
Temporal SDK's) go through the same processors (structlog's ProcessorFormatter), so they carry them too.
The SDK's reports of expected activity failures are cut to one line, without a traceback."""

from __future__ import annotations

import asyncio
import logging
import sys

import structlog
from temporalio import activity as temporal_activity
from temporalio.exceptions import ApplicationError

from ragline.errors import TransientError, non_retryable_types
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
        activity = getattr(record, "temporal_activity", None) or {}  # the SDK's extra on its records
        if activity:  # written after the step's own context closed: its fields, from the SDK's record
            record.job_id, record.step = activity.get("workflow_id"), activity.get("activity_type")
            record.attempt = activity.get("attempt")
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            # The SDK's own frames only. A step whose job was cancelled (or ended) meanwhile, or whose worker
            # stops: the job tells why, and its attempt, stopped as asked, is no warning. One that timed out
            # (no heartbeat in time) is: it says so, in one line.
            details = _cancellation_details()
            record.args = (activity.get("activity_type"), activity.get("workflow_id"))
            record.exc_info = record.exc_text = None
            if details is not None and details.timed_out:
                record.msg = "activity %s of job %s timed out (no heartbeat, or over its time): retried while " \
                             "its policy allows"
            else:
                record.msg = "activity %s of job %s stopped: " + (
                    "the worker is shutting down" if details is not None and details.worker_shutdown
                    else "its job was cancelled or has ended")
                record.levelno, record.levelname = logging.INFO, "INFO"
            return True
        if not isinstance(error, ApplicationError):
            return True
        if error.non_retryable and error.type in self.expected:
            record.msg = "activity %s of job %s failed, not retried: %s: %s"
            record.args = (activity.get("activity_type"), activity.get("workflow_id"), error.type, error.message)
            record.exc_info = record.exc_text = None
        elif not error.non_retryable and error.type == TransientError.__name__:
            # A provider's 503 or timeout is weather, not a bug: during an outage a traceback per attempt
            # buries everything else in the log.
            record.msg = "activity %s of job %s failed on attempt %s (transient: retried while its policy allows): %s"
            record.args = (activity.get("activity_type"), activity.get("workflow_id"), activity.get("attempt"),
                           error.message)
            record.exc_info = record.exc_text = None
        return True


class CoreAfterCancelFilter(logging.Filter):
    """The SDK core warns when an activity completes that the server no longer knows: what every step of a
    cancelled job does once it has stopped. Said as information, not as a warning each time."""

    EXPECTED = ("Activity not found on completion",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and any(m in record.getMessage() for m in self.EXPECTED):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


CORE_LOGGER = "temporalio.core"  # where temporal/telemetry.py forwards the SDK core's lines


def _cancellation_details() -> temporal_activity.ActivityCancellationDetails | None:
    """Why the activity whose record is being logged was cancelled (the SDK logs within its context)."""
    try:
        return temporal_activity.cancellation_details()
    except RuntimeError:  # not in an activity's context
        return None


# uvicorn configures these before it imports the app, each with a handler of its own that does not
# pass records on: they are sent through the root handler instead, to carry the same fields.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
RAGLINE_HANDLER = "ragline"
STEP_FIELDS = ("job_id", "step", "attempt")  # a library record's own (ExpectedFailureFilter sets them)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (a test's capture, replaced per test)."""

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


class _Stderr:
    """sys.stderr as it is when a line is written, for structlog's own lines: they go where the standard
    library's do, and standard output stays for what a process prints as its output (RAGLINE_AUDIT_LOG=-)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "INFO", json: bool = False, *, redact: bool = False) -> None:
    """`redact` (RAGLINE_REDACT_PII): phone numbers, e-mail addresses and ID numbers are masked in
    every log line, whatever logged them (structlog events and the standard library's records)."""
    sdk_activity = logging.getLogger(SDK_ACTIVITY_LOGGER)
    if not any(isinstance(f, ExpectedFailureFilter) for f in sdk_activity.filters):
        sdk_activity.addFilter(ExpectedFailureFilter())
    core = logging.getLogger(CORE_LOGGER)
    if not any(isinstance(f, CoreAfterCancelFilter) for f in core.filters):
        core.addFilter(CoreAfterCancelFilter())
    # Tracebacks as plain text (never rich's, which prints every frame's locals: a PDF's password, a
    # request's headers), made before masking so that an exception's message is masked too.
    renderer = structlog.processors.JSONRenderer() if json else \
        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    masking = []
    if redact:
        from ragline.redact import structlog_processor

        masking = [structlog_processor]
    shared = [structlog.contextvars.merge_contextvars, add_trace_id, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso")]
    handler = _StderrHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder(allow=STEP_FIELDS)],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    *masking, renderer]))
    if redact:  # also before formatting: a record's message is masked whichever handler writes it
        from ragline.redact import RedactingFilter

        handler.addFilter(RedactingFilter())
    handler.name = RAGLINE_HANDLER
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if h.name != RAGLINE_HANDLER] + [handler]  # configured again: one
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:  # at RAGLINE_LOG_LEVEL too, whatever uvicorn was told
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate, logger.disabled = [], True, False
        logger.setLevel(logging.NOTSET)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, *masking, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
    )
