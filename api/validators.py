"""Checks and server-policy values shared by several routes (a route never imports another route)."""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated

from fastapi import Path, Query

from api.errors import ApiError
from models.chat import SESSION_PATTERN
from models.jobs import COLLECTION_PATTERN
from ragline.settings import Settings
from temporal import policies

COLLECTION_RE = re.compile(COLLECTION_PATTERN)
SESSION_RE = re.compile(SESSION_PATTERN)
# Job ids are workflow ids: `<tenant>.<kind>-...` (the tenant prefix may be left out).
JOB_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,255}$"
JOB_ID = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="A job id, as answered when the job was accepted")]
SESSION_ID = Annotated[str, Path(pattern=SESSION_PATTERN, description="A chat session id")]
CursorDep = Annotated[str | None, Query(max_length=2048, pattern=r"^[A-Za-z0-9_-]+$",
                                        description="`next_cursor` of the page before")]


def validate_collection(collection: str) -> str:
    if not COLLECTION_RE.fullmatch(collection):
        raise ApiError(422, "invalid_collection",
                       "collection must be 1-64 characters of letters, digits, '_' or '-'", collection=collection)
    return collection


def is_session_id(session_id: str) -> bool:
    return SESSION_RE.fullmatch(session_id) is not None


def validate_session_id(session_id: str) -> str:
    if not is_session_id(session_id):
        raise ApiError(422, "invalid_session_id", "session_id must be 1-64 letters, digits, '_' or '-'")
    return session_id


def display_name(filename: str | None) -> str:
    """A filename for display only; it is never used as a path."""
    name = (filename or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if unicodedata.category(ch)[0] != "C").strip()
    return name[:255] or "unnamed"


def review_timeout_seconds(settings: Settings) -> float:
    """How long a job waits for a person's review (RAGLINE_REVIEW_TIMEOUT), handed to the job at acceptance."""
    return policies.parse_duration(settings.review_timeout).total_seconds()
