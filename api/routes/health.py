"""GET /healthz: each component's state, with the workers polling each task queue (and the shared
rate-limit counters, when there are); 503 when Temporal is down."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Response
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest, GetSystemInfoRequest
from temporalio.client import Client

from api.auth import GuardDep, shown_address
from api.deps import ClientDep, SettingsDep
from api.schemas import Component, Health, QueuePollers
from temporal import queues

router = APIRouter(tags=["health"])

# A poller that has not polled for this long is considered gone.
POLLER_FRESHNESS = timedelta(minutes=2)
CHECK_TIMEOUT = timedelta(seconds=3)


async def _pollers(client: Client, queue: str, kind: TaskQueueType.ValueType) -> int:
    answer = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=client.namespace, task_queue=TaskQueue(name=queue), task_queue_type=kind),
        timeout=CHECK_TIMEOUT)
    now = datetime.now(timezone.utc)
    return sum(1 for p in answer.pollers
               if now - p.last_access_time.ToDatetime(tzinfo=timezone.utc) < POLLER_FRESHNESS)


async def queue_pollers(client: Client, task_queue: str) -> dict[str, QueuePollers]:
    """Fresh pollers on every queue kind (workflow and activity pollers are counted apart)."""
    wf, act = TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY
    names = {kind: queues.queue_name(task_queue, kind) for kind in queues.QUEUE_KINDS}
    wf_counts = await asyncio.gather(*(_pollers(client, names[k], wf) for k in queues.WORKFLOW_KINDS))
    act_counts = await asyncio.gather(*(_pollers(client, names[k], act) for k in queues.QUEUE_KINDS))
    by_kind = dict(zip(queues.WORKFLOW_KINDS, wf_counts))
    return {names[k]: QueuePollers(kind=k, workflow_pollers=by_kind.get(k), activity_pollers=n)
            for k, n in zip(queues.QUEUE_KINDS, act_counts)}


@router.get("/healthz", summary="Component health", response_model_exclude_none=True,
            responses={503: {"model": Health, "description": "Temporal is down: no work can be recorded"}})
async def healthz(client: ClientDep, settings: SettingsDep, guard: GuardDep, response: Response) -> Health:
    components: dict[str, Component] = {}
    if guard.shared:  # counters in this process's memory are always there
        address = shown_address(settings.rate_limit_storage)
        components["rate_limits"] = (
            Component(status="up", address=address) if await guard.counters_reachable() else
            Component(status="down", address=address,
                      reason="the shared rate-limit counters do not answer: requests are let through unlimited"))
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
        by_queue = await queue_pollers(client, settings.task_queue)
        main = by_queue[settings.task_queue]
        # A queue nobody polls: its jobs wait (a role is missing). Activity pollers count for every
        # queue; workflow pollers too where workflows run (main, vector).
        idle = [name for name, q in by_queue.items()
                if q.activity_pollers == 0 or q.workflow_pollers == 0]
        reason = None
        if idle:
            reason = (f"no worker is polling {', '.join(idle)}; their jobs wait until one starts "
                      "(worker.py --role ..., RAGLINE_WORKERS)")
        components["worker"] = Component(
            status="up" if not idle else "down", pollers=main.workflow_pollers, task_queue=settings.task_queue,
            queues=by_queue, reason=reason)
    except Exception as exc:
        components["worker"] = Component(status="unknown", reason=str(exc))
    healthy = all(c.status == "up" for c in components.values())
    return Health(status="up" if healthy else "degraded", components=components)
