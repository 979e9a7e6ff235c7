"""GET /v1/jobs/{job_id}/events: the job's durable event stream as Server-Sent Events.

Every job workflow publishes CloudEvents on a `temporalio.contrib.workflow_streams` stream; this
relays them. The SSE `id` is the event's offset in that stream, so a client that reconnects with
`Last-Event-ID` resumes right after the last event it saw. While no event arrives for
`PROGRESS_AFTER` seconds, a `ragline.job.running` event (no id: it is not part of the durable
log) tells a person which steps are still running, from the server's view of the job.

The caller's key is checked when the stream opens and again before each event and every
KEY_CHECK_SECONDS while idle: a stream outlives its request (an agent waits days for a review), and a
key revoked meanwhile (or moved to another tenant or role) ends it. A browser's EventSource then
reconnects, gets 401 and stops.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Annotated

import structlog
from fastapi import APIRouter, Header, Query, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from temporalio.api.common.v1 import Payloads
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from api.auth import CallerDep, still_valid
from api.deps import AcceptedDep, ClientDep, RpcTimeoutDep, SettingsDep, StreamsDep
from api.errors import RETRY_AFTER, ApiError
from api.job_views import (
    accepted_turn, failure_message, never_started, not_found, owned, wait_until_created,
)
from api.streams import HeldEventSource, JobStreams
from api.validators import JOB_ID
from models.tenancy import scoped
from api.schemas import INVALID_REQUEST, TEMPORAL_DOWN, JobEvent, error_responses

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
log = structlog.get_logger("ragline.api")

TERMINAL_TYPES = {"ragline.job.completed", "ragline.job.failed", "ragline.job.cancelled"}
KEEPALIVE_SECONDS = 15
RECONNECT_MS = 5000  # the `retry:` a stream ends with when the job's events cannot be read for now
PROGRESS_AFTER = 30
# A progress event describes at most this many of the job's running child jobs (the first started):
# one read of Temporal each, every PROGRESS_AFTER seconds of quiet, for an upload of any number of files.
MAX_CHILDREN_DESCRIBED = 16
# While no event comes, the caller's key is looked at again this often (a stat of the keys file): a
# revoked key's stream ends within these seconds, not at the next event, which may be days away.
KEY_CHECK_SECONDS = 5.0


def _start_offset(last_event_id: str | None, from_offset: int | None) -> int:
    """After the event the client saw last; an id that is not one of ours (not an offset) is ignored."""
    if last_event_id is not None and re.fullmatch(r"[0-9]{1,18}", last_event_id.strip()):
        return int(last_event_id) + 1
    return from_offset or 0


# The stream is not JSON, so it is documented here rather than by a response model: each SSE `data`
# is a JobEvent (the item schema FastAPI writes for its own SSE routes). Errors are JSON as everywhere.
STREAM_RESPONSES = {
    200: {"description": "Server-Sent Events: `id` is the event's offset in the job's stream (send it back as "
                         "Last-Event-ID to resume), `data` a CloudEvent as JSON",
          "content": {"text/event-stream": {"itemSchema": {
              # Not every frame is an event: a keep-alive comment, and the `retry:` a stream ends with when its
              # job's events cannot be read for now, carry no `data` (an EventSource dispatches nothing for them).
              "type": "object",
              "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                      "contentSchema": JobEvent.model_json_schema()},
                             "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer", "minimum": 0}}}}}},
    204: {"description": "Resumed (Last-Event-ID) after the last event of a job that has ended: nothing more "
                         "will come, and a browser's EventSource stops reconnecting"},
    **error_responses({404: "job_not_found", 422: INVALID_REQUEST, 429: "rate_limited, too_many_streams",
                       503: TEMPORAL_DOWN}),
}


@router.get("/{job_id}/events", name="job_events", summary="Live job events (SSE, CloudEvents 1.0 in data)",
            response_class=EventSourceResponse, responses=STREAM_RESPONSES)
async def job_events(request: Request, job_id: JOB_ID, client: ClientDep, caller: CallerDep, timeout: RpcTimeoutDep,
                     settings: SettingsDep, accepted: AcceptedDep, streams: StreamsDep,
                     last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
                     from_offset: Annotated[int | None, Query(ge=0, description="Resume from this offset")] = None,
                     last_event_id_query: Annotated[str | None, Query(
                         alias="lastEventId", max_length=64,
                         description="Last-Event-ID as EventSource polyfills that send headers (a key) send it on "
                                     "a reconnect; the header wins")] = None,
                     ) -> Response:
    slot = streams.reserve(caller.sha256)
    if slot is None:
        raise ApiError(429, "too_many_streams", f"this key holds {streams.max_per_key} event streams open on this "
                       "API process (RAGLINE_MAX_STREAMS_PER_KEY); close one (a job's stream ends with the job)",
                       headers=RETRY_AFTER)
    with slot:  # given back on the way out, unless the stream's response holds it
        asked, job_id = job_id, scoped(caller.tenant, job_id)
        handle = client.get_workflow_handle(job_id)
        pending = ended = False
        try:
            desc = await handle.describe(rpc_timeout=timeout)
            if not owned(desc, caller.tenant):
                raise not_found(asked)
            ended = desc.status != WorkflowExecutionStatus.RUNNING
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            # An accepted chat turn whose job its session has not started yet: the stream opens now
            # and its events follow once the job exists.
            pending = accepted.just_accepted(job_id) is not None or \
                await accepted_turn(client, caller.tenant, job_id, timeout) is not None
            if not pending:
                raise not_found(asked) from None
        start = _start_offset(last_event_id if last_event_id is not None else last_event_id_query, from_offset)
        accepted_by = accepted.session_run(job_id)
        if pending and start > 0 and \
                await never_started(client, caller.tenant, job_id, timeout, accepted_by) is not None:
            return Response(status_code=204)  # its one event was read: an EventSource stops reconnecting
        cooldown = timedelta(seconds=settings.events_poll_cooldown)
        opened = None
        if ended and start > 0:
            # Resumed after the end? Read the first event left (the relay goes on from it: one read).
            items = streams.follow(client, job_id, start, cooldown).__aiter__()
            first = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({first}, timeout=timeout.total_seconds())
            if first.done() and isinstance(first.exception(), StopAsyncIteration):
                await items.aclose()
                # An empty 200 would end the stream, and an EventSource reconnects after every end, for ever.
                return Response(status_code=204)
            opened = items, first
        guard = request.app.state.guard
        relay = _relay(client, streams, caller.tenant, job_id, start, timeout, cooldown, pending, opened, ended=ended,
                       key_valid=lambda: still_valid(guard, caller), accepted_by=accepted_by)
        return HeldEventSource(relay, slot, ping=KEEPALIVE_SECONDS)


def _come_back(job_id: str, reason: object) -> ServerSentEvent:
    """The job's events cannot be read now (an ended job's are read through a worker, which replays its
    history; or Temporal is down): say why, and when to come back. A browser's EventSource reconnects
    then, with Last-Event-ID, and misses nothing. (An error status would make it give up for good.)"""
    log.warning("job events unavailable", job_id=job_id, error=str(reason))
    return ServerSentEvent(comment=f"events unavailable, reconnect: {reason}"[:300], retry=RECONNECT_MS)


def _never_started(job_id: str, reason: str, since: datetime) -> ServerSentEvent:
    """The terminal event of a turn whose session's run ended before starting its job (no job, so no
    stream of its own: the API says it, with offset 0, so a reconnect after it is answered 204)."""
    return ServerSentEvent(id="0", data=json.dumps({
        "specversion": "1.0", "id": f"{job_id}/never-started", "source": "ragline/api", "type": "ragline.job.failed",
        "time": since.isoformat(), "subject": job_id, "datacontenttype": "application/json",
        "data": {"error": reason}}, ensure_ascii=False))  # as a job's own failed event


def _key_gone(job_id: str) -> ServerSentEvent:
    log.info("job events stream ended: its key is no longer valid", job_id=job_id)
    return ServerSentEvent(comment="the API key of this stream is no longer valid")


async def _relay(client: Client, streams: JobStreams, tenant: str, job_id: str, start: int, timeout: timedelta,
                 cooldown: timedelta, pending: bool, opened: tuple | None = None, *, ended: bool = False,
                 key_valid: Callable[[], bool], accepted_by: str | None = None):
    """`opened`: the job's events already followed, and the read of the next one under way. An ended
    job's events are all there to read: a read that takes longer than an RPC may means no worker
    answers, and the client is told to come back rather than held on a silent stream. `key_valid`:
    whether the caller's key still holds (asked before each event, and every KEY_CHECK_SECONDS)."""
    if opened is not None:
        items, next_item = opened
    else:
        # A turn whose session has not started its job may wait long (no worker): the key is watched meanwhile.
        created = asyncio.ensure_future(wait_until_created(client, tenant, job_id, timeout, pending=pending))
        try:
            while not (await asyncio.wait({created}, timeout=KEY_CHECK_SECONDS))[0]:
                if not key_valid():
                    yield _key_gone(job_id)
                    return
        finally:
            created.cancel()
            await asyncio.gather(created, return_exceptions=True)
        if not created.result():
            if (ended := await never_started(client, tenant, job_id, timeout, accepted_by)) is not None:
                yield _never_started(job_id, *ended)  # what GET /v1/jobs/{id} says of it
            return
        # Each poll is an Update that waits in the workflow until there is something new (no busy loop
        # at any cooldown). With no pause the next poll is already waiting when the job publishes its
        # terminal event, so that event leaves with the run's last workflow task; otherwise the poll
        # would come after the run closed and be answered by a query, which a worker serves by
        # replaying the whole history.
        items = streams.follow(client, job_id, start, cooldown).__aiter__()
        next_item = asyncio.ensure_future(items.__anext__())
    loop = asyncio.get_running_loop()
    try:
        quiet_since = loop.time()
        while True:
            # How long the stream may stay quiet: then an ended job's client is told to come back, a running
            # job's is sent what still runs. Waited for in steps of KEY_CHECK_SECONDS, to look at the key.
            patience = timeout.total_seconds() if ended else PROGRESS_AFTER
            left = quiet_since + patience - loop.time()
            done, _ = await asyncio.wait({next_item}, timeout=max(0.0, min(left, KEY_CHECK_SECONDS)))
            if not key_valid():  # before anything more goes out
                yield _key_gone(job_id)
                return
            if not done and loop.time() < quiet_since + patience:
                continue
            if not done and ended:
                yield _come_back(job_id, f"no worker answered within {timeout.total_seconds():g} s")
                return
            if not done:
                event = await _progress_event(client, job_id, timeout)
                if event and not key_valid():  # revoked while the job was described
                    yield _key_gone(job_id)
                    return
                if event:
                    yield ServerSentEvent(data=json.dumps(event))
                quiet_since = loop.time()
                continue
            try:
                item = next_item.result()
            except StopAsyncIteration:
                return
            except Exception as exc:  # noqa: BLE001 - any reason the stream cannot be read: the client comes back
                yield _come_back(job_id, exc)
                return
            yield ServerSentEvent(data=json.dumps(item.data, ensure_ascii=False), id=str(item.offset))
            if item.data.get("type") in TERMINAL_TYPES:
                return
            next_item = asyncio.ensure_future(items.__anext__())
            quiet_since = loop.time()
    finally:
        # Leave the job's shared subscription now (the last reader to leave ends it), not when the
        # reader is garbage-collected.
        next_item.cancel()
        await asyncio.gather(next_item, return_exceptions=True)
        await items.aclose()


async def _heartbeat(client: Client, details: Payloads) -> dict | None:
    """What a running step last said of its progress in its heartbeat ({"page": 61, "pages": 500}), if anything."""
    if not details.payloads:
        return None
    try:
        first, *_ = await client.data_converter.decode(details.payloads)
    except Exception:  # noqa: BLE001 - progress is a courtesy: one that does not read is left out
        return None
    return first if isinstance(first, dict) else None


async def _progress_event(client: Client, job_id: str, timeout: timedelta) -> dict | None:
    """What is still running, from the server's view of pending activities (heartbeat details): the job's
    own, then those of its child jobs still running (an upload's documents, an agent's sub-agents), each
    with its `job_id`, so an upload's stream shows the page its 500-page PDF is at."""
    try:
        desc = await client.get_workflow_handle(job_id).describe(rpc_timeout=timeout)
    except RPCError:
        return None
    now = datetime.now(timezone.utc)
    running = await _running_steps(client, desc, now)
    children = list(desc.raw_description.pending_children)[:MAX_CHILDREN_DESCRIBED]
    for child, steps in zip(children, await asyncio.gather(*(_child_steps(client, c.workflow_id, c.run_id, now,
                                                                          timeout) for c in children))):
        running += [{"job_id": child.workflow_id, **step} for step in steps]
    if not running:  # nothing runs (the job waits for a person, or for its turn): the keep-alives suffice
        return None
    return {"specversion": "1.0", "id": f"{job_id}/progress/{int(now.timestamp())}", "source": "ragline/api",
            "type": "ragline.job.running", "time": now.isoformat(), "subject": job_id,
            "datacontenttype": "application/json", "data": {"running": running}}


async def _child_steps(client: Client, workflow_id: str, run_id: str, now: datetime,
                       timeout: timedelta) -> list[dict]:
    try:  # the run this job started: a later run under the id (a document uploaded again) is not its child
        desc = await client.get_workflow_handle(workflow_id, run_id=run_id or None).describe(rpc_timeout=timeout)
    except RPCError:  # it ended meanwhile (and was deleted), or the server is busy: progress is a courtesy
        return []
    return await _running_steps(client, desc, now)


async def _running_steps(client: Client, desc, now: datetime) -> list[dict]:  # noqa: ANN001
    running = []
    for pending in desc.raw_description.pending_activities:
        # Scheduled, not started: it waits for a worker's slot (a local model's one slot, say), or for its
        # next attempt (then its scheduled time is that attempt's, still to come: counted from the last one).
        started = pending.state != PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
        since = pending.last_started_time if started else pending.scheduled_time
        if not started and (not since.seconds or since.ToDatetime(tzinfo=timezone.utc) > now):
            since = pending.last_attempt_complete_time
        seconds = max(0.0, (now - since.ToDatetime(tzinfo=timezone.utc)).total_seconds()) if since.seconds else None
        running.append({
            "step": pending.activity_type.name,
            "attempt": pending.attempt,
            "state": "running" if started else "waiting",
            "running_for_s": round(seconds, 1) if started and seconds is not None else None,
            "waiting_for_s": round(seconds, 1) if not started and seconds is not None else None,
            "last_error": await failure_message(client, pending.last_failure) or None,  # encrypted: decoded
            "progress": await _heartbeat(client, pending.heartbeat_details) if started else None,
        })
    return running
