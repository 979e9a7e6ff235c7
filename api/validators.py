"""Checks and server-policy values shared by several routes (a route never imports another route)."""

from __future__ import annotations

import re
import typing
import unicodedata
from typing import Annotated

from fastapi import Path, Query, Request
from fastapi.dependencies.models import Dependant
from pydantic import BaseModel

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


def _query_parameters(dependant: Dependant) -> dict[str, bool]:
    """The query parameters a route takes (its dependencies' too), each with whether it may repeat (a list)."""
    taken = {field.alias: typing.get_origin(field.field_info.annotation) in (list, set, tuple)
             for field in dependant.query_params}
    for sub in dependant.dependencies:
        taken.update(_query_parameters(sub))
    return taken


def _body_fields(dependant: Dependant) -> dict[str, str]:
    """The fields a route takes in its body, each with how it is sent ("a form field", "a JSON field")."""
    fields = {}
    for field in dependant.body_params:
        model = field.field_info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            fields.update({f.alias or name: "a JSON field" for name, f in model.model_fields.items()})
        else:
            fields[field.alias] = "a form field"
    return fields


async def known_query_parameters(request: Request) -> None:
    """Strict, as JSON bodies and upload forms are: a misspelt filter (`?stauts=failed`) would otherwise list
    every job without a word, and a filter sent twice would be read as its last value."""
    route = request.scope.get("route")
    if getattr(route, "dependant", None) is None or not request.query_params:
        return
    taken = getattr(route, "ragline_query_parameters", None)
    if taken is None:  # once per route
        taken = route.ragline_query_parameters = _query_parameters(route.dependant)
    sent = request.query_params
    if unknown := sorted(set(sent.keys()) - set(taken)):
        body = getattr(route, "ragline_body_fields", None)
        if body is None:
            body = route.ragline_body_fields = _body_fields(route.dependant)
        if misplaced := [name for name in unknown if name in body]:  # `POST /v1/documents?collection=x`
            raise ApiError(422, "invalid_request", "; ".join(f"{name} goes in the request body ({body[name]}), not "
                                                             "in the query" for name in misplaced),
                           problems=[{"field": f"query.{name}", "message": f"send it as {body[name]}"}
                                     for name in misplaced])
        accepts = f"this route takes {', '.join(sorted(taken))}" if taken else "this route takes none"
        raise ApiError(422, "invalid_request", f"unknown query parameter(s): {', '.join(unknown)}; {accepts}",
                       problems=[{"field": f"query.{name}", "message": "unknown query parameter"} for name in unknown])
    if repeated := sorted(name for name in set(sent.keys()) if not taken[name] and len(sent.getlist(name)) > 1):
        raise ApiError(422, "invalid_request", f"{', '.join(repeated)} given more than once: give each once",
                       problems=[{"field": f"query.{name}", "message": "given more than once"} for name in repeated])
