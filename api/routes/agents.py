"""POST /v1/agents, GET /v1/reviews, POST /v1/jobs/{job_id}/review."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from api import jobs
from api.deps import get_client, get_settings, rpc_timeout
from api.errors import ApiError
from api.routes.documents import validate_collection
from ragline.settings import Settings
from temporal import policies
from temporal import search_attributes as sa
from workflows.agent import AgentWorkflow
from workflows.models import AgentInput, Budget, ReviewAck, ReviewDecision

router = APIRouter(tags=["agents"])


class BudgetRequest(BaseModel):
    max_llm_calls: int = Field(50, ge=1)
    max_tokens: int = Field(200_000, ge=1)
    max_seconds: float = Field(3600, gt=0)


class AgentRequest(BaseModel):
    goal: str = Field(min_length=1, max_length=4000)
    collection: str = "default"
    max_depth: int = Field(3, ge=0)
    budget: BudgetRequest = BudgetRequest()


def review_timeout_seconds(settings: Settings) -> float:
    return policies.parse_duration(settings.review_timeout).total_seconds()


@router.post("/v1/agents", status_code=202, summary="Start an agent; answers at once with a job")
async def start_agent(req: AgentRequest, request: Request, client: Client = Depends(get_client),
                      settings: Settings = Depends(get_settings)) -> JSONResponse:
    validate_collection(req.collection)
    ceilings = {"max_depth": (req.max_depth, settings.agent_max_depth),
                "budget.max_llm_calls": (req.budget.max_llm_calls, settings.agent_max_llm_calls),
                "budget.max_tokens": (req.budget.max_tokens, settings.agent_max_tokens),
                "budget.max_seconds": (req.budget.max_seconds, settings.agent_max_seconds)}
    over = [f"{name} {value:g} > {limit:g}" for name, (value, limit) in ceilings.items() if value > limit]
    if over:
        raise ApiError(422, "over_ceiling", "above the server's ceiling: " + "; ".join(over), limits={
            name: limit for name, (_, limit) in ceilings.items()})
    job_id = f"agent-{uuid.uuid4().hex[:16]}"
    await client.start_workflow(
        AgentWorkflow.run,
        AgentInput(goal=req.goal, collection=req.collection, max_depth=req.max_depth,
                   budget=Budget(**req.budget.model_dump()), review_timeout_seconds=review_timeout_seconds(settings)),
        id=job_id, task_queue=settings.task_queue, rpc_timeout=rpc_timeout(settings),
        search_attributes=TypedSearchAttributes([
            SearchAttributePair(sa.JOB_KIND, "agent"), SearchAttributePair(sa.JOB_STATUS, "queued"),
            SearchAttributePair(sa.COLLECTION, req.collection)]))
    return JSONResponse({"job_id": job_id, "status_url": str(request.url_for("get_job", job_id=job_id)),
                         "events_url": str(request.url_for("job_events", job_id=job_id))}, status_code=202)


@router.get("/v1/reviews", summary="Everything waiting for a human review")
async def list_reviews(client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    query = f"{jobs.list_query(status='waiting_review')}"
    executions = await jobs.list_jobs(client, query, 500, rpc_timeout(settings))

    async def item(execution) -> dict | None:
        try:
            request = await client.get_workflow_handle(execution.id).query(
                "review_request", rpc_timeout=rpc_timeout(settings))
        except Exception:
            return None
        if not request:
            return None  # decided a moment ago; visibility has not caught up
        return {"job_id": execution.id, "workflow_id": execution.id,
                "kind": execution.typed_search_attributes.get(sa.JOB_KIND), **request}

    items = [i for i in await asyncio.gather(*(item(e) for e in executions)) if i]
    return {"reviews": items}


@router.post("/v1/jobs/{job_id}/review", summary="Approve, reject or revise what a job waits on")
async def review_job(job_id: str, decision: ReviewDecision, client: Client = Depends(get_client),
                     settings: Settings = Depends(get_settings)) -> dict:
    return await jobs.send_update(client, job_id, "review", decision, ReviewAck, rpc_timeout(settings),
                                  refused_code="not_waiting_for_review")
