"""What the API answers: one pydantic model per response body, so `/openapi.json` describes reality.

Request bodies live beside their routes; models shared with the workflows come from `models/`.
Every error answer has the `ErrorBody` shape (built by `api.errors`); `error_responses` documents,
route by route, which error statuses it really returns and with which codes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Self

import structlog
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema, model_serializer

from models.chat import Citation
from models.jobs import JobKind, JobStatus, OperatorDecision, StepState
from models.review import PendingReview

# Times the API reads from Temporal are written as `datetime.isoformat()` ("+00:00"), as they always
# were; models from the workflows (steps, decisions, reviews) keep pydantic's form ("Z").
Timestamp = Annotated[datetime, PlainSerializer(datetime.isoformat, return_type=str, when_used="json"),
                      WithJsonSchema({"type": "string", "format": "date-time"})]


# -- errors ------------------------------------------------------------------------------------------

class Problem(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    """`code` is stable and machine-readable; other fields depend on the code (`collection`, `file`,
    `limits`, `reason`...)."""
    model_config = ConfigDict(extra="allow")

    code: str = Field(examples=["job_not_found"])
    message: str
    problems: list[Problem] | None = Field(None, description="invalid_request only: each invalid field")


class ErrorBody(BaseModel):
    """The body of every 4xx/5xx answer."""
    error: ErrorDetail


AUTH_ERRORS = {401: "unauthenticated, conflicting_keys", 403: "forbidden", 429: "rate_limited"}
RETRY_AFTER = {"Retry-After": {"description": "Seconds until the key may send again",
                               "schema": {"type": "integer", "minimum": 1}}}
UNAUTHENTICATED = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}


def error_responses(codes: dict[int, str], *, auth: bool = True) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: each error status it returns with the codes it uses there, and any
    unexpected error (500 `internal_error` or `payload_unreadable`, 502 `temporal_error`) as `default`.
    Declaring 422 (or `default`) also replaces FastAPI's own validation-error schema, which is not what
    this API sends.
    Routes behind an API key (`auth`) also answer 401, 403 (a codec key; a member's on a reviewer's route)
    and 429."""
    codes = {**AUTH_ERRORS, **codes} if auth else codes
    documented: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorBody, "description": f"error code{'s' if ',' in code else ''}: {code}"}
        for status, code in sorted(codes.items())}
    if auth:
        documented[429]["headers"] = RETRY_AFTER
        documented[401]["headers"] = UNAUTHENTICATED
    documented["default"] = {"model": ErrorBody,
                             "description": "unexpected error: internal_error (500); payload_unreadable (500: the "
                                            "job's data is encrypted with a key this API does not hold); "
                                            "temporal_error (502); temporal_timeout (504: Temporal did not answer "
                                            "in time, so a request that starts a job may have been recorded: its "
                                            "job_id and status_url say where to look before sending it again)"}
    return documented


TEMPORAL_DOWN = "temporal_unavailable"
ACCEPTED = "Accepted: the job is recorded; follow it at status_url or events_url"
INVALID_REQUEST = "invalid_request"


# -- 202 Accepted ---------------------------------------------------------------------------------

class Accepted(BaseModel):
    """A job was recorded; follow it at `status_url` (JSON) or `events_url` (Server-Sent Events)."""
    job_id: str
    status_url: str
    events_url: str

    @classmethod
    def for_job(cls, request: Request, job_id: str, **fields: Any) -> Self:
        structlog.contextvars.bind_contextvars(job_id=job_id)  # the request's access line names its job
        base = str(request.base_url).rstrip("/")
        status_path, events_path = _job_paths(request.app)
        return cls(job_id=job_id, status_url=base + status_path.replace(_JOB_ID, job_id),
                   events_url=base + events_path.replace(_JOB_ID, job_id), **fields)


def starting(request: Request, job_id: str) -> None:
    """Names the job this request is about to start: should Temporal not confirm it in time, the answer
    (504 `temporal_timeout`, api/errors.py) points to where the job would be, to look before sending again."""
    status_url = str(request.base_url).rstrip("/") + _job_paths(request.app)[0].replace(_JOB_ID, job_id)
    request.state.starting = {"job_id": job_id, "status_url": status_url}


_JOB_ID = "{job_id}"


def _job_paths(app: Any) -> tuple[str, str]:
    """The paths of `get_job` and `job_events` with a stand-in for the job id, looked up once per app:
    what `request.url_for` gives, without searching every route twice per 202 (that search was 9 % of
    the API's time per 202 under a burst)."""
    paths = getattr(app.state, "job_paths", None)
    if paths is None:
        paths = app.state.job_paths = tuple(app.url_path_for(name, job_id=_JOB_ID) for name in ("get_job", "job_events"))
    return paths


class AcceptedDocument(BaseModel):
    document_id: str
    filename: str
    sha256: str
    same_content: list[str] = Field([], description="Other files of the request with the very same bytes: one "
                                                    "document, listed under the first file's name")
    indexed_as: str | None = Field(None, description="A duplicate upload only, once the document's own ingestion "
                                                     "has started: the file name it is indexed under, when it is "
                                                     "not this one (citations, search hits and listings show it)")


class DocumentsAccepted(Accepted):
    duplicate: bool = Field(description="The same files are already indexed or being indexed: no new work")
    documents: list[AcceptedDocument]


class DocumentRemovalAccepted(Accepted):
    duplicate: bool = Field(description="A removal of this document is already under way: its job answers")
    document_id: str
    filename: str
    collection: str


class AgentAccepted(Accepted):
    duplicate: bool = Field(description="The same Idempotency-Key was sent before: its job answers, nothing new runs")


class ChatAccepted(Accepted):
    session_id: str
    turn: int | None = Field(description="null until the session numbers the turn (see the job)")
    duplicate: bool = Field(description="The same Idempotency-Key was sent before in this session")


# -- jobs ----------------------------------------------------------------------------------------

class JobError(BaseModel):
    message: str
    type: str
    details: Any = None


class JobSummary(BaseModel):
    job_id: str
    kind: JobKind
    status: JobStatus
    created_at: Timestamp
    updated_at: Timestamp
    collection: str | None


NEXT_CURSOR = ("Send as `cursor` (with the same filters) for the next page; null on the last page. Running jobs "
               "come first, newest started first, then ended ones, newest ended first")


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: str | None = Field(description=NEXT_CURSOR)
    query: str = Field(description="The Temporal visibility query that listed them")


class TurnAhead(BaseModel):
    """An earlier turn of the same session, still open: a queued turn runs after it."""
    job_id: str
    turn: int | None
    status: JobStatus


class JobView(BaseModel):
    """A job; `turn`, `waiting_for` and `operator_decisions` are left out where they do not apply."""
    job_id: str
    kind: JobKind
    status: JobStatus
    created_at: Timestamp
    updated_at: Timestamp
    turn: int | None = Field(None, description="Chat jobs only: the turn's number in its session")
    steps: list[StepState]
    result: Any = Field(description="The job's result once completed, else null")
    answer: dict | None = Field(None, description="Chat turns not completed: the answer (`answer`, `citations`) "
                                "once shown on the event stream, while the turn's summary and entities still run "
                                "(or after it was cancelled or failed in them); the session's next turn has it")
    error: JobError | None
    operator_decisions: list[OperatorDecision] = Field(
        [], description="Only when an operator retried or discarded the job")
    trace_id: str | None = Field(None, description="The trace of the request that started the job (W3C trace id)")
    links: dict[str, str] = Field({}, description="`temporal_ui`: the job's page in the Temporal Web UI")
    waiting_for: list[TurnAhead] = Field(
        [], description="Queued chat turns only: the earlier turns of its session still without their answer, "
                        "which answer first (one whose summary and entities still run is not listed: it holds "
                        "nothing). One that is dead-lettered or waits for a review holds the later ones until "
                        "it is decided, retried, discarded or cancelled")
    progress_unreadable: bool = Field(
        False, description="Only when true: no worker answered for the job just now (none runs, or all are busy), "
                           "so `steps`, `answer` and `operator_decisions` are unknown (they read empty), not "
                           "none; ask again")

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler):
        data = handler(self)
        if not self.progress_unreadable:
            data.pop("progress_unreadable", None)
        if self.kind != "chat":
            data.pop("turn", None)
        if not self.waiting_for:
            data.pop("waiting_for", None)
        if not self.operator_decisions:
            data.pop("operator_decisions", None)
        if self.answer is None:
            data.pop("answer", None)
        return data


class OperatorResult(BaseModel):
    job_id: str
    action: Literal["retry", "discard"]
    steps: list[str]


class ReviewResult(BaseModel):
    job_id: str
    accepted: bool
    decision: str


class ReviewItem(PendingReview):
    """What a job waits on a person for (`POST /v1/jobs/{job_id}/review` decides it)."""
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    job_id: str
    workflow_id: str
    kind: JobKind


class ReviewList(BaseModel):
    reviews: list[ReviewItem]
    unreadable: list[str] = Field(default_factory=list, description=(
        "Jobs waiting for a review whose request could not be read just now (no worker answered the "
        "query in time): they still wait; ask again"))
    more: bool = Field(False, description="More jobs may wait for a review than this list holds (500 of each kind: "
                                          "waiting for review, and chat turns parked while their review waits); "
                                          "decide some and ask again")


# -- documents, chats, health --------------------------------------------------------------------

# A document's status is its ingestion job's, with "completed" read as "indexed"; "removing" while a
# DELETE of it runs.
DocumentStatus = Literal["queued", "running", "waiting_review", "indexed", "failed", "dead_lettered", "cancelled",
                         "removing"]


class DocumentView(BaseModel):
    document_id: str | None
    filename: str | None
    collection: str | None
    status: DocumentStatus
    chunks: int | None
    pages: int | None
    job_id: str
    created_at: Timestamp
    updated_at: Timestamp
    error: str | None = Field(None, description="Why the document failed (failed), or why it waits for an "
                                                "operator (dead_lettered)")


class DocumentList(BaseModel):
    documents: list[DocumentView]
    next_cursor: str | None = Field(description=NEXT_CURSOR.replace("jobs", "ingestions"))


class TurnView(BaseModel):
    """A turn of a session; `model` is left out until the turn is completed. `answer` and `citations` are there
    once the turn has shown its answer, before its summary and entities end."""
    turn: int | None
    job_id: str
    message: str | None
    status: JobStatus
    created_at: Timestamp
    answer: str | None
    citations: list[Citation]
    error: str | None
    model: str | None = Field(None, description="Completed turns only: the model that answered")
    written_by_reviewer: bool = Field(False, description="Completed turns only: a reviewer replaced the model's "
                                      "answer with this text (`model` names the model whose answer it replaced)")

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler):
        data = handler(self)
        if self.status != "completed":
            data.pop("model", None)
            data.pop("written_by_reviewer", None)
        return data


class SessionView(BaseModel):
    session_id: str
    turns: list[TurnView] = Field(description="In the order they were asked: the page's turns (running ones, then "
                                              "the latest ended, page by page), sorted by turn number")
    next_cursor: str | None = Field(description="The session's other turns, if any: " + NEXT_CURSOR)


class QueuePollers(BaseModel):
    kind: str
    workflow_pollers: int | None = None
    activity_pollers: int
    backlog: int = 0  # tasks waiting there (workflow and activity): a queue nobody polls is down only with some


class Component(BaseModel):
    status: Literal["up", "down", "unknown"]
    address: str | None = None
    pollers: int | None = None
    task_queue: str | None = None
    # Workers polling each task queue of the deployment (roles: temporal/queues.py), by queue name.
    queues: dict[str, QueuePollers] | None = None
    reason: str | None = None
    error: str | None = None  # the error as raised (for an operator key only, like addresses and pollers)



class Health(BaseModel):
    status: Literal["up", "degraded", "down"]
    components: dict[str, Component]


class Liveness(BaseModel):
    status: Literal["up"] = "up"


class JobEvent(BaseModel):
    """A CloudEvents 1.0 event, the `data` of each Server-Sent Event of `GET /v1/jobs/{job_id}/events`."""
    specversion: Literal["1.0"]
    id: str
    source: str
    type: str = Field(examples=["ragline.step.completed", "ragline.job.completed", "ragline.answer.delta"])
    time: str
    subject: str
    datacontenttype: Literal["application/json"]
    data: dict[str, Any]
    traceparent: str | None = Field(None, description="The W3C trace context of the request that started the job "
                                    "(CloudEvents distributed-tracing extension); absent on `ragline.job.running`, "
                                    "which the API adds and is not part of the job's stream")


# -- evaluations -------------------------------------------------------------------------------------

from ragline.evaluation import EvaluationReport  # noqa: E402


class EvaluationAccepted(BaseModel):
    job_id: str
    collection: str
    questions: int
    duplicate: bool = Field(description="The same Idempotency-Key was sent before: its job answers, nothing new runs")
    status_url: str
    events_url: str


class EvaluationView(BaseModel):
    job_id: str
    collection: str | None = None
    status: JobStatus
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # The report once the job completed; its per-question `outcomes` only from GET /v1/evaluations/{id}.
    report: EvaluationReport | None = None
    withheld: list[str] = Field([], description=(
        '["answer"]: with RAGLINE_REVIEW_UNSUPPORTED_ANSWERS, the outcomes\' answers (the model\'s, reviewed by '
        "nobody) are for reviewer keys only; a member key reads them without"))


class EvaluationList(BaseModel):
    evaluations: list[EvaluationView]
    next_cursor: str | None = Field(description=NEXT_CURSOR.replace("jobs", "evaluations"))
    query: str = Field(description="The Temporal visibility query that listed them")
