"""Activities that wait on other jobs through Temporal itself (the worker's client)."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode

from activities.heartbeats import heartbeating

from models.chat import AwaitTurnInput, TurnOutcome, TurnResult
from models.ingest import AwaitDocumentInput, DocumentOutcome, ForgetDocumentInput, ForgetDocumentOutput
from ragline.errors import InputError
from temporal.errors import translate_errors


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
                return await handle.result()
        except WorkflowFailureError as exc:
            cause = exc.cause
            return DocumentOutcome.failed_from(req.workflow_id, getattr(cause, "message", None) or str(cause))

    @activity.defn
    @translate_errors
    async def await_turn(self, req: AwaitTurnInput) -> TurnOutcome:
        """Outcome of a chat turn whose job an earlier run of its session started (continue-as-new)."""
        handle = self.client.get_workflow_handle(req.workflow_id, result_type=TurnResult)
        try:
            async with heartbeating():
                result = await handle.result()
        except WorkflowFailureError:
            return TurnOutcome(answer=None)
        return TurnOutcome(answer=result.answer if result.answered else None)

    @activity.defn
    @translate_errors
    async def forget_document(self, req: ForgetDocumentInput) -> ForgetDocumentOutput:
        """Delete every run of a removed document's ingestion job from Temporal: the document is no longer
        listed, and the same bytes uploaded again are a new document job (its id is free again). Returns
        once the server no longer has the job, so an upload right after the removal ingests anew."""
        handle = self.client.get_workflow_handle(req.workflow_id)
        try:
            latest = await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return ForgetDocumentOutput(runs=0, attempt=activity.info().attempt)  # forgotten by an earlier attempt
            raise
        if latest.status == WorkflowExecutionStatus.RUNNING:
            # Uploaded again since the removal was asked for: that job indexes the document anew.
            raise InputError(f"the document is being ingested again by job {req.workflow_id}: its chunks were "
                             "removed, and that job indexes them again; remove the document once it has ended")
        runs = {latest.run_id} | {e.run_id async for e in self.client.list_workflows(f"WorkflowId = '{req.workflow_id}'")}
        for run_id in runs:
            try:
                await self.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
                    namespace=self.client.namespace,
                    workflow_execution=WorkflowExecution(workflow_id=req.workflow_id, run_id=run_id)))
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
        # The server deletes a closed run in the background, once its transfer queue has recorded how far it
        # has read (history.transferProcessorUpdateAckInterval: 30 s by default, 1 s on `make run`'s server).
        # Until then the document is still listed, and a start under its id would find the old run.
        async with heartbeating():
            while True:
                try:
                    await handle.describe()
                except RPCError as exc:
                    if exc.status == RPCStatusCode.NOT_FOUND:
                        return ForgetDocumentOutput(runs=len(runs), attempt=activity.info().attempt)
                    raise
                await asyncio.sleep(0.5)
