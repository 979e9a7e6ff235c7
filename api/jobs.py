"""Reading jobs back from Temporal: status mapping, step views, listing through visibility."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timezone
from typing import Any

from temporalio.client import (
    Client, WorkflowExecution, WorkflowExecutionStatus, WorkflowFailureError, WorkflowUpdateFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from api.errors import ApiError
from temporal import search_attributes as sa
from workflows.models import JobProgress, session_workflow_id

JOB_STATUSES = ("queued", "running", "waiting_review", "completed", "failed", "dead_lettered", "cancelled")
JOB_KINDS = ("ingest", "ingest_document", "chat", "agent")
_OPEN_STATES = ("queued", "running", "waiting_review", "dead_lettered")


def job_status(execution: WorkflowExecution) -> str:
    status = execution.status
    if status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW, None):
        own = execution.typed_search_attributes.get(sa.JOB_STATUS)
        return own if own in _OPEN_STATES else "running"
    if status == WorkflowExecutionStatus.COMPLETED:
        return "completed"
    if status == WorkflowExecutionStatus.CANCELED:
        return "cancelled"
    return "failed"  # failed, terminated, timed out


def status_query(status: str) -> str:
    if status == "completed":
        return "ExecutionStatus = 'Completed'"
    if status == "cancelled":
        return "ExecutionStatus = 'Canceled'"
    if status == "failed":
        return "ExecutionStatus IN ('Failed', 'Terminated', 'TimedOut')"
    return f"ExecutionStatus = 'Running' AND {sa.JOB_STATUS.name} = '{status}'"


def list_query(*, status: str | None = None, kind: str | None = None, extra: dict[str, str] | None = None) -> str:
    kinds = [kind] if kind else list(JOB_KINDS)
    clauses = [f"{sa.JOB_KIND.name} IN ({', '.join(repr(k) for k in kinds)})"]
    if status:
        clauses.append(status_query(status))
    for key, value in (extra or {}).items():
        clauses.append(f"{key} = '{value}'")  # values are validated identifiers, never free text
    return " AND ".join(clauses)


def summary(execution: WorkflowExecution) -> dict[str, Any]:
    attrs = execution.typed_search_attributes
    return {
        "job_id": execution.id,
        "kind": attrs.get(sa.JOB_KIND),
        "status": job_status(execution),
        "created_at": execution.start_time,
        "updated_at": execution.close_time or execution.start_time,
        "collection": attrs.get(sa.COLLECTION),
    }


async def list_jobs(client: Client, query: str, limit: int, rpc_timeout) -> list[WorkflowExecution]:
    """Latest run of each workflow id matching `query`, newest first."""
    seen: dict[str, WorkflowExecution] = {}
    async for execution in client.list_workflows(query, page_size=min(max(limit, 10), 1000), rpc_timeout=rpc_timeout):
        if execution.id not in seen:
            seen[execution.id] = execution
        if len(seen) >= limit:
            break
    return list(seen.values())


_TURN_ID = re.compile(r"^chat-(?P<session>[A-Za-z0-9_-]{1,64})-(?P<turn>\d+)$")


async def pending_turn(client: Client, job_id: str, rpc_timeout) -> dict[str, Any] | None:
    """A chat turn its session has accepted but whose job the server has not created yet (a few ms)."""
    match = _TURN_ID.match(job_id)
    if not match:
        return None
    try:
        pending = await client.get_workflow_handle(session_workflow_id(match["session"])).query(
            "pending_turns", rpc_timeout=rpc_timeout)
    except Exception:
        return None
    return next((p for p in pending if p.get("job_id") == job_id), None)


async def wait_until_created(client: Client, job_id: str, rpc_timeout, timeout: float = 10.0) -> None:
    """Waits out the moment between a turn's 202 and its job's creation; 404 if it never comes."""
    deadline = asyncio.get_running_loop().time() + timeout
    while await pending_turn(client, job_id, rpc_timeout) is not None:
        try:
            await client.get_workflow_handle(job_id).describe(rpc_timeout=rpc_timeout)
            return
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)


async def describe_job(client: Client, job_id: str, rpc_timeout) -> dict[str, Any]:
    handle = client.get_workflow_handle(job_id)
    try:
        desc = await handle.describe(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            turn = await pending_turn(client, job_id, rpc_timeout)
            if turn is not None:
                now = datetime.now(timezone.utc)
                return {"job_id": job_id, "kind": "chat", "status": "queued", "created_at": now, "updated_at": now,
                        "steps": [], "result": None, "error": None}
            raise ApiError(404, "job_not_found", f"no job with id {job_id!r}") from None
        raise
    if desc.typed_search_attributes.get(sa.JOB_KIND) not in JOB_KINDS:
        raise ApiError(404, "job_not_found", f"no job with id {job_id!r}")
    view = summary(desc)
    view.pop("collection")
    progress = await _progress(handle, rpc_timeout)
    steps = _steps(progress, desc)
    result = error = None
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result(rpc_timeout=rpc_timeout)
    elif view["status"] == "failed":
        error = await _failure(handle, desc, rpc_timeout)
    elif progress and progress.dead_letters:
        letter = progress.dead_letters[0]
        error = {"message": f"step {letter.step} failed {letter.attempts} times: {letter.error}",
                 "type": "DeadLettered", "details": [d.model_dump(mode="json") for d in progress.dead_letters]}
    if progress and progress.decisions:
        view["operator_decisions"] = progress.decisions
    finished = [s["finished_at"] for s in steps if s.get("finished_at")]
    started = [s["started_at"] for s in steps if s.get("started_at")]
    view["updated_at"] = max([view["updated_at"], *_aware(finished), *_aware(started)])
    view.update(steps=steps, result=result, error=error)
    return view


def _aware(values: list) -> list[datetime]:
    out = []
    for v in values:
        if isinstance(v, str):
            v = datetime.fromisoformat(v)
        out.append(v if v.tzinfo else v.replace(tzinfo=timezone.utc))
    return out


async def _progress(handle, rpc_timeout) -> JobProgress | None:
    try:
        return await asyncio.wait_for(handle.query("progress", result_type=JobProgress, rpc_timeout=rpc_timeout),
                                      timeout=rpc_timeout.total_seconds())
    except Exception:  # no worker to answer the query: show what the server knows
        return None


def _steps(progress: JobProgress | None, desc) -> list[dict[str, Any]]:
    steps = [s.model_dump(mode="json") for s in progress.steps] if progress else []
    # Live retry information comes from the server's view of activities still pending.
    by_name = {s["name"]: s for s in steps}
    for pending in desc.raw_description.pending_activities:
        step = by_name.get(pending.activity_type.name)
        if step is None:
            continue
        step["attempts"] = max(step.get("attempts", 0), pending.attempt)
        if pending.HasField("last_failure") and pending.last_failure.message:
            step["error"] = pending.last_failure.message
            step["status"] = "running"
    return steps


async def _failure(handle, desc, rpc_timeout) -> dict[str, Any]:
    try:
        await handle.result(rpc_timeout=rpc_timeout)
    except WorkflowFailureError as exc:
        cause = exc.cause
        details = list(getattr(cause, "details", []) or [])
        return {"message": getattr(cause, "message", None) or str(cause),
                "type": getattr(cause, "type", None) or type(cause).__name__,
                "details": details[0] if details else None}
    except Exception as exc:  # terminated / timed out surface as other errors
        return {"message": str(exc), "type": type(exc).__name__, "details": None}
    return {"message": f"workflow ended {desc.status.name.lower()}", "type": "Workflow", "details": None}


async def send_update(client: Client, job_id: str, name: str, payload, result_type, rpc_timeout, *,
                      refused_code: str) -> dict:
    """A person's decision on a job (operator retry/discard, review), as a validated Update.
    Unknown job: 404; refused by the workflow's validator: 409 with its reason; job ended: 409."""
    await describe_job(client, job_id, rpc_timeout)
    try:
        ack = await client.get_workflow_handle(job_id).execute_update(
            name, payload, result_type=result_type, rpc_timeout=rpc_timeout)
    except WorkflowUpdateFailedError as exc:
        raise ApiError(409, refused_code, getattr(exc.cause, "message", None) or str(exc.cause)) from None
    except RPCError as exc:
        if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
            raise ApiError(409, "job_closed", f"job {job_id} has already ended") from None
        raise
    return {"job_id": job_id, **ack.model_dump()}
