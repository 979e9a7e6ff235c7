"""GET /healthz: each component's state; 503 when Temporal is down."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest, GetSystemInfoRequest
from temporalio.client import Client

from api.deps import get_client, get_settings
from ragline.settings import Settings

router = APIRouter(tags=["health"])

# A poller that has not polled for this long is considered gone.
POLLER_FRESHNESS = timedelta(minutes=2)
CHECK_TIMEOUT = timedelta(seconds=3)


@router.get("/healthz", summary="Component health")
async def healthz(client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> JSONResponse:
    components: dict[str, dict] = {}
    try:
        await client.workflow_service.get_system_info(GetSystemInfoRequest(), timeout=CHECK_TIMEOUT)
        components["temporal"] = {"status": "up", "address": settings.temporal_address}
    except Exception as exc:
        components["temporal"] = {"status": "down", "address": settings.temporal_address,
                                  "reason": f"cannot reach Temporal: {exc}"}
        components["worker"] = {"status": "unknown", "reason": "Temporal is down"}
        return JSONResponse({"status": "down", "components": components}, status_code=503)
    try:
        response = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
            namespace=client.namespace, task_queue=TaskQueue(name=settings.task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW), timeout=CHECK_TIMEOUT)
        now = datetime.now(timezone.utc)
        fresh = [p for p in response.pollers
                 if now - p.last_access_time.ToDatetime(tzinfo=timezone.utc) < POLLER_FRESHNESS]
        components["worker"] = {"status": "up" if fresh else "down", "pollers": len(fresh),
                                "task_queue": settings.task_queue}
        if not fresh:
            components["worker"]["reason"] = "no worker is polling the task queue; jobs wait until one starts"
    except Exception as exc:
        components["worker"] = {"status": "unknown", "reason": str(exc)}
    healthy = all(c["status"] == "up" for c in components.values())
    return JSONResponse({"status": "up" if healthy else "degraded", "components": components}, status_code=200)
