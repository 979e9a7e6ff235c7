"""Evaluation jobs: golden questions (in the blob store) run against a collection's retrieval pipeline."""

from __future__ import annotations

from pydantic import BaseModel, Field

from models.jobs import StepResult
from models.tenancy import DEFAULT_TENANT
from ragline.evaluation import EvaluationReport


class EvaluationInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    collection: str
    # The JSONL body, claim-checked: only its blob reference travels through workflow history.
    questions_ref: str
    questions: int
    k: int = Field(5, ge=1, le=20)
    # Also generate answers (model calls) and score their accuracy and citations.
    answers: bool = False
    # Outcomes an earlier round of the step saved (blob references), handed on when an operator retries it
    # after its attempts were used up: its answers are not asked for (and paid for) again.
    checkpoints: list[str] = Field(default_factory=list)


class EvaluationOutput(StepResult):
    # The report without per-question outcomes; the full report is the blob at report_ref.
    report: EvaluationReport
    report_ref: str
