"""POST /v1/search: runs in the worker that holds the vector store (role vector or all): SearchWorkflow
on the vector queue, with the search as a local activity in that same process."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from fastapi import APIRouter
from pydantic import BaseModel, Field
from temporalio.client import WorkflowFailureError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError

from api.auth import CallerDep
from api.deps import ClientDep, RpcTimeoutDep, SettingsDep
from api.errors import RETRY_AFTER, ApiError
from api.schemas import INVALID_REQUEST, TEMPORAL_DOWN, error_responses
from api.validators import validate_collection
from models.ingest import SearchInput, SearchOutput
from models.inputs import NOT_BLANK, STRICT_INPUT, Int
from models.jobs import COLLECTION_PATTERN
from models.tenancy import workflow_id
from temporal import search_attributes as sa
from temporal.queues import search_queue
from workflows.search import SearchWorkflow

router = APIRouter(prefix="/v1", tags=["search"])


class SearchRequest(BaseModel):
    model_config = STRICT_INPUT
    query: str = Field(min_length=1, max_length=2000, pattern=NOT_BLANK)
    collection: str = Field("default", pattern=COLLECTION_PATTERN)
    top_k: Int = Field(5, ge=1, le=50)


@router.post("/search", summary="Semantic search over a collection",
             responses=error_responses({422: f"{INVALID_REQUEST}, invalid_collection",
                                        503: f"{TEMPORAL_DOWN}, worker_unavailable, search_failed"}))
async def search(req: SearchRequest, client: ClientDep, caller: CallerDep, settings: SettingsDep,
                 timeout: RpcTimeoutDep) -> SearchOutput:
    validate_collection(req.collection)
    seconds = settings.search_timeout
    try:
        return await asyncio.wait_for(client.execute_workflow(
            SearchWorkflow.run,
            SearchInput(tenant=caller.tenant, query=req.query, collection=req.collection, top_k=req.top_k),
            id=workflow_id(caller.tenant, f"search-{uuid.uuid4().hex}"), task_queue=search_queue(settings.task_queue),
            # The tenant's fair share, as every other route's jobs: one tenant's burst of searches takes
            # its turn on the vector queue rather than holding up the other tenants' searches and indexing.
            priority=caller.priority,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.TENANT, caller.tenant)]),
            execution_timeout=timedelta(seconds=seconds), rpc_timeout=timeout), seconds)
    except asyncio.TimeoutError:
        raise ApiError(503, "worker_unavailable", f"no worker answered the search within {seconds:g} s; is the worker "
                       "running?", headers=RETRY_AFTER) from None
    except WorkflowFailureError as exc:  # the store failed the search (unreachable, say): try again later
        cause = exc.cause.cause if isinstance(exc.cause, ActivityError) and exc.cause.cause else exc.cause
        raise ApiError(503, "search_failed", f"the search failed: {getattr(cause, 'message', None) or cause}",
                       headers=RETRY_AFTER) from None
