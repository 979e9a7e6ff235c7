"""Human review: what a job asks a person, and what the person decides."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, Field

from models.inputs import STRICT_INPUT, Int

# What one review may grant: finite, not negative, and within what the workflow's arithmetic takes
# (an infinite token budget cannot be counted down, and would fail the job on every replay).
MAX_EXTRA_DEPTH = 10
MAX_EXTRA_BUDGET = 1e9
# int | float: a count given as 20 is shown as 20, not 20.0 (seconds may be fractions).
Extension = Annotated[int | float, Field(ge=0, le=MAX_EXTRA_BUDGET, allow_inf_nan=False)]



class ReviewDecision(BaseModel):
    """Payload of the `review` Update and Signal (Web UI, CLI, or POST /v1/jobs/{id}/review)."""
    model_config = STRICT_INPUT
    decision: Literal["approve", "reject", "revise"]
    reviewer: str = Field(max_length=200)
    comment: str = Field("", max_length=4000)
    instructions: str | None = Field(None, max_length=4000)
    extra_depth: Int = Field(0, ge=0, le=MAX_EXTRA_DEPTH)
    extra_budget: dict[str, Extension] = {}
    # For held chat answers: the text to release instead of the model's.
    answer: str | None = Field(None, max_length=20_000)
    # The review this decides, by its `requested_at` (GET /v1/reviews, the `review_request` query): a
    # decision sent twice, or late, is refused instead of deciding a review the person has not seen.
    requested_at: AwareDatetime | None = Field(None, strict=False)
    # Set by the API: the name of the key that decided (`reviewer` is what the person typed). Whatever a
    # caller sends here is replaced; a decision from the Web UI or the CLI has none.
    key: str | None = Field(None, max_length=200, description="set by the API to the deciding key's name; "
                            "what a request sends here is replaced")


class ReviewRequest(BaseModel):
    reason: str
    detail: str
    proposed_action: dict[str, Any]
    goal: str
    depth: int
    requested_at: datetime
    expires_at: datetime
    # Keys of `proposed_action` for reviewers only (a held chat answer): the job's events and its record
    # of the review leave them out, and so does what a member key reads (GET /v1/reviews).
    withheld: list[str] = []

    def shown_to_all(self) -> dict[str, Any]:
        """`proposed_action` without what is withheld."""
        return without(self.proposed_action, self.withheld)


def without(action: dict[str, Any], withheld: list[str]) -> dict[str, Any]:
    return {key: value for key, value in action.items() if key not in withheld}


class RejectedInput(BaseModel):
    """A `review` Signal whose payload failed validation (Temporal would otherwise drop it silently)."""
    payload: Any
    error: str
    at: datetime

    def shown_to_all(self, withheld: list[str]) -> RejectedInput:
        """Without what only reviewers may read (a reviewer's revised answer, sent malformed). A payload that is
        not an object (a decision quoted once too often arrives as a string) may hold it anywhere: none of it."""
        if not withheld:
            return self
        if not isinstance(self.payload, dict):
            return self.model_copy(update={"payload": None})
        return self.model_copy(update={"payload": without(self.payload, withheld)})


class PendingReview(ReviewRequest):
    """The `review_request` query: what waits for a person, and bad inputs sent so far."""
    rejected_inputs: list[RejectedInput] = []

    def as_a_member_sees(self) -> dict[str, Any]:
        """The fields a member key reads: the proposal and the rejected inputs without what is withheld."""
        return {"proposed_action": self.shown_to_all(),
                "rejected_inputs": [r.shown_to_all(self.withheld) for r in self.rejected_inputs]}


class ReviewRecord(BaseModel):
    """One decided review, as kept in a job's result."""
    reason: str
    detail: str
    proposed_action: dict[str, Any]
    depth: int
    decision: Literal["approve", "reject", "revise"]
    reviewer: str
    key: str | None = None  # the API key that decided, by name (ReviewDecision.key)
    comment: str = ""
    instructions: str | None = None
    extra_depth: int = 0
    extra_budget: dict[str, int | float] = {}
    decided_at: datetime
    # Keys of `proposed_action` for reviewers only (ReviewRequest.withheld): kept here for the audit, left
    # out of the job's events and of what a member key reads.
    withheld: list[str] = []


class ReviewAck(BaseModel):
    accepted: bool
    decision: str
