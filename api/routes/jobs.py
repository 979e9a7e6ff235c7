"""GET /v1/jobs, GET /v1/jobs/{job_id}."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Body, Depends, Query
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from api import jobs
from api.deps import get_client, get_settings, rpc_timeout
from api.errors import ApiError
from workflows.models import OperatorAck, OperatorRequest
from ragline.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobStatus = Literal["queued", "running", "waiting_review", "completed", "failed", "dead_lettered", "cancelled"]
JobKind = Literal["ingest", "ingest_document", "chat", "agent"]


@router.get("", summary="List jobs (Temporal visibility)")
async def list_jobs(status: JobStatus | None = None, kind: JobKind | None = None,
                    limit: int = Query(50, ge=1, le=1000),
                    client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    query = jobs.list_query(status=status, kind=kind)
    executions = await jobs.list_jobs(client, query, limit, rpc_timeout(settings))
    return {"jobs": [jobs.summary(e) for e in executions], "query": query}


@router.get("/{job_id}", summary="One job: status, steps, result or error")
async def get_job(job_id: str, client: Client = Depends(get_client),
                  settings: Settings = Depends(get_settings)) -> dict:
    return await jobs.describe_job(client, job_id, rpc_timeout(settings))


async def _operator(action: str, job_id: str, req: OperatorRequest, client: Client, settings: Settings) -> dict:
    await jobs.describe_job(client, job_id, rpc_timeout(settings))  # 404 for unknown ids
    handle = client.get_workflow_handle(job_id)
    try:
        ack = await handle.execute_update(action, req, result_type=OperatorAck, rpc_timeout=rpc_timeout(settings))
    except WorkflowUpdateFailedError as exc:
        raise ApiError(409, "not_dead_lettered", getattr(exc.cause, "message", None) or str(exc.cause)) from None
    except RPCError as exc:
        if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
            raise ApiError(409, "job_closed", f"job {job_id} has already ended") from None
        raise
    return {"job_id": job_id, **ack.model_dump()}


@router.post("/{job_id}/retry", summary="Resume a dead-lettered job at its failed step")
async def retry_job(job_id: str, req: OperatorRequest = Body(default_factory=OperatorRequest),
                    client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    return await _operator("retry", job_id, req, client, settings)


@router.post("/{job_id}/discard", summary="End a dead-lettered job as failed")
async def discard_job(job_id: str, req: OperatorRequest = Body(default_factory=OperatorRequest),
                      client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    return await _operator("discard", job_id, req, client, settings)
