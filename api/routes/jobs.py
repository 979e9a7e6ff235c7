"""GET /v1/jobs, GET /v1/jobs/{job_id}."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Body, Depends, Query
from temporalio.client import Client

from api import jobs
from api.deps import get_client, get_settings, rpc_timeout
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
    return await jobs.send_update(client, job_id, action, req, OperatorAck, rpc_timeout(settings),
                                  refused_code="not_dead_lettered")


@router.post("/{job_id}/retry", summary="Resume a dead-lettered job at its failed step")
async def retry_job(job_id: str, req: OperatorRequest = Body(default_factory=OperatorRequest),
                    client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    return await _operator("retry", job_id, req, client, settings)


@router.post("/{job_id}/discard", summary="End a dead-lettered job as failed")
async def discard_job(job_id: str, req: OperatorRequest = Body(default_factory=OperatorRequest),
                      client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    return await _operator("discard", job_id, req, client, settings)
