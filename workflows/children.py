"""Starting a child job so that a cancel which comes during the start still reaches it.

The SDK gives up on a child's start when its parent is cancelled meanwhile: it asks the child to cancel once
started, and waits for nothing. The parent then ends in the workflow task that sends that request, and the
server drops a request from a closed workflow. The child ran on: a document embedded and indexed for a
cancelled upload, a sub-agent's plan paid for and never counted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from temporalio import workflow
from temporalio.exceptions import WorkflowAlreadyStartedError


async def started_child(start: Awaitable[workflow.ChildWorkflowHandle], patch: str) -> workflow.ChildWorkflowHandle:
    """The handle `start` (a `workflow.start_child_workflow(...)` not yet awaited) gives. A cancel that comes
    during the start waits for it, then cancels the child as a running one: awaiting the handle waits for the
    child's end (cancelled) under the child's cancellation type. A start refused (another job runs that id) is
    not the caller's to cancel: the cancel goes on up. `patch`: histories recorded before this replay as the
    SDK ran them."""
    starting = asyncio.ensure_future(start)
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError as cancel:
        if not workflow.patched(patch):
            starting.cancel()
            raise
        try:
            child = await starting
        except WorkflowAlreadyStartedError:
            raise cancel from None
        child.cancel()
        return child
