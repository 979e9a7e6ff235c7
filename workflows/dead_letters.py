"""Dead letters: a step whose activity exhausts its retry policy on a retryable error parks the job
as `dead_lettered` until an operator sends the `retry` or `discard` Update (API, Web UI or CLI), or
until the dead-letter TTL ends it as failed. Retry resumes at the parked step; completed steps stay
done. Non-retryable failures (bad input) never park: they fail the job at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from models.jobs import DeadLetter, OperatorAck, OperatorDecision, OperatorRequest
    from temporal import policies
    from workflows.events import JobEvents

# Histories from before a step stopped while parked was taken off the parked list replay keeping it there.
UNPARK_ON_CANCEL_PATCH = "parked-step-unparked-when-stopped"
# Two calls of one step parked (two batches of a document) are two dead letters: one that goes on no longer
# takes the other's off the list, which left it waiting unseen (no retry reached it). Earlier histories
# replay with one entry per step.
PER_CALL_PATCH = "dead-letter-per-parked-call"
# A parked step of a job told to stop (an agent, when a reviewer rejected something elsewhere in its tree) is
# withdrawn: the job finishes with what it has instead of waiting for an operator, whose retry would only
# pay for work nobody wants. Earlier jobs stayed parked.
WITHDRAWN_WHEN_STOPPING_PATCH = "parked-step-withdrawn-when-told-to-stop"


class ParkWithdrawn(Exception):
    """The job was told to stop while a step of it waited for an operator: the step no longer waits."""


class DeadLetters:
    def __init__(self, events: JobEvents, on_change: Callable[[], None],
                 on_park: Callable[[], None] = lambda: None,
                 while_waiting: Callable[[], AbstractAsyncContextManager] = nullcontext,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        """`stopping`: the job was told to stop (it finishes with what it has): what is parked is withdrawn."""
        self._events = events
        self._stopping = stopping
        self._withdraw_on: bool | None = None  # the patch's answer, asked once the job is told to stop
        self._on_change = on_change
        self._on_park = on_park
        self._while_waiting = while_waiting
        self.parked: dict[str, DeadLetter] = {}  # by parked call
        self._calls = 0
        self.decisions: list[OperatorDecision] = []
        self._releases = 0
        self._discard: OperatorRequest | None = None
        self._decided: set[str] = set()  # parked calls an operator has decided on, until they go on

    async def park(self, step: str, *, attempts: int, reason: str, error_type: str | None) -> None:
        """Wait for an operator. Returns when they retry; raises a non-retryable ApplicationError when
        they discard or nobody decides within the TTL, and ParkWithdrawn when the job is told to stop first."""
        ttl = policies.dead_letter_ttl()
        now = workflow.now()
        letter = DeadLetter(step=step, attempts=attempts, error=reason, error_type=error_type,
                            parked_at=now, expires_at=now + ttl)
        self._calls += 1
        key = f"{step}#{self._calls}" if workflow.patched(PER_CALL_PATCH) else step
        self.parked[key] = letter
        self._on_change()
        self._on_park()
        self._events.emit("ragline.job.dead_lettered", letter.model_dump(mode="json"))
        release = self._releases
        # The job's running slot is lent while it waits; taken again only when it is to retry.
        async with self._while_waiting():
            try:
                await workflow.wait_condition(
                    lambda: self._releases != release or self._discard is not None or self.withdrawing(), timeout=ttl)
            except asyncio.CancelledError:
                # Stopped while parked (a chat turn's summary, when its reviewer rejects the answer): nothing
                # is left for an operator. Earlier jobs kept the step listed as parked.
                if workflow.patched(UNPARK_ON_CANCEL_PATCH):
                    self._unpark(key)
                raise
            except asyncio.TimeoutError:
                self._unpark(key)
                raise ApplicationError(
                    f"dead-lettered {_human(ttl)} ago and nobody decided (RAGLINE_DEAD_LETTER_TTL); "
                    f"step {step} last failed with: {reason}", type="DeadLetterExpired", non_retryable=True) from None
            self._unpark(key)
            if self._discard is not None:
                who = self._discard.operator or "an operator"
                why = f": {self._discard.reason}" if self._discard.reason else ""
                raise ApplicationError(f"discarded by {who}{why} (step {step} last failed with: {reason})",
                                       type="Discarded", non_retryable=True)
            if self._releases == release:  # neither retried nor discarded: withdrawn
                self._events.emit("ragline.job.dead_letter_withdrawn", {"step": step, "reason": "the job was told "
                                  "to stop: it finishes with what it has"})
                raise ParkWithdrawn(step)
        self._events.emit("ragline.step.retrying", {"step": step, "by": "operator"})

    def withdrawing(self) -> bool:
        """Whether a step that parks now, or is parked, no longer waits: the job was told to stop."""
        if not self._stopping():
            return False
        if self._withdraw_on is None:
            self._withdraw_on = workflow.patched(WITHDRAWN_WHEN_STOPPING_PATCH)
        return self._withdraw_on

    def _unpark(self, key: str) -> None:
        self.parked.pop(key, None)
        self._decided.discard(key)
        self._on_change()

    # -- what an operator may do -------------------------------------------------------------------
    def validate(self, status: str) -> None:
        if not self.parked:
            raise ApplicationError(f"the job is {status}, not dead_lettered: nothing to retry or discard",
                                   type="NotDeadLettered")
        # Told in the same workflow task: a retry would be accepted and not run. (A job told to stop under
        # earlier code, whose step stayed parked, still takes an operator's decision: it is its way out.)
        if self._stopping() and self._withdraw_on is not False:
            raise ApplicationError("the job was told to stop: its parked steps are withdrawn, and it finishes with "
                                   "what it has", type="NotDeadLettered")
        if self._decided >= set(self.parked):  # a decision sent at the same moment was taken first
            last = self.decisions[-1]
            raise ApplicationError(f"an operator already decided: {last.action} by {last.operator or 'an operator'}",
                                   type="NotDeadLettered")

    def retry(self, req: OperatorRequest) -> OperatorAck:
        self._releases += 1
        return self._record("retry", req)

    def discard(self, req: OperatorRequest) -> OperatorAck:
        self._discard = req
        return self._record("discard", req)

    def _record(self, action, req: OperatorRequest) -> OperatorAck:
        steps = sorted({letter.step for letter in self.parked.values()})
        self._decided.update(self.parked)
        self.decisions.append(OperatorDecision(action=action, operator=req.operator, reason=req.reason,
                                               steps=steps, at=workflow.now()))
        return OperatorAck(action=action, steps=steps)


def _human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
