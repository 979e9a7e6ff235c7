"""What every job has: status, kind, steps, dead letters and the decisions people took on it."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field

from models.inputs import STRICT_INPUT
from models.review import ReviewRecord

JobStatus = Literal["queued", "running", "waiting_review", "completed", "failed", "dead_lettered", "cancelled"]
JobKind = Literal["ingest", "ingest_document", "remove_document", "chat", "agent", "evaluation"]
StepStatus = Literal["pending", "waiting", "running", "completed", "failed", "skipped", "dead_lettered", "cancelled"]

JOB_KINDS: tuple[str, ...] = get_args(JobKind)
OPEN_STATUSES: tuple[str, ...] = ("queued", "running", "waiting_review", "dead_lettered")
# A collection name, wherever one is given.
# Not starting with "_": Ragline's own Qdrant collections are named so (`ragline__meta` holds every
# collection's version; a collection "_meta" would have been it).
COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
# The topic of a job's event stream (workflow_streams) that the API relays as Server-Sent Events.
EVENTS_TOPIC = "events"
# The memo field of a job started by a keyed request: a digest of that request, against which the same
# Idempotency-Key sent again is checked (api/idempotency.py).
REQUEST_MEMO = "request"
# The memo field of a chat turn that told its session its answer while its summary and entities still run:
# it holds no later turn of the session any more.
ANSWERED_MEMO = "answered"
# The memo field of a chat turn whose answer waits for its reviewer while its summary and entities run: GET
# /v1/reviews lists it even while one of them is parked (the job then shows as dead_lettered).
REVIEW_PENDING_MEMO = "review_pending"


class StepResult(BaseModel):
    """Base of every activity output: which attempt produced it, so a job shows retries afterwards."""
    attempt: int = 1


class PolicyAttemptsInput(BaseModel):
    activity: str  # an activity's name in the policy file


class PolicyAttempts(StepResult):
    """How many attempts the policy file gives the activity (`max_attempts`)."""
    maximum_attempts: int


class StreamedStepResult(StepResult):
    """The output of an activity that publishes events into its job's stream (answer deltas): the last
    batch comes back with the result, and the job publishes it (one signal, one stream read fewer)."""
    unsent_events: list[dict[str, Any]] = []


class StepState(BaseModel):
    name: str
    status: StepStatus = "pending"
    attempts: int = 0
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    detail: str | None = None
    # The activity the step runs, once asked for (a step named apart from it: `plan 2` runs agent_plan): how
    # the server's view of a retrying activity finds its step.
    activity: str | None = None


class DeadLetter(BaseModel):
    step: str
    attempts: int
    error: str
    error_type: str | None = None
    parked_at: datetime
    expires_at: datetime


class OperatorRequest(BaseModel):
    """Payload of the `retry` and `discard` Updates. Every field is optional: `{}` is valid."""
    model_config = STRICT_INPUT
    operator: str | None = Field(None, max_length=200)
    reason: str | None = Field(None, max_length=2000)


class OperatorAck(BaseModel):
    action: Literal["retry", "discard"]
    steps: list[str]


class OperatorDecision(BaseModel):
    """An operator's retry or discard, as recorded with the job."""
    action: Literal["retry", "discard"]
    operator: str | None = None
    reason: str | None = None
    steps: list[str]
    at: datetime


class JobProgress(BaseModel):
    """The `progress` query of every job workflow."""
    status: JobStatus
    steps: list[StepState]
    dead_letters: list[DeadLetter] = []
    decisions: list[OperatorDecision] = []
    reviews: list[ReviewRecord] = []
    # A chat turn's answer as the person was shown it (`ragline.answer.completed`: answer, citations), from
    # then on: its summary and entities may still run, and the session's next turn already has it.
    answer: dict | None = None
