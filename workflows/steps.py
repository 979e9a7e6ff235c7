"""Step bookkeeping and live events shared by every job workflow.

`Steps` keeps what `GET /v1/jobs/{id}` shows as `steps` (a query), keeps the RaglineStatus search
attribute in step with it, and publishes every change as a CloudEvents 1.0 object on the job's
durable stream (`temporalio.contrib.workflow_streams`), which the API relays as Server-Sent Events.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from temporal import search_attributes as sa
    from workflows.models import JobProgress, StepState

T = TypeVar("T")
EVENTS_TOPIC = "events"


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


class Steps:
    def __init__(self, stream: WorkflowStream, names: list[str]) -> None:
        self._stream = stream
        self._events = stream.topic(EVENTS_TOPIC)
        self._steps = {name: StepState(name=name) for name in names}
        self._published = 0
        self.status = "queued"

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
            "data": data or {},
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

    async def run(self, name: str, awaitable: Awaitable[T]) -> T:
        """Await one activity as the step `name`, recording start, end, attempts and failure."""
        self.start(name)
        try:
            result = await awaitable
        except (ActivityError, ChildWorkflowError) as exc:
            self.fail(name, failure_reason(exc))
            raise
        self.complete(name, attempts=getattr(result, "attempt", 1))
        return result

    def view(self) -> JobProgress:
        return JobProgress(status=self.status, steps=[s.model_copy() for s in self._steps.values()])
