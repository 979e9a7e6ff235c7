"""GET /healthz: each component's state; 503 when Temporal is down."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Response
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest, GetSystemInfoRequest

from api.deps import ClientDep, SettingsDep
from api.schemas import Component, Health

router = APIRouter(tags=["health"])

# A poller that has not polled for this long is considered gone.
POLLER_FRESHNESS = timedelta(minutes=2)
CHECK_TIMEOUT = timedelta(seconds=3)


@router.get("/healthz", summary="Component health", response_model_exclude_none=True,
            responses={503: {"model": Health, "description": "Temporal is down: no work can be recorded"}})
async def healthz(client: ClientDep, settings: SettingsDep, response: Response) -> Health:
    components: dict[str, Component] = {}
    try:
        await client.workflow_service.get_system_info(GetSystemInfoRequest(), timeout=CHECK_TIMEOUT)
        components["temporal"] = Component(status="up", address=settings.temporal_address)
    except Exception as exc:
        components["temporal"] = Component(status="down", address=settings.temporal_address,
                                           reason=f"cannot reach Temporal: {exc}")
        components["worker"] = Component(status="unknown", reason="Temporal is down")
        response.status_code = 503
        return Health(status="down", components=components)
    try:
        answer = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
            namespace=client.namespace, task_queue=TaskQueue(name=settings.task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW), timeout=CHECK_TIMEOUT)
        now = datetime.now(timezone.utc)
        fresh = [p for p in answer.pollers
                 if now - p.last_access_time.ToDatetime(tzinfo=timezone.utc) < POLLER_FRESHNESS]
        components["worker"] = Component(
            status="up" if fresh else "down", pollers=len(fresh), task_queue=settings.task_queue,
            reason=None if fresh else "no worker is polling the task queue; jobs wait until one starts")
    except Exception as exc:
        components["worker"] = Component(status="unknown", reason=str(exc))
    healthy = all(c.status == "up" for c in components.values())
    return Health(status="up" if healthy else "degraded", components=components)
