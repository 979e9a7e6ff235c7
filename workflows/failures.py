"""Reading Temporal failures: the reason a person can act on, and whether retries were used up."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, RetryState, TimeoutError

_EXHAUSTED = (RetryState.MAXIMUM_ATTEMPTS_REACHED, RetryState.TIMEOUT)


def _innermost(exc: BaseException) -> BaseException:
    while isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause is not None:
        exc = exc.cause
    return exc


def failure_reason(exc: BaseException) -> str:
    """The innermost human-readable reason of an activity or child failure."""
    exc = _innermost(exc)
    if isinstance(exc, TimeoutError):
        kind = exc.type.name.lower().replace("_", "-") if exc.type else "timeout"
        return f"timed out ({kind})"
    if isinstance(exc, ApplicationError):
        return exc.message
    return str(exc) or type(exc).__name__


def failure_type(exc: BaseException) -> str | None:
    exc = _innermost(exc)
    return exc.type if isinstance(exc, ApplicationError) else type(exc).__name__


def exhausted_retries(exc: ActivityError) -> bool:
    """True when a retryable error used up the retry policy (as opposed to a non-retryable one)."""
    cause = exc.cause
    if isinstance(cause, ApplicationError) and cause.non_retryable:
        return False
    return exc.retry_state in _EXHAUSTED
