"""GET /v1/jobs, GET /v1/jobs/{job_id}, POST /v1/jobs/{job_id}/cancel, /retry and /discard, and
POST /v1/dead-letters/retry (every parked job at once, after an outage)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Body, Query, Request
from pydantic import BaseModel, Field
from temporalio.client import Client

from api import job_views
from api.auth import Caller, CallerDep, reviewer_only
from api.deps import AcceptedDep, ClientDep, CursorsDep, RpcTimeoutDep, SettingsDep
from api.errors import ApiError, audited
from api.idempotency import IdempotencyKeyDep, decision_id
from api.schemas import (
    INVALID_REQUEST, TEMPORAL_DOWN, Accepted, JobList, JobView, OperatorResult, error_responses,
)
from api.validators import JOB_ID, CursorDep
from models.jobs import COLLECTION_PATTERN, JobKind, JobStatus, OperatorAck, OperatorRequest
from models.tenancy import scoped
from temporal import search_attributes as sa
from ragline import audit
from ragline.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
dead_letters = APIRouter(prefix="/v1/dead-letters", tags=["jobs"])
BULK_RETRIES_AT_ONCE = 16  # Updates in flight to Temporal at once for one bulk retry

OPERATOR_ERRORS = error_responses({403: "forbidden", 404: "job_not_found",
                                   409: "not_dead_lettered, job_closed, job_stuck, job_not_started",
                                   422: INVALID_REQUEST, 503: TEMPORAL_DOWN})


@router.get("", summary="List the tenant's jobs (Temporal visibility)",
            responses=error_responses({422: f"{INVALID_REQUEST}, invalid_cursor", 503: TEMPORAL_DOWN}))
async def list_jobs(client: ClientDep, cursors: CursorsDep, caller: CallerDep, timeout: RpcTimeoutDep,
                    status: JobStatus | None = None, kind: JobKind | None = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 50, cursor: CursorDep = None) -> JobList:
    query = job_views.list_query(caller.tenant, status=status, kind=kind)
    executions, next_cursor = await job_views.list_page(client, cursors, query, limit, cursor, timeout)
    if status in job_views.ENDED_STATUSES:
        # A job run again under its id (a document uploaded again after it failed) keeps its ended runs in
        # visibility: a status filter would list them beside, or instead of, what the job is now.
        executions = await job_views.latest_runs_only(client, executions, timeout)
    return JobList(jobs=[job_views.summary(e) for e in executions], next_cursor=next_cursor, query=query)


@router.get("/{job_id}", summary="One job: status, steps, result or error",
            responses=error_responses({404: "job_not_found", 422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
async def get_job(job_id: JOB_ID, client: ClientDep, caller: CallerDep, settings: SettingsDep,
                  timeout: RpcTimeoutDep, accepted: AcceptedDep) -> JobView:
    view = await job_views.describe_job(client, caller.tenant, job_id, timeout,
                                        ui_url=settings.effective_temporal_ui_url, accepted=accepted)
    return view if caller.is_reviewer else job_views.as_a_member_sees(view)


@router.post("/{job_id}/cancel", status_code=202, summary="Cancel a running job (any key of its tenant)",
             response_description="Cancel requested: the job's running steps stop (a model call within seconds) "
                                  "and it ends as cancelled; `ragline.job.cancelled` ends its event stream",
             responses=error_responses({404: "job_not_found", 409: "job_closed (completed or failed), job_not_started",
                                        422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
@audited("cancel")
async def cancel_job(job_id: JOB_ID, request: Request, client: ClientDep, caller: CallerDep, settings: SettingsDep,
                     timeout: RpcTimeoutDep) -> Accepted:
    # Audited under the id as asked (every route does): another tenant's id is not made this tenant's.
    with audit.recorded(settings, action="cancel", job_id=job_id, **caller.on_record):
        workflow_id = await job_views.cancel(client, caller.tenant, job_id, timeout)
    return Accepted.for_job(request, workflow_id)


async def _operator(action: str, job_id: str, req: OperatorRequest, client: Client, caller: Caller,
                    settings: Settings, timeout: timedelta, key: str | None) -> OperatorResult:
    with audit.recorded(settings, action=action, job_id=job_id, operator=req.operator, reason=req.reason,
                        **caller.on_record) as details:
        reviewer_only(caller)  # in the block: a member's try is audited too
        ack = await job_views.send_update(client, caller.tenant, job_id, action, req, OperatorAck, timeout,
                                          refused_code="not_dead_lettered",
                                          update_id=decision_id(action, key, req.model_dump(mode="json")))
        details["steps"] = ack.steps
    return OperatorResult(job_id=scoped(caller.tenant, job_id), **ack.model_dump())


@router.post("/{job_id}/retry", summary="Resume a dead-lettered job at its failed step (reviewer key)",
             responses=OPERATOR_ERRORS)
@audited("retry")
async def retry_job(job_id: JOB_ID, client: ClientDep, caller: CallerDep, settings: SettingsDep,
                    timeout: RpcTimeoutDep, idempotency_key: IdempotencyKeyDep = None,
                    req: OperatorRequest = Body(default_factory=OperatorRequest)) -> OperatorResult:
    return await _operator("retry", job_id, req, client, caller, settings, timeout, idempotency_key)


@router.post("/{job_id}/discard", summary="End a dead-lettered job as failed (reviewer key)",
             responses=OPERATOR_ERRORS)
@audited("discard")
async def discard_job(job_id: JOB_ID, client: ClientDep, caller: CallerDep, settings: SettingsDep,
                      timeout: RpcTimeoutDep, idempotency_key: IdempotencyKeyDep = None,
                      req: OperatorRequest = Body(default_factory=OperatorRequest)) -> OperatorResult:
    return await _operator("discard", job_id, req, client, caller, settings, timeout, idempotency_key)


class DeadLetterRetry(OperatorRequest):
    """Which of the tenant's dead-lettered jobs to resume: all, or those of one kind or collection."""
    kind: JobKind | None = None
    collection: str | None = Field(None, pattern=COLLECTION_PATTERN)
    limit: int = Field(100, ge=1, le=1000, description="At most this many jobs, the most recently started first")


class RetryRefused(BaseModel):
    job_id: str
    code: str = Field(description="not_dead_lettered, job_closed or job_not_found: it was retried, discarded or "
                                  "ended (or deleted) after it was listed")
    message: str


class DeadLetterRetryResult(BaseModel):
    retried: list[OperatorResult]
    refused: list[RetryRefused]
    more: bool = Field(description="More dead-lettered jobs match than `limit`: send the request again")


@dead_letters.post("/retry", summary="Resume every dead-lettered job (of a kind, of a collection) at its failed "
                                     "step, after an outage (reviewer key)",
                   responses=error_responses({403: "forbidden", 422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
@audited("retry_dead_letters")
async def retry_dead_letters(client: ClientDep, caller: CallerDep, settings: SettingsDep, timeout: RpcTimeoutDep,
                             idempotency_key: IdempotencyKeyDep = None,
                             req: DeadLetterRetry = Body(default_factory=DeadLetterRetry)) -> DeadLetterRetryResult:
    """Each job is retried as by `POST /v1/jobs/{job_id}/retry`, and audited on its own; the request itself is
    audited too (a member's try, or one that found nothing to retry, included). With an Idempotency-Key, a job
    the request already retried is not retried again when it is sent again."""
    with audit.recorded(settings, action="retry_dead_letters", job_id="", kind=req.kind, collection=req.collection,
                        **caller.on_record):
        reviewer_only(caller)  # in the block: a member's try is audited too
    extra = {sa.COLLECTION.name: req.collection} if req.collection else None
    query = job_views.list_query(caller.tenant, status="dead_lettered", kind=req.kind, extra=extra)
    parked = await job_views.list_jobs(client, query, req.limit + 1, timeout)
    operator = OperatorRequest(operator=req.operator, reason=req.reason)
    retried: list[OperatorResult] = []
    refused: list[RetryRefused] = []
    at_once = asyncio.Semaphore(BULK_RETRIES_AT_ONCE)

    async def retry(job_id: str) -> None:
        async with at_once:
            try:
                retried.append(await _operator("retry", job_id, operator, client, caller, settings, timeout,
                                               idempotency_key))
            except ApiError as exc:
                if exc.status not in (404, 409):  # Temporal unreachable: the whole request fails, send it again
                    raise
                refused.append(RetryRefused(job_id=scoped(caller.tenant, job_id), code=exc.code, message=exc.message))

    # By the id the API shows (tenant-scoped): each audit entry names the job as that id.
    await asyncio.gather(*(retry(e.id) for e in parked[:req.limit]))
    return DeadLetterRetryResult(retried=sorted(retried, key=lambda r: r.job_id),
                                 refused=sorted(refused, key=lambda r: r.job_id), more=len(parked) > req.limit)
