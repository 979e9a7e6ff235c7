"""Jobs as the API shows them, read back from Temporal: status mapping, job views, listing through
visibility, and the Updates people send to a job.

Everything here is scoped to the caller's tenant: a job id is read inside the tenant's id prefix
(`models.tenancy.scoped`), its `RaglineTenant` search attribute must match, and every visibility
query carries `RaglineTenant = '<tenant>'`. Another tenant's job is "not found" (404), never 403.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Iterable
from datetime import datetime, timedelta, timezone
from typing import TypeVar
from urllib.parse import quote

from pydantic import BaseModel
from temporalio.api.enums.v1 import PendingActivityState, PendingWorkflowTaskState
from temporalio.api.failure.v1 import Failure
from temporalio.client import (
    Client, WorkflowExecution, WorkflowExecutionDescription, WorkflowExecutionStatus, WorkflowFailureError,
    WorkflowHandle, WorkflowUpdateFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from api.cursors import CursorSigner, invalid_cursor
from api.errors import ApiError
from api.schemas import JobError, JobSummary, JobView, TurnAhead
from models.chat import SessionState, TurnInput, session_of_turn, session_workflow_id
from models.jobs import ANSWERED_MEMO, JOB_KINDS, OPEN_STATUSES, JobKind, JobProgress, JobStatus, StepState
from models.review import without
from models.tenancy import scoped
from ragline import tracing
from temporal import search_attributes as sa

# A job's `progress` query needs a worker: without one, the view shows what the server knows, quickly.
PROGRESS_QUERY_TIMEOUT = timedelta(seconds=2)
# How long one long poll on a session's history waits for the start of an accepted turn's job.
SESSION_WATCH = timedelta(seconds=10)
# A read of a chat turn queued longer than this asks whether its session still runs (one describe).
QUEUED_A_MOMENT = timedelta(seconds=5)

Ack = TypeVar("Ack", bound=BaseModel)
T = TypeVar("T")


class RecentlyAccepted:
    """Chat turns this API process accepted lately, by job id (already scoped to the tenant), with the
    digest of a keyed request. A stream or a status read that follows its POST before the session has
    started the job then needs no look into the session's history, which the server reads and we decode
    whole: under a burst of chats with a stream each, those reads kept the server too busy to hand the
    sessions their first workflow tasks. Not authoritative: a turn another API process accepted is
    looked up as before."""

    # How long a turn counts as just accepted when its job is not found: longer, the session's history
    # says (its job may have been started and be gone since: past the retention, or deleted).
    FRESH_FOR = timedelta(minutes=10)

    def __init__(self, size: int = 10_000) -> None:
        # job id -> (the request's digest, when accepted, the session run that took it)
        self._ids: OrderedDict[str, tuple[str | None, datetime, str | None]] = OrderedDict()
        self._size = size
        self._claims: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def claimed(self, job_id: str) -> AsyncIterator[None]:
        """One keyed request per job id at a time in this process: a resend sent while the first is
        still being recorded waits for it, then finds it (a duplicate, or a conflicting body)."""
        lock, users = self._claims.get(job_id, (asyncio.Lock(), 0))
        self._claims[job_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._claims[job_id]
            if users == 1:
                del self._claims[job_id]
            else:
                self._claims[job_id] = (lock, users - 1)

    def add(self, job_id: str, request: str | None, accepted_at: datetime, session_run: str | None = None) -> None:
        self._ids[job_id] = (request, accepted_at, session_run)
        if len(self._ids) > self._size:
            self._ids.popitem(last=False)

    def request(self, job_id: str) -> str | None:
        return self._ids[job_id][0] if job_id in self._ids else None

    def accepted_at(self, job_id: str) -> datetime | None:
        return self._ids[job_id][1] if job_id in self._ids else None

    def just_accepted(self, job_id: str) -> datetime | None:
        """When the turn was accepted, if that was a moment ago: its job, not found, is not started yet."""
        at = self.accepted_at(job_id)
        return at if at is not None and datetime.now(timezone.utc) - at < self.FRESH_FOR else None

    def session_run(self, job_id: str) -> str | None:
        """The run of its session that took the turn (the one its `submit` signal reached)."""
        return self._ids[job_id][2] if job_id in self._ids else None

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._ids


def job_status(execution: WorkflowExecution) -> JobStatus:
    status = execution.status
    if status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW, None):
        own = execution.typed_search_attributes.get(sa.JOB_STATUS)
        return own if own in OPEN_STATUSES else "running"
    if status == WorkflowExecutionStatus.COMPLETED:
        return "completed"
    if status == WorkflowExecutionStatus.CANCELED:
        return "cancelled"
    return "failed"  # failed, terminated, timed out


def status_query(status: JobStatus) -> str:
    if status == "completed":
        return "ExecutionStatus = 'Completed'"
    if status == "cancelled":
        return "ExecutionStatus = 'Canceled'"
    if status == "failed":
        return "ExecutionStatus IN ('Failed', 'Terminated', 'TimedOut')"
    return f"ExecutionStatus = 'Running' AND {sa.JOB_STATUS.name} = '{status}'"


def list_query(tenant: str, *, status: JobStatus | None = None, kind: JobKind | None = None,
               extra: dict[str, str] | None = None) -> str:
    kinds = [kind] if kind else list(JOB_KINDS)
    # The tenant is a validated identifier ([a-z0-9-]), never free text.
    clauses = [f"{sa.TENANT.name} = '{tenant}'", f"{sa.JOB_KIND.name} IN ({', '.join(repr(k) for k in kinds)})"]
    if status:
        clauses.append(status_query(status))
    for key, value in (extra or {}).items():
        clauses.append(f"{key} = '{value}'")  # values are validated identifiers, never free text
    return " AND ".join(clauses)


def summary(execution: WorkflowExecution) -> JobSummary:
    attrs = execution.typed_search_attributes
    return JobSummary(job_id=execution.id, kind=attrs.get(sa.JOB_KIND), status=job_status(execution),
                      created_at=execution.start_time, updated_at=execution.close_time or execution.start_time,
                      collection=attrs.get(sa.COLLECTION))


def _latest_runs(executions) -> list[WorkflowExecution]:  # noqa: ANN001
    """One execution per workflow id, the first listed (visibility lists the latest run first)."""
    seen: dict[str, WorkflowExecution] = {}
    for execution in executions:
        seen.setdefault(execution.id, execution)
    return list(seen.values())


async def list_page(client: Client, cursors: CursorSigner, query: str, limit: int, cursor: str | None,
                    rpc_timeout: timedelta) -> tuple[list[WorkflowExecution], str | None]:
    """One page of the executions matching `query`, in the visibility store's order (running ones
    first, newest started first; then ended ones, newest ended first), and the cursor of the next page
    (None when there is none). A cursor this deployment did not sign for `query` is refused (422) before
    anything is asked of Temporal."""
    token = cursors.decode(query, cursor) if cursor else None
    pages = client.list_workflows(query, page_size=limit, next_page_token=token, rpc_timeout=rpc_timeout)
    try:
        await pages.fetch_next_page()
    except RPCError as exc:
        # A token we signed that the server no longer takes (e.g. after a change of its visibility store).
        if cursor and exc.status == RPCStatusCode.INVALID_ARGUMENT:
            raise invalid_cursor() from None
        raise
    token = pages.next_page_token
    if token and not await _more_after(client, query, token, rpc_timeout):
        token = None  # the page ended the listing exactly: no cursor to an empty page
    return _latest_runs(pages.current_page or []), cursors.encode(query, token) if token else None


async def _more_after(client: Client, query: str, token: bytes, rpc_timeout: timedelta) -> bool:
    """Whether anything is listed after `token`: a store hands one over with every full page, the last too.
    A peek that fails says yes: the page already read is still the caller's, and its cursor at worst leads
    to an empty page."""
    peek = client.list_workflows(query, page_size=1, next_page_token=token, rpc_timeout=rpc_timeout)
    try:
        await peek.fetch_next_page()
    except RPCError:
        return True
    return bool(peek.current_page)


# Reads a listing makes per job (a result, a failure, a query a worker answers), at most this many at once:
# a session of 1,000 turns must not send Temporal and the workers 1,000 requests in the same instant.
READS_AT_ONCE = 16


async def gather_reads(reads: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather` of per-job reads, READS_AT_ONCE at a time, results in order."""
    at_once = asyncio.Semaphore(READS_AT_ONCE)

    async def read(one: Awaitable[T]) -> T:
        async with at_once:
            return await one
    return list(await asyncio.gather(*(read(r) for r in reads)))


async def list_jobs(client: Client, query: str, limit: int, rpc_timeout: timedelta) -> list[WorkflowExecution]:
    """Latest run of each workflow id matching `query`, up to `limit` (order: `list_page`)."""
    seen: dict[str, WorkflowExecution] = {}
    async for execution in client.list_workflows(query, page_size=min(max(limit, 10), 1000), rpc_timeout=rpc_timeout):
        if execution.id not in seen:
            seen[execution.id] = execution
        if len(seen) >= limit:
            break
    return list(seen.values())


ENDED_STATUSES = ("completed", "failed", "cancelled")


async def latest_runs_only(client: Client, executions: list[WorkflowExecution],
                           rpc_timeout: timedelta) -> list[WorkflowExecution]:
    """The runs that are still their workflow's latest (one describe each, READS_AT_ONCE at a time)."""
    latest = await gather_reads(describe_or_none(client, e.id, rpc_timeout) for e in executions)
    return [e for e, now in zip(executions, latest) if now is not None and now.run_id == e.run_id]


async def describe_or_none(client: Client, workflow_id: str, rpc_timeout: timedelta):  # noqa: ANN201
    """The workflow's latest run, or None when Temporal has none under that id."""
    try:
        return await client.get_workflow_handle(workflow_id).describe(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


async def exists(client: Client, workflow_id: str, rpc_timeout: timedelta) -> bool:
    return await describe_or_none(client, workflow_id, rpc_timeout) is not None


def not_found(job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"no job with id {job_id!r}")


def owned(desc, tenant: str) -> bool:
    """A Ragline job of this tenant (and not some other workflow that happens to share the prefix)."""
    attrs = desc.typed_search_attributes
    return attrs.get(sa.JOB_KIND) in JOB_KINDS and attrs.get(sa.TENANT) == tenant


async def accepted_turn(client: Client, tenant: str, job_id: str, rpc_timeout: timedelta) -> TurnInput | None:
    """A chat turn its session has recorded but whose job does not exist yet (the session starts it
    when a worker runs it). Read from the session's history on the server, so it needs no worker."""
    job_id = scoped(tenant, job_id)
    session_id = session_of_turn(job_id)
    if session_id is None:
        return None
    handle = client.get_workflow_handle(session_workflow_id(tenant, session_id))
    deadline = asyncio.get_running_loop().time() + rpc_timeout.total_seconds()
    delay = 0.02
    try:
        while True:
            turn, task_running = await _submitted(client, handle, tenant, job_id, rpc_timeout)
            if turn is not None:
                return turn
            # A signal that reaches a workflow while one of its workflow tasks runs is held back by the
            # server ("buffered") and enters the history only when that task completes: a turn accepted
            # a moment ago may not be there yet. Look again once the running task is done.
            if not task_running or asyncio.get_running_loop().time() > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


class _Submits(BaseModel):
    """What one read of a session run's history says of the turns sent to it, by job id (not whole messages:
    a long session's would weigh megabytes)."""
    submitted: set[str] = set()  # job ids a `submit` of this tenant sent
    started: set[str] = set()  # job ids the run started or tried to (the job existed), or took as seen
    # Started, then sent again since (a resend after the job was gone): the session starts a job for it
    # (workflows/chat.py, IdempotencyKeyExpired), so it reads as accepted, not as gone.
    resent: set[str] = set()
    history_length: int = 0


# (session workflow id, run id) -> its turns, as its history was that long: a flood of reads of ids it never took
# (any key may send them) costs a look at the run and, while its history has not grown, no read of it, where each
# read fetched and decrypted every message the session was sent.
_SUBMITS: OrderedDict[tuple[str, str], _Submits] = OrderedDict()
_SUBMITS_KEPT = 64
_READING: dict[tuple[str, str, int], asyncio.Future[_Submits]] = {}


async def _submitted(client: Client, handle: WorkflowHandle, tenant: str, job_id: str,
                     rpc_timeout: timedelta) -> tuple[TurnInput | None, bool]:
    """The session's `submit` signal for `job_id`, if its history has it and the session has not started
    the job: a job the session started and that is gone (past the retention, deleted) is no job at all,
    not one still queued (its stream would wait for ever for events that never come). And whether a workflow
    task of the session runs now."""
    desc = await handle.describe(rpc_timeout=rpc_timeout)
    task_running = desc.raw_description.HasField("pending_workflow_task") and \
        desc.raw_description.pending_workflow_task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_STARTED
    # Pinned to the run described: the history read is the one its length names, or longer.
    run = client.get_workflow_handle(handle.id, run_id=desc.run_id)
    key, length = (handle.id, desc.run_id), desc.raw_description.workflow_execution_info.history_length
    if (turns := _SUBMITS.get(key)) is None or turns.history_length != length:
        # Reads that miss together share one (a flood of unknown ids arrives at once, not one by one).
        if (reading := _READING.get((*key, length))) is None:
            reading = _READING[(*key, length)] = asyncio.ensure_future(_read_submits(client, run, tenant, rpc_timeout))
            reading.add_done_callback(lambda _: _READING.pop((*key, length), None))
        turns = await asyncio.shield(reading)  # one caller gone does not cancel the others' read
        turns.history_length = length
        _SUBMITS[key] = turns
        while len(_SUBMITS) > _SUBMITS_KEPT:
            _SUBMITS.popitem(last=False)
    _SUBMITS.move_to_end(key)
    if job_id not in turns.submitted:
        return None, task_running
    if job_id in turns.started and job_id not in turns.resent and not await exists(client, job_id, rpc_timeout):
        return None, task_running
    # (Started a moment ago, after the caller found no job: read as just accepted, the job shows next time.)
    return await _submit_of(client, run, tenant, job_id, rpc_timeout), task_running


async def _submits(client: Client, run: WorkflowHandle, tenant: str,
                   rpc_timeout: timedelta) -> AsyncIterator[tuple[str, str | TurnInput]]:
    """The run's history as ("started", job id) for each job it started, tried to start (the job existed) or
    took as seen, and ("submitted", turn) for each turn a `submit` of this tenant sent."""
    async for event in run.fetch_history_events(rpc_timeout=rpc_timeout):
        if event.HasField("workflow_execution_started_event_attributes"):
            # An earlier run of the session (before a continue-as-new) took these: it started their jobs then.
            (state,) = await client.data_converter.decode(
                event.workflow_execution_started_event_attributes.input.payloads, [SessionState])
            for job_id in state.seen:
                yield "started", job_id
        elif event.HasField("child_workflow_execution_started_event_attributes"):
            yield "started", event.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id
        elif event.HasField("start_child_workflow_execution_failed_event_attributes"):  # it existed then
            yield "started", event.start_child_workflow_execution_failed_event_attributes.workflow_id
        elif event.HasField("workflow_execution_signaled_event_attributes"):
            signaled = event.workflow_execution_signaled_event_attributes
            if signaled.signal_name != "submit":
                continue  # payloads are encrypted: no peeking at the bytes before decoding
            (turn,) = await client.data_converter.decode(signaled.input.payloads, [TurnInput])
            if turn.tenant == tenant:
                yield "submitted", turn


async def _read_submits(client: Client, run: WorkflowHandle, tenant: str, rpc_timeout: timedelta) -> _Submits:
    turns = _Submits()
    async for what, item in _submits(client, run, tenant, rpc_timeout):
        if what == "started":
            turns.started.add(item)
            turns.resent.discard(item)
        else:
            turns.submitted.add(item.job_id)
            if item.job_id in turns.started:
                turns.resent.add(item.job_id)
    return turns


async def _submit_of(client: Client, run: WorkflowHandle, tenant: str, job_id: str,
                     rpc_timeout: timedelta) -> TurnInput | None:
    """The `submit` that sent `job_id`: its latest (a resend after its job was gone is the one a job comes for)."""
    found = None
    async for what, item in _submits(client, run, tenant, rpc_timeout):
        if what == "submitted" and item.job_id == job_id:
            found = item
    return found


async def wait_until_created(client: Client, tenant: str, job_id: str, rpc_timeout: timedelta, *,
                             pending: bool = False) -> bool:
    """Waits while `job_id` is an accepted turn whose job its session has not started yet (no worker,
    or earlier turns of the session still starting). False when there is no such job at all.
    `pending`: the caller has just found the turn accepted and its job missing; the wait begins there."""
    job_id = scoped(tenant, job_id)
    if pending and await _session_starts(client, tenant, job_id, SESSION_WATCH) == "closed":
        return await exists(client, job_id, rpc_timeout)
    while not await exists(client, job_id, rpc_timeout):
        if await accepted_turn(client, tenant, job_id, rpc_timeout) is None:
            return await exists(client, job_id, rpc_timeout)
        if await _session_starts(client, tenant, job_id, SESSION_WATCH) == "closed":
            # Its session's run ended without starting it (terminated by hand): no run will (README).
            return await exists(client, job_id, rpc_timeout)
    return True


async def never_started(client: Client, tenant: str, job_id: str, rpc_timeout: timedelta,
                        accepted_by: str | None = None) -> tuple[str, datetime] | None:
    """Why, and since when, an accepted turn's job will never run: its session's run ended (terminated by
    hand, README) without starting it. None while the session runs, or when the job exists after all.
    `accepted_by`: the session run that took the turn, when known (RecentlyAccepted): its session id may
    have been used again since, a new chain that will not start it."""
    job_id = scoped(tenant, job_id)
    workflow_id = session_workflow_id(tenant, session_of_turn(job_id))
    session = await describe_or_none(client, workflow_id, rpc_timeout)
    if session is None:
        return None
    if session.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW):
        if accepted_by is None or session.run_id == accepted_by:
            return None
        try:
            took = await client.get_workflow_handle(workflow_id, run_id=accepted_by).describe(rpc_timeout=rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        chain = took.raw_description.workflow_execution_info.first_run_id
        if took.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW) or \
                not chain or chain == session.raw_description.workflow_execution_info.first_run_id:
            return None  # its chain runs on (continued as new, or reset by an operator)
        session = took
    if await exists(client, job_id, rpc_timeout):  # started just before its session's run ended
        return None
    how = session.status.name.lower().replace("canceled", "cancelled").replace("_", " ")
    return (f"its session's workflow was {how} before it started this turn's job: the turn never ran (no model "
            f"was called for it); send the question again", session.close_time or datetime.now(timezone.utc))


async def _session_starts(client: Client, tenant: str, job_id: str, wait: timedelta) -> str:
    """Until the turn's session has started (or tried to start) the job `job_id` ("started"), its run
    ended without doing so ("closed"), or `wait` passes ("waited"): a long poll on the session's history,
    which the server answers as events arrive, rather than asking again and again (a burst of accepted
    turns would cost the server that much)."""
    handle = client.get_workflow_handle(session_workflow_id(tenant, session_of_turn(job_id)))

    async def watch() -> str:
        async for event in handle.fetch_history_events(wait_new_event=True, rpc_timeout=wait):
            if event.HasField("child_workflow_execution_started_event_attributes"):
                started = event.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id
                if started == job_id:
                    return "started"
            elif event.HasField("start_child_workflow_execution_failed_event_attributes"):
                if event.start_child_workflow_execution_failed_event_attributes.workflow_id == job_id:
                    return "started"  # it existed already
        return "closed"  # a long poll of a history ends only with its run (a continue-as-new starts it first)

    try:
        return await asyncio.wait_for(watch(), wait.total_seconds())
    except (asyncio.TimeoutError, RPCError):
        return "waited"  # the caller looks again


async def describe_job(client: Client, tenant: str, job_id: str, rpc_timeout: timedelta, *,
                       ui_url: str | None = None, accepted: RecentlyAccepted | None = None) -> JobView:
    """`ui_url`: the Temporal Web UI's base URL, for the job's `links`; `accepted`: turns this process
    accepted lately (a queued one of them is not looked up in its session's history)."""
    asked, job_id = job_id, scoped(tenant, job_id)
    handle = client.get_workflow_handle(job_id)
    try:
        desc = await handle.describe(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            at = accepted.just_accepted(job_id) if accepted is not None else None
            if at is None and (turn := await accepted_turn(client, tenant, job_id, rpc_timeout)) is not None:
                at = turn.accepted_at or datetime.now(timezone.utc)  # a turn accepted before the time was kept
            # (A turn this process accepted a moment ago is not looked at: its session ran then.)
            if at is not None and datetime.now(timezone.utc) - at > QUEUED_A_MOMENT and \
                    (ended := await never_started(client, tenant, job_id, rpc_timeout,
                                                  accepted.session_run(job_id) if accepted else None)) is not None:
                return JobView(job_id=job_id, kind="chat", status="failed", created_at=at, updated_at=ended[1],
                               turn=None, steps=[], result=None, error=JobError(message=ended[0], type="SessionEnded"))
            if at is not None:
                return JobView(job_id=job_id, kind="chat", status="queued", created_at=at, updated_at=at,
                               turn=None, steps=[], result=None, error=None,
                               waiting_for=await turns_ahead(client, tenant, job_id, None, rpc_timeout))
            raise not_found(asked) from None
        raise
    if not owned(desc, tenant):
        raise not_found(asked)
    run_id = desc.run_id
    links = {"temporal_ui": f"{ui_url}/namespaces/{quote(client.namespace)}/workflows/{quote(job_id, safe='')}/"
                            f"{run_id}/history"} if ui_url else {}
    ended = desc.status in ENDED
    if ended and (kept := _ENDED_VIEWS.get((job_id, run_id))) is not None:
        _ENDED_VIEWS.move_to_end((job_id, run_id))
        return kept.model_copy(update={"links": links})
    view = summary(desc)
    turn = (await desc.memo()).get("turn") if view.kind == "chat" else None
    # Before a worker has taken its first task there is nothing to ask the workflow.
    started = desc.raw_description.workflow_execution_info.history_length > 2
    progress = await _progress(handle, rpc_timeout) if started else None
    steps = await _steps(client, progress, desc)
    result = error = None
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result(rpc_timeout=rpc_timeout)
    elif view.status == "failed":
        error = await failure_of(handle, desc, rpc_timeout)
        if view.kind == "ingest" and isinstance(error.details, dict) and "documents" in error.details:
            result = error.details  # none of the upload's documents was indexed: each one's outcome, as ever
    elif progress and progress.dead_letters:
        error = dead_letter_error(progress)
    step_times = [t for s in steps for t in (s.finished_at, s.started_at) if t]
    ahead = await turns_ahead(client, tenant, job_id, turn, rpc_timeout) if view.kind == "chat" and \
        view.status == "queued" else []
    job = JobView(job_id=view.job_id, kind=view.kind, status=view.status, created_at=view.created_at,
                  updated_at=max([view.updated_at, *_aware(step_times)]), turn=turn, steps=steps,
                  result=result, answer=progress.answer if progress and result is None else None,
                  error=error, operator_decisions=progress.decisions if progress else [],
                  trace_id=await trace_id(client, job_id, run_id, rpc_timeout), links=links, waiting_for=ahead,
                  progress_unreadable=started and progress is None)
    if ended and (progress is not None or not started):  # whole: its steps came from the workflow
        _ENDED_VIEWS[(job_id, run_id)] = job
        if len(_ENDED_VIEWS) > ENDED_VIEWS_KEPT:
            _ENDED_VIEWS.popitem(last=False)
    return job


def as_a_member_sees(view: JobView) -> JobView:
    """A job as a member key reads it: a review's proposal for reviewers only (a held chat answer, kept in
    the turn's result for the audit) is left out."""
    result = view.result
    review = result.get("review") if isinstance(result, dict) else None
    if not isinstance(review, dict) or not review.get("withheld"):
        return view
    shown = {**review, "proposed_action": without(review.get("proposed_action") or {}, review["withheld"])}
    return view.model_copy(update={"result": {**result, "review": shown}})


# A session's open turns shown on a queued one (a person needs the first of them).
MAX_TURNS_AHEAD = 100


async def turns_ahead(client: Client, tenant: str, job_id: str, turn: int | None,
                      rpc_timeout: timedelta) -> list[TurnAhead]:
    """The earlier turns of a queued turn's session that are still open and have no answer yet (all of the
    session's such turns when `turn` is not numbered yet), read from visibility: a person learns that turn 3,
    dead-lettered, is what holds turn 4, and that cancelling or retrying it lets the session go on. Best effort: a
    listing that fails leaves the field empty, a turn whose memo cannot be read shows without its number,
    rather than failing the whole read."""
    session_id = session_of_turn(job_id)
    if session_id is None or turn == 1:
        return []
    query = f"{list_query(tenant, kind='chat', extra={sa.SESSION.name: session_id})} AND ExecutionStatus = 'Running'"
    try:
        executions = await list_jobs(client, query, MAX_TURNS_AHEAD, rpc_timeout)
    except RPCError:
        return []
    ahead = []
    for execution in executions:
        try:
            memo = await execution.memo()
        except Exception:  # noqa: BLE001 - a payload this API cannot decode (another codec key)
            memo = {}
        number = memo.get("turn")
        if memo.get(ANSWERED_MEMO):
            continue  # it has told the session its answer: only its summary and entities still run
        if execution.id != job_id and (turn is None or number is None or number < turn):
            ahead.append(TurnAhead(job_id=execution.id, turn=number, status=job_status(execution)))
    return sorted(ahead, key=lambda t: t.turn or 0)


# An ended run never changes, and its steps are read by a query, which a worker answers by replaying the
# whole history: a client polling a finished job would keep a worker busy for nothing. Its view is kept
# (per API process, the most recently read first), and a read costs one describe (ownership, run id).
ENDED = frozenset({WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.FAILED, WorkflowExecutionStatus.CANCELED,
                   WorkflowExecutionStatus.TERMINATED, WorkflowExecutionStatus.TIMED_OUT})
ENDED_VIEWS_KEPT = 2000
_ENDED_VIEWS: OrderedDict[tuple[str, str], JobView] = OrderedDict()


_TRACE_IDS: dict[tuple[str, str], str | None] = {}


async def trace_id(client: Client, job_id: str, run_id: str, rpc_timeout: timedelta) -> str | None:
    """The trace a run belongs to: the tracing header of its first history event (it never changes,
    so it is read once per run)."""
    key = (job_id, run_id)
    if key not in _TRACE_IDS:
        found = None
        async for event in client.get_workflow_handle(job_id, run_id=run_id).fetch_history_events(
                page_size=1, rpc_timeout=rpc_timeout):
            header = event.workflow_execution_started_event_attributes.header.fields.get(tracing.TEMPORAL_HEADER)
            if header is not None:
                carrier = client.data_converter.payload_converter.from_payloads([header])[0]
                found = tracing.trace_id_of(carrier.get("traceparent"))
            break
        if len(_TRACE_IDS) > 10_000:
            _TRACE_IDS.clear()
        _TRACE_IDS[key] = found
    return _TRACE_IDS[key]


def _aware(values: list[datetime]) -> list[datetime]:
    return [v if v.tzinfo else v.replace(tzinfo=timezone.utc) for v in values]


def dead_letter_error(progress: JobProgress) -> JobError:
    """Why a dead-lettered job waits for an operator: its parked step, attempts and last error."""
    letter = progress.dead_letters[0]
    return JobError(message=f"step {letter.step} failed {letter.attempts} times: {letter.error}",
                    type="DeadLettered", details=[d.model_dump(mode="json") for d in progress.dead_letters])


async def dead_letter_of(handle: WorkflowHandle, rpc_timeout: timedelta) -> JobError | None:
    """A dead-lettered job's reason (None when no worker answers the job's `progress` query now)."""
    progress = await _progress(handle, rpc_timeout)
    return dead_letter_error(progress) if progress and progress.dead_letters else None


async def shown_answer(handle, rpc_timeout: timedelta) -> dict | None:
    """A chat turn's answer as shown before its end (None when none was, or no worker answers now)."""
    progress = await _progress(handle, rpc_timeout)
    return progress.answer if progress else None


async def _progress(handle, rpc_timeout: timedelta) -> JobProgress | None:
    timeout = min(rpc_timeout, PROGRESS_QUERY_TIMEOUT)
    try:
        return await asyncio.wait_for(handle.query("progress", result_type=JobProgress, rpc_timeout=timeout),
                                      timeout=timeout.total_seconds())
    except Exception:  # no worker to answer the query: show what the server knows
        return None


async def _steps(client: Client, progress: JobProgress | None, desc) -> list[StepState]:
    steps = [s.model_copy() for s in progress.steps] if progress else []
    # Live retry information comes from the server's view of activities still pending, found by the activity
    # each step runs (a step named apart from it, `plan 2`, included). Several steps open on one activity
    # (an upload's documents waiting on other uploads) cannot be told apart there: they keep their own view.
    by_activity: dict[str, list[StepState]] = {}
    for s in steps:
        by_activity.setdefault(s.activity or s.name, []).append(s)
    by_name = {s.name: s for s in steps}
    # A job that ended (cancelled during an activity's retry backoff, say) may still list the activity as
    # pending: its step is what the job's own log says (cancelled), not "running" for ever.
    live = desc.status == WorkflowExecutionStatus.RUNNING
    waiting, under_way = set(), set()
    for pending in desc.raw_description.pending_activities if live else ():
        open_steps = [s for s in by_activity.get(pending.activity_type.name, []) if s.status not in _STEP_ENDED]
        if len(open_steps) != 1:
            continue
        [step] = open_steps
        if step.status == "dead_lettered":  # a call of it waits for an operator: its error is the one it parked with
            continue
        # Scheduled, not started: no attempt of it runs now (it waits for a worker's slot, or its next attempt).
        scheduled = pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
        (waiting if scheduled else under_way).add(step.name)
        step.attempts = max(step.attempts, pending.attempt - 1 if scheduled else pending.attempt)
        if pending.HasField("last_failure") and (message := await failure_message(client, pending.last_failure)):
            step.error = message
            step.status = "running"
    # A step of many calls (a document's batches) waits only while none of its calls runs.
    for name in waiting - under_way:
        if by_name[name].status == "running":
            by_name[name].status = "waiting"
    # Ended from outside (`temporal workflow terminate`, a run timeout): the job's own bookkeeping never ran,
    # and its steps under way would show running for ever.
    if (ended := _ENDED_FROM_OUTSIDE.get(desc.status)) is not None:
        for step in steps:
            if step.status in ("running", "waiting", "dead_lettered"):
                step.status, step.error = "failed", f"the job was {ended} while this step ran"
    return steps


_STEP_ENDED = ("completed", "failed", "cancelled", "skipped")
_ENDED_FROM_OUTSIDE = {WorkflowExecutionStatus.TERMINATED: "terminated",
                       WorkflowExecutionStatus.TIMED_OUT: "timed out"}


async def failure_message(client: Client, failure: Failure) -> str:
    """The message of a failure read raw from Temporal (a pending activity's last failure, a history event):
    with payload encryption its `message` is "Encoded failure" and the real one travels in its encoded
    attributes, which the codec encrypts (temporal/converter.py). A failure recorded before, or without
    encryption, has its message in plain text and reads as it is. A key this API lacks raises CodecError."""
    if not failure.HasField("encoded_attributes"):
        return failure.message
    copy = Failure()
    copy.CopyFrom(failure)  # decode_failure decodes in place: the caller's proto stays as Temporal sent it
    error = await client.data_converter.decode_failure(copy)
    return getattr(error, "message", None) or str(error)


async def failure_of(handle: WorkflowHandle, execution: WorkflowExecution, rpc_timeout: timedelta) -> JobError:
    """Why a failed job failed: its workflow's failure (the step's error, a reviewer's rejection...)."""
    try:
        await handle.result(rpc_timeout=rpc_timeout)
    except WorkflowFailureError as exc:
        cause = exc.cause
        details = list(getattr(cause, "details", []) or [])
        return JobError(message=getattr(cause, "message", None) or str(cause),
                        type=getattr(cause, "type", None) or type(cause).__name__,
                        details=details[0] if details else None)
    except Exception as exc:  # terminated / timed out surface as other errors
        return JobError(message=str(exc), type=type(exc).__name__)
    return JobError(message=f"workflow ended {execution.status.name.lower()}", type="Workflow")


async def _owned_job(client: Client, tenant: str, job_id: str, rpc_timeout: timedelta,
                     action: str) -> tuple[str, WorkflowExecutionDescription]:
    """The job's scoped id and description, for an `action` on it. Unknown job (or another tenant's): 404;
    a chat turn its session has accepted but not started yet (no worker has run the session): 409."""
    asked, job_id = job_id, scoped(tenant, job_id)
    try:
        desc = await client.get_workflow_handle(job_id).describe(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        if await accepted_turn(client, tenant, job_id, rpc_timeout) is not None:
            if (ended := await never_started(client, tenant, job_id, rpc_timeout)) is not None:
                raise ApiError(409, "job_closed", f"turn {job_id} failed: {ended[0]}") from None
            raise ApiError(409, "job_not_started", f"turn {job_id} is accepted and its session has not started "
                                                   f"it yet (no worker has run the session): {action} it once it "
                                                   "has") from None
        raise not_found(asked) from None
    if not owned(desc, tenant):
        raise not_found(asked)
    return job_id, desc


async def cancel(client: Client, tenant: str, job_id: str, rpc_timeout: timedelta) -> str:
    """Ask a running job to stop: its steps are cancelled (a model call stops within the heartbeat
    interval) and it ends as `cancelled`. Cancelled already: the same answer again (a client that lost
    the first answer may send it again). Unknown job (or another tenant's): 404; ended otherwise: 409;
    a chat turn its session has accepted but not started yet (no worker has run the session): 409."""
    job_id, desc = await _owned_job(client, tenant, job_id, rpc_timeout, "cancel")
    closed = ApiError(409, "job_closed", f"job {job_id} has already ended ({job_status(desc)})")
    if desc.status == WorkflowExecutionStatus.CANCELED:
        return job_id
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise closed
    try:
        await client.get_workflow_handle(job_id, run_id=desc.run_id).cancel(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:  # it ended in between
            raise closed from None
        raise
    return job_id


async def send_update(client: Client, tenant: str, job_id: str, name: str, payload: BaseModel,
                      result_type: type[Ack], rpc_timeout: timedelta, *, refused_code: str,
                      update_id: str | None = None, kinds: tuple[str, ...] | None = None) -> Ack:
    """A person's decision on a job (operator retry/discard, review), as a validated Update; answers
    the workflow's acknowledgement. Unknown job (or another tenant's): 404; refused by the workflow's
    validator, or a job of a kind not in `kinds` (which never waits for it): 409 with its reason (422 when
    the decision itself is invalid); job ended: 409. `update_id`: the same decision sent again under it
    gets the first one's acknowledgement (Temporal keeps an Update's outcome by id while the job runs)."""
    # The job's description, not its whole view: that asks the workflow for its progress too.
    job_id, desc = await _owned_job(client, tenant, job_id, rpc_timeout, name)
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise ApiError(409, "job_closed", f"job {job_id} has already ended ({job_status(desc)})")
    kind = desc.typed_search_attributes.get(sa.JOB_KIND)
    if kinds is not None and kind is not None and kind not in kinds:  # None: started by hand, not known
        raise ApiError(409, refused_code, f"job {job_id} ({kind}) never waits for a {name}")
    try:
        ack = await client.get_workflow_handle(job_id).execute_update(
            name, payload, id=update_id, result_type=result_type, rpc_timeout=rpc_timeout)
    except WorkflowUpdateFailedError as exc:
        message = getattr(exc.cause, "message", None) or str(exc.cause)
        if getattr(exc.cause, "type", None) == "InvalidReview":  # what was sent is wrong, not the job's state
            raise ApiError(422, "invalid_review", message) from None
        raise ApiError(409, refused_code, message) from None
    except RPCError as exc:
        if exc.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
            raise
        if exc.status == RPCStatusCode.FAILED_PRECONDITION and await _still_running(client, job_id, rpc_timeout):
            # Temporal takes no Update while the job's workflow task keeps failing (a worker's error).
            raise ApiError(409, "job_stuck", f"job {job_id} takes no decision now: its workflow task keeps failing "
                           "(see the worker log, or the job's page in the Temporal Web UI); an operator must fix "
                           "that first", job_id=job_id, reason=exc.message) from None
        raise ApiError(409, "job_closed", f"job {job_id} has already ended") from None
    return ack


async def _still_running(client: Client, job_id: str, rpc_timeout: timedelta) -> bool:
    desc = await describe_or_none(client, job_id, rpc_timeout)
    return desc is not None and desc.status == WorkflowExecutionStatus.RUNNING
