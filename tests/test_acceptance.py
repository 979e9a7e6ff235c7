"""Acceptance is one durable write: POSTs answer 202 with no worker running, jobs show `queued`, and
once a worker is back they run, chat turns in the order they were accepted. Chat job ids are derived
from the session and the Idempotency-Key, so they stay unique for the life of a session id."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import uuid
from datetime import timedelta

import httpx
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    DeleteWorkflowExecutionRequest, PollWorkflowTaskQueueRequest, ResetWorkflowExecutionRequest,
    RespondWorkflowTaskFailedRequest,
)
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError
from temporalio.worker import Replayer

from api.app import create_app
from api import job_views
from api.job_views import RecentlyAccepted
from models.chat import KEY_EXPIRED_TYPE, SessionState, TurnInput, session_workflow_id
from ragline.vectorstore import open_index
from temporal import search_attributes as sa
from tests.conftest import running_stack, serving_api
from tests.helpers import (
    delegate_until, eventually, read_events, session_turns, terminate_unless_ended, waiting_reviews,
)
import worker
from worker import build_worker
from workflows.chat import ChatSessionWorkflow


def _answer_questions(llm, tag: str) -> list[str]:
    """The questions the model was asked to answer, in the order it was asked, for this test's tag."""
    return [c["question"] for c in llm.calls if c["task"] == "answer" and tag in (c["question"] or "")]


async def test_posts_answer_202_without_a_worker_and_run_in_order_once_one_starts(temporal_env, scripted_llm,
                                                                                  tmp_path):
    tag = uuid.uuid4().hex[:8]
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False,
                             task_queue=f"no-worker-{tag}") as stack:
        # Nobody polls the queues, and nothing waits there yet: idle, as a role scaled to zero is.
        operator = {"Authorization": f"Bearer {stack.keys['operator']}"}
        health = (await stack.http.get("/healthz", headers=operator)).json()
        assert (health["status"], health["components"]["worker"]["status"]) == ("up", "up"), health
        assert "where nothing waits" in health["components"]["worker"]["reason"]
        upload = await stack.upload((f"{tag}.txt", f"The {tag} lighthouse is painted red and white.".encode()),
                                    collection=tag)
        session = f"s-{tag}"
        questions = [f"Question {i} about the {tag} lighthouse?" for i in range(1, 4)]
        turns = [await stack.chat(q, session_id=session, collection=tag) for q in questions]
        keyed = [await stack.chat(f"Keyed question about {tag}?", session_id=session, collection=tag,
                                  idempotency_key="same") for _ in range(2)]
        r = await stack.http.post("/v1/agents", json={"goal": f"Describe the {tag} lighthouse", "collection": tag})
        assert r.status_code == 202, r.text
        agent = r.json()

        assert keyed[0]["job_id"] == keyed[1]["job_id"]
        # Now jobs wait on the main queue, which nobody polls: the worker is down, and said so (once the look
        # that found everything up is past RAGLINE_HEALTHZ_CACHE_SECONDS).
        async def worker_down() -> dict | None:
            health = (await stack.http.get("/healthz", headers=operator)).json()
            return health if health["status"] != "up" else None
        health = await eventually(worker_down, timeout=30, what="/healthz finding jobs wait on an unpolled queue")
        worker = health["components"]["worker"]
        assert (health["status"], worker["status"]) == ("degraded", "down"), health
        assert worker["queues"][f"no-worker-{tag}"]["backlog"] > 0
        assert f"no worker is polling no-worker-{tag}," in worker["reason"], worker
        job_ids = [upload["job_id"], *(t["job_id"] for t in turns), keyed[0]["job_id"], agent["job_id"]]
        for job_id in job_ids:
            r = await stack.http.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "queued", r.json()
        # A queued turn shows when it was accepted, the same at every read.
        created = {(await stack.http.get(f"/v1/jobs/{turns[2]['job_id']}")).json()["created_at"] for _ in range(2)}
        assert len(created) == 1
        assert (await stack.http.get(f"/v1/jobs/chat-{session}.{'0' * 20}")).status_code == 404
        # A decision on a turn no worker has started yet is refused as that, not as one on a job that ended.
        r = await stack.http.post(f"/v1/jobs/{turns[0]['job_id']}/review", json={"decision": "approve",
                                                                               "reviewer": "Ada"})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "job_not_started"), r.text
        # A stream opened now follows a turn whose job no worker has started yet; so does one opened on
        # an API process that did not accept the turn (here: this one, made to forget), from the history.
        stream = asyncio.ensure_future(read_events(stack, turns[1]["job_id"]))
        stack.app.state.accepted = RecentlyAccepted()
        forgotten = (await stack.http.get(f"/v1/jobs/{turns[2]['job_id']}")).json()
        assert forgotten["status"] == "queued" and {forgotten["created_at"]} == created
        other_stream = asyncio.ensure_future(read_events(stack, turns[2]["job_id"]))
        # The keyed turn's key with another question, on an API process that did not take the first: with no
        # job to compare with yet, it is let through (README), and the session, which knows the job id, drops it.
        keyed_body = {"message": f"Keyed question about {tag}?", "collection": tag, "session_id": session}
        changed_body = {**keyed_body, "message": f"Another keyed question about {tag}?"}
        r = await stack.http.post("/v1/chats", json=changed_body, headers={"Idempotency-Key": "same"})
        assert r.status_code == 202 and r.json()["job_id"] == keyed[0]["job_id"], r.text

        # A worker comes: everything accepted runs, the session's turns in acceptance order.
        index = open_index(stack.settings)
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=8)
        try:
            async with build_worker(stack.client, stack.settings, index, executor):
                done = [await stack.wait_done(job_id, timeout=120) for job_id in job_ids]
                events = [e for _, e in await asyncio.wait_for(stream, 60)]
                other_events = [e for _, e in await asyncio.wait_for(other_stream, 60)]
                # Once its job is there, the job decides, not what this process let through before: the first
                # question is the key's (a duplicate), the other is refused.
                again = await stack.http.post("/v1/chats", json=keyed_body, headers={"Idempotency-Key": "same"})
                assert again.status_code == 202 and again.json()["duplicate"] is True, again.text
                changed = await stack.http.post("/v1/chats", json=changed_body, headers={"Idempotency-Key": "same"})
                assert changed.status_code == 422, changed.text
                assert changed.json()["error"]["code"] == "idempotency_key_reused", changed.text
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            index.close()
    assert all(job["status"] == "completed" for job in done), done
    assert events[0]["type"] == "ragline.job.accepted" and events[-1]["type"] == "ragline.job.completed"
    assert events[-1]["data"]["question"] == questions[1]
    assert other_events[-1]["type"] == "ragline.job.completed" and other_events[-1]["data"]["question"] == questions[2]
    chat_jobs = done[1:5]
    assert [job["turn"] for job in chat_jobs] == [1, 2, 3, 4]
    assert [job["result"]["question"] for job in chat_jobs] == [*questions, f"Keyed question about {tag}?"]
    # The turns ran in that order, each once the one before had its answer (its summary and entities may
    # have run on beside it); the keyed request sent twice ran once.
    for earlier, later in zip(chat_jobs, chat_jobs[1:]):
        # (a turn that found nothing to answer from skips its model steps: they have no times)
        finished = {s["name"]: s["finished_at"] for s in earlier["steps"] if s["finished_at"]}
        answered_at = finished.get("generate_answer") or max(finished.values())
        assert answered_at <= min(s["started_at"] for s in later["steps"] if s["started_at"])

    async def counted() -> int | None:  # visibility counts a job a moment after its start
        listed = await stack.client.count_workflows(f"{sa.SESSION.name} = '{session}' AND {sa.JOB_KIND.name} = "
                                                    f"'chat' AND {sa.TENANT.name} = '{stack.tenant}'")
        return listed.count if listed.count >= 4 else None
    assert await eventually(counted, what="the session's 4 turns counted") == 4


async def _a_ferry_session(stack, prefix: str) -> tuple[str, str, dict]:
    """A collection about a ferry, and a session whose first (keyed) turn about it has completed."""
    tag = uuid.uuid4().hex[:8]
    seed = await stack.upload((f"{tag}.txt", f"The {tag} ferry leaves at nine. It returns at five.".encode()),
                              collection=tag)
    await stack.wait_job(seed["job_id"])
    session = f"{prefix}-{tag}"
    first = await stack.chat(f"When does the {tag} ferry leave?", session_id=session, collection=tag,
                             idempotency_key="first")
    assert (await stack.wait_job(first["job_id"]))["status"] == "completed"
    return tag, session, first


async def test_a_session_id_used_again_after_its_workflow_ended_answers_the_new_message(stack):
    tag, session, first = await _a_ferry_session(stack, "reused")
    await stack.client.get_workflow_handle(session_workflow_id(stack.tenant, session)).terminate(
        "session closed by an operator")

    second = await stack.chat(f"When does the {tag} ferry return?", session_id=session, collection=tag)
    assert second["job_id"] != first["job_id"]
    job = await stack.wait_job(second["job_id"])
    assert job["status"] == "completed" and job["result"]["question"] == f"When does the {tag} ferry return?"
    assert job["turn"] == 1  # a new session run numbers from 1 again; the job id stays unique
    # The first request, resent with its key, still names its own job and its own answer.
    again = await stack.chat(f"When does the {tag} ferry leave?", session_id=session, collection=tag,
                             idempotency_key="first")
    assert again["job_id"] == first["job_id"] and again["duplicate"] is True


async def test_a_session_that_ended_idle_goes_on_from_what_it_left_at_the_next_message(stack):
    """A session with no turn for [sessions] idle (tests: 5 s) ends, rather than one workflow per conversation
    running for ever. The next message starts it again from what it left: its turns are numbered on, the model
    is given the earlier turns, and a resent request still names its first job."""
    tag, session, first = await _a_ferry_session(stack, "idle")
    session_wf = session_workflow_id(stack.tenant, session)
    ended = stack.client.get_workflow_handle(session_wf, run_id=(await stack.client.get_workflow_handle(
        session_wf).describe()).run_id)

    async def ended_idle() -> bool:
        return (await ended.describe()).status == WorkflowExecutionStatus.COMPLETED
    await eventually(ended_idle, timeout=60, what="the session ending idle")

    # Two messages at once: one starts the session again, the other reaches the run it started.
    questions = [f"When does the {tag} ferry return?", f"Is the {tag} ferry on time?"]
    later = await asyncio.gather(*(stack.chat(q, session_id=session, collection=tag) for q in questions))
    jobs = [await stack.wait_job(a["job_id"]) for a in later]
    assert all(j["status"] == "completed" for j in jobs), jobs
    assert sorted(j["turn"] for j in jobs) == [2, 3]
    asked = [c for c in stack.llm.calls if c["task"] == "answer" and c["question"] in questions]
    assert asked and all(f"When does the {tag} ferry leave?" in c["text"] for c in asked)
    again = await stack.chat(f"When does the {tag} ferry leave?", session_id=session, collection=tag,
                             idempotency_key="first")
    assert again["job_id"] == first["job_id"] and again["duplicate"] is True
    turns = await session_turns(stack.http, session, first["job_id"], *(a["job_id"] for a in later))
    assert [t["turn"] for t in turns] == [1, 2, 3]
    await terminate_unless_ended(stack.client, session_wf)


async def _runs_carrying(stack, session_wf: str) -> list[list[TurnInput]]:
    """The turns not yet run each continue-as-new of the session carried, oldest run first."""
    carried = []
    async for execution in stack.client.list_workflows(f"WorkflowId = '{session_wf}'"):
        handle = stack.client.get_workflow_handle(session_wf, run_id=execution.run_id)
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_execution_continued_as_new_event_attributes"):
                payloads = event.workflow_execution_continued_as_new_event_attributes.input.payloads
                (state,) = await stack.client.data_converter.decode(payloads, [SessionState])
                carried.append((execution.start_time, state.pending))
    return [turns for _, turns in sorted(carried, key=lambda run: run[0])]


async def test_continue_as_new_carries_the_turns_still_waiting(stack):
    tag = uuid.uuid4().hex[:8]
    seed = await stack.upload((f"{tag}.txt", f"The {tag} tower has ninety steps.".encode()), collection=tag)
    await stack.wait_job(seed["job_id"])
    session = f"can-{tag}"
    # A session that continues as new after every two turns (production: 100, or when the server asks).
    await stack.client.start_workflow(
        ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, turns_per_run=2),
        id=session_workflow_id(stack.tenant, session), task_queue=stack.settings.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session),
                                                 SearchAttributePair(sa.TENANT, stack.tenant)]))
    questions = [f"Step question {i} on the {tag} tower?" for i in range(1, 6)]
    accepted = [await stack.chat(q, session_id=session, collection=tag) for q in questions]
    jobs = [await stack.wait_job(a["job_id"], timeout=120) for a in accepted]
    assert all(j["status"] == "completed" for j in jobs), jobs
    assert [j["turn"] for j in jobs] == [1, 2, 3, 4, 5]
    assert _answer_questions(stack.llm, tag) == questions

    # The session did continue as new with turns still waiting, and they were not lost or repeated.
    session_wf = session_workflow_id(stack.tenant, session)

    async def continued() -> list[int] | None:  # visibility lists a run a moment after its start
        carried = [len(pending) for pending in await _runs_carrying(stack, session_wf)]
        return carried if len(carried) >= 2 else None
    carried = await eventually(continued, what="the session's runs that continued as new, listed")
    assert any(carried), carried


async def test_a_turn_accepted_while_its_session_runs_a_workflow_task_reads_as_queued(temporal_env, scripted_llm,
                                                                                       tmp_path):
    """While one of the session's workflow tasks runs, the server holds a new signal back from the
    history until the task completes ("buffered"): the turn it carries was accepted all the same, and
    reads as `queued`, never as "not found"."""
    tag = uuid.uuid4().hex[:8]
    queue = f"held-task-{tag}"
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False, task_queue=queue,
                             temporal_rpc_timeout=2) as stack:
        session = f"s-{tag}"
        first = await stack.chat(f"First question {tag}?", session_id=session)
        # A bare poller takes the session's first workflow task and sits on it, as a busy worker would.
        poll = await stack.client.workflow_service.poll_workflow_task_queue(PollWorkflowTaskQueueRequest(
            namespace=stack.client.namespace, task_queue=TaskQueue(name=queue), identity="test-holder"))
        assert poll.workflow_execution.workflow_id == session_workflow_id(stack.tenant, session)
        second = await stack.chat(f"Second question {tag}?", session_id=session)
        r = await stack.http.get(f"/v1/jobs/{first['job_id']}")
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        # The API process that accepted the turn knows it, and needs no look at the history (which
        # cannot show the turn before the held task ends: that look would end in "not found").
        r = await stack.http.get(f"/v1/jobs/{second['job_id']}")
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        # Another API process (here: this one, made to forget) has only the session's history to go by.
        stack.app.state.accepted = RecentlyAccepted()
        # Asked about while the task still runs, the second turn is not in the history yet: the API
        # looks again once the task is over (here the holder gives it up a moment later).
        asked = asyncio.create_task(stack.http.get(f"/v1/jobs/{second['job_id']}"))
        await asyncio.sleep(0.5)
        assert not asked.done()
        await stack.client.workflow_service.respond_workflow_task_failed(RespondWorkflowTaskFailedRequest(
            namespace=stack.client.namespace, task_token=poll.task_token, identity="test-holder"))
        r = await asked
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        # An id nobody sent stays unknown.
        assert (await stack.http.get(f"/v1/jobs/chat-{session}.{'0' * 20}")).status_code == 404


async def test_reads_that_need_a_worker_say_so_while_none_runs(temporal_env, scripted_llm, tmp_path):
    """An ended job's steps and events and a waiting review's request are read through a worker (a
    query replays the history). With no worker up, a finished job this API process has read reads the
    same, a stream ends with a `retry:` hint, so an EventSource comes back later with Last-Event-ID, and
    the review list names the review it could not read instead of dropping it."""
    tag = uuid.uuid4().hex[:8]
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False,
                             task_queue=f"worker-gone-{tag}", temporal_rpc_timeout=2) as stack:
        with stack.llm.scope() as llm:
            llm.script_fn("agent", delegate_until(leaf_depth=9, token=llm.token))
            index = open_index(stack.settings)
            executor = concurrent.futures.ThreadPoolExecutor(max_workers=8)
            try:
                async with build_worker(stack.client, stack.settings, index, executor):
                    chat = await stack.chat(f"Anything about {tag}?", collection=tag)
                    finished = await stack.wait_done(chat["job_id"])
                    assert finished["status"] == "completed" and finished["steps"], finished
                    r = await stack.http.post("/v1/agents", json={"goal": f"Audit {llm.token}", "collection": tag,
                                                                  "max_depth": 1})
                    assert r.status_code == 202, r.text
                    agent = r.json()["job_id"]
                    [review] = await waiting_reviews(stack, agent)
                    events = await read_events(stack, chat["job_id"])
                    assert events[-1][1]["type"] == "ragline.job.completed"
            finally:
                executor.shutdown(wait=False, cancel_futures=True)
                index.close()

        # The worker is gone. A finished job still reads whole: its view was kept by the API when it ended.
        r = await stack.http.get(f"/v1/jobs/{chat['job_id']}")
        assert r.status_code == 200 and r.json() == finished, r.text
        # A running one says that what it shows is only the server's part, not that it has no steps.
        r = await stack.http.get(f"/v1/jobs/{agent}")
        assert r.status_code == 200 and r.json()["status"] == "running", r.text  # its sub-agent waits for review
        assert r.json()["progress_unreadable"] is True, r.text
        for headers in ({}, {"Last-Event-ID": events[0][0]}):
            async with stack.http.stream("GET", f"/v1/jobs/{chat['job_id']}/events", headers=headers) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines()]
            assert "retry: 5000" in lines, lines
            assert any(line.startswith(": events unavailable, reconnect") for line in lines), lines
            assert not any(line.startswith("data:") for line in lines), lines
        try:
            r = await stack.http.get("/v1/reviews")
            assert r.status_code == 200, r.text
            assert review["job_id"] in r.json()["unreadable"]
            assert all(not item["job_id"].startswith(agent) for item in r.json()["reviews"])
        finally:
            # Nothing of this test's tenant may be left waiting on a queue no worker polls: other tests
            # list the tenant's reviews.
            for job_id in (review["job_id"], agent):
                await stack.client.get_workflow_handle(job_id).terminate("test over")


async def test_a_turn_whose_session_was_terminated_before_starting_it_reads_as_failed(temporal_env, scripted_llm,
                                                                                      tmp_path):
    """README asks operators not to terminate a session's workflow; one who does leaves the turns it had
    accepted but not started without a job, and no run will start them. Such a turn reads as failed,
    saying why, not as queued for ever; its stream ends with that failure, and an EventSource coming
    back after it is told there is nothing more (204)."""
    tag = uuid.uuid4().hex[:8]
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False,
                             task_queue=f"session-ended-{tag}") as stack:  # no worker: the turn stays queued
        chat = await stack.chat(f"Anyone at {tag}?", collection=tag)
        other = await stack.chat(f"Anyone else at {tag}?", collection=tag)  # another session, left running
        assert (await stack.http.get(f"/v1/jobs/{chat['job_id']}")).json()["status"] == "queued"
        await stack.client.get_workflow_handle(session_workflow_id(stack.tenant, chat["session_id"])).terminate(
            "by hand, from the Web UI")

        async def failed() -> dict | None:
            job = (await stack.http.get(f"/v1/jobs/{chat['job_id']}")).json()
            return job if job["status"] != "queued" else None
        job = await eventually(failed, what="the stranded turn no longer queued")
        assert job["status"] == "failed" and job["error"]["type"] == "SessionEnded", job
        assert "terminated" in job["error"]["message"] and "send the question again" in job["error"]["message"]
        async with stack.http.stream("GET", f"/v1/jobs/{chat['job_id']}/events") as r:
            data = [json.loads(line[5:]) for line in [line async for line in r.aiter_lines()]
                    if line.startswith("data:")]
        assert [(e["type"], e["data"]["error"]) for e in data] == [("ragline.job.failed", job["error"]["message"])]
        r = await stack.http.get(f"/v1/jobs/{chat['job_id']}/events", headers={"Last-Event-ID": "0"})
        assert r.status_code == 204, r.text
        r = await stack.http.post(f"/v1/jobs/{chat['job_id']}/cancel")  # as for any job that failed
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_closed", r.text
        # A turn whose session still runs (accepted as long ago) waits for a worker, as before.
        assert (await stack.http.get(f"/v1/jobs/{other['job_id']}")).json()["status"] == "queued"
        await stack.client.get_workflow_handle(session_workflow_id(stack.tenant, other["session_id"])).terminate(
            "test over")


async def test_a_turn_waiting_for_its_go_fails_saying_so_once_its_session_was_terminated(stack):
    """A follow-up's job waits for its session's go while the turn before it waits for a reviewer. The
    session terminated by hand gives no go: the follow-up looks now and then, and fails (SessionEnded)
    rather than wait for ever; the turn before it is not touched."""
    session = f"go-{uuid.uuid4().hex[:8]}"
    r = await stack.http.post("/v1/chats", json={"message": "Who counts the herds?", "session_id": session,
                                                 "collection": "chat", "require_review": True})
    first = r.json()["job_id"]
    await waiting_reviews(stack, first, timeout=30)
    second = (await stack.chat("And from what?", session_id=session, collection="chat"))["job_id"]
    try:
        await eventually(lambda: job_exists(stack, second), what="the follow-up's job started, waiting for its go")
        await stack.client.get_workflow_handle(session_workflow_id(stack.tenant, session)).terminate("by hand")
        job = await stack.wait_done(second, timeout=60)
        assert job["status"] == "failed" and "never ran" in job["error"]["message"], job
        assert [s["status"] for s in job["steps"]] == ["skipped"] * len(job["steps"]), job["steps"]
        assert (await stack.http.get(f"/v1/jobs/{first}")).json()["status"] == "waiting_review"
    finally:
        await stack.http.post(f"/v1/jobs/{first}/cancel")


async def job_exists(stack, job_id: str) -> bool:
    try:
        await stack.client.get_workflow_handle(job_id).describe()
    except RPCError:
        return False
    return True


async def _session_checks(stack, job_id: str) -> int:
    """How many times the waiting turn `job_id` has looked at its session so far (scheduled looks)."""
    count = 0
    async for event in stack.client.get_workflow_handle(job_id).fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes") and \
                event.activity_task_scheduled_event_attributes.activity_type.name == "session_still_runs":
            count += 1
    return count


async def _after_a_look(stack, job_id: str) -> None:
    """Until the waiting turn has looked at its session once more, from now (a look scheduled next is
    one the look before it ended)."""
    before = await _session_checks(stack, job_id)

    async def looked() -> bool:
        ended = (await stack.client.get_workflow_handle(job_id).describe()).status != WorkflowExecutionStatus.RUNNING
        return ended or await _session_checks(stack, job_id) >= before + 2
    await eventually(looked, timeout=90, every=0.5, what=f"{job_id} looked at its session again")


async def _approve(stack, job_id: str) -> None:
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "Ada"})
    assert r.status_code == 200, r.text


async def test_a_turn_waiting_for_its_go_waits_on_while_its_session_runs_on_in_a_later_run(stack):
    """The run that started a waiting turn's job may be gone while the session runs on: it continued as
    new long enough ago that the retention took it, or an operator reset the session (a reset ends the
    run it resets, and a new run of the same chain goes on). The turn waits on: it gets its go."""
    tag = uuid.uuid4().hex[:8]
    session = f"later-{tag}"
    session_wf = session_workflow_id(stack.tenant, session)
    await stack.client.start_workflow(  # continues as new after each turn
        ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, turns_per_run=1),
        id=session_wf, task_queue=stack.settings.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session),
                                                 SearchAttributePair(sa.TENANT, stack.tenant)]))

    async def ask(message: str, review: bool) -> str:
        r = await stack.http.post("/v1/chats", json={"message": message, "session_id": session,
                                                     "collection": "chat", "require_review": review})
        assert r.status_code == 202, r.text
        return r.json()["job_id"]
    first = await ask("Who counts the herds?", True)
    await waiting_reviews(stack, first, timeout=30)
    second = await ask("And from what?", True)
    third = await ask("And how often?", False)
    jobs = [first, second, third]
    try:
        for job_id in (second, third):
            await eventually(lambda: job_exists(stack, job_id), what=f"{job_id} started, waiting for its go")
        started_by = (await stack.client.get_workflow_handle(third).describe()).raw_description \
            .workflow_execution_info.parent_execution.run_id
        # An operator resets the session's run to its last workflow task: that run ends (terminated), a new
        # run of its chain goes on.
        last_task = [e.event_id async for e in stack.client.get_workflow_handle(
            session_wf, run_id=started_by).fetch_history_events()
            if e.HasField("workflow_task_completed_event_attributes")][-1]
        await stack.client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
            namespace=stack.client.namespace, reason="by hand",
            workflow_execution=WorkflowExecution(workflow_id=session_wf, run_id=started_by),
            workflow_task_finish_event_id=last_task, request_id=uuid.uuid4().hex))
        await _after_a_look(stack, third)
        assert (await stack.http.get(f"/v1/jobs/{third}")).json()["status"] == "queued"
        await _approve(stack, first)  # the session continues as new, carrying the two turns still waiting
        await waiting_reviews(stack, second, timeout=30)
        # The run that started the third turn's job, past the retention.
        await stack.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
            namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=session_wf,
                                                                                   run_id=started_by)))
        await eventually(lambda: gone(stack, session_wf, started_by), what="the first session run deleted")
        await _after_a_look(stack, third)
        assert (await stack.http.get(f"/v1/jobs/{third}")).json()["status"] == "queued"
        await _approve(stack, second)  # and the third turn gets its go
        assert (await stack.wait_done(third, timeout=60))["status"] == "completed"
    finally:
        for job_id in jobs:
            await stack.http.post(f"/v1/jobs/{job_id}/cancel")
        await terminate_unless_ended(stack.client, session_wf)


async def test_a_session_whose_turn_a_reviewer_holds_bounds_its_queue_and_continues_as_new_meanwhile(
        stack, monkeypatch):
    """Messages keep coming while a reviewer holds a session's running turn. Each waiting turn is a child
    workflow of the session's run, and each message a signal and events in its history: Temporal fails every
    step of a workflow with 2,000 children waiting, and terminates one whose history outgrows its limits. A
    full session refuses a message (its job fails at once, SessionBusy, unnumbered, no model call), and a run
    grown long continues as new while the turn waits, carrying it: once approved, every queued turn runs in
    order, with the held answer in its history, as soon as that answer is final (the held turn's summary and
    entities may run on: here they hang)."""
    tag = uuid.uuid4().hex[:8]
    seed = await stack.upload((f"{tag}.txt", f"The {tag} herds are counted by Ada, from the hill, at dawn.".encode()),
                              collection=tag)
    await stack.wait_job(seed["job_id"])
    session = f"full-{tag}"
    session_wf = session_workflow_id(stack.tenant, session)
    await stack.client.start_workflow(  # continues as new after four messages, even mid-turn
        ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, submits_per_run=4),
        id=session_wf, task_queue=stack.settings.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session),
                                                 SearchAttributePair(sa.TENANT, stack.tenant)]))
    monkeypatch.setattr(stack.settings, "session_max_queued_turns", 3)

    async def ask(message: str, review: bool = False) -> str:
        r = await stack.http.post("/v1/chats", json={"message": f"{message} {tag}", "session_id": session,
                                                     "collection": tag, "require_review": review})
        assert r.status_code == 202, r.text
        return r.json()["job_id"]
    slow = stack.llm.scope()  # the held turn's summary and entities hang, each attempt until its timeout
    for step in ("summarize", "extract_entities"):
        slow.script_fn(step, lambda request: {"content": "[]", "delay": 60})
    first = await ask(f"Who counts the herds? {slow.token}", review=True)
    jobs = [first]
    try:
        await waiting_reviews(stack, first, timeout=30)
        long = "And how often? " + "Tell every count of the herds, " * 200  # 6,200 characters
        jobs += [await ask("And from what?"), await ask(long)]
        refused = await ask("And where?")  # a fourth turn not yet answered: one too many
        jobs.append(refused)
        job = await stack.wait_done(refused, timeout=30)
        assert job["status"] == "failed" and job["error"]["type"] == "SessionBusy", job
        assert "3 turns not yet answered" in job["error"]["message"] and job["turn"] is None, job
        # Four messages came to the run while its turn waited: it continued as new, carrying the three turns.
        carried = await eventually(lambda: _runs_carrying(stack, session_wf), what="the session continued as new")
        assert [[t.job_id for t in turns] for turns in carried] == [jobs[:3]], carried
        # What the next run needs of a waiting turn (its job has the question): what goes into the history.
        assert max(len(t.question.message) for t in carried[0]) == 600
        assert (await stack.http.get(f"/v1/jobs/{first}")).json()["status"] == "waiting_review"
        await _approve(stack, first)
        ended = [await stack.wait_done(job_id, timeout=60) for job_id in jobs[1:3]]
        assert [(j["status"], j["turn"]) for j in ended] == [("completed", 2), ("completed", 3)]
        held = (await stack.http.get(f"/v1/jobs/{first}")).json()
        # Not ended: its side steps still at work, or (a slow host, past their four 10-15 s attempts) parked for an
        # operator. Had the later turns waited for it to end, they would not have been answered.
        assert held["status"] in ("running", "dead_lettered") and held["turn"] == 1, held
        asked = [c for c in stack.llm.calls if c["task"] == "answer" and tag in (c["question"] or "")]
        assert [c["question"] for c in asked] == [f"{q} {tag}" for q in (
            f"Who counts the herds? {slow.token}", "And from what?", long)], asked
        # The next run had the held turn's answer for the history of the turn after it.
        assert held["answer"]["answer"][:100] in asked[1]["text"], asked[1]["text"]
        # Answered: the session takes a message again.
        after = await ask("And since when?")
        jobs.append(after)
        assert (await stack.wait_done(after, timeout=60))["turn"] == 4
        # Both runs of the session, and the refused turn's job, replay.
        replayer = Replayer(workflows=worker.WORKFLOWS, data_converter=stack.client.data_converter)
        runs = [e.run_id async for e in stack.client.list_workflows(f"WorkflowId = '{session_wf}'")]
        for workflow_id, run_id in [*((session_wf, run) for run in runs), (refused, None)]:
            history = await stack.client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
            replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
            assert replayed.replay_failure is None, (workflow_id, run_id, replayed.replay_failure)
    finally:
        slow.close()
        for job_id in jobs:
            await stack.http.post(f"/v1/jobs/{job_id}/cancel")
        await terminate_unless_ended(stack.client, session_wf)


async def gone(stack, workflow_id: str, run_id: str) -> bool:
    try:
        await stack.client.get_workflow_handle(workflow_id, run_id=run_id).describe()
    except RPCError:
        return True
    return False


async def test_a_turn_its_terminated_session_never_started_stays_failed_once_the_session_id_is_used_again(
        temporal_env, scripted_llm, tmp_path):
    """The session id of a terminated session, used again, is a new session: it will not start the turns
    the terminated one left without a job. Read on the API process that accepted such a turn, it stays
    failed (its stream ends with that failure, a reconnect after it gets 204), not queued for ever."""
    tag = uuid.uuid4().hex[:8]
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False,
                             task_queue=f"reused-{tag}") as stack:  # no worker: the turns stay queued
        chat = await stack.chat(f"Anyone at {tag}?", collection=tag)
        session_wf = session_workflow_id(stack.tenant, chat["session_id"])
        await stack.client.get_workflow_handle(session_wf).terminate("by hand")
        await stack.chat(f"Anyone again at {tag}?", session_id=chat["session_id"], collection=tag)
        try:
            async def failed() -> dict | None:
                job = (await stack.http.get(f"/v1/jobs/{chat['job_id']}")).json()
                return job if job["status"] != "queued" else None
            job = await eventually(failed, what="the stranded turn no longer queued")
            assert job["status"] == "failed" and job["error"]["type"] == "SessionEnded", job
            async with stack.http.stream("GET", f"/v1/jobs/{chat['job_id']}/events") as r:
                types = [json.loads(line[5:])["type"] async for line in r.aiter_lines() if line.startswith("data:")]
            assert types == ["ragline.job.failed"]
            r = await stack.http.get(f"/v1/jobs/{chat['job_id']}/events", headers={"Last-Event-ID": "0"})
            assert r.status_code == 204, r.text
        finally:
            await terminate_unless_ended(stack.client, session_wf)


async def test_a_turn_whose_job_is_gone_is_not_found_rather_than_queued_for_ever(stack, monkeypatch):
    """A turn whose job its session started, and that is gone since (past the retention, or deleted by
    hand), is 404 to every read, its stream too. Read as a turn accepted and not started yet (its `submit`
    signal is still in its session's history), it showed `queued` for ever, a cancel was refused as "not
    started yet", and its stream never ended, holding one of the key's stream slots."""
    tag = uuid.uuid4().hex[:8]
    job_id = (await stack.chat(f"Where is the lighthouse? {tag}", collection=f"gone-{tag}"))["job_id"]
    assert (await stack.wait_done(job_id))["status"] == "completed"
    run_id = (await stack.client.get_workflow_handle(job_id).describe()).run_id
    await stack.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
        namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=job_id)))
    await eventually(lambda: gone(stack, job_id, run_id), what="the turn's job deleted")
    # Ten minutes on: the API process that accepted the turn no longer takes it for one accepted a moment ago.
    monkeypatch.setattr(RecentlyAccepted, "FRESH_FOR", timedelta(0))
    for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
        r = await stack.http.request(method, f"/v1/jobs/{job_id}{path}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (path, r.text)


async def test_a_keyed_turn_sent_again_after_its_job_is_gone_fails_saying_so_past_a_continue_as_new(
        stack, monkeypatch):
    """A keyed turn ran in an earlier run of its session (it continued as new since), its job is gone, and the
    same request comes again, a day on (202: the API finds no job). The session remembers the
    job id: it runs nothing again, and the job under that id fails at once saying why, for every API process.
    The session used to drop it: the 202 named a job that read `queued` for ever (its new run's history had the
    resent `submit` and no start of the job), then 404, and a person sent it again under the same key."""
    tag = uuid.uuid4().hex[:8]
    session = f"gone-can-{tag}"
    session_wf = session_workflow_id(stack.tenant, session)
    first_run = await stack.client.start_workflow(
        ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, turns_per_run=1),
        id=session_wf, task_queue=stack.settings.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session),
                                                 SearchAttributePair(sa.TENANT, stack.tenant)]))
    body = {"message": f"Where is the {tag} lighthouse?", "collection": f"gone-{tag}", "session_id": session}
    keyed = {"Idempotency-Key": f"q-{tag}"}
    r = await stack.http.post("/v1/chats", json=body, headers=keyed)
    job_id = r.json()["job_id"]
    assert (await stack.wait_done(job_id))["status"] == "completed"
    calls = len(stack.llm.calls_for(containing=tag))

    async def continued() -> bool:
        return (await stack.client.get_workflow_handle(session_wf).describe()).run_id != first_run.result_run_id
    await eventually(continued, what="the session continued as new")
    run_id = (await stack.client.get_workflow_handle(job_id).describe()).run_id
    await stack.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
        namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=job_id)))
    await eventually(lambda: gone(stack, job_id, run_id), what="the turn's job deleted")
    monkeypatch.setattr(RecentlyAccepted, "FRESH_FOR", timedelta(0))  # ten minutes on, for every API process
    try:
        async with serving_api(create_app(stack.settings)) as url, \
                httpx.AsyncClient(base_url=url, timeout=30, headers=dict(stack.http.headers)) as other:
            # Sent again through the process that took it first (ten minutes on: its record is stale).
            again = await stack.http.post("/v1/chats", json=body, headers=keyed)
            assert again.status_code == 202 and again.json()["job_id"] == job_id, again.text
            # (Until the session has started it, the API reads the id as a job its session started and is gone.)
            await eventually(lambda: job_views.exists(stack.client, job_id, timedelta(seconds=10)),
                             what="the job under the key's id")
            job = await stack.wait_done(job_id)
            assert job["status"] == "failed" and job["error"]["type"] == KEY_EXPIRED_TYPE, job
            assert "new Idempotency-Key" in job["error"]["message"] and job["turn"] is None, job
            r = await other.get(f"/v1/jobs/{job_id}")
            assert r.json()["status"] == "failed" and r.json()["error"]["type"] == KEY_EXPIRED_TYPE, r.text
        assert len(stack.llm.calls_for(containing=tag)) == calls  # no model call ran again
    finally:
        await terminate_unless_ended(stack.client, session_wf)


async def test_reads_of_turn_ids_a_session_never_took_read_its_history_once(stack, monkeypatch):
    """Any key may ask for `chat-<a session>.<any digest>`: each such read looked through the session's whole
    history (every message it was sent, decrypted) for a turn accepted and not started yet. While the history
    has not grown, the reads (at once or one by one) now share one look; a message sent since is read again
    (it may be the one)."""
    tag = uuid.uuid4().hex[:8]
    session = f"flood-{tag}"
    first = await stack.chat(f"Where is the {tag} mill?", collection=f"flood-{tag}", session_id=session)
    await stack.wait_done(first["job_id"])
    wf_id = session_workflow_id(stack.tenant, session)
    reads: list[str] = []
    read_submits = job_views._read_submits

    async def counted(client, handle, tenant, rpc_timeout):  # noqa: ANN001, ANN202
        if handle.id == wf_id:
            reads.append(handle.run_id)
            await asyncio.sleep(0.3)  # as long as a long session's history takes: reads overlap
        return await read_submits(client, handle, tenant, rpc_timeout)

    monkeypatch.setattr(job_views, "_read_submits", counted)

    async def unknown() -> int:
        r = await stack.http.get(f"/v1/jobs/{stack.tenant}.chat-{session}.{uuid.uuid4().hex[:20]}")
        return r.status_code

    async def settled(job_id: str) -> bool:
        """The session has taken the turn's end and has no workflow task to run: its history stays as it is
        (until its idle timer, some seconds on)."""
        handle = stack.client.get_workflow_handle(wf_id)
        ended = [e async for e in handle.fetch_history_events()
                 if e.HasField("child_workflow_execution_completed_event_attributes")
                 and e.child_workflow_execution_completed_event_attributes.workflow_execution.workflow_id == job_id]
        return bool(ended) and not (await handle.describe()).raw_description.HasField("pending_workflow_task")

    await eventually(lambda: settled(first["job_id"]), what="the session settled after its first turn")
    # Together (the reads that miss share one) and one by one.
    assert await asyncio.gather(*(unknown() for _ in range(5))) == [404] * 5
    assert [await unknown() for _ in range(5)] == [404] * 5
    assert 1 <= len(reads) <= 2, reads  # once; twice if the session's idle timer fired meanwhile
    second = await stack.chat(f"And who built the {tag} mill?", collection=f"flood-{tag}", session_id=session)
    await stack.wait_done(second["job_id"])
    await eventually(lambda: settled(second["job_id"]), what="the session settled after its second turn")
    before = len(reads)
    assert await unknown() == 404 and len(reads) == before + 1, reads  # the session's history has grown since
