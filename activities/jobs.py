"""Activities that talk to Temporal itself (through the worker's client)."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError

from activities.models import AwaitDocumentInput
from temporal.errors import translate_errors
from workflows.models import DocumentOutcome


class JobActivities:
    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name="await_document")
    @translate_errors
    async def await_document(self, req: AwaitDocumentInput) -> DocumentOutcome:
        """Outcome of a document ingestion another job started (same bytes, same collection)."""
        handle = self.client.get_workflow_handle(req.workflow_id, result_type=DocumentOutcome)
        result_task = asyncio.ensure_future(handle.result())
        try:
            while True:
                done, _ = await asyncio.wait({result_task}, timeout=10)
                if done:
                    return result_task.result()
                activity.heartbeat()
        except WorkflowFailureError as exc:
            cause = exc.cause
            return DocumentOutcome.failed_from(req.workflow_id, getattr(cause, "message", None) or str(cause))
        finally:
            result_task.cancel()

    def all(self) -> list:
        return [self.await_document]
