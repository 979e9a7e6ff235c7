"""Step bookkeeping, dead-lettering and live events shared by every job workflow.

`Steps` keeps what `GET /v1/jobs/{id}` shows as `steps` (a query), keeps the RaglineStatus search
attribute in step with it, and publishes every change as a CloudEvents 1.0 object on the job's
durable stream (`temporalio.contrib.workflow_streams`), which the API relays as Server-Sent Events.

A step whose activity exhausts its retry policy on a retryable error is not dropped: the job parks
as `dead_lettered` until an operator sends the `retry` or `discard` Update (API, Web UI or CLI), or
until the dead-letter TTL ends it as failed. Retry resumes at the parked step; completed steps stay
done. Non-retryable failures (bad input) fail the job at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import (
    ActivityError, ApplicationError, ChildWorkflowError, RetryState, TimeoutError,
)

with workflow.unsafe.imports_passed_through():
    from temporal import policies
    from temporal import search_attributes as sa
    from workflows.models import DeadLetter, JobProgress, OperatorAck, OperatorRequest, StepState

T = TypeVar("T")
EVENTS_TOPIC = "events"
_EXHAUSTED = (RetryState.MAXIMUM_ATTEMPTS_REACHED, RetryState.TIMEOUT)


def failure_reason(exc: BaseException) -> str:
    """The innermost human-readable reason of an activity or child failure."""
    while isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, TimeoutError):
        kind = exc.type.name.lower().replace("_", "-") if exc.type else "timeout"
        return f"timed out ({kind})"
    if isinstance(exc, ApplicationError):
        return exc.message
    return str(exc) or type(exc).__name__


def failure_type(exc: BaseException) -> str | None:
    while isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause is not None:
        exc = exc.cause
    return exc.type if isinstance(exc, ApplicationError) else type(exc).__name__


def exhausted_retries(exc: ActivityError) -> bool:
    """True when a retryable error used up the retry policy (as opposed to a non-retryable one)."""
    cause = exc.cause
    if isinstance(cause, ApplicationError) and cause.non_retryable:
        return False
    return exc.retry_state in _EXHAUSTED


class Steps:
    def __init__(self, stream: WorkflowStream, names: list[str]) -> None:
        self._stream = stream
        self._events = stream.topic(EVENTS_TOPIC)
        self._steps = {name: StepState(name=name) for name in names}
        self._published = 0
        self.status = "queued"
        self.parked: dict[str, DeadLetter] = {}
        self._releases = 0
        self._discard: OperatorRequest | None = None
        self.decisions: list[dict[str, Any]] = []
        # Merged into every event's data (an agent adds its depth).
        self.context: dict[str, Any] = {}

    # -- events ---------------------------------------------------------------------------------
    def emit(self, type_: str, data: dict[str, Any] | None = None) -> None:
        info = workflow.info()
        self._published += 1
        self._events.publish({
            "specversion": "1.0",
            "id": f"{info.workflow_id}/{info.run_id[:8]}/{self._published}",
            "source": f"ragline/{info.workflow_type}",
            "type": type_,
            "time": workflow.now().isoformat(),
            "subject": info.workflow_id,
            "datacontenttype": "application/json",
            "data": {**self.context, **(data or {})},
        })

    async def finish(self, type_: str, data: dict[str, Any] | None = None) -> None:
        """Publish the terminal event, release subscribers and let handlers drain before the run ends."""
        self.emit(type_, data)
        self._stream.detach_pollers()
        await workflow.wait_condition(workflow.all_handlers_finished)

    # -- status and steps ------------------------------------------------------------------------
    def set_status(self, status: str) -> None:
        if status != self.status:
            self.status = status
            # Jobs started by Ragline carry its search attributes; one started by hand (or on a server
            # without them, like the time-skipping test server) keeps its status in the query only.
            if workflow.info().typed_search_attributes.get(sa.JOB_KIND) is not None:
                workflow.upsert_search_attributes([sa.JOB_STATUS.value_set(status)])

    def add(self, name: str) -> None:
        self._steps.setdefault(name, StepState(name=name))

    def start(self, name: str, detail: str | None = None) -> None:
        self.add(name)
        step = self._steps[name]
        if detail is not None:
            step.detail = detail
        if step.status != "running":
            step.status, step.started_at, step.error = "running", workflow.now(), None
            self.emit("ragline.step.started", {"step": name, "detail": step.detail})
        if not self.parked:
            self.set_status("running")

    def progress(self, name: str, *, attempts: int, detail: str) -> None:
        step = self._steps[name]
        step.attempts = max(step.attempts, attempts)
        step.detail = detail
        self.emit("ragline.step.progress", {"step": name, "detail": detail})

    def complete(self, name: str, *, attempts: int = 1, detail: str | None = None) -> None:
        step = self._steps[name]
        step.status, step.finished_at = "completed", workflow.now()
        step.started_at = step.started_at or step.finished_at
        step.attempts = max(step.attempts, attempts)
        step.error = None
        if detail is not None:
            step.detail = detail
        self.emit("ragline.step.completed", {"step": name, "attempts": step.attempts, "detail": step.detail})

    def fail(self, name: str, error: str) -> None:
        step = self._steps[name]
        step.status, step.finished_at, step.error = "failed", workflow.now(), error
        self.emit("ragline.step.failed", {"step": name, "error": error})

    def skip_pending(self) -> None:
        for step in self._steps.values():
            if step.status == "pending":
                step.status = "skipped"

    async def call(self, name: str, activity: Callable[[], Awaitable[T]]) -> T:
        """Run an activity (a factory, so it can run again), parking the job when it exhausts its retries."""
        while True:
            try:
                return await activity()
            except ActivityError as exc:
                if not exhausted_retries(exc):
                    self.fail(name, failure_reason(exc))
                    raise
                await self._park(name, exc)

    async def run(self, name: str, activity: Callable[[], Awaitable[T]]) -> T:
        """One activity as the step `name`: start, attempts, dead-lettering, completion."""
        self.start(name)
        result = await self.call(name, activity)
        self.complete(name, attempts=getattr(result, "attempt", 1))
        return result

    # -- dead letters ----------------------------------------------------------------------------
    async def _park(self, name: str, exc: ActivityError) -> None:
        ttl = policies.dead_letter_ttl()
        reason = failure_reason(exc)
        attempts = policies.policy(name).retry.maximum_attempts if name in policies.KNOWN_ACTIVITIES else 0
        step = self._steps.get(name)
        if step is not None:
            step.error = reason
            step.attempts = max(step.attempts, attempts)
        letter = DeadLetter(step=name, attempts=attempts, error=reason, error_type=failure_type(exc),
                            parked_at=workflow.now(), expires_at=workflow.now() + ttl)
        self.parked[name] = letter
        self.set_status("dead_lettered")
        self.emit("ragline.job.dead_lettered", letter.model_dump(mode="json"))
        release = self._releases
        try:
            await workflow.wait_condition(lambda: self._releases != release or self._discard is not None,
                                          timeout=ttl)
        except asyncio.TimeoutError:
            self.parked.pop(name, None)
            self.fail(name, reason)
            raise ApplicationError(
                f"dead-lettered {_human(ttl)} ago and nobody decided (RAGLINE_DEAD_LETTER_TTL); "
                f"step {name} last failed with: {reason}", type="DeadLetterExpired", non_retryable=True) from None
        self.parked.pop(name, None)
        if self._discard is not None:
            self.fail(name, reason)
            who = self._discard.operator or "an operator"
            why = f": {self._discard.reason}" if self._discard.reason else ""
            raise ApplicationError(f"discarded by {who}{why} (step {name} last failed with: {reason})",
                                   type="Discarded", non_retryable=True)
        self.set_status("running")
        self.emit("ragline.step.retrying", {"step": name, "by": "operator"})

    def validate_operator(self) -> None:
        if not self.parked:
            raise ApplicationError(f"the job is {self.status}, not dead_lettered: nothing to retry or discard",
                                   type="NotDeadLettered")

    def operator_retry(self, req: OperatorRequest) -> OperatorAck:
        steps = sorted(self.parked)
        self._record("retry", req, steps)
        self._releases += 1
        return OperatorAck(action="retry", steps=steps)

    def operator_discard(self, req: OperatorRequest) -> OperatorAck:
        steps = sorted(self.parked)
        self._record("discard", req, steps)
        self._discard = req
        return OperatorAck(action="discard", steps=steps)

    def _record(self, action: str, req: OperatorRequest, steps: list[str]) -> None:
        self.decisions.append({"action": action, "operator": req.operator, "reason": req.reason,
                               "steps": steps, "at": workflow.now().isoformat()})

    def view(self) -> JobProgress:
        return JobProgress(status=self.status, steps=[s.model_copy() for s in self._steps.values()],
                           dead_letters=list(self.parked.values()), decisions=list(self.decisions))


def _human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


class OperatorHandlers:
    """Updates every job workflow offers an operator (API, Temporal Web UI, `temporal` CLI)."""

    steps: Steps

    @workflow.update(name="retry")
    def retry(self, req: OperatorRequest) -> OperatorAck:
        return self.steps.operator_retry(req)

    @retry.validator
    def _validate_retry(self, req: OperatorRequest) -> None:
        self.steps.validate_operator()

    @workflow.update(name="discard")
    def discard(self, req: OperatorRequest) -> OperatorAck:
        return self.steps.operator_discard(req)

    @discard.validator
    def _validate_discard(self, req: OperatorRequest) -> None:
        self.steps.validate_operator()
