"""One error taxonomy: every failure is either retryable (transient) or not (bad input, refused request).

Activities raise these; `temporal.policies` and the activity wrappers turn them into Temporal
`ApplicationError`s whose `type` is the class name, so retry policies can name them as
non-retryable and the API can show the reason to a person.
"""

from __future__ import annotations


class RaglineError(Exception):
    """Base class. `retryable` says whether trying the same thing again may succeed."""

    retryable: bool = True

    def __init__(self, message: str, *, details: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class TransientError(RaglineError):
    """Something outside us failed in a way that may pass: timeout, 429, 5xx, connection reset."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, details: dict | None = None) -> None:
        super().__init__(message, details=details)
        self.retry_after = retry_after


class InputError(RaglineError):
    """The input itself can never be processed (encrypted, corrupt, empty, too large). Never retried."""

    retryable = False


class ProviderRejectedError(RaglineError):
    """A model provider refused the request (400/401/403/404/422). Retrying the same call cannot help."""

    retryable = False


class StoreUnavailableError(RaglineError):
    """A local resource (the embedded Qdrant folder) is held by another process."""

    retryable = False


class ModelReplyError(RaglineError):
    """The model's reply cannot be used even after it was told what was wrong with it (an agent's tool
    call it keeps writing malformed). The same request would get the same reply: never retried."""

    retryable = False


def non_retryable_types() -> frozenset[str]:
    """Names of the error types that are never retried (as `ApplicationError.type`): their failure is the
    expected end of bad input or a refused request, with a reason a person can act on, not a crash."""
    found, todo = set(), [RaglineError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not cls.retryable:
            found.add(cls.__name__)
    return frozenset(found)
