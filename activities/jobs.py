"""Activities that wait on other jobs through Temporal itself (the worker's client)."""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError

from activities.heartbeats import heartbeating

from models.chat import AwaitTurnInput, TurnOutcome, TurnResult
from models.ingest import AwaitDocumentInput, DocumentOutcome
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
