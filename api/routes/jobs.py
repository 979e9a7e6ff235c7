"""GET /v1/jobs, GET /v1/jobs/{job_id}, POST /v1/jobs/{job_id}/retry and /discard."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Body, Query
from temporalio.client import Client

from api import job_views
from api.auth import Caller, CallerDep, ReviewerDep
from api.deps import AcceptedDep, ClientDep, RpcTimeoutDep, SettingsDep
from api.schemas import INVALID_REQUEST, TEMPORAL_DOWN, JobList, JobView, OperatorResult, error_responses
from api.validators import JOB_ID
from models.jobs import JobKind, JobStatus, OperatorAck, OperatorRequest
from models.tenancy import scoped
from ragline import audit
from ragline.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

OPERATOR_ERRORS = error_responses({403: "forbidden", 404: "job_not_found", 409: "not_dead_lettered, job_closed",
                                   422: INVALID_REQUEST, 503: TEMPORAL_DOWN})


@router.get("", summary="List the tenant's jobs (Temporal visibility)",
            responses=error_responses({422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
async def list_jobs(client: ClientDep, caller: CallerDep, timeout: RpcTimeoutDep, status: JobStatus | None = None,
                    kind: JobKind | None = None, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> JobList:
    query = job_views.list_query(caller.tenant, status=status, kind=kind)
    executions = await job_views.list_jobs(client, query, limit, timeout)
    return JobList(jobs=[job_views.summary(e) for e in executions], query=query)


@router.get("/{job_id}", summary="One job: status, steps, result or error",
            responses=error_responses({404: "job_not_found", 422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
async def get_job(job_id: JOB_ID, client: ClientDep, caller: CallerDep, settings: SettingsDep,
                  timeout: RpcTimeoutDep, accepted: AcceptedDep) -> JobView:
    return await job_views.describe_job(client, caller.tenant, job_id, timeout,
                                        ui_url=settings.effective_temporal_ui_url, accepted=accepted)


async def _operator(action: str, job_id: str, req: OperatorRequest, client: Client, caller: Caller,
                    settings: Settings, timeout: timedelta) -> OperatorResult:
    try:
        ack = await job_views.send_update(client, caller.tenant, job_id, action, req, OperatorAck, timeout,
                                          refused_code="not_dead_lettered")
    except Exception as exc:
        audit.record(settings.data_dir, action=action, tenant=caller.tenant, key=caller.key_id,
                     key_name=caller.name, job_id=job_id, outcome=f"refused: {getattr(exc, 'code', type(exc).__name__)}",
                     operator=req.operator, reason=req.reason)
        raise
    audit.record(settings.data_dir, action=action, tenant=caller.tenant, key=caller.key_id, key_name=caller.name,
                 job_id=job_id, outcome="accepted", operator=req.operator, reason=req.reason, steps=ack.steps)
    return OperatorResult(job_id=scoped(caller.tenant, job_id), **ack.model_dump())


@router.post("/{job_id}/retry", summary="Resume a dead-lettered job at its failed step (reviewer key)",
             responses=OPERATOR_ERRORS)
async def retry_job(job_id: JOB_ID, client: ClientDep, caller: ReviewerDep, settings: SettingsDep,
                    timeout: RpcTimeoutDep,
                    req: OperatorRequest = Body(default_factory=OperatorRequest)) -> OperatorResult:
    return await _operator("retry", job_id, req, client, caller, settings, timeout)


@router.post("/{job_id}/discard", summary="End a dead-lettered job as failed (reviewer key)",
             responses=OPERATOR_ERRORS)
async def discard_job(job_id: JOB_ID, client: ClientDep, caller: ReviewerDep, settings: SettingsDep,
                      timeout: RpcTimeoutDep,
                      req: OperatorRequest = Body(default_factory=OperatorRequest)) -> OperatorResult:
    return await _operator("discard", job_id, req, client, caller, settings, timeout)
