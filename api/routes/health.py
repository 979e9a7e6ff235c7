"""GET /healthz: each component's state, with the workers polling each task queue (and the shared
rate-limit counters, when there are); 503 when Temporal is down.

It needs no key (probes). Without an operator key it says each component's status and why, in words of
its own; addresses, poller counts and errors as raised (which may name hosts) only to an operator key.
A key that is not valid is no error here: the answer is the anonymous one, so probes keep working.

Its Temporal half is ~7 RPCs: that half is checked at most once per
RAGLINE_HEALTHZ_CACHE_SECONDS and shared by every request in that window (those that arrive while a
check is under way wait for it), so a flood of anonymous requests costs Temporal nothing more."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Request, Response
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest, GetSystemInfoRequest
from temporalio.client import Client

from api.auth import Guard, GuardDep, presented_key, shown_address
from api.deps import ClientDep, SettingsDep
from api.schemas import Component, Health, Liveness, QueuePollers
from ragline.settings import Settings
from temporal import queues

router = APIRouter(tags=["health"])

# A poller that has not polled for this long is considered gone.
POLLER_FRESHNESS = timedelta(minutes=2)
CHECK_TIMEOUT = timedelta(seconds=3)


async def _pollers(client: Client, queue: str, kind: TaskQueueType.ValueType) -> tuple[int, int]:
    """Fresh pollers of one queue kind, and the tasks waiting there."""
    answer = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=client.namespace, task_queue=TaskQueue(name=queue), task_queue_type=kind, report_stats=True),
        timeout=CHECK_TIMEOUT)
    now = datetime.now(timezone.utc)
    fresh = sum(1 for p in answer.pollers
                if now - p.last_access_time.ToDatetime(tzinfo=timezone.utc) < POLLER_FRESHNESS)
    return fresh, answer.stats.approximate_backlog_count


async def queue_pollers(client: Client, task_queue: str) -> dict[str, QueuePollers]:
    """Fresh pollers on every queue kind (workflow and activity pollers are counted apart), and its backlog."""
    wf, act = TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY
    names = {kind: queues.queue_name(task_queue, kind) for kind in queues.QUEUE_KINDS}
    wf_counts = await asyncio.gather(*(_pollers(client, names[k], wf) for k in queues.WORKFLOW_KINDS))
    act_counts = await asyncio.gather(*(_pollers(client, names[k], act) for k in queues.QUEUE_KINDS))
    by_kind = dict(zip(queues.WORKFLOW_KINDS, wf_counts))
    return {names[k]: QueuePollers(kind=k, workflow_pollers=by_kind[k][0] if k in by_kind else None,
                                   activity_pollers=pollers, backlog=backlog + (by_kind[k][1] if k in by_kind else 0))
            for k, (pollers, backlog) in zip(queues.QUEUE_KINDS, act_counts)}


class SharedCheck:
    """The last result of a check, reused for `ttl` seconds after it was taken when every component was up;
    one check at a time. A result with something down is not reused: the recovery shows at once (a probe
    that saw Temporal down would otherwise keep the pod out of service for `ttl` more seconds)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._taken_at = float("-inf")
        self._result: dict[str, Component] | None = None
        self._running: asyncio.Task | None = None

    async def get(self, check: Callable[[], Awaitable[dict[str, Component]]]) -> dict[str, Component]:
        if self._result is not None and time.monotonic() - self._taken_at < self.ttl and \
                all(c.status == "up" for c in self._result.values()):
            return self._result
        if self._running is None:
            self._running = asyncio.ensure_future(self._take(check))
        # Shielded: a caller that goes away (a probe's timeout) does not cancel the others' check.
        return await asyncio.shield(self._running)

    async def _take(self, check: Callable[[], Awaitable[dict[str, Component]]]) -> dict[str, Component]:
        try:
            self._result = await check()
            self._taken_at = time.monotonic()
            return self._result
        finally:
            self._running = None


async def temporal_components(client: Client, settings: Settings) -> dict[str, Component]:
    """`temporal` and `worker`: the server, and the workers polling each task queue."""
    try:
        await client.workflow_service.get_system_info(GetSystemInfoRequest(), timeout=CHECK_TIMEOUT)
    except Exception as exc:
        return {"temporal": Component(status="down", address=settings.temporal_address,
                                      reason="cannot reach Temporal", error=str(exc)),
                "worker": Component(status="unknown", reason="Temporal is down")}
    components = {"temporal": Component(status="up", address=settings.temporal_address)}
    try:
        by_queue = await queue_pollers(client, settings.task_queue)
        main = by_queue[settings.task_queue]
        # A queue nobody polls where tasks wait: its jobs wait (a role is missing). Activity pollers count for
        # every queue; workflow pollers too where workflows run (main, vector). One nobody polls and where
        # nothing waits is idle, not down: a role scaled to zero between jobs (the cpu role under KEDA).
        unpolled = [name for name, q in by_queue.items() if q.activity_pollers == 0 or q.workflow_pollers == 0]
        down = [name for name in unpolled if by_queue[name].backlog > 0]
        idle = [name for name in unpolled if name not in down]
        reason = None
        if down:
            reason = (f"no worker is polling {', '.join(down)}, where tasks wait; their jobs wait until one starts "
                      "(worker.py --role ..., RAGLINE_WORKERS)")
        elif idle:
            reason = (f"no worker is polling {', '.join(idle)}, where nothing waits: its role may be scaled to zero "
                      "until work comes (else, start it: worker.py --role ..., RAGLINE_WORKERS)")
        components["worker"] = Component(
            status="up" if not down else "down", pollers=main.workflow_pollers, task_queue=settings.task_queue,
            queues=by_queue, reason=reason)
    except Exception as exc:
        components["worker"] = Component(status="unknown", reason="the task queues could not be described",
                                         error=str(exc))
    return components


@router.get("/healthz", summary="Component health", response_model_exclude_none=True,
            description="Needs no key. Addresses, pollers and errors as raised only for an operator key "
                        "(`Authorization: Bearer <key>` or `X-API-Key`); any other key, or none, gets each "
                        "component's status and reason",
            responses={503: {"model": Health, "description": "Temporal is down: no work can be recorded"}})
async def healthz(request: Request, client: ClientDep, settings: SettingsDep, guard: GuardDep,
                  response: Response) -> Health:
    components: dict[str, Component] = {}
    if guard.shared:  # counters in this process's memory are always there
        # Asked every time (one PING to this API's own Redis, no Temporal call): an answer also ends the
        # limiter's pause after an outage at once (Guard.counters_reachable).
        address = shown_address(settings.rate_limit_storage)
        components["rate_limits"] = (
            Component(status="up", address=address) if await guard.counters_reachable() else
            Component(status="down", address=address,
                      reason="the shared rate-limit counters do not answer: requests are let through unlimited"))
    shared: SharedCheck = request.app.state.temporal_health
    components.update(await shared.get(lambda: temporal_components(client, settings)))
    if not _operator(request, guard):
        components = {name: Component(status=c.status, reason=c.reason) for name, c in components.items()}
    if components["temporal"].status == "down":
        response.status_code = 503
        return Health(status="down", components=components)
    healthy = all(c.status == "up" for c in components.values())
    return Health(status="up" if healthy else "degraded", components=components)


@router.get("/livez", summary="The API process answers", response_model=Liveness,
            description="Needs no key, and asks nothing of Temporal: the probes' endpoint. A Temporal outage keeps "
                        "every API process in service, answering 503 `temporal_unavailable` with its reason, rather "
                        "than taking them all out of the load balancer at once (clients would get refused "
                        "connections instead). `GET /healthz` says what is down.")
async def livez() -> Liveness:
    return Liveness()


def _operator(request: Request, guard: Guard) -> bool:
    """Whether the request carries an operator's key (not counted against its rate: probes poll)."""
    key = presented_key(request.headers)
    entry = guard.keys.find(key) if key else None
    return entry is not None and entry.role == "operator"
