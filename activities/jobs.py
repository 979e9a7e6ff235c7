"""Activities that talk to Temporal itself (through the worker's client)."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError

from activities.models import AwaitDocumentInput, AwaitTurnInput, AwaitTurnOutput
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
        try:
            return await _with_heartbeats(handle.result())
        except WorkflowFailureError as exc:
            cause = exc.cause
            return DocumentOutcome.failed_from(req.workflow_id, getattr(cause, "message", None) or str(cause))

    @activity.defn(name="await_turn")
    @translate_errors
    async def await_turn(self, req: AwaitTurnInput) -> AwaitTurnOutput:
        """Answer of a chat turn started by an earlier run of its session (before continue-as-new)."""
        handle = self.client.get_workflow_handle(req.workflow_id)
        try:
            result = await _with_heartbeats(handle.result())
        except WorkflowFailureError:
            return AwaitTurnOutput(answer=None)
        return AwaitTurnOutput(answer=(result or {}).get("answer", ""))

    def all(self) -> list:
        return [self.await_document, self.await_turn]


async def _with_heartbeats(awaitable, every: float = 10.0):
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()
