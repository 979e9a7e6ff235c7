"""Turns the project's error taxonomy into Temporal failures that retry policies understand."""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from ragline.errors import RaglineError, TransientError


# The key of an activity failure's details that says which attempt failed (temporal.errors.failed_attempt).
ATTEMPT_DETAIL = "attempt"


def to_application_error(exc: RaglineError) -> ApplicationError:
    delay = None
    message = exc.message
    if isinstance(exc, TransientError) and exc.retry_after is not None:
        # The provider's wish, but no longer than the step's own longest backoff: a Retry-After of a
        # day (a spent daily quota) would otherwise keep the job "running" for days before anyone hears.
        # Outside an activity there is no retry for a delay to shape: none is set.
        longest = _max_interval()
        if longest is not None and exc.retry_after > longest.total_seconds():
            message = f"{message} (the provider asked to wait {exc.retry_after:g} s; retried after {longest})"
            delay = longest
        elif longest is not None:
            delay = timedelta(seconds=exc.retry_after)
    details = dict(exc.details)
    if activity.in_activity():  # the attempt it failed on: a step that fails for good shows how many it took
        details[ATTEMPT_DETAIL] = activity.info().attempt
    return ApplicationError(message, details or None, type=type(exc).__name__,
                            non_retryable=not exc.retryable, next_retry_delay=delay)


def failure_detail(failure: BaseException | None, key: str) -> Any:
    """`key` of a failure's first detail, when that is a dict (how Ragline's failures carry what they tell)."""
    details = getattr(failure, "details", None) or ()
    first = details[0] if details else None
    return first.get(key) if isinstance(first, dict) else None


def failed_attempt(error: BaseException) -> int | None:
    """The attempt an activity's failure (ActivityError, or its ApplicationError cause) happened on."""
    return failure_detail(getattr(error, "cause", None) or error, ATTEMPT_DETAIL)


def _max_interval() -> timedelta | None:
    """The running activity's longest retry backoff (its policy's max_interval), if in an activity."""
    if not activity.in_activity():
        return None
    policy = activity.info().retry_policy
    return policy.maximum_interval if policy is not None else None


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
