"""Maps errors from the `openai` client onto the project's error taxonomy, in one place."""

from __future__ import annotations

import email.utils
import json
import math
from contextlib import contextmanager
from datetime import datetime, timezone

import openai

from ragline.errors import ProviderRejectedError, TransientError

# The same request would be refused again: 413 (the prompt is larger than the provider takes) included.
# Everything else (429, 5xx, and 402, a spent balance an operator can top up) is retried, then parked.
_REJECTED_STATUSES = {400, 401, 403, 404, 413, 422}


def _retry_after(exc: openai.APIStatusError) -> float | None:
    """Seconds the provider asks to wait: `Retry-After` as seconds, or as an HTTP date."""
    value = exc.response.headers.get("retry-after") if exc.response is not None else None
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


@contextmanager
def translate_provider_errors(what: str):
    try:
        yield
    except (json.JSONDecodeError, openai.APIResponseValidationError) as exc:
        raise TransientError(f"{what}: malformed response from the provider ({exc})") from exc
    except openai.APITimeoutError as exc:
        raise TransientError(f"{what}: provider timed out") from exc
    except openai.APIConnectionError as exc:
        raise TransientError(f"{what}: cannot reach provider ({exc.__cause__ or exc})") from exc
    except openai.APIStatusError as exc:
        status = exc.status_code
        message = f"{what}: provider answered {status}: {_short(exc)}"
        if status in _REJECTED_STATUSES:
            raise ProviderRejectedError(message, details={"status": status}) from exc
        raise TransientError(message, retry_after=_retry_after(exc) if status == 429 else None,
                             details={"status": status}) from exc
    except openai.APIError as exc:
        # An error event in the middle of a stream (`data: {"error": ...}`): no status, its kind in the body.
        message = f"{what}: provider sent an error in its stream: {_short(exc)}"
        if _refusal(exc):
            raise ProviderRejectedError(message, details={"code": exc.code or exc.type}) from exc
        raise TransientError(message, details={"code": exc.code or exc.type}) from exc


# Error kinds (an error event's `type` or `code`) that say the same request would be refused again.
_REFUSALS = ("invalid_request", "context_length", "content_filter", "authentication", "permission", "not_found")


def _refusal(exc: openai.APIError) -> bool:
    kinds = f"{exc.type or ''} {exc.code or ''}".lower()
    return any(kind in kinds for kind in _REFUSALS)


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."
