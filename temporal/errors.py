"""Turns the project's error taxonomy into Temporal failures that retry policies understand."""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta

from temporalio.exceptions import ApplicationError

from ragline.errors import RaglineError, TransientError


def to_application_error(exc: RaglineError) -> ApplicationError:
    delay = None
    if isinstance(exc, TransientError) and exc.retry_after is not None:
        delay = timedelta(seconds=exc.retry_after)
    return ApplicationError(exc.message, exc.details or None, type=type(exc).__name__,
                            non_retryable=not exc.retryable, next_retry_delay=delay)


def translate_errors(fn):
    """Decorator for activities: a RaglineError leaves as an ApplicationError typed by its class."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except RaglineError as exc:
                raise _failure(exc) from exc
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RaglineError as exc:
            raise _failure(exc) from exc
    return wrapper


def _failure(exc: RaglineError) -> ApplicationError:
    """The failure Temporal keeps: our error, where it was raised, and what it says of its cause. The
    cause's own chain (the HTTP client's internals, four levels for "cannot reach provider") is left
    out: a retrying activity's last failure over 4 KB shows as "Failure exceeds size limit." in the
    Web UI and in `ragline.step.progress`."""
    exc.__cause__ = None
    exc.__suppress_context__ = True
    return to_application_error(exc)
