"""POST /v1/chats (a turn of a session, answered at once with a job), GET /v1/chats/{session_id}."""

from __future__ import annotations

import asyncio
import random
import re
import uuid
import weakref
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from temporalio.client import (
    Client, WithStartWorkflowOperation, WorkflowExecutionStatus, WorkflowFailureError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from api import jobs
from api.deps import get_client, get_settings, rpc_timeout
from api.errors import ApiError
from api.routes.agents import review_timeout_seconds
from api.routes.documents import validate_collection
from ragline.settings import Settings
from temporal import search_attributes as sa
from workflows.chat import ChatSessionWorkflow
from workflows.models import SessionState, TurnAccepted, TurnRequest, session_workflow_id

router = APIRouter(prefix="/v1/chats", tags=["chat"])

SESSION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Temporal admits 10 in-flight Updates per workflow by default; a burst to one session waits here
# instead of being refused by the server.
UPDATES_PER_SESSION = 4
_session_gates: weakref.WeakValueDictionary[str, asyncio.Semaphore] = weakref.WeakValueDictionary()


class ChatRequest(BaseModel):
    message: str = Field(min_length=1, max_length=8000)
    session_id: str | None = Field(None, description="Continue a session; a new one is made when omitted")
    collection: str = "default"
    top_k: int = Field(5, ge=1, le=20)
    require_review: bool = Field(False, description="Hold the answer until a reviewer approves it")


@router.post("", status_code=202, summary="Ask a question in a session; answers at once with a job")
async def post_chat(req: ChatRequest, request: Request,
                    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)] = None,
                    client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> JSONResponse:
    validate_collection(req.collection)
    session_id = req.session_id or uuid.uuid4().hex
    if not SESSION_RE.match(session_id):
        raise ApiError(422, "invalid_session_id", "session_id must be 1-64 letters, digits, '_' or '-'")
    # Every turn gets a key (the client's, or one made here), so resending an unconfirmed update is safe.
    turn = TurnRequest(message=req.message, collection=req.collection, top_k=req.top_k,
                       idempotency_key=idempotency_key or f"auto-{uuid.uuid4().hex}",
                       require_review=req.require_review, review_unsupported=settings.review_unsupported_answers,
                       review_timeout_seconds=review_timeout_seconds(settings))
    try:
        accepted = await asyncio.wait_for(_submit(client, turn, session_id, settings), settings.accept_timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, "temporal_unavailable",
                       "the session did not confirm the message in time (Temporal or the worker is not available); "
                       "send it again, with the same Idempotency-Key to be sure it runs once") from None
    body = {
        "job_id": accepted.job_id, "session_id": session_id, "turn": accepted.turn,
        "duplicate": accepted.duplicate and idempotency_key is not None,
        "status_url": str(request.url_for("get_job", job_id=accepted.job_id)),
        "events_url": str(request.url_for("job_events", job_id=accepted.job_id)),
    }
    return JSONResponse(body, status_code=202)


def _start_session(session_id: str, settings: Settings) -> WithStartWorkflowOperation:
    return WithStartWorkflowOperation(
        ChatSessionWorkflow.run, SessionState(session_id=session_id), id=session_workflow_id(session_id),
        task_queue=settings.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session_id)]))


async def _submit(client: Client, turn: TurnRequest, session_id: str, settings: Settings) -> TurnAccepted:
    """Update-with-start, retried while the server sheds load: Temporal admits only a few concurrent
    Updates per workflow (10 by default), and a burst to one session must queue, not fail."""
    gate = _session_gates.get(session_id)
    if gate is None:
        gate = _session_gates[session_id] = asyncio.Semaphore(UPDATES_PER_SESSION)
    delay = 0.02
    while True:
        try:
            async with gate:
                return await client.execute_update_with_start_workflow(
                    ChatSessionWorkflow.submit, turn, start_workflow_operation=_start_session(session_id, settings),
                    rpc_timeout=rpc_timeout(settings))
        except RPCError as exc:
            if not _update_rejected_for_load(exc):
                raise
        except WorkflowUpdateRPCTimeoutOrCancelledError:
            # The SDK raises this also when our own deadline cancels the call: then stop, don't resend.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise asyncio.CancelledError from None
        # The turn's idempotency key makes a resend return the same turn if the first one did land.
        await asyncio.sleep(random.uniform(delay / 2, delay))
        delay = min(delay * 2, 0.5)


def _update_rejected_for_load(exc: RPCError) -> bool:
    if exc.status == RPCStatusCode.RESOURCE_EXHAUSTED:
        return True
    return exc.status == RPCStatusCode.UNAVAILABLE and "update was aborted" in str(exc)


@router.get("/{session_id}", summary="A session's turns with their answers, citations and status")
async def get_chat(session_id: str, client: Client = Depends(get_client),
                   settings: Settings = Depends(get_settings)) -> dict:
    if not SESSION_RE.match(session_id):
        raise ApiError(404, "session_not_found", f"no chat session {session_id!r}")
    try:
        await client.get_workflow_handle(session_workflow_id(session_id)).describe(rpc_timeout=rpc_timeout(settings))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise ApiError(404, "session_not_found", f"no chat session {session_id!r}") from None
        raise
    query = jobs.list_query(kind="chat", extra={sa.SESSION.name: session_id})
    executions = await jobs.list_jobs(client, query, 1000, rpc_timeout(settings))
    turns = await asyncio.gather(*(_turn_view(client, e, settings) for e in executions))
    return {"session_id": session_id, "turns": sorted(turns, key=lambda t: t["turn"])}


async def _turn_view(client: Client, execution, settings: Settings) -> dict:
    memo = await execution.memo()
    view = {"turn": memo.get("turn"), "job_id": execution.id, "message": memo.get("message"),
            "status": jobs.job_status(execution), "answer": None, "citations": [], "error": None}
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
    if execution.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result(rpc_timeout=rpc_timeout(settings))
        view.update(answer=result["answer"], citations=result["citations"], model=result.get("model"))
    elif view["status"] == "failed":
        try:
            await handle.result(rpc_timeout=rpc_timeout(settings))
        except WorkflowFailureError as exc:
            view["error"] = getattr(exc.cause, "message", None) or str(exc.cause)
        except Exception as exc:
            view["error"] = str(exc)
    return view
