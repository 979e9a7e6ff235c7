"""Live job events over SSE, relayed from the job's durable Temporal stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError, WorkflowUpdateStage
from temporalio.contrib.workflow_streams import PollInput, PollResult
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

import worker
from api.job_views import _steps, wait_until_created
from api.routes import events as events_route
from api.routes.events import _progress_event, _relay
from ragline.settings import Settings
from temporal import policies
from temporal.converter import build_data_converter
from tests.conftest import running_stack, shared_pdf
from tests.helpers import eventually, read_events, waiting_reviews
from models.chat import ChatQuestion, SessionState, TurnInput, session_workflow_id, turn_job_id
from models.jobs import JobProgress, StepState
from workflows import events as events_mod
from workflows.events import JobEvents


async def test_ingestion_events_stream_and_resume(stack):
    body = await stack.upload(("pages.pdf", shared_pdf("pdflatex-outline.pdf").read_bytes()),
                              ("hello.txt", b"Hello from a text file about lighthouses."), collection="events")
    events = await read_events(stack, body["job_id"])
    types = [e["type"] for _, e in events]
    assert types[0] == "ragline.job.accepted"
    assert types[-1] == "ragline.job.completed"
    assert types.count("ragline.step.started") == 2 and types.count("ragline.step.completed") == 2
    for event_id, event in events:
        assert event["specversion"] == "1.0" and event["subject"] == body["job_id"]
        assert {"id", "source", "type", "time", "data"} <= set(event)
    ids = [int(i) for i, _ in events]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "offsets have gaps"
    assert len({e["id"] for _, e in events}) == len(events)

    # Reconnecting after the second event gives exactly the rest, nothing missed, nothing repeated.
    resumed = await read_events(stack, body["job_id"], last_event_id=str(ids[1]))
    assert [e for _, e in resumed] == [e for _, e in events[2:]]
    # After the terminal event of the ended job there is nothing more: 204, which tells a browser's
    # EventSource to stop reconnecting (an empty 200 would have it reconnect for ever).
    r = await stack.http.get(f"/v1/jobs/{body['job_id']}/events", headers={"Last-Event-ID": str(ids[-1])})
    assert r.status_code == 204 and r.content == b""
    assert [e for _, e in await read_events(stack, body["job_id"], last_event_id=str(ids[-2]))] == [events[-1][1]]

    # The document's own job streams its DAG steps.
    doc_job = body["documents"][0]["document_id"]
    doc_events = await read_events(stack, f"doc-{doc_job}")
    started = [e["data"]["step"] for _, e in doc_events if e["type"] == "ragline.step.started"]
    assert started == ["extract_text", "chunk_text", "embed_chunks", "index_chunks", "prune_stale_chunks"]


async def test_failed_job_stream_ends_with_the_reason(stack):
    body = await stack.upload(("scan.pdf", shared_pdf("git.pdf").read_bytes()), collection="events")
    events = await read_events(stack, body["job_id"])
    assert events[-1][1]["type"] == "ragline.job.failed"
    assert "no extractable text" in events[-1][1]["data"]["error"]


async def _history(stack, job_id: str) -> list:
    handle = stack.client.get_workflow_handle(job_id)  # the API's job ids are the workflow ids
    return [e async for e in handle.fetch_history_events()]


async def test_a_watched_job_hands_its_terminal_event_to_the_waiting_stream(stack):
    """The terminal event leaves with the run's last workflow task, as the answer to the stream's poll:
    no poll comes after the run closed (a query, which a worker answers by replaying the history)."""
    doc = await stack.upload(("cranes.txt", b"Harbour cranes at the north pier lift forty tonnes."),
                             collection="events-linger")
    assert (await stack.wait_done(doc["job_id"]))["status"] == "completed"
    # Three turns: whether the last poll is already waiting when the run ends is a race; each turn
    # must win it.
    for attempt in range(3):
        with stack.llm.scope(delay=0.3) as llm:  # the turn still runs when its stream subscribes
            turn = await stack.chat(f"How much do the harbour cranes lift ({attempt})? {llm.token}",
                                    collection="events-linger")
            events = await read_events(stack, turn["job_id"])
        assert events[-1][1]["type"] == "ragline.job.completed"
        history = await _history(stack, turn["job_id"])
        last_task = max(i for i, e in enumerate(history)
                        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
        tail = [e.event_type for e in history[last_task + 1:]]
        assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED in tail, tail
        assert tail[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED


async def test_a_job_nobody_watches_ends_without_waiting_for_a_stream(stack):
    body = await stack.upload(("unwatched.txt", b"An unwatched text about harbour cranes."),
                              collection="events-linger")
    assert (await stack.wait_done(body["job_id"]))["status"] == "completed"
    history = await _history(stack, body["job_id"])
    assert not [e for e in history if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED]
    assert not [e for e in history if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED]


async def test_many_watchers_of_one_job_share_one_poll_and_leave_room_for_a_decision(stack):
    """Temporal admits about 10 Updates in flight per workflow, and each stream poll is one: a dozen
    open tabs on a job would be refused, and so would the reviewer's decision. An API process polls
    each job once, whoever watches it."""
    seed = await stack.upload(("tides.txt", b"High tide at Vell harbour is at noon."), collection="watched")
    await stack.wait_job(seed["job_id"])
    r = await stack.http.post("/v1/chats", json={"message": "When is high tide at Vell?", "collection": "watched",
                                                 "require_review": True})
    job_id = r.json()["job_id"]
    watchers = [asyncio.create_task(read_events(stack, job_id)) for _ in range(12)]
    await waiting_reviews(stack, job_id)
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "ana"})
    assert r.status_code == 200, r.text
    seen = await asyncio.gather(*watchers)
    assert all(events == seen[0] for events in seen)
    assert seen[0][-1][1]["type"] == "ragline.job.completed"
    assert [int(i) for i, _ in seen[0]] == list(range(len(seen[0])))
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    polls = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
             and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name != "review"]
    # One subscriber's polls, not one per watcher: a poll returns at least one new event, so there are no
    # more polls than events (a held answer's steps go out as they happen); twelve pollers would make
    # about twelve times as many.
    assert len(polls) <= len(seen[0]), (len(polls), len(seen[0]))


async def _held_turn(stack, tag: str) -> str:
    """A chat turn whose answer waits for a reviewer: its job publishes nothing meanwhile."""
    seed = await stack.upload((f"{tag}.txt", f"High tide at {tag} harbour is at noon.".encode()), collection=tag)
    await stack.wait_job(seed["job_id"])
    r = await stack.http.post("/v1/chats", json={"message": f"When is high tide at {tag}?", "collection": tag,
                                                 "require_review": True})
    job_id = r.json()["job_id"]
    await waiting_reviews(stack, job_id)
    return job_id


async def test_polls_whose_readers_went_away_leave_room_for_a_decision(stack):
    """A poll waits in the job until its next event, and Temporal keeps it in flight after its reader has gone:
    an SSE client that reconnects, an API process restarted. A held answer publishes nothing until its review,
    so ten gone readers took every Update the job may have in flight, and the reviewer's decision was refused
    (502) until the review timed out. The oldest waiting polls now return empty once newer ones wait."""
    job_id = await _held_turn(stack, f"gone{uuid.uuid4().hex[:8]}")
    handle = stack.client.get_workflow_handle(job_id)
    end = await handle.query("__temporal_workflow_stream_offset", result_type=int)
    gone = []
    for _ in range(12):  # each reader polls from the end, then goes away without its answer
        try:
            gone.append(await handle.start_update(
                events_mod.POLL_UPDATE, PollInput(topics=["events"], from_offset=end),
                wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=PollResult))
        except RPCError as exc:  # refused: every Update the job may have in flight is taken
            assert exc.status == RPCStatusCode.RESOURCE_EXHAUSTED, exc
    # The oldest came back empty while the job still waits for its review; five wait on.
    early = [await asyncio.wait_for(poll.result(), 10) for poll in gone[:7]]
    assert all(result.items == [] and result.next_offset == end for result in early), early
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "ana"})
    assert r.status_code == 200, r.text
    assert (await stack.wait_done(job_id))["status"] == "completed"


async def test_a_job_past_its_polls_streams_on_by_query_and_still_takes_a_decision(stack, monkeypatch):
    """Temporal takes 2,000 Updates per run, stream polls and decisions alike: a long watched job (a large
    document's batches) or a thousand reconnects used them all, its stream died and an operator's retry
    was refused. Polls stop before (here after 3): the stream goes on by query, decisions still land."""
    monkeypatch.setattr(events_mod, "MAX_POLLS_PER_RUN", 3)
    job_id = await _held_turn(stack, f"spent{uuid.uuid4().hex[:8]}")
    handle = stack.client.get_workflow_handle(job_id)
    for _ in range(3):  # a reader reconnecting from the start: each poll answers at once
        await handle.execute_update(events_mod.POLL_UPDATE, PollInput(topics=["events"], from_offset=0),
                                    result_type=PollResult)
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update(events_mod.POLL_UPDATE, PollInput(topics=["events"], from_offset=0),
                                    result_type=PollResult)
    assert refused.value.cause.type == events_mod.POLLS_SPENT
    # While the job runs (its answer waits for review), a stream opened now shows what happened so far ...
    so_far = await asyncio.wait_for(read_events(stack, job_id, stop_after=1), 30)
    assert so_far[0][1]["type"] == "ragline.job.accepted", so_far
    # ... and, to the end, what comes next.
    reading = asyncio.create_task(read_events(stack, job_id))
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "ana"})
    assert r.status_code == 200, r.text
    events = await asyncio.wait_for(reading, 60)
    assert [int(i) for i, _ in events] == list(range(len(events)))
    types = [e["type"] for _, e in events]
    assert types[0] == "ragline.job.accepted" and "ragline.answer.completed" in types, types
    assert types[-1] == "ragline.job.completed", types


@dataclasses.dataclass
class _Item:
    offset: int
    data: dict


def _relay_of(queue: asyncio.Queue, key_valid) -> tuple:
    """The relay of a job whose events are what the test puts in `queue` (no Temporal: the stream is open)."""
    async def items():
        while True:
            yield await queue.get()

    followed = items()
    opened = (followed, asyncio.ensure_future(followed.__anext__()))
    return _relay(None, None, "acme", "acme.x", 0, timedelta(seconds=5), timedelta(0), False, opened,
                  key_valid=key_valid)


async def test_a_stream_sends_no_event_once_its_key_is_revoked():
    """The key is looked at again before each event: one revoked after the stream opened reads nothing more."""
    queue, valid = asyncio.Queue(), [True]
    relay = _relay_of(queue, lambda: valid[0])
    queue.put_nowait(_Item(0, {"type": "ragline.review.requested"}))
    assert (await anext(relay)).id == "0"
    valid[0] = False
    queue.put_nowait(_Item(1, {"type": "ragline.answer.completed", "data": {"answer": "secret"}}))
    queue.put_nowait(_Item(2, {"type": "ragline.job.completed"}))
    rest = await asyncio.wait_for(_rest(relay), timeout=10)
    assert [(e.data, e.comment) for e in rest] == [(None, "the API key of this stream is no longer valid")]


async def test_an_idle_stream_ends_soon_after_its_key_is_revoked(monkeypatch):
    """No event may come for days (a job waiting for a review): the key is looked at while idle too."""
    monkeypatch.setattr(events_route, "KEY_CHECK_SECONDS", 0.05)
    queue, valid = asyncio.Queue(), [True]
    relay = _relay_of(queue, lambda: valid[0])
    queue.put_nowait(_Item(0, {"type": "ragline.review.requested"}))
    assert (await anext(relay)).id == "0"
    valid[0] = False
    rest = await asyncio.wait_for(_rest(relay), timeout=5)  # PROGRESS_AFTER (30 s) is far off
    assert [e.comment for e in rest] == ["the API key of this stream is no longer valid"]


async def test_a_stream_of_a_turn_whose_session_was_terminated_before_starting_it_ends(temporal_env, tmp_path):
    """The session accepted the turn (its `submit` is in the session's history), then was terminated by hand
    before it started the turn's job: no run will start it. A stream waiting for that job ends, rather than
    read the closed session's history again and again, at once."""
    session = f"s-{uuid.uuid4().hex[:8]}"
    client = Client(temporal_env.client.service_client,  # payloads as Ragline writes them
                    data_converter=build_data_converter(Settings(data_dir=tmp_path, encrypt_payloads=False)))
    job_id = f"acme.{turn_job_id(session, 'k')}"
    turn = TurnInput(tenant="acme", job_id=job_id, session_id=session,
                     question=ChatQuestion(message="Anyone there?", collection="default"))
    handle = await client.start_workflow(  # as POST /v1/chats does; no worker polls this queue
        "ChatSessionWorkflow", SessionState(tenant="acme", session_id=session),
        id=session_workflow_id("acme", session), task_queue=f"nobody-{session}",
        start_signal="submit", start_signal_args=[turn])
    await handle.terminate("by hand, from the Web UI")
    created = await asyncio.wait_for(
        wait_until_created(client, "acme", job_id, timedelta(seconds=5), pending=True), timeout=30)
    assert created is False


async def _rest(relay) -> list:
    return [e async for e in relay]


async def test_a_summary_the_answer_waits_for_shows_the_turn_at_work(temporal_env, scripted_llm, tmp_path):
    """A chat turn keeps its step events until its first answer delta, except while a summary runs before
    the answer (passages too long for the model's context): that can take tens of seconds on a local model,
    and the person sees the steps meanwhile, not nothing."""
    tag = uuid.uuid4().hex[:8]
    address = temporal_env.client.service_client.config.target_host
    # A context this small holds no passage: every turn summarizes before it answers. The summary takes
    # 5 s (the stack's model timeout allows it): the step must show within them.
    async with running_stack(address, scripted_llm, tmp_path, task_queue=f"summary-first-{tag}",
                             llm_context_tokens=700, llm_max_tokens=64, llm_timeout=30) as stack:
        collection = f"summary-first-{tag}"
        text = " ".join(f"Lighthouse {n} guides ships along the rocky coast at night with a rotating lamp."
                        for n in range(8))
        upload = await stack.upload(("lights.txt", text.encode()), collection=collection)
        assert (await stack.wait_done(upload["job_id"]))["status"] == "completed"
        with scripted_llm.scope() as llm:
            llm.script("summarize", [{"content": "Lighthouses guide ships at night.", "delay": 5}])
            accepted = await stack.chat(f"What do lighthouses do? {llm.token}", collection=collection)
            seen: list[dict] = []
            summary_done_when_shown = None
            async with stack.http.stream("GET", f"/v1/jobs/{accepted['job_id']}/events",
                                         timeout=httpx.Timeout(60)) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    seen.append(event)
                    if event["type"] == "ragline.step.started" and event["data"]["step"] == "summarize_context":
                        summary_done_when_shown = any(c.finished_at for c in llm.calls("summarize"))
    types = [e["type"] for e in seen]
    assert types[0] == "ragline.job.accepted" and types[-1] == "ragline.job.completed", types
    assert summary_done_when_shown is False, types  # shown while the summary was still being written
    assert llm.count("summarize") == 1
    first_delta = types.index("ragline.answer.delta")
    started = [e["data"]["step"] for e in seen[:first_delta] if e["type"] == "ragline.step.started"]
    assert started == ["retrieve_context", "summarize_context", "generate_answer"], started


async def test_a_turn_whose_answer_waits_for_review_shows_its_steps_as_they_happen(stack):
    """A held answer is not streamed, so no answer delta carries the step events along: each goes out at
    once, and the person sees the turn at work instead of nothing until the review (minutes on a local model)."""
    collection = f"held-steps-{uuid.uuid4().hex[:8]}"
    seed = await stack.upload(("tides.txt", b"High tide at Vell harbour is at noon. Low tide follows at six."),
                              collection=collection)
    assert (await stack.wait_done(seed["job_id"]))["status"] == "completed"
    with stack.llm.scope() as llm:
        llm.script("answer", [{"content": "High tide is at noon [1].", "delay": 2}])
        r = await stack.http.post("/v1/chats", json={"message": f"When is high tide at Vell? {llm.token}",
                                                     "collection": collection, "require_review": True})
        job_id = r.json()["job_id"]
        answer_done_when_shown = None
        async with stack.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(60)) as events:
            async for line in events.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if event["type"] == "ragline.step.started" and event["data"]["step"] == "generate_answer":
                    answer_done_when_shown = any(c.finished_at for c in llm.calls("answer"))
                if event["type"] == "ragline.review.requested":
                    break
        decided = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "reject", "reviewer": "ed"})
        assert decided.status_code == 200, decided.text
    assert answer_done_when_shown is False  # shown while the answer was still being written


@activity.defn(name="held_step")
async def held_step() -> None:
    activity.heartbeat({"page": 3, "pages": 10})  # what a long step says of its progress
    await asyncio.Event().wait()  # runs until the test ends the workflow


@workflow.defn(name="TwoStepsUnderWay", sandboxed=False)
class TwoStepsUnderWay:
    @workflow.run
    async def run(self, queue: str) -> None:
        options = {"start_to_close_timeout": timedelta(minutes=5)}
        await asyncio.gather(workflow.execute_activity("held_step", task_queue=queue, **options),
                             workflow.execute_activity("held_step", task_queue=f"{queue}-nobody-polls", **options))


async def test_the_progress_event_tells_a_step_that_runs_from_one_waiting_for_a_worker(temporal_env):
    """`ragline.job.running`, sent on a quiet stream: a step a worker runs says how long it has run; one
    no worker has picked up yet (a local model's one slot is busy, say) says it waits, and since when."""
    client, queue = temporal_env.client, f"progress-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[TwoStepsUnderWay], activities=[held_step]):
        handle = await client.start_workflow(TwoStepsUnderWay.run, queue, id=queue, task_queue=queue)
        try:
            async def both_pending() -> dict | None:
                event = await _progress_event(client, handle.id, timedelta(seconds=5))
                running = event["data"]["running"] if event else []
                states = sorted((s["state"], s["progress"] is not None) for s in running)
                return event if states == [("running", True), ("waiting", False)] else None
            event = await eventually(both_pending, what="one step running, one waiting")
        finally:
            await handle.terminate("test over")
    assert event["type"] == "ragline.job.running" and event["subject"] == handle.id
    running, waiting = sorted(event["data"]["running"], key=lambda s: s["state"])
    assert running["step"] == waiting["step"] == "held_step"
    assert running["running_for_s"] >= 0 and running["waiting_for_s"] is None
    assert waiting["waiting_for_s"] >= 0 and waiting["running_for_s"] is None
    assert running["progress"] == {"page": 3, "pages": 10} and waiting["progress"] is None


@workflow.defn(name="WaitsOnItsChild", sandboxed=False)
class WaitsOnItsChild:
    """An upload waiting on its document's job: it runs no activity of its own."""
    @workflow.run
    async def run(self, queue: str) -> None:
        await workflow.execute_child_workflow(TwoStepsUnderWay.run, queue, id=f"{workflow.info().workflow_id}-doc")


async def test_the_progress_event_of_a_job_waiting_on_its_child_tells_the_childs_steps(temporal_env):
    """An upload's stream: its documents' jobs are what runs, so `ragline.job.running` lists their steps,
    each with its job's id and its progress (the page a long PDF is at)."""
    client, queue = temporal_env.client, f"parent-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[WaitsOnItsChild, TwoStepsUnderWay],
                      activities=[held_step]):
        handle = await client.start_workflow(WaitsOnItsChild.run, queue, id=queue, task_queue=queue)
        try:
            async def child_running() -> dict | None:
                event = await _progress_event(client, handle.id, timedelta(seconds=5))
                running = event["data"]["running"] if event else []
                return event if any(s["progress"] for s in running) else None
            event = await eventually(child_running, what="the child's step running, with its progress")
        finally:
            await handle.terminate("test over")  # and its child with it (the default parent close policy)
    assert event["subject"] == handle.id
    assert sorted((s["job_id"], s["step"], s["state"], s["progress"] is not None)
                  for s in event["data"]["running"]) == [(f"{queue}-doc", "held_step", "running", True),
                                                         (f"{queue}-doc", "held_step", "waiting", False)]


@activity.defn(name="other_held_step")
async def other_held_step() -> None:
    await asyncio.Event().wait()


SCHEDULED, STARTED = (PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED,
                      PendingActivityState.PENDING_ACTIVITY_STATE_STARTED)


@workflow.defn(name="OneStepWaitsOneRunsTwice", sandboxed=False)
class OneStepWaitsOneRunsTwice:
    @workflow.run
    async def run(self, queue: str) -> None:
        options = {"start_to_close_timeout": timedelta(minutes=5)}
        nobody = f"{queue}-nobody-polls"
        await asyncio.gather(workflow.execute_activity("held_step", task_queue=queue, **options),
                             workflow.execute_activity("held_step", task_queue=nobody, **options),
                             workflow.execute_activity("other_held_step", task_queue=nobody, **options))


async def test_a_job_shows_a_step_no_worker_has_picked_up_as_waiting(temporal_env):
    """`GET /v1/jobs/{id}`: a step whose activity waits for a worker's slot (a local model's one slot is
    busy) shows `waiting` with no attempt made, not `running`; a step of many calls (a document's
    batches) runs while any of its calls does."""
    client, queue = temporal_env.client, f"steps-{uuid.uuid4().hex[:8]}"
    shown = JobProgress(status="running", steps=[StepState(name="held_step", status="running"),
                                                 StepState(name="other_held_step", status="running")])
    async with Worker(client, task_queue=queue, workflows=[OneStepWaitsOneRunsTwice], activities=[held_step]):
        handle = await client.start_workflow(OneStepWaitsOneRunsTwice.run, queue, id=queue, task_queue=queue)
        try:
            async def all_pending() -> list | None:
                desc = await handle.describe()
                states = sorted(p.state for p in desc.raw_description.pending_activities)
                return await _steps(client, shown, desc) if states == [SCHEDULED, SCHEDULED, STARTED] else None
            steps = await eventually(all_pending, what="two calls waiting, one running")
        finally:
            await handle.terminate("test over")
    assert [(s.name, s.status, s.attempts) for s in steps] == [("held_step", "running", 1),
                                                               ("other_held_step", "waiting", 0)]


@workflow.defn(name="EndsWhileWatched", sandboxed=False)
class EndsWhileWatched:
    """A job's events alone: one step event when told, its terminal event when told."""

    def __init__(self) -> None:
        self.events = JobEvents()
        self.told: list[str] = []

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: "step" in self.told)
        self.events.emit("ragline.step.started", {"step": "one"})
        await workflow.wait_condition(lambda: "end" in self.told)
        await self.events.close("ragline.job.completed", {})
        return "completed"

    @workflow.signal
    def tell(self, what: str) -> None:
        self.told.append(what)


async def test_a_cancel_that_comes_as_a_job_ends_leaves_it_as_it_ended(temporal_env, restore_policies):
    """A job someone watches waits a moment after its terminal event for the watcher's next poll
    (`[events] subscriber_grace`). It is over by then: a cancel arriving in that moment changes nothing,
    and the job whose stream said `ragline.job.completed` ends completed, with its result."""
    policies.load(Path(__file__).resolve().parent / "fast_policies.toml", worker.activity_names())
    policies._loaded = dataclasses.replace(policies.loaded(), subscriber_grace=timedelta(seconds=30))  # a window
    client, queue = temporal_env.client, f"ends-watched-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[EndsWhileWatched]):
        handle = await client.start_workflow(EndsWhileWatched.run, id=queue, task_queue=queue)
        # A watcher's poll waits when the step event comes (the job is watched from then on); the watcher
        # then leaves without polling again, as a closed tab does.
        poll = await handle.start_update("__temporal_workflow_stream_poll", PollInput(from_offset=0),
                                         wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=PollResult)
        await handle.signal(EndsWhileWatched.tell, "step")
        assert len((await poll.result()).items) == 1
        await handle.signal(EndsWhileWatched.tell, "end")
        async for event in handle.fetch_history_events(wait_new_event=True):
            if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
                break  # the terminal event is out; the job waits for the watcher's next poll
        else:
            pytest.fail("the job ended without waiting for its watcher's next poll")
        await handle.cancel()
        assert await handle.result() == "completed"
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def _first_event(lines) -> dict:  # noqa: ANN001
    """The first event on a stream's lines (`response.aiter_lines()`, kept by the caller: an iterator left
    behind would be closed when collected, and with it the stream)."""
    async for line in lines:
        if line.startswith("data:"):
            return json.loads(line[len("data:"):])
    raise AssertionError("the stream ended without an event")


async def test_a_key_holds_a_bounded_number_of_event_streams_open(stack):
    """An open stream of a running job holds a long poll on Temporal for as long as it is open: a key may
    hold RAGLINE_MAX_STREAMS_PER_KEY of them on an API process, one more is 429 `too_many_streams` until one
    ends, and other keys are not held back."""
    from api.app import create_app
    from tests.conftest import serving_api

    def waiting(http: httpx.AsyncClient) -> asyncio.Future:  # a turn that waits for its reviewer
        return asyncio.ensure_future(http.post("/v1/chats", json={
            "message": "Is the harbour open?", "collection": f"streams-{uuid.uuid4().hex[:6]}",
            "require_review": True}))

    mine = [r.json()["job_id"] for r in await asyncio.gather(*(waiting(stack.http) for _ in range(3)))]
    theirs = (await waiting(stack.other_http)).json()["job_id"]
    settings = stack.settings.model_copy(update={"max_streams_per_key": 2})
    try:
        async with serving_api(create_app(settings)) as url, \
                httpx.AsyncClient(base_url=url, headers=stack.http.headers, timeout=60) as http, \
                httpx.AsyncClient(base_url=url, headers=stack.other_http.headers, timeout=60) as other:
            for _ in range(3):  # a request refused before its stream opened gives its slot back
                assert (await http.get("/v1/jobs/no-such-job/events")).status_code == 404
            async with AsyncExitStack() as held:
                # A burst of opens: two take the key's slots, the others are refused (a slot is taken as the
                # request is checked, not once its stream starts).
                burst = await asyncio.gather(*(
                    held.enter_async_context(http.stream("GET", f"/v1/jobs/{mine[n % 3]}/events")) for n in range(5)))
                assert sorted(r.status_code for r in burst) == [200, 200, 429, 429, 429]
                for refused in (r for r in burst if r.status_code == 429):
                    assert json.loads(await refused.aread())["error"]["code"] == "too_many_streams"
                    assert refused.headers["Retry-After"]
                opened = [r.aiter_lines() for r in burst if r.status_code == 200]  # read, and kept open
                assert [(await _first_event(lines))["type"] for lines in opened] == ["ragline.job.accepted"] * 2
                async with other.stream("GET", f"/v1/jobs/{theirs}/events") as another_key:
                    assert (await _first_event(another_key.aiter_lines()))["type"] == "ragline.job.accepted"
            # Both closed by their client: the key may open streams again.

            async def opens() -> bool:
                async with http.stream("GET", f"/v1/jobs/{mine[2]}/events") as third:
                    return third.status_code == 200 and \
                        (await _first_event(third.aiter_lines()))["type"] == "ragline.job.accepted"

            assert await eventually(opens, what="a stream once the others closed")
    finally:
        for job_id in mine:
            await stack.http.post(f"/v1/jobs/{job_id}/cancel")
        await stack.other_http.post(f"/v1/jobs/{theirs}/cancel")
