"""Human review: a job that needs a person stops spending, shows up in `GET /v1/reviews`
(RaglineStatus=waiting_review), and waits for a `review` decision or the review timeout.

The decision arrives as the `review` Update (validated: a bad payload is rejected back to the sender,
in the Web UI's dialog too) or as the `review` Signal (a permissive payload; input that fails
validation is recorded where a person sees it, since a signal that cannot be decoded would otherwise
be dropped silently).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from models.review import PendingReview, RejectedInput, ReviewAck, ReviewDecision, ReviewRecord, ReviewRequest
    from workflows.events import JobEvents

BUDGET_KEYS = {"max_llm_calls", "max_tokens", "max_seconds"}
# A review whose wait is cancelled (the job cancelled, or a chat turn failing beside it) is withdrawn at once:
# a decision sent then is refused instead of accepted and ignored. Earlier jobs kept it pending to their end.
WITHDRAWN_PATCH = "review-withdrawn-when-its-wait-stops"
# A second `review` signal that comes before the job has acted on the first is refused (recorded as rejected
# input). Signal handlers run on replay: histories from before took the last one.
SECOND_DECISION_PATCH = "review-second-decision-refused"
# A `review` signal that comes once the review is being withdrawn (its job was told to stop, in the same
# workflow task) is refused (recorded as rejected input). Earlier histories replay taking it, and ignoring it.
WITHDRAWING_REFUSES_PATCH = "review-being-withdrawn-refuses-decisions"


class ReviewWithdrawn(Exception):
    """The job stopped waiting for the review before anyone decided (its `withdraw_when` came true)."""


class Reviews:
    def __init__(self, events: JobEvents, on_change: Callable[[], None],
                 while_waiting: Callable[[], AbstractAsyncContextManager] = nullcontext) -> None:
        self._events = events
        self._on_change = on_change
        self._while_waiting = while_waiting
        self.pending: ReviewRequest | None = None
        self.decision: ReviewDecision | None = None
        self.history: list[ReviewRecord] = []
        self.rejected_inputs: list[RejectedInput] = []
        self._withdrawing: Callable[[], bool] = lambda: False  # the pending review's `withdraw_when`
        # A job whose work a reviewer revises by giving its text (a chat answer), not by instructions.
        self.revise_needs_answer = False

    async def ask(self, *, reason: str, detail: str, proposed_action: dict, goal: str, depth: int,
                  timeout: timedelta, withheld: tuple[str, ...] = (),
                  withdraw_when: Callable[[], bool] = lambda: False) -> ReviewDecision:
        """`withheld`: keys of `proposed_action` only reviewers may read (workflows/chat.py: a held answer).
        `withdraw_when`: the job no longer needs the decision once it is true (unless one came first): the
        review is withdrawn and ReviewWithdrawn raised."""
        now = workflow.now()
        self.pending = ReviewRequest(reason=reason, detail=detail, proposed_action=proposed_action, goal=goal,
                                     depth=depth, requested_at=now, expires_at=now + timeout, withheld=list(withheld))
        shown = self.pending.shown_to_all()
        self.decision = None
        self.rejected_inputs = []  # bad input sent for an earlier review is not this one's
        self._withdrawing = withdraw_when
        self._on_change()
        # The job's stream is read by any key of the tenant: what only reviewers may read stays out of it.
        self._events.emit("ragline.review.requested", {**self.pending.model_dump(mode="json"), "proposed_action": shown})
        async with self._while_waiting():  # the job's running slot is lent meanwhile
            try:
                await workflow.wait_condition(lambda: self.decision is not None or withdraw_when(),
                                              timeout=timeout)
                decision = self.decision
                if decision is None:
                    self._withdraw(reason)
                    raise ReviewWithdrawn()
            except TimeoutError:
                decision = self.decision = ReviewDecision(decision="reject", reviewer="system",
                                                          comment="review timed out")
            except asyncio.CancelledError:
                if workflow.patched(WITHDRAWN_PATCH):
                    self._withdraw(reason)
                raise
        record = ReviewRecord(reason=reason, detail=detail, proposed_action=proposed_action, depth=depth,
                              decision=decision.decision, reviewer=decision.reviewer, key=decision.key,
                              comment=decision.comment, instructions=decision.instructions,
                              extra_depth=decision.extra_depth, extra_budget=decision.extra_budget,
                              decided_at=workflow.now(), withheld=list(withheld))
        self.history.append(record)
        self.pending = None
        self._on_change()
        self._events.emit("ragline.review.decided", {**record.model_dump(mode="json"), "proposed_action": shown})
        return decision

    def _withdraw(self, reason: str) -> None:
        withdrawn, self.pending = self.pending, None
        self._on_change()
        self._events.emit("ragline.review.withdrawn", {"requested_at": withdrawn.requested_at.isoformat(),
                                                       "reason": reason})

    def view(self) -> PendingReview | None:
        if self.pending is None:
            return None
        return PendingReview(**self.pending.model_dump(), rejected_inputs=self.rejected_inputs)

    def parse(self, payload: Any) -> ReviewDecision:
        """A decision from a permissive payload, with a message a person can act on when it is wrong."""
        if isinstance(payload, ReviewDecision):
            return payload
        try:
            return ReviewDecision.model_validate(payload)
        except ValidationError as exc:
            raise ApplicationError(f"invalid review: {validation_summary(exc)}", type="InvalidReview") from None

    def validate(self, decision: ReviewDecision, *, refuse_second: bool = True,
                 refuse_withdrawing: bool = True) -> None:
        """`refuse_second`: refuse a decision that comes after one the job has not acted on yet (sent at the
        same moment, or the review timed out meanwhile). `refuse_withdrawing`: refuse one that comes after the
        job was told to stop (in the same workflow task): it would be accepted and ignored (a rejection is not)."""
        if self.pending is None:
            raise ApplicationError("nothing is waiting for review on this job", type="NotWaitingForReview")
        # A rejection still counts (the job stops either way, and the rejected action is not proposed again).
        if refuse_withdrawing and self.decision is None and decision.decision != "reject" and self._withdrawing():
            raise ApplicationError("this review is being withdrawn: the job was told to stop, and finishes with "
                                   "what it has", type="NotWaitingForReview")
        if refuse_second and self.decision is not None:
            raise ApplicationError(f"this review was already decided ({self.decision.decision} by "
                                   f"{self.decision.reviewer})", type="NotWaitingForReview")
        if decision.requested_at is not None and decision.requested_at != self.pending.requested_at:
            raise ApplicationError(
                f"requested_at {decision.requested_at.isoformat()} is not the review this job waits on (requested "
                f"at {self.pending.requested_at.isoformat()}): that one was decided or withdrawn, or never was",
                type="NotWaitingForReview")
        if decision.extra_depth < 0 or any(v < 0 for v in decision.extra_budget.values()):
            raise ApplicationError("extensions cannot be negative", type="InvalidReview")
        unknown = set(decision.extra_budget) - BUDGET_KEYS
        if unknown:
            raise ApplicationError(f"unknown budget key(s): {', '.join(sorted(unknown))}", type="InvalidReview")
        if not decision.reviewer.strip():
            raise ApplicationError("reviewer is required", type="InvalidReview")
        if decision.decision == "revise" and self.revise_needs_answer and not (decision.answer or "").strip():
            raise ApplicationError("revise needs the revised text in `answer` (approve releases the answer as it is)",
                                   type="InvalidReview")

    def accept(self, decision: ReviewDecision) -> ReviewAck:
        self.decision = decision
        return ReviewAck(accepted=True, decision=decision.decision)

    def accept_signal(self, payload: Any) -> None:
        try:
            decision = self.parse(payload)
            second = self.decision is not None and workflow.patched(SECOND_DECISION_PATCH)
            withdrawing = (self.pending is not None and decision.decision != "reject" and self._withdrawing()
                           and workflow.patched(WITHDRAWING_REFUSES_PATCH))
            self.validate(decision, refuse_second=second, refuse_withdrawing=withdrawing)
        except (ApplicationError, TypeError) as exc:
            message = exc.message if isinstance(exc, ApplicationError) else str(exc)
            entry = RejectedInput(payload=payload, error=message, at=workflow.now())
            self.rejected_inputs.append(entry)
            # The stream is read by any key of the tenant: what only reviewers may read stays out of it
            # (of the review still waiting, or of the one just decided).
            withheld = self.pending.withheld if self.pending else self.history[-1].withheld if self.history else []
            shown = entry.shown_to_all(withheld)
            self._events.emit("ragline.review.rejected_input", shown.model_dump(mode="json"))
            workflow.logger.warning("review signal rejected: %s", message)
            return
        self.decision = decision


def validation_summary(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'payload'}: {e['msg']}" for e in exc.errors())


class ReviewHandlers:
    """The `review` Update and Signal, and the `review_request` query, for jobs that may ask a person."""

    reviews: Reviews

    # The payload is taken as plain JSON and checked by the validator, so a person who types a wrong
    # decision in the Web UI reads what is wrong instead of "Failed decoding arguments".
    @workflow.update(name="review")
    def review(self, payload: dict[str, Any]) -> ReviewAck:
        return self.reviews.accept(self.reviews.parse(payload))

    @review.validator
    def _validate_review(self, payload: dict[str, Any]) -> None:
        self.reviews.validate(self.reviews.parse(payload))

    @workflow.signal(name="review")
    def review_signal(self, payload: Any) -> None:
        self.reviews.accept_signal(payload)

    @workflow.query(name="review_request")
    def review_request(self) -> PendingReview | None:
        return self.reviews.view()
