"""POST /v1/chats (a turn of a session, answered at once with a job), GET /v1/chats/{session_id}.

Acceptance is one durable write with no worker in the path: the turn's job id is derived from the
session and the Idempotency-Key, and a signal-with-start hands the turn to its session workflow,
whose history keeps the turns in the order they were accepted.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import datetime, timedelta, timezone
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import Field
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import Priority, SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from api import job_views, observability
from api.auth import CallerDep
from api.deps import AcceptedDep, ClientDep, CursorsDep, RpcTimeoutDep, SettingsDep
from api.errors import ApiError
from api.idempotency import IdempotencyKeyDep, ensure_same_request, recorded_request, request_digest
from api.job_views import RecentlyAccepted
from api.schemas import (
    ACCEPTED, INVALID_REQUEST, TEMPORAL_DOWN, ChatAccepted, SessionView, TurnView, error_responses, starting,
)
from api.validators import SESSION_ID, CursorDep, review_timeout_seconds, validate_collection, validate_session_id
from models.chat import (
    MESSAGE_MAX_CHARS, SESSION_PATTERN, ChatQuestion, SessionState, TurnInput, keyed_session_id,
    session_workflow_id, turn_job_id,
)
from models.inputs import NOT_BLANK
from models.tenancy import workflow_id
from ragline import tracing
from ragline.llm import too_long_a_question
from temporal import search_attributes as sa
from workflows.chat import ChatSessionWorkflow

router = APIRouter(prefix="/v1/chats", tags=["chat"])


class ChatRequest(ChatQuestion):
    # Blank is refused here, at the door; the turn's own model stays as lenient as the histories it reads.
    message: str = Field(min_length=1, max_length=MESSAGE_MAX_CHARS, pattern=NOT_BLANK,
                         description="The question. Besides its characters, its tokens are bounded by what the "
                                     "model's context leaves beside the passages (RAGLINE_LLM_CONTEXT_TOKENS): "
                                     "a longer one is 422 `message_too_long`, whose message says the bound")
    session_id: str | None = Field(None, pattern=SESSION_PATTERN,
                                   description="Continue a session; a new one is made when omitted, and under an id "
                                        "no session has yet (a client may name its sessions)")


@router.post("", status_code=202, summary="Ask a question in a session; answers at once with a job",
             response_description=ACCEPTED,
             responses=error_responses({422: f"{INVALID_REQUEST}, invalid_collection, invalid_session_id, "
                                             "message_too_long, idempotency_key_reused",
                                        503: TEMPORAL_DOWN}))
async def post_chat(req: ChatRequest, request: Request, client: ClientDep, caller: CallerDep,
                    settings: SettingsDep, timeout: RpcTimeoutDep, accepted: AcceptedDep,
                    idempotency_key: IdempotencyKeyDep = None) -> ChatAccepted:
    validate_collection(req.collection)
    if (too_long := too_long_a_question(req.message, settings)) is not None:
        raise ApiError(422, "message_too_long", too_long, field="message")
    if req.session_id is not None:
        session_id = validate_session_id(req.session_id)
    else:  # a new session; a keyed request names it by its key, so that resending it starts no other
        session_id = keyed_session_id(idempotency_key) if idempotency_key is not None else uuid.uuid4().hex
    # Scoped per tenant: two tenants may use the same session id and the same Idempotency-Key.
    job_id = workflow_id(caller.tenant, turn_job_id(session_id, idempotency_key or uuid.uuid4().hex))
    digest = request_digest("chat", req.model_dump(exclude={"session_id"})) if idempotency_key is not None else None
    # A keyed request is recorded once: the same key sent again while the first is on its way waits here.
    async with accepted.claimed(job_id) if idempotency_key is not None else contextlib.nullcontext():
        duplicate = idempotency_key is not None and await _sent_before(
            client, accepted, job_id, idempotency_key, digest, timeout)
        if not duplicate:
            turn = TurnInput(tenant=caller.tenant, job_id=job_id, session_id=session_id,
                             question=ChatQuestion(**req.model_dump(exclude={"session_id"})),
                             review_unsupported=settings.review_unsupported_answers,
                             review_timeout_seconds=review_timeout_seconds(settings),
                             traceparent=tracing.current_traceparent(),
                             fallback=bool(settings.fallback_llm_base_url), request=digest,
                             accepted_at=datetime.now(timezone.utc), fairness_weight=caller.fairness_weight,
                             session_max_queued=settings.session_max_queued_turns)
            starting(request, job_id)
            session = await _submit(client, settings.task_queue, turn, caller.priority, timeout)
            accepted.add(job_id, digest, turn.accepted_at, session.result_run_id)
            observability.job_accepted("chat")
    return ChatAccepted.for_job(request, job_id, session_id=session_id, turn=None, duplicate=duplicate)


async def _submit(client: Client, task_queue: str, turn: TurnInput, priority: Priority,
                  timeout: timedelta) -> WorkflowHandle:
    """Hands the turn to its session: a signal to the running session, else a start with it. A session
    whose run ended idle is started again from what that run left (the server names that run when it
    refuses to start a new one in its place); one that never ran, or is gone (the retention), anew."""
    async def signal_with_start(state: SessionState, reuse: WorkflowIDReusePolicy) -> WorkflowHandle:
        return await client.start_workflow(
            ChatSessionWorkflow.run, state, id=session_workflow_id(turn.tenant, turn.session_id),
            task_queue=task_queue, start_signal="submit", start_signal_args=[turn], priority=priority,
            id_reuse_policy=reuse,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                     SearchAttributePair(sa.SESSION, turn.session_id),
                                                     SearchAttributePair(sa.TENANT, turn.tenant)]),
            rpc_timeout=timeout)

    state = SessionState(tenant=turn.tenant, session_id=turn.session_id)
    try:
        return await signal_with_start(state, WorkflowIDReusePolicy.REJECT_DUPLICATE)
    except WorkflowAlreadyStartedError as ended:
        # (Should another message start the session first, this one is a signal to that run.)
        resumed = state.model_copy(update={"resumed_from": ended.run_id})
        return await signal_with_start(resumed, WorkflowIDReusePolicy.ALLOW_DUPLICATE)


async def _sent_before(client: Client, accepted: RecentlyAccepted, job_id: str, key: str, digest: str,
                       timeout: timedelta) -> bool:
    """Whether this keyed turn was accepted before: its job exists (then nothing is written), or this process
    took it a moment ago. Another question under the same key is refused. The job's memo decides where there
    is a job: what this process took may be a question it let through, before the session had started the
    job, under a key another process had taken first. A resend that another API process took and its session
    has not started yet is let through: the session skips a job id it has seen."""
    found, recorded = await recorded_request(client, job_id, timeout)
    if not found and accepted.just_accepted(job_id) is not None:  # a moment ago: its job is not started yet
        found, recorded = True, accepted.request(job_id)
    if found:
        ensure_same_request(key, recorded, digest)
    return found


@router.get("/{session_id}", summary="A session's turns with their answers, citations and status",
            responses=error_responses({404: "session_not_found", 422: f"{INVALID_REQUEST}, invalid_cursor",
                                       503: TEMPORAL_DOWN}))
async def get_chat(session_id: SESSION_ID, client: ClientDep, cursors: CursorsDep, caller: CallerDep,
                   timeout: RpcTimeoutDep, cursor: CursorDep = None,
                   limit: Annotated[int, Query(ge=1, le=1000, description="At most this many turns: running ones "
                                               "first (an earlier turn whose side steps still run too), then "
                                               "ended ones, the latest ended first; each page in turn order; "
                                               "`next_cursor` pages on")] = 100,
                   ) -> SessionView:
    if not await job_views.exists(client, session_workflow_id(caller.tenant, session_id), timeout):
        raise ApiError(404, "session_not_found", f"no chat session {session_id!r}")
    query = job_views.list_query(caller.tenant, kind="chat", extra={sa.SESSION.name: session_id})
    executions, next_cursor = await job_views.list_page(client, cursors, query, limit, cursor, timeout)
    turns = await job_views.gather_reads(_turn_view(client, e, timeout) for e in executions)
    return SessionView(session_id=session_id, turns=sorted(turns, key=lambda t: (t.turn or 0, t.created_at)),
                       next_cursor=next_cursor)


async def _turn_view(client: Client, execution, timeout: timedelta) -> TurnView:
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
    if execution.status == WorkflowExecutionStatus.RUNNING:
        # Visibility records a turn's end a moment after it: the run itself says whether it still runs
        # (read as running, an ended turn would show no error, and its answer without who wrote it).
        execution = await handle.describe(rpc_timeout=timeout)
    memo = await execution.memo()
    status = job_views.job_status(execution)
    outcome = {"answer": None, "citations": [], "error": None}
    if execution.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result(rpc_timeout=timeout)
        outcome.update(answer=result["answer"], citations=result["citations"], model=result.get("model"),
                       written_by_reviewer=result.get("written_by_reviewer", False))
    else:
        if status == "failed":
            outcome["error"] = (await job_views.failure_of(handle, execution, timeout)).message
        if status != "queued" and (shown := await job_views.shown_answer(handle, timeout)) is not None:
            # Shown on the stream before the turn's end; the next turn already has it.
            outcome.update(answer=shown.get("answer"), citations=shown.get("citations") or [])
    return TurnView(turn=memo.get("turn"), job_id=execution.id, message=memo.get("message"), status=status,
                    created_at=execution.start_time, **outcome)
