"""Where a chat turn's time goes, read back from the Temporal histories of the turn's job and of its session
(server timestamps; the bench, the server and the client share one clock on one machine)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from models.chat import session_workflow_id

ATTR = "_event_attributes"

# The segments of a turn, in order: each runs from the end of the one before (the first from the POST)
# to the moment named; together they make POST -> `ragline.job.completed` seen by the client.
TURN_SEGMENTS = [
    ("session_task", "session's first workflow task starts (after the signal-with-start)"),
    ("job_started", "the session has started the turn's job (child workflow)"),
    ("proceed", "the turn's job has its go (`proceed` signal from the session, or with its start)"),
    ("retrieve_scheduled", "`retrieve_context` scheduled (a workflow task of the turn)"),
    ("retrieve_started", "`retrieve_context` picked up by the worker (queue wait)"),
    ("retrieve_done", "`retrieve_context` done (embedding + vector search)"),
    ("answer_scheduled", "`generate_answer` scheduled"),
    ("answer_started", "`generate_answer` picked up (queue wait)"),
    ("answer_done", "`generate_answer` done (model stream + deltas published)"),
    ("side_scheduled", "`summarize_context` and `extract_entities` scheduled"),
    ("side_started", "both picked up (queue wait)"),
    ("side_done", "both done"),
    ("job_closed", "the job's workflow completed (terminal event, handlers drained)"),
    ("seen", "the client reads `ragline.job.completed` on the SSE stream"),
]
# Up to the first answer delta: the turn's segments up to the answer step's start, then the client's read.
FIRST_DELTA_SEGMENTS = TURN_SEGMENTS[:8] + [
    ("first_delta", "the client reads the first `ragline.answer.delta` (model's first token, published, relayed)"),
]
BARE_SEGMENTS = [
    ("activity_scheduled", "activity scheduled (first workflow task)"),
    ("activity_started", "activity picked up (queue wait)"),
    ("activity_done", "activity done"),
    ("closed", "workflow completed (second workflow task)"),
    ("seen", "the client has the result"),
]


def _kind(event) -> str:  # noqa: ANN001
    return (event.WhichOneof("attributes") or "").removesuffix(ATTR)


def _t(event) -> float:  # noqa: ANN001
    return event.event_time.seconds + event.event_time.nanos / 1e9


async def history(client, workflow_id: str) -> list:  # noqa: ANN001
    return [e async for e in client.get_workflow_handle(workflow_id).fetch_history_events()]


def _activities(events: list) -> dict[str, dict[str, float]]:
    """Activity name -> scheduled / started / completed times (the first attempt that completed)."""
    by_id: dict[int, str] = {}
    out: dict[str, dict[str, float]] = {}
    for e in events:
        kind = _kind(e)
        if kind == "activity_task_scheduled":
            name = e.activity_task_scheduled_event_attributes.activity_type.name
            by_id[e.event_id] = name
            out.setdefault(name, {})["scheduled"] = _t(e)
        elif kind == "activity_task_started":
            name = by_id.get(e.activity_task_started_event_attributes.scheduled_event_id)
            if name:
                out[name]["started"] = _t(e)
        elif kind in ("activity_task_completed", "activity_task_failed", "activity_task_timed_out"):
            attrs = getattr(e, kind + ATTR)
            name = by_id.get(attrs.scheduled_event_id)
            if name:
                out[name]["done"] = _t(e)
    return out


def counts(events: list) -> dict[str, int]:
    c = Counter(_kind(e) for e in events)
    return {"events": len(events), "workflow_tasks": c["workflow_task_completed"],
            "signals": c["workflow_execution_signaled"], "updates": c["workflow_execution_update_accepted"],
            "activities": c["activity_task_scheduled"]}


async def turn_timeline(client, job_id: str, session_id: str, wall_post: float,  # noqa: ANN001
                        seen_after: float | None, first_delta: float | None = None) -> dict[str, Any]:
    """Moments (seconds after the POST) of each point of TURN_SEGMENTS, and the history counts."""
    turn = await history(client, job_id)
    session = await history(client, _session_workflow(job_id, session_id))
    points: dict[str, float | None] = {name: None for name, _ in TURN_SEGMENTS}

    for e in session:
        kind = _kind(e)
        if kind == "workflow_task_started" and points["session_task"] is None:
            points["session_task"] = _t(e)
    started = next((_t(e) for e in turn if _kind(e) == "workflow_execution_started"), None)
    for e in turn:
        kind = _kind(e)
        if kind == "workflow_execution_signaled" and e.workflow_execution_signaled_event_attributes.signal_name \
                == "proceed" and points["proceed"] is None:
            points["proceed"] = _t(e)
        elif kind in ("workflow_execution_completed", "workflow_execution_failed"):
            points["job_closed"] = _t(e)
    points["job_started"] = started
    if points["proceed"] is None:  # the go came with the start (nothing ran before it in the session)
        points["proceed"] = started
    acts = _activities(turn)
    retrieve, answer = acts.get("retrieve_context", {}), acts.get("generate_answer", {})
    side = [acts[n] for n in ("summarize_context", "extract_entities") if n in acts]
    points["retrieve_scheduled"] = retrieve.get("scheduled")
    points["retrieve_started"] = retrieve.get("started")
    points["retrieve_done"] = retrieve.get("done")
    points["answer_scheduled"] = answer.get("scheduled")
    points["answer_started"] = answer.get("started")
    points["answer_done"] = answer.get("done")
    if side and all("done" in s for s in side):
        points["side_scheduled"] = max(s["scheduled"] for s in side)
        points["side_started"] = max(s["started"] for s in side)
        points["side_done"] = max(s["done"] for s in side)
    rel = {k: (v - wall_post if v is not None else None) for k, v in points.items()}
    rel["seen"] = seen_after
    rel["first_delta"] = first_delta
    return {"points": rel, "turn": counts(turn), "session": counts(session)}


async def turn_timelines(client, turns: list, concurrency: int = 16) -> list[dict | None]:  # noqa: ANN001
    """turn_timeline of each TurnTimes (None where it failed or has no job)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(t) -> dict | None:  # noqa: ANN001
        if not t.job_id:
            return None
        async with sem:
            try:
                return await turn_timeline(client, t.job_id, t.session_id, t.wall_post, t.terminal, t.first_delta)
            except Exception:  # noqa: BLE001 - a missing history leaves a gap, not a failed bench
                return None

    return list(await asyncio.gather(*(one(t) for t in turns)))


async def bare_timeline(client, workflow_id: str, wall_start: float, seen_after: float) -> dict[str, Any]:  # noqa: ANN001
    events = await history(client, workflow_id)
    acts = _activities(events)
    (act,) = acts.values() if len(acts) == 1 else ({},)
    closed = next((_t(e) for e in events if _kind(e) == "workflow_execution_completed"), None)
    points = {"activity_scheduled": act.get("scheduled"), "activity_started": act.get("started"),
              "activity_done": act.get("done"), "closed": closed}
    rel: dict[str, float | None] = {k: (v - wall_start if v is not None else None) for k, v in points.items()}
    rel["seen"] = seen_after
    return {"points": rel, "workflow": counts(events)}


def _session_workflow(job_id: str, session_id: str) -> str:
    """The session workflow's id, in the turn's tenant (the prefix of its job id) when ids carry one."""
    import inspect

    if len(inspect.signature(session_workflow_id).parameters) == 2:
        return session_workflow_id(job_id.split(".", 1)[0], session_id)
    return session_workflow_id(session_id)


def segment_stats(timelines: list[dict | None], order: list[tuple[str, str]], stats) -> dict[str, dict]:  # noqa: ANN001
    """Per segment of `order`, `stats` (bench.ratios.stats) over the timelines that have it."""
    rows = [segments(t["points"], order) for t in timelines if t]
    return {name: stats([r[name] for r in rows]) for name, _ in order}


def segments(points: dict[str, float | None], order: list[tuple[str, str]]) -> dict[str, float | None]:
    """Durations of each segment: its point minus the previous one's (the first from 0, the POST)."""
    out: dict[str, float | None] = {}
    prev: float | None = 0.0
    for name, _ in order:
        now = points.get(name)
        out[name] = (now - prev) if (now is not None and prev is not None) else None
        prev = now if now is not None else prev
    return out
