"""A job's steps as `GET /v1/jobs/{id}` shows them: status, attempts, times, error, detail.
Each change is also published as a `ragline.step.*` event."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from models.jobs import StepState
    from workflows.events import JobEvents


class StepLog:
    def __init__(self, events: JobEvents, on_change: Callable[[], None], planned: Iterable[str] = ()) -> None:
        self._events = events
        self._on_change = on_change
        self._steps = {name: StepState(name=name) for name in planned}
        self._attempts_before: dict[str, int] = {}  # attempts made before an operator's retry
        self._parked: dict[str, int] = {}  # calls of a step (a document's batches) waiting for an operator
        self._detail_before_wait: dict[str, str | None] = {}
        self._scheduled: set[str] = set()  # steps whose activity was asked for (an attempt was made or is due)
        self._again: dict[str, str] = {}  # set-aside steps: what they say once they run again

    @property
    def started(self) -> bool:
        return any(s.status != "pending" for s in self._steps.values())

    def start(self, name: str, detail: str | None = None) -> None:
        step = self._steps.setdefault(name, StepState(name=name))
        detail = self._again.pop(name, detail)
        if detail is not None:
            step.detail = detail
        if step.status != "running" and not self._parked.get(name):
            step.status, step.started_at, step.error = "running", workflow.now(), None
            self._events.emit("ragline.step.started", {"step": name, "detail": step.detail})
            self._on_change()

    def progress(self, name: str, *, attempts: int, detail: str) -> None:
        step = self._steps[name]
        step.attempts = max(step.attempts, attempts)
        step.detail = detail
        self._events.emit("ragline.step.progress", {"step": name, "detail": detail})

    def complete(self, name: str, *, attempts: int = 1, detail: str | None = None) -> None:
        step = self._steps[name]
        self._waited(name)
        step.status, step.finished_at = "completed", workflow.now()
        step.started_at = step.started_at or step.finished_at
        step.attempts = max(step.attempts, self._attempts_before.get(name, 0) + attempts)
        step.error = None
        if detail is not None:
            step.detail = detail
        self._events.emit("ragline.step.completed", {"step": name, "attempts": step.attempts, "detail": step.detail})

    def note(self, name: str, detail: str) -> None:
        """What a completed step came to, for whoever reads the job (a plan whose tool call went wrong)."""
        if name in self._steps:
            self._steps[name].detail = detail[:500]

    def failed_attempts(self, name: str, *, attempts: int, error: str) -> None:
        """The step's retries are used up; it waits (dead-lettered) rather than failing. `attempts`: all
        of them so far, those before an operator's retry included."""
        step = self._steps.get(name)
        if step is not None:
            step.error = error
            step.attempts = max(step.attempts, attempts)

    def park(self, name: str) -> None:
        """The step waits for an operator (its error and attempts stay shown), for as long as any call of
        it does: a sibling batch that starts meanwhile does not show it running."""
        if (step := self._steps.get(name)) is not None:
            step.status = "dead_lettered"
            self._parked[name] = self._parked.get(name, 0) + 1

    def resume(self, name: str) -> None:
        """An operator retries the parked step: it runs again, its attempts counted on from where they were
        (while another call of it still waits for an operator, it shows as waiting)."""
        self._parked[name] = max(0, self._parked.get(name, 0) - 1)
        if (step := self._steps.get(name)) is not None:
            if not self._parked[name]:
                step.status, step.error = "running", None
            self._attempts_before[name] = step.attempts

    def scheduled(self, name: str, activity: str | None = None) -> None:
        """The step's activity is asked for now (not only waiting for its job's running slot)."""
        self._scheduled.add(name)
        if activity is not None and (step := self._steps.get(name)) is not None:
            step.activity = activity

    def child_waits(self, name: str, child_id: str, waiting: bool) -> None:
        """The job this step runs as a child (an upload's document, a sub-agent) waits for a person, or
        no longer: the step, which shows running, says where to look."""
        step = self._steps.get(name)
        if step is None or step.status != "running":
            return
        if waiting:
            self._detail_before_wait.setdefault(name, step.detail)
            step.detail = f"its job {child_id} waits for a person (an operator or a reviewer)"
        else:
            self._waited(name)

    def _waited(self, name: str) -> None:
        """The step's child no longer waits for a person (or the step ended): its detail is its own again."""
        if name in self._detail_before_wait:
            self._steps[name].detail = self._detail_before_wait.pop(name)

    def fail(self, name: str, error: str, *, attempts: int | None = None) -> None:
        """`attempts`: the attempt it failed on, when its failure says (temporal.errors.failed_attempt)."""
        step = self._steps.setdefault(name, StepState(name=name))
        self._waited(name)
        step.status, step.finished_at, step.error = "failed", workflow.now(), error
        if step.started_at is not None:  # it ran, and failed: at least the attempt that failed counts
            step.attempts = max(step.attempts, self._attempts_before.get(name, 0) + (attempts or 1))
        self._events.emit("ragline.step.failed", {"step": name, "error": error})

    def cancel(self, name: str) -> None:
        """The job was cancelled while the step ran (its `ragline.job.cancelled` event says so), or
        another call of it failed and this one was stopped (a batch): then the step stays failed."""
        step = self._steps.setdefault(name, StepState(name=name))
        self._waited(name)
        if step.status == "running" and name in self._scheduled:  # its attempt was under way: it counts
            step.attempts = max(step.attempts, 1)
        if step.status != "failed":
            step.status, step.finished_at = "cancelled", workflow.now()

    def set_aside(self, name: str, detail: str, again: str) -> None:
        """The step was stopped to run again later (a chat turn's summary, while a later turn's answer uses
        the model): it waits, saying why (`detail`), and runs again saying so (`again`)."""
        step = self._steps.setdefault(name, StepState(name=name))
        step.status, step.detail, step.finished_at = "waiting", detail, None
        self._again[name] = again
        self._events.emit("ragline.step.progress", {"step": name, "detail": detail})
        self._on_change()

    def cancel_running(self, *names: str) -> None:
        """Steps of many calls (a document's batches) that were stopped before all of them had ended; with
        no names, every step still running (the job was cancelled: a step the cancel reached before its
        activity began, while it waited for the running slot, say, would otherwise show running for ever)."""
        for name in names or list(self._steps):
            if name in self._steps and self._steps[name].status in ("running", "waiting"):  # (waiting: set aside)
                self.cancel(name)

    def skip_pending(self) -> None:
        for step in self._steps.values():
            if step.status == "pending":
                step.status = "skipped"

    def attempts(self, name: str) -> int:
        """The attempts a step made, those before an operator's retry included."""
        step = self._steps.get(name)
        return step.attempts if step is not None else 0

    def view(self) -> list[StepState]:
        return [s.model_copy() for s in self._steps.values()]
