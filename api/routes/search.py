"""POST /v1/search: runs in the worker, which alone holds the vector store."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from temporalio.client import Client

from activities.models import SearchInput, SearchOutput
from api.deps import get_client, get_settings, rpc_timeout
from api.errors import ApiError
from api.routes.documents import validate_collection
from ragline.settings import Settings
from workflows.search import SearchWorkflow

router = APIRouter(prefix="/v1", tags=["search"])


class SearchRequest(BaseModel):
    query: str = Field(min_length=1, max_length=2000)
    collection: str = "default"
    top_k: int = Field(5, ge=1, le=50)


@router.post("/search", summary="Semantic search over a collection", response_model=SearchOutput)
async def search(req: SearchRequest, client: Client = Depends(get_client),
                 settings: Settings = Depends(get_settings)) -> SearchOutput:
    validate_collection(req.collection)
    timeout = settings.search_timeout
    try:
        return await asyncio.wait_for(client.execute_workflow(
            SearchWorkflow.run, SearchInput(query=req.query, collection=req.collection, top_k=req.top_k),
            id=f"search-{uuid.uuid4().hex}", task_queue=settings.task_queue,
            execution_timeout=timedelta(seconds=timeout), rpc_timeout=rpc_timeout(settings)), timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, "worker_unavailable",
                       f"no worker answered the search within {timeout:g} s; is the worker running?") from None
