"""Workflow inputs, results and progress views."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

StepStatus = Literal["pending", "running", "completed", "failed", "skipped"]


class StepState(BaseModel):
    name: str
    status: StepStatus = "pending"
    attempts: int = 0
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    detail: str | None = None


class DeadLetter(BaseModel):
    step: str
    attempts: int
    error: str
    error_type: str | None = None
    parked_at: datetime
    expires_at: datetime


class OperatorRequest(BaseModel):
    """Payload of the `retry` and `discard` Updates. Every field is optional: `{}` is valid."""
    operator: str | None = None
    reason: str | None = None


class OperatorAck(BaseModel):
    action: str
    steps: list[str]


class JobProgress(BaseModel):
    status: str
    steps: list[StepState]
    dead_letters: list[DeadLetter] = []
    decisions: list[dict] = []


class DocumentInput(BaseModel):
    document_id: str
    collection: str
    filename: str
    blob_ref: str
    sha256: str
    size: int
    kind: Literal["pdf", "text"]
    password: str | None = None


class DocumentOutcome(BaseModel):
    document_id: str
    filename: str = ""
    status: Literal["indexed", "failed"]
    job_id: str
    pages: int = 0
    chunks: int = 0
    error: str | None = None

    @classmethod
    def failed_from(cls, workflow_id: str, error: str, filename: str = "") -> "DocumentOutcome":
        return cls(document_id=workflow_id.removeprefix("doc-"), filename=filename, status="failed",
                   job_id=workflow_id, error=error)


class IngestInput(BaseModel):
    collection: str
    documents: list[DocumentInput]


class IngestResult(BaseModel):
    collection: str
    indexed: int
    failed: int
    documents: list[DocumentOutcome]


def document_workflow_id(document_id: str) -> str:
    return f"doc-{document_id}"


# -- chat ----------------------------------------------------------------------------------------

class TurnRequest(BaseModel):
    message: str
    collection: str = "default"
    top_k: int = 5
    idempotency_key: str | None = None
    require_review: bool = False
    review_unsupported: bool = False
    review_timeout_seconds: float = 86400


class TurnAccepted(BaseModel):
    job_id: str
    turn: int
    duplicate: bool = False


class TurnInput(BaseModel):
    session_id: str
    turn: int
    message: str
    collection: str
    top_k: int
    # Hold the answer for a person: always, or only when nothing in the documents supports it.
    require_review: bool = False
    review_unsupported: bool = False
    review_timeout_seconds: float = 86400


class TurnContext(BaseModel):
    """Sent by the session when it is this turn's go: the recent turns to answer in context."""
    history: list[dict] = []


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class TurnResult(BaseModel):
    session_id: str
    turn: int
    question: str
    answer: str
    citations: list[dict]
    summary: str
    entities: list[dict]
    model: str
    usage: Usage
    warnings: list[str] = []
    review: dict | None = None


class PendingTurn(BaseModel):
    turn: int
    job_id: str
    message: str


class SessionState(BaseModel):
    session_id: str
    next_turn: int = 1
    # Idempotency-Key -> accepted turn, oldest first (bounded).
    keys: dict[str, TurnAccepted] = {}
    pending: list[PendingTurn] = []
    history: list[dict] = []


def session_workflow_id(session_id: str) -> str:
    return f"session-{session_id}"


def turn_job_id(session_id: str, turn: int) -> str:
    return f"chat-{session_id}-{turn}"


# -- human review and agents -----------------------------------------------------------------------

class ReviewDecision(BaseModel):
    """Payload of the `review` Update and Signal (Web UI, CLI, or POST /v1/jobs/{id}/review)."""
    decision: Literal["approve", "reject", "revise"]
    reviewer: str
    comment: str = ""
    instructions: str | None = None
    extra_depth: int = 0
    extra_budget: dict[str, float] = {}
    # For held chat answers: the text to release instead of the model's.
    answer: str | None = None


class ReviewRequest(BaseModel):
    reason: str
    detail: str
    proposed_action: dict
    goal: str
    depth: int
    requested_at: datetime
    expires_at: datetime


class ReviewAck(BaseModel):
    accepted: bool
    decision: str


class Budget(BaseModel):
    max_llm_calls: int = 50
    max_tokens: int = 200_000
    max_seconds: float = 3600


class Spend(BaseModel):
    llm_calls: int = 0
    tokens: int = 0

    def add(self, other: "Spend") -> None:
        self.llm_calls += other.llm_calls
        self.tokens += other.tokens


class AgentInput(BaseModel):
    goal: str
    collection: str = "default"
    depth: int = 0
    max_depth: int = 3
    budget: Budget = Budget()
    # Wall-clock end of the whole tree's time budget (set by the root).
    deadline: datetime | None = None
    ancestors: list[str] = []
    review_timeout_seconds: float = 86400


class AgentNode(BaseModel):
    goal: str
    depth: int
    job_id: str
    status: str
    answer: str = ""
    children: list["AgentNode"] = []


class AgentResult(BaseModel):
    answer: str
    status: Literal["finished", "stopped"]
    tree: AgentNode
    llm_calls: int
    tokens: int
    decisions: list[dict] = []


def agent_workflow_id(parent_id: str, index: int) -> str:
    return f"{parent_id}.{index}"
