"""The skeleton every job workflow shares.

A job workflow subclasses `JobWorkflow` and writes only its DAG: `await self.step(Activities.method,
input)` runs one activity as one step, with its timeout and retry policy taken from the policy file by
the activity's name. The base class gives every job the same parts, each with one job:

  JobEvents    the CloudEvents stream the API relays as SSE        (workflows/events.py)
  StepLog      the steps `GET /v1/jobs/{id}` shows                 (workflows/steps.py)
  DeadLetters  parking an exhausted step for an operator           (workflows/dead_letters.py)
  Reviews      waiting for a person's decision                     (workflows/review.py)
  RunningSlot  the tenant's cap on jobs running at once            (workflows/slot.py)

and the same surface: the `progress` query, the `retry`/`discard` Updates, the RaglineStatus search
attribute, and `run_job`, which emits accepted/completed/failed and turns an exhausted or rejected
step into a failed job with a reason a person can act on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError, ApplicationError, ChildWorkflowError, FailureError, RetryState, is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from activities.jobs import JobActivities
    from models.jobs import (
        JobProgress, JobStatus, OperatorAck, OperatorRequest, PolicyAttemptsInput, StreamedStepResult,
    )
    from models.tenancy import ChildWaiting, SlotGrant
    from ragline import metrics
    from temporal import policies
    from temporal import search_attributes as sa
    from temporal.errors import failed_attempt
    from workflows.dead_letters import DeadLetters, ParkWithdrawn
    from workflows.events import HOLD_PATCH, TERMINAL_EVENT_STANDS_PATCH, JobEvents
    from workflows.failures import exhausted_retries, failure_reason, failure_type
    from workflows.review import Reviews
    from workflows.slot import RunningSlot
    from workflows.steps import StepLog
    from workflows.waits import SIGNAL as WAITS_SIGNAL
    from workflows.waits import PersonWaits

R = TypeVar("R")
# What a step or a wait ends with, short of GeneratorExit: a coroutine the garbage collector closes after its
# worker let go of the workflow must run no workflow code (it may wake on another workflow's thread).
ENDED = (Exception, asyncio.CancelledError)
# A step that waits for its activity to take a cancel (WAIT_CANCELLATION_COMPLETED) and then sees it fail with a
# retryable error is not retried by the server once the job's cancel was asked (retry state CANCEL_REQUESTED):
# that is the job's cancel, and the job ends cancelled. Earlier histories replay ending failed.
CANCEL_REQUESTED_IS_CANCEL_PATCH = "step-failed-after-cancel-request-is-cancelled"
# A step that used up its retries counts the attempts its history says (the failure's attempt, or the policy
# read once by a local activity), not the policy file as the replaying worker reads it: an agent's budget
# branches on the count, and an edited file made running agents fail to replay. Earlier histories replay
# with the file's count.
ATTEMPTS_FROM_HISTORY_PATCH = "exhausted-attempts-from-history"
# A step whose fallback (a chat answer's lighter model) refuses for good parks with both reasons. Earlier
# jobs failed with the fallback's refusal.
FALLBACK_REFUSED_PARKS_PATCH = "fallback-refused-parks-the-step"
# An optional step (a chat answer's cache write) that used up its retries is left failed and the job goes on.
# Earlier jobs parked it for an operator: an answered turn dead-lettered by its cache, holding its session's
# later turns. Asked only when such a step has used up its retries: other jobs' histories carry no marker.
OPTIONAL_STEP_SKIPPED_PATCH = "optional-step-left-failed-when-its-retries-are-used-up"


class _FellBack(Exception):
    """A step's retries ran out and its fallback answered instead."""

    def __init__(self, result: Any) -> None:
        super().__init__("fell back")
        self.result = result


class _LeftFailed(Exception):
    """An optional step's retries ran out: the job goes on without it."""


class JobWorkflow:
    # The activities this job runs, shown as pending steps from the start (in DAG order).
    PLANNED: ClassVar[tuple[Callable[..., Any], ...]] = ()
    # Whether the job's steps wait for its running slot (workflows/slot.py). False: the job's own code
    # awaits `running_slot()` before the steps the cap is for, and runs cheap ones meanwhile.
    SLOT_BEFORE_WORK: ClassVar[bool] = True
    # Whether the job's accepted and step events wait for the next event a person waits for
    # (workflows/events.py): for a short job whose person waits for its answer, not for its steps.
    HOLD_STEP_EVENTS: ClassVar[bool] = False

    def __init__(self) -> None:
        self.events = JobEvents()
        self.steps = StepLog(self.events, self._sync_status, [policies.activity_name(a) for a in self.PLANNED])
        self.slot = RunningSlot(self.events, self._sync_status, on_held=self.slot_waited)
        self._calls_running = 0
        self.waits = PersonWaits(self.slot, within_parent=lambda: not self.takes_slot(),
                                 busy=lambda: self._calls_running, on_child=self._child_waiting)
        self.dead_letters = DeadLetters(self.events, self._sync_status, on_park=lambda: self._count("dead_lettered"),
                                        while_waiting=self.waits.own, stopping=lambda: self.stopping())
        self.reviews = Reviews(self.events, self._sync_status, while_waiting=self.waits.own)
        self._running = False
        self._status: JobStatus = "queued"
        self._slot_asked: asyncio.Future[None] | None = None

    # -- the run skeleton ------------------------------------------------------------------------
    async def run_job(self, work: Callable[[], Awaitable[R]], accepted: dict[str, Any],
                      ready: Callable[[], Awaitable[None]] | None = None) -> R:
        """Run the job's DAG between its `accepted` and its terminal event: once `ready` (a job's own
        precondition, like a chat turn's go) and a running slot of its tenant are there."""
        self.events.hold_steps = self.HOLD_STEP_EVENTS and workflow.patched(HOLD_PATCH)
        self.events.emit("ragline.job.accepted", accepted)
        let_go = False
        try:
            if ready is not None:
                await ready()
            self._slot_asked = asyncio.ensure_future(self.slot.acquire(takes_slot=self.takes_slot()))
            if self.SLOT_BEFORE_WORK:
                await self.running_slot()
            result = await work()
            self._count("completed")
            await self.events.close("ragline.job.completed", self.shown_result(result))
            return result
        except asyncio.CancelledError:
            await self._cancelled()
            raise
        except (ActivityError, ChildWorkflowError, ApplicationError) as exc:
            if is_cancelled_exception(exc):  # a step cut short by the job's cancellation
                await self._cancelled()
                raise
            self.steps.skip_pending()
            reason = failure_reason(exc)
            self._count("failed")
            await self.events.close("ragline.job.failed", {"error": reason})
            # The step already exhausted its retry policy (or failed non-retryably): fail the job with
            # the reason, and do not retry the workflow itself.
            details = exc.details if isinstance(exc, ApplicationError) else ()
            if extra := self.failure_details():
                first = details[0] if details and isinstance(details[0], dict) else {}
                details = ({**first, **extra}, *details[1:]) if first else (extra, *details)
            raise ApplicationError(reason, *details, type=failure_type(exc), non_retryable=True) from exc
        except GeneratorExit:
            let_go = True  # as ENDED says: a closed coroutine gives nothing back (its worker let go of the run)
            raise
        finally:
            if not let_go:
                try:
                    await self.slot.release()
                except asyncio.CancelledError:
                    # A cancel that comes once the terminal event is out changes nothing (workflows/events.py);
                    # the gate's sweep frees a slot whose release it stopped.
                    if not workflow.patched(TERMINAL_EVENT_STANDS_PATCH):
                        raise

    def stopping(self) -> bool:
        """Whether the job was told to stop and finish with what it has (agents): a parked step is withdrawn."""
        return False

    def failure_details(self) -> dict[str, Any]:
        """What the job's failure carries for whoever started it, beside the reason (its first detail)."""
        return {}

    def shown_result(self, result: Any) -> dict[str, Any]:
        """The result as `ragline.job.completed` carries it to every key of the tenant."""
        return result.model_dump(mode="json")

    async def _cancelled(self) -> None:
        """Cancelled (Web UI, CLI): the job ends as `cancelled`, its stream with `ragline.job.cancelled`."""
        self.steps.cancel_running()
        self.steps.skip_pending()
        self._count("cancelled")
        await self.events.close("ragline.job.cancelled", {}, linger=False)

    async def running_slot(self) -> None:
        """Until the job holds its tenant's running slot (asked for as the job began)."""
        if self._slot_asked is not None:
            await self._slot_asked

    def slot_waited(self, waited: timedelta) -> None:
        """The job holds its tenant's running slot, after asking for it (in line at a full gate) this long."""

    def takes_slot(self) -> bool:
        """Whether this job counts against its tenant's running jobs (workflows/slot.py): only a job
        no other job started; the others run within their parent's slot."""
        return workflow.info().parent is None

    def _count(self, status: str) -> None:
        """ragline_jobs_total{kind,status}: through the workflow's meter, which skips replays."""
        info = workflow.info()
        kind = info.typed_search_attributes.get(sa.JOB_KIND) or info.workflow_type
        metrics.job_finished(workflow.metric_meter(), kind, status)

    def _child_waiting(self, child_id: str, step: str | None, waiting: bool) -> None:
        """A person following this job learns that a job it waits on waits for a person (or no longer)."""
        if step is not None:
            self.steps.child_waits(step, child_id, waiting)
        self.events.emit("ragline.job.child_waiting", {"job_id": child_id, "waiting": waiting}, in_signal=True)

    def begin(self) -> None:
        """The job is under way even before its first step (it waits on children, say)."""
        self._running = True
        self._sync_status()

    async def step(self, activity: Callable[..., Any], arg: Any, *, name: str | None = None,
                   on_exhausted: Callable[[], Awaitable[Any]] | None = None,
                   resume: Callable[[Any, ActivityError], Any] | None = None, optional: bool = False,
                   **options: Any) -> Any:
        """One activity as one step of the DAG: started, retried by its policy, parked when its retries
        are used up, completed with the attempt that succeeded. With `on_exhausted`, used-up retries on a
        retryable error run that instead (a fallback), which parks in turn if it fails. An `optional` step
        whose retries are used up is left failed, and returns None (one that fails for good fails the job).
        The events an activity that publishes into the job's stream left unsent (`StreamedStepResult`, the
        answer's last deltas) are published before the step shows as completed. With `resume`, an operator's
        retry runs the activity with what it makes of the argument and the failure that parked it (the
        progress it carried). `options` as `call` takes them."""
        name = name or policies.activity_name(activity)
        self.steps.start(name)
        try:
            result = await self.call(activity, arg, step=name, on_exhausted=on_exhausted, resume=resume,
                                     optional=optional, **options)
        except _FellBack as fell_back:
            return fell_back.result
        except _LeftFailed:
            return None
        if isinstance(result, StreamedStepResult):
            self.events.publish_unsent(result.unsent_events)
        self.steps.complete(name, attempts=getattr(result, "attempt", 1))
        return result

    async def beside(self, work: Awaitable[R]) -> asyncio.Task[R]:
        """Start work that runs beside what the job does next, and return once its first step is under way:
        a wait for a person that begins next sees the job busy, and lends the running slot only when no step
        runs (they ended, or wait for an operator)."""
        task = asyncio.ensure_future(work)
        before = self._calls_running
        await workflow.wait_condition(lambda: self._calls_running > before or task.done())
        return task

    @staticmethod
    async def together(*work: Awaitable[Any]) -> list[Any]:
        """Run steps beside each other; when one fails for good, the others are stopped (and have ended)
        before its failure goes on: nothing of a failed job keeps calling a model or waiting for an operator."""
        tasks = [asyncio.ensure_future(w) for w in work]
        try:
            return await asyncio.gather(*tasks)
        except ENDED:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    @staticmethod
    async def stop(task: asyncio.Task[Any]) -> None:
        """Cancel work run `beside` (its steps' activities are asked to stop) and wait for the task to end.
        How it ended no longer matters (a step of it may have failed for good already): the caller's reason
        for stopping it is the job's."""
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, FailureError):
            pass

    async def call(self, activity: Callable[..., Any], arg: Any, *, step: str,
                   on_exhausted: Callable[[], Awaitable[Any]] | None = None,
                   resume: Callable[[Any, ActivityError], Any] | None = None, optional: bool = False,
                   **options: Any) -> Any:
        """Run an activity under its policy; for steps whose bookkeeping the caller does (batches).
        When the activity exhausts its retries the job parks until an operator retries or discards it.
        `options` go to the activity's start beside its policy's (a cancellation type a patch decides)."""
        name = policies.activity_name(activity)
        rounds = 0  # times an operator retried this call after it had used up its attempts
        made = 0  # the attempts of those rounds
        while True:
            await self.slot.take_back()  # lent while a person decided
            self._calls_running += 1  # a parked call does not count: it waits for a person
            self.waits.recheck()
            self.steps.scheduled(step, name)
            try:
                let_go = False
                try:
                    return await policies.execute(activity, arg, **options)
                except GeneratorExit:
                    let_go = True  # as ENDED says: no parent is told anything from a closed coroutine
                    raise
                finally:
                    if not let_go:
                        self._calls_running -= 1
                        self.waits.recheck()
            except ActivityError as exc:
                if is_cancelled_exception(exc):  # the job was cancelled: the step stopped, it did not fail
                    self.steps.cancel(step)
                    raise
                cancel_asked = exc.retry_state == RetryState.CANCEL_REQUESTED
                if cancel_asked and workflow.patched(CANCEL_REQUESTED_IS_CANCEL_PATCH):
                    self.steps.cancel(step)
                    raise asyncio.CancelledError(f"cancelled while {step} ended: {failure_reason(exc)}") from exc
                reason = failure_reason(exc)
                if not exhausted_retries(exc):
                    self.steps.fail(step, reason, attempts=failed_attempt(exc))
                    raise
                # Each round used up the policy's attempts (a batch step counts its own call's, not its siblings').
                if workflow.patched(ATTEMPTS_FROM_HISTORY_PATCH):
                    try:
                        made += await self._attempts_made(name, exc)
                    except ENDED as stopped:  # cancelled meanwhile (a sibling step failed), say
                        if isinstance(stopped, asyncio.CancelledError) or is_cancelled_exception(stopped):
                            self.steps.cancel(step)
                        else:
                            self.steps.fail(step, reason)
                        raise
                    attempts = made
                else:
                    attempts = (rounds + 1) * policies.policy(name).retry.maximum_attempts
                self.steps.failed_attempts(step, attempts=attempts, error=reason)
                if optional and workflow.patched(OPTIONAL_STEP_SKIPPED_PATCH):
                    self.steps.fail(step, reason)
                    workflow.logger.warning("optional step %s left failed: %s", step, reason)
                    raise _LeftFailed(step)
                if on_exhausted is not None:
                    self.steps.fail(step, reason)
                    try:
                        answered = await on_exhausted()
                    except ActivityError as refused:
                        # The fallback refused for good (a smaller context, a wrong key, none on this worker):
                        # the step parks with both reasons, as it would have without a fallback. Earlier jobs
                        # failed with the fallback's refusal, though an operator could have retried the step.
                        if is_cancelled_exception(refused) or not workflow.patched(FALLBACK_REFUSED_PARKS_PATCH):
                            raise
                        reason = f"{reason}; the fallback refused too: {failure_reason(refused)}"
                    else:
                        raise _FellBack(answered)
                if self.dead_letters.withdrawing():  # told to stop before it came to this: it does not park
                    self.steps.cancel(step)
                    raise ParkWithdrawn(step)
                self.steps.park(step)
                try:
                    await self.dead_letters.park(step, attempts=attempts, reason=reason,
                                                 error_type=failure_type(exc))
                except ApplicationError:
                    self.steps.fail(step, reason)
                    raise
                except (asyncio.CancelledError, ParkWithdrawn):
                    self.steps.cancel(step)  # stopped while parked
                    raise
                self.steps.resume(step)
                if resume is not None:
                    arg = resume(arg, exc)
                rounds += 1

    @staticmethod
    async def _attempts_made(name: str, exc: ActivityError) -> int:
        """The attempts of a call that used up its retries: its failure says on which it failed (our
        activities' errors do); a timeout does not, and the policy's count is read once, into the history."""
        if (attempt := failed_attempt(exc)) is not None:
            return attempt
        return (await policies.execute_local(JobActivities.policy_attempts, PolicyAttemptsInput(activity=name))
                ).maximum_attempts

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> JobStatus:
        if self.dead_letters.parked:
            return "dead_lettered"
        if self.reviews.pending is not None:
            return "waiting_review"
        if self.slot.waiting:
            return "queued"
        return "running" if self._running or self.steps.started else "queued"

    def _sync_status(self) -> None:
        status = self.status()
        if status == self._status:
            return
        self._status = status
        self.upsert_attributes(sa.JOB_STATUS.value_set(status))

    def upsert_attributes(self, *updates: Any) -> None:
        """Set Ragline search attributes. Jobs started by Ragline carry them; one started by hand (or on a
        server without them, like the time-skipping test server) keeps its state in the query only."""
        if workflow.info().typed_search_attributes.get(sa.JOB_KIND) is not None:
            workflow.upsert_search_attributes(list(updates))

    # -- what every job answers --------------------------------------------------------------------
    @workflow.signal
    def slot_update(self, standing: SlotGrant) -> None:
        self.slot.heard(standing)

    @workflow.signal(name=WAITS_SIGNAL)
    def child_waiting(self, news: ChildWaiting) -> None:
        self.waits.heard(news)

    @workflow.query
    def progress(self) -> JobProgress:
        return JobProgress(status=self.status(), steps=self.steps.view(),
                           dead_letters=list(self.dead_letters.parked.values()),
                           decisions=list(self.dead_letters.decisions), reviews=list(self.reviews.history),
                           answer=self.shown_answer())

    def shown_answer(self) -> dict | None:
        """What the job has shown as its answer before its end (chat turns)."""
        return None

    @workflow.update(name="retry")
    def retry(self, req: OperatorRequest) -> OperatorAck:
        return self.dead_letters.retry(req)

    @retry.validator
    def _validate_retry(self, req: OperatorRequest) -> None:
        self.dead_letters.validate(self.status())

    @workflow.update(name="discard")
    def discard(self, req: OperatorRequest) -> OperatorAck:
        return self.dead_letters.discard(req)

    @discard.validator
    def _validate_discard(self, req: OperatorRequest) -> None:
        self.dead_letters.validate(self.status())
