"""GET /v1/jobs, GET /v1/jobs/{job_id}."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query
from temporalio.client import Client

from api import jobs
from api.deps import get_client, get_settings, rpc_timeout
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
