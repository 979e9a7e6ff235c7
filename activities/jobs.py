"""Activities of the job machinery: waits on other jobs through Temporal itself (the worker's client),
and what a step's policy says."""

from __future__ import annotations

import asyncio
import time

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError
from temporalio.service import RPCError, RPCStatusCode

from activities.heartbeats import heartbeating

from models.chat import (
    FINAL_ANSWER_DETAIL, AwaitTurnInput, SessionLeft, SessionRun, SessionRunning, SessionState, TurnOutcome, TurnResult,
)
from models.ingest import (
    CANCELLED, CANCELLED_WITH_ITS_UPLOAD, AwaitDocumentInput, DocumentOutcome, ForgetDocumentInput,
    ForgetDocumentOutput, NewerRun, RemovalConfirmed,
)
from models.jobs import PolicyAttempts, PolicyAttemptsInput, StepResult
from ragline.errors import InputError
from temporal import policies
from temporal.errors import failure_detail, translate_errors


class JobActivities:
    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn
    @translate_errors
    async def await_document(self, req: AwaitDocumentInput) -> DocumentOutcome:
        """Outcome of a document ingestion another job started (same bytes, same collection)."""
        handle = self.client.get_workflow_handle(req.workflow_id, result_type=DocumentOutcome)
        try:
            async with heartbeating():
                outcome = await handle.result()
        except WorkflowFailureError as exc:
            cause = exc.cause
            if isinstance(cause, CancelledError):  # a person cancelled that document's job, or its upload
                by_its_upload = await self._cancelled_by_parent(handle)
                return DocumentOutcome.failed_from(req.workflow_id, CANCELLED_WITH_ITS_UPLOAD if by_its_upload
                                                   else CANCELLED)
            return DocumentOutcome.failed_from(req.workflow_id, getattr(cause, "message", None) or str(cause),
                                               error_type=getattr(cause, "type", None) or type(cause).__name__)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            return self._removed(req)  # its job was deleted meanwhile: a removal ended
        if req.removal_id and outcome.status == "indexed" and await self._removed_since(req):
            return self._removed(req)
        return outcome

    @staticmethod
    async def _cancelled_by_parent(handle: WorkflowHandle) -> bool:
        """Whether the run's cancel came from its parent (the upload that started it was cancelled), not from
        a person cancelling the document's own job (API, CLI, Web UI)."""
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_execution_cancel_requested_event_attributes"):
                asked = event.workflow_execution_cancel_requested_event_attributes
                return bool(asked.external_workflow_execution.workflow_id)
        return False

    async def _removed_since(self, req: AwaitDocumentInput) -> bool:
        """A removal asked for after the indexed run ended took it out (the run stays known until the
        removal ends). One still running is waited for: ingested anew before it ends, the document's new
        chunks could be among the ones it removes."""
        removal_job = self.client.get_workflow_handle(req.removal_id)
        try:
            run = await self.client.get_workflow_handle(req.workflow_id).describe()
            removal = await removal_job.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return not await self._known(req.workflow_id)  # no removal, or the run itself is gone
            raise
        if run.close_time is None or removal.start_time < run.close_time:
            return False  # a removal of an earlier run
        if removal.status == WorkflowExecutionStatus.RUNNING:
            activity.heartbeat({"waiting_for": req.removal_id})
            async with heartbeating():
                try:
                    await removal_job.result()
                except (WorkflowFailureError, RPCError):
                    pass  # it did not complete: read below
            removal = await removal_job.describe()
        return removal.status == WorkflowExecutionStatus.COMPLETED

    @staticmethod
    def _removed(req: AwaitDocumentInput) -> DocumentOutcome:
        return DocumentOutcome(document_id=req.workflow_id.rsplit("doc-", 1)[-1], status="removed",
                               job_id=req.workflow_id)

    @activity.defn
    @translate_errors
    async def await_turn(self, req: AwaitTurnInput) -> TurnOutcome:
        """Outcome of a chat turn whose job an earlier run of its session started (continue-as-new)."""
        handle = self.client.get_workflow_handle(req.workflow_id, result_type=TurnResult)
        try:
            async with heartbeating():
                result = await handle.result()
        except WorkflowFailureError as exc:  # an answer it had shown before failing stays in the history
            return TurnOutcome(answer=failure_detail(exc.cause, FINAL_ANSWER_DETAIL))
        except RPCError as exc:
            # Gone (deleted by hand, or past the retention while no worker ran): it has ended, with no answer
            # to read. Retried, the session and every later turn of it would wait on it for ever.
            if exc.status == RPCStatusCode.NOT_FOUND:
                return TurnOutcome(answer=None)
            raise
        return TurnOutcome(answer=result.answer if result.answered else None)

    @activity.defn
    @translate_errors
    async def confirm_removal(self, req: ForgetDocumentInput) -> RemovalConfirmed:
        """The run the removal was asked for is still the document's latest: nobody uploaded the same bytes
        again since (their job would index what the removal takes out). Returns when: a run that starts
        after it (an upload queued before the DELETE) writes chunks the removal leaves alone."""
        confirmed = time.time()
        try:
            latest = await self.client.get_workflow_handle(req.workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return RemovalConfirmed(attempt=activity.info().attempt, at=confirmed)  # forgotten already, or gone
            raise
        if latest.run_id != req.run_id:  # (no run asked for: the job had gone, and is back)
            raise InputError(f"the document was uploaded again (job {req.workflow_id}) after its removal was "
                             "asked for: nothing was removed; remove it again once that upload has ended")
        return RemovalConfirmed(attempt=activity.info().attempt, at=confirmed)

    @activity.defn
    @translate_errors
    async def await_newer_run(self, req: ForgetDocumentInput) -> NewerRun:
        """The document's run that started after the removal was confirmed, waited for to its end: whether
        it indexed the document (then its chunks stay) or not (then what it wrote goes too)."""
        try:
            latest = await self.client.get_workflow_handle(req.workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return NewerRun(attempt=activity.info().attempt)
            raise
        if latest.run_id == req.run_id:
            return NewerRun(attempt=activity.info().attempt)
        try:
            async with heartbeating():
                await self.client.get_workflow_handle(req.workflow_id, run_id=latest.run_id).result()
        except WorkflowFailureError:  # failed, cancelled, terminated
            return NewerRun(started=True, indexed=False, at=time.time(), attempt=activity.info().attempt)
        return NewerRun(started=True, indexed=True, at=time.time(), attempt=activity.info().attempt)

    @activity.defn
    @translate_errors
    async def forget_document(self, req: ForgetDocumentInput) -> ForgetDocumentOutput:
        """Delete the removed document's ingestion runs from Temporal: the document is no longer listed, and
        the same bytes uploaded again are a new run of its job. Returns once the server no longer has them."""
        listed = [e async for e in self.client.list_workflows(f"WorkflowId = '{req.workflow_id}'")]
        runs = {e.run_id for e in listed if e.status != WorkflowExecutionStatus.RUNNING
                and req.run_started_at is not None and e.start_time <= req.run_started_at}
        if req.run_id is not None:
            runs.add(req.run_id)
        for run_id in runs:
            try:
                await self.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
                    namespace=self.client.namespace,
                    workflow_execution=WorkflowExecution(workflow_id=req.workflow_id, run_id=run_id)))
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:  # gone already (an earlier attempt)
                    raise
        # The server deletes a closed run in the background, once its transfer queue has recorded how far it
        # has read (history.transferProcessorUpdateAckInterval: 30 s by default, 1 s on `make run`'s server).
        # Until then the document is still listed. Its visibility record goes last: until it has, the listing
        # would show the document indexed again once the removal has ended.
        async with heartbeating():
            for run_id in runs:
                while await self._known(req.workflow_id, run_id):
                    await asyncio.sleep(0.5)
            while runs & {e.run_id async for e in self.client.list_workflows(f"WorkflowId = '{req.workflow_id}'")}:
                await asyncio.sleep(0.5)
        return ForgetDocumentOutput(runs=len(runs), attempt=activity.info().attempt)

    @activity.defn
    @translate_errors
    async def session_still_runs(self, req: SessionRun) -> SessionRunning:
        """Whether the session that started a waiting chat turn still runs: that run, or a later run of its
        chain (continued as new, carrying the turns still waiting; or reset by an operator, which ends the run
        it resets). Ended otherwise (terminated by hand), or run anew under its id since (a new chain numbers
        its turns from 1), it will give the turn no go. The run that started the turn may be gone while its
        chain runs on (continued as new longer ago than the retention): its chain is then the one an earlier
        look found (`first_run_id`)."""
        started = await self._described(req.workflow_id, req.run_id)
        chain = req.first_run_id
        if started is not None:
            chain = started.raw_description.workflow_execution_info.first_run_id or chain
            if started.status == WorkflowExecutionStatus.RUNNING:
                return SessionRunning(running=True, first_run_id=chain)
        latest = await self._described(req.workflow_id)
        if latest is None or latest.status != WorkflowExecutionStatus.RUNNING:
            return SessionRunning(running=False, first_run_id=chain)
        latest_chain = latest.raw_description.workflow_execution_info.first_run_id
        if not latest_chain:  # a server that does not say: no sign that the session ended
            return SessionRunning(running=True, first_run_id=chain)
        # No chain known (its first look came after the retention): the run was its chain's first, or not ours.
        return SessionRunning(running=latest_chain == (chain or req.run_id), first_run_id=chain)

    @activity.defn
    @translate_errors
    async def session_left(self, req: SessionRun) -> SessionLeft:
        """What the session's run `req.run_id`, which ended idle, left for the run that takes it up: its result.
        None when that run ended otherwise (terminated by hand, failed) or is gone (the retention)."""
        handle = self.client.get_workflow_handle(req.workflow_id, run_id=req.run_id, result_type=SessionState)
        try:
            return SessionLeft(state=await handle.result(follow_runs=False))
        except WorkflowFailureError:
            return SessionLeft()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            return SessionLeft()

    async def _described(self, workflow_id: str, run_id: str | None = None):  # noqa: ANN202
        """The run (the latest without `run_id`), or None when the server no longer has it (the retention)."""
        try:
            return await self.client.get_workflow_handle(workflow_id, run_id=run_id).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            return None

    @activity.defn
    async def policy_attempts(self, req: PolicyAttemptsInput) -> PolicyAttempts:
        """A local activity of a job whose step used up its retries on a timeout (no failure says how many
        attempts that took): the policy's count, read once and kept in the job's history, so that a replay
        after an edit of the policy file counts as the run did (an agent's budget branches on it)."""
        return PolicyAttempts(maximum_attempts=policies.policy(req.activity).retry.maximum_attempts)

    async def _known(self, workflow_id: str, run_id: str | None = None) -> bool:
        try:
            await self.client.get_workflow_handle(workflow_id, run_id=run_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True
