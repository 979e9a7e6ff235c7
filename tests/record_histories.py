"""Record the histories the replay test (tests/test_replay.py) replays: `python -m tests.record_histories`.

`python -m tests.record_histories SCENARIO...` records only the scenarios named (those in ALONE): it replaces
their files alone, so a scenario added for a new patch leaves every other recorded history as it was.

Runs each scenario against a fresh dev server with the real worker (role all), the real API and the
scripted model, and saves every workflow's history (`WorkflowHistory.to_json()`) under
tests/histories/<scenario>--<WorkflowType>--<n>.json (their workflow ids in
tests/histories/workflow_ids.json). Re-record after a deliberate, versioned change to
workflow code (README: "Running on a cluster"); never to make a failing replay pass.

Scenarios: an ingestion (two documents: the batch and its children), a document removed, a chat session
with several turns that continues as new, an agent tree whose depth guard waits for a review that approves
it (with an extension), two sub-agents of which a rejection of one stops the other, an agent whose broken
tool call gets a corrective plan, an agent tree whose depth guard's review is revised (it extends too), an
agent whose plan names one sub-goal twice and then again once answered, a turn whose passages overflow the
model's context (the summary first), a follow-up whose job waits for its go while the turn before it waits
for a reviewer (looking whether its session still runs meanwhile), a chat turn dead-lettered by a failing
model and retried by an operator, a held answer whose summary is discarded while its review waits, one
whose reviewer rejects it while its summary is parked, a turn that fails after its answer was shown (its
summary discarded), a turn of a session that continues as new after each turn cancelled while its summary
runs (its answer shown: it tells its session, which reads it at the turn's end) and the question sent after
it, an agent out of time granted seconds by a reviewer (counted from the decision), a held refusal, an
answer cut as it looped, a reply of markers only, an evaluation, a search, a blob sweep, a tenant capped at
one running job whose second turn waits for its slot (the gate's history too), and a turn whose cancel comes
in one workflow task with its session's ask for the answer (real workflows on fake activities: the workflow
worker stopped meanwhile), which awaits the answer the ask sends before it ends, and a session that ends
idle and is started again by a later message, and a keyed turn sent again once its job is gone past its
session's continue-as-new (a job refused at once: IdempotencyKeyExpired). Recordable alone as well (ALONE): a
full session that refuses a turn and continues as new while a reviewer holds its turn, a publish cancelled as it
failed, a cancel after a watched turn's terminal event, gone readers' polls answered early, a full tenant gate
refusing a job, a gate ending while it owes a job its answer, an answer parked when its fallback refused too, a
grant followed by a late "wait in line", a gate owing more answers than it sends at once, a session's refused
turn whose cache write fails every attempt, asked for its answer by the turn after it, sub-agents cancelled (one
as it starts its own), a stop that withdraws a parked plan, review signals that come with a stop, uploads that
run documents other uploads ran (cancelled, failed on a password, removed since), an upload cancelled as its
document's job starts, a publish that ends with its cancel, an upload whose document was removed again while it
ran, a removal whose newer run failed (it takes only what was written before that run ended), and a turn's
summary that steps aside for the next question's answer on a one-slot model.
Histories of earlier code stay in tests/histories/before-*/ (replayed as well, never re-recorded).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import (Client, WorkflowExecutionDescription, WorkflowExecutionStatus, WorkflowFailureError,
                               WorkflowUpdateStage)
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.workflow_streams import PollInput, PollResult
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.gate import gate_id
from api.job_views import RecentlyAccepted
from devtools.devserver import dynamic_config_flags, temporal_binary
from devtools.scripted_llm import ScriptedLLM, last_user_message
from models.agent import AgentInput, PlanInput, PlanOutput, ToolCall, agent_workflow_id
from models.blobs import SweepInput
from models.chat import KEY_EXPIRED_TYPE, HistoryItem, SessionState, session_workflow_id
from models.ingest import (CANCELLED_WITH_ITS_UPLOAD, AwaitDocumentInput, DocumentOutcome, IngestInput, NewerRun,
                           RemoveDocumentInput, document_workflow_id, removal_workflow_id)
from models.tenancy import GateState, SlotGrant, SlotRequest
from ragline import keys as api_keys
from ragline.text import WRONG_PASSWORD
from temporal import policies
from temporal import search_attributes as sa
from temporal.queues import queue_name
from tests.conftest import running_stack
from tests.helpers import (WaitsForSlot, delegate_until, eventually, fresh_plan, plan_depth, read_events,
                           two_sub_agents_that_delegate_deeper, until_waited, waiting_reviews)
from tests.test_workflows import (Fakes, FirstRefusedCacheDown, FirstTurnsSummaryRunsOn, HoldsAPayload,
                                  ModelOfFewSlots, document, fake_worker, finish, start_session, turn, turn_result)
from workflows.agent import AgentWorkflow
from workflows.chat import ChatSessionWorkflow, ChatTurnWorkflow
from workflows.events import POLL_UPDATE
from workflows.gate import MAX_IN_GATE, MAX_SENDING, TenantGateWorkflow
from workflows.ingest import IngestDocumentWorkflow, IngestWorkflow
from workflows.remove import RemoveDocumentWorkflow

HISTORIES = Path(__file__).resolve().parent / "histories"
ATTEMPTS = 4  # max_attempts of the chat steps in tests/fast_policies.toml


# Workflow ids by file name (a replay needs the recorded id: child ids derive from it).
ids: dict[str, str] = {}


async def _save(client, scenario: str, query: str) -> list[Path]:
    saved = []
    counts: dict[str, int] = {}
    async for execution in client.list_workflows(query):
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        history = await handle.fetch_history()
        n = counts[execution.workflow_type] = counts.get(execution.workflow_type, 0) + 1
        path = HISTORIES / f"{scenario}--{execution.workflow_type}--{n}.json"
        path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")
        saved.append(path)
        ids[path.name] = execution.id
    return saved


async def _wait(stack, job_id: str, headers: dict) -> None:
    for _ in range(600):
        r = await stack.http.get(f"/v1/jobs/{job_id}", headers=headers)
        if r.json()["status"] == "completed":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{job_id} did not complete: {r.json()}")


async def _session_looks(client, job_id: str, count: int) -> bool:
    """Whether the waiting turn `job_id` has scheduled `count` looks at its session (session_still_runs)."""
    looks = 0
    try:
        async for event in client.get_workflow_handle(job_id).fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes") and \
                    event.activity_task_scheduled_event_attributes.activity_type.name == "session_still_runs":
                looks += 1
    except RPCError:
        return False  # the session has not started its job yet
    return looks >= count


async def _resent_after_gone(stack) -> list[Path]:
    """A keyed turn ran in its session's first run (which continued as new), its job is deleted, and the same
    request comes again once the API no longer takes it for one just accepted: the session, which remembers
    the job id, starts a job under it that fails at once (patch resent-turn-whose-job-is-gone-fails-saying-so).
    Driven as in tests/test_acceptance.py (test_a_keyed_turn_sent_again_after_its_job_is_gone_...)."""
    client = stack.client
    session = f"resent-{uuid.uuid4().hex[:6]}"
    session_wf = session_workflow_id(stack.tenant, session)
    first_run = await client.start_workflow(
        ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, turns_per_run=1),
        id=session_wf, task_queue=stack.settings.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session),
                                                 SearchAttributePair(sa.TENANT, stack.tenant)]))
    # An empty collection: the scenario needs no upload, so it records alone too.
    body = {"message": "Question: where is the lighthouse?", "collection": "record-empty", "session_id": session}
    keyed = {"Idempotency-Key": f"rec-{session}"}
    job_id = (await stack.http.post("/v1/chats", json=body, headers=keyed)).json()["job_id"]
    assert (await stack.wait_done(job_id))["status"] == "completed"

    async def continued() -> bool:
        return (await client.get_workflow_handle(session_wf).describe()).run_id != first_run.result_run_id
    await eventually(continued, what="the session continued as new")
    await client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
        namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=job_id)))

    async def gone() -> bool:
        try:
            await client.get_workflow_handle(job_id).describe()
        except RPCError:
            return True
        return False
    await eventually(gone, what="the turn's job deleted")
    # Ten minutes on: the API sends the resend to the session rather than reading it as accepted a moment ago.
    fresh_for, RecentlyAccepted.FRESH_FOR = RecentlyAccepted.FRESH_FOR, timedelta(0)
    try:
        again = await stack.http.post("/v1/chats", json=body, headers=keyed)
        assert again.status_code == 202 and again.json()["job_id"] == job_id, again.text

        async def refused() -> WorkflowExecutionDescription | None:
            try:
                described = await client.get_workflow_handle(job_id).describe()
            except RPCError:
                return None  # not started yet (until then the API reads the id as a job that is gone)
            return described if described.close_time else None
        run_id = (await eventually(refused, what="the refused job under the key's id")).run_id
    finally:
        RecentlyAccepted.FRESH_FOR = fresh_for
    job = await stack.wait_done(job_id)
    assert job["status"] == "failed" and job["error"]["type"] == KEY_EXPIRED_TYPE, job
    await asyncio.sleep(1)
    return (await _save(client, "chat-resent-after-gone", f"WorkflowId = '{session_wf}'")
            + await _save(client, "chat-resent-after-gone", f"WorkflowId = '{job_id}' AND RunId = '{run_id}'"))


async def _runs_carrying(client, session_wf: str) -> list[list[str]]:
    """The job ids of the turns each continue-as-new of the session carried, oldest run first."""
    carried = []
    async for execution in client.list_workflows(f"WorkflowId = '{session_wf}'"):
        async for event in client.get_workflow_handle(session_wf, run_id=execution.run_id).fetch_history_events():
            if event.HasField("workflow_execution_continued_as_new_event_attributes"):
                payloads = event.workflow_execution_continued_as_new_event_attributes.input.payloads
                (state,) = await client.data_converter.decode(payloads, [SessionState])
                carried.append((execution.start_time, [t.job_id for t in state.pending]))
    return [turns for _, turns in sorted(carried)]


async def _session_full_mid_turn(stack) -> list[Path]:
    """Messages come while a reviewer holds a session's turn: the fourth not yet answered is refused (patch
    session-refuses-past-its-bound), and the run, grown to its four messages, continues as new while the turn
    waits (session-continues-as-new-while-its-turn-waits); the next run asks the carried turn for its answer
    (carried-turn-asked-for-its-answer). Driven as in tests/test_acceptance.py
    (test_a_session_whose_turn_a_reviewer_holds_bounds_its_queue_and_continues_as_new_meanwhile)."""
    client = stack.client
    tag = uuid.uuid4().hex[:8]
    seed = await stack.upload((f"{tag}.txt", f"The {tag} herds are counted by Ada, from the hill.".encode()),
                              collection=tag)  # a collection of its own: the scenario records alone
    assert (await stack.wait_job(seed["job_id"]))["status"] == "completed"
    session = f"full-{tag}"
    session_wf = session_workflow_id(stack.tenant, session)
    await client.start_workflow(  # continues as new after four messages, even mid-turn
        ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, submits_per_run=4),
        id=session_wf, task_queue=stack.settings.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                 SearchAttributePair(sa.SESSION, session),
                                                 SearchAttributePair(sa.TENANT, stack.tenant)]))

    async def ask(message: str, review: bool = False) -> str:
        r = await stack.http.post("/v1/chats", json={"message": f"{message} {tag}", "session_id": session,
                                                     "collection": tag, "require_review": review})
        assert r.status_code == 202, r.text
        return r.json()["job_id"]
    bound, stack.settings.session_max_queued_turns = stack.settings.session_max_queued_turns, 3
    try:
        held = await ask("Who counts the herds?", review=True)
        await waiting_reviews(stack, held)
        queued = [await ask("And from what?"), await ask("And how often?")]
        refused = await ask("And where?")  # a fourth turn not yet answered: one too many
        job = await stack.wait_done(refused)
        assert job["status"] == "failed" and job["error"]["type"] == "SessionBusy", job
    finally:
        stack.settings.session_max_queued_turns = bound
    carried = await eventually(lambda: _runs_carrying(client, session_wf), what="the session continued as new")
    assert carried == [[held, *queued]], carried
    r = await stack.http.post(f"/v1/jobs/{held}/review", json={"decision": "approve", "reviewer": "rec"})
    assert r.status_code == 200, r.text
    for job_id in (held, *queued):
        assert (await stack.wait_done(job_id))["status"] == "completed"
    await asyncio.sleep(1)  # visibility
    name = "chat-session-full-mid-turn"
    return (await _save(client, name, f"WorkflowId = '{session_wf}'")
            + await _save(client, name, f"WorkflowId = '{held}' OR WorkflowId = '{refused}'"))  # one count


async def _cancel_during_failing_publish(stack) -> list[Path]:
    """A document's publish, cancelled while it runs, then fails retryably: the server retries nothing once the
    cancel was asked, and the job ends cancelled (patch step-failed-after-cancel-request-is-cancelled). As
    tests/test_workflows.py does it (test_a_cancel_during_a_publish_that_then_fails_ends_the_job_cancelled): the
    real workflow on its fake activities, which fail the publish after 1.5 s."""
    fakes = Fakes(publish_seconds=1.5, publish_fails=True)
    doc = document("a.txt", "record-late-cancel")
    loaded = policies._loaded  # fake_worker loads the test policies for the fakes' names: the stack's go back
    try:
        async with fake_worker(SimpleNamespace(client=stack.client), fakes) as queue:
            handle = await stack.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                                       id=document_workflow_id(doc.tenant, doc.document_id))

            async def publishing() -> bool:
                return bool(fakes.named("prune_stale_chunks"))
            await eventually(publishing, timeout=20, what="the publish")
            await handle.cancel()
            try:
                await handle.result()
                raise AssertionError("the document's job was not cancelled")
            except WorkflowFailureError as exc:
                assert isinstance(exc.cause, CancelledError), exc.cause
    finally:
        policies._loaded = loaded
    assert len(fakes.named("prune_stale_chunks")) == 1  # not retried
    await asyncio.sleep(1)
    return await _save(stack.client, "ingest-cancel-during-failing-publish", f"WorkflowId = '{handle.id}'")


async def _seeded(stack, tag: str) -> str:
    """A collection of the scenario's own with one document (so that it records alone)."""
    seed = await stack.upload((f"{tag}.txt", f"High tide at {tag} harbour is at noon.".encode()), collection=tag)
    assert (await stack.wait_job(seed["job_id"]))["status"] == "completed"
    return tag


async def _cancel_after_terminal_event(stack) -> list[Path]:
    """A watched turn has sent its terminal event and waits for its watcher's next poll, and a cancel comes:
    it stays completed (patch cancel-after-terminal-event-changes-nothing). Driven as in tests/test_cancel.py
    (test_a_cancel_that_comes_as_a_job_ends_leaves_it_as_it_ended), with a longer wait for the watcher so the
    cancel surely lands in it (the timer's length is not part of what a replay checks)."""
    collection = await _seeded(stack, f"late{uuid.uuid4().hex[:8]}")
    loaded = policies._loaded
    policies._loaded = dataclasses.replace(loaded, subscriber_grace=timedelta(seconds=30))
    try:
        with stack.llm.scope(delay=1.0) as llm:
            job_id = (await stack.chat(f"When is high tide? {llm.token}", collection=collection))["job_id"]
            handle = stack.client.get_workflow_handle(job_id)

            async def poll() -> PollResult | None:
                try:
                    return await handle.execute_update(POLL_UPDATE, PollInput(from_offset=0), result_type=PollResult)
                except Exception:  # noqa: BLE001 - the session has not started the job yet
                    return None
            # A watcher reads the first events and leaves without polling again (a closed browser tab).
            await eventually(poll, what="the turn's first events")
            async for event in handle.fetch_history_events(wait_new_event=True):
                if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED and \
                        event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta() == \
                        timedelta(seconds=30):
                    break  # the terminal event is out; the job waits for the watcher's next poll
            else:
                raise AssertionError("the turn ended without waiting for its watcher's next poll")
            r = await stack.http.post(f"/v1/jobs/{job_id}/cancel")
            assert r.status_code == 202, r.text
    finally:
        policies._loaded = loaded
    ended = await stack.wait_done(job_id)
    assert ended["status"] == "completed" and ended["result"]["answer"], ended
    await asyncio.sleep(1)
    return await _save(stack.client, "chat-cancel-after-terminal-event", f"WorkflowId = '{job_id}'")


async def _stream_polls_bounded(stack) -> list[Path]:
    """Readers of a turn held for review go away with their polls still in flight: past five waiting, the
    oldest is answered empty (patch stream-polls-bounded), and the reviewer's decision still lands. Driven as
    in tests/test_events.py (test_polls_whose_readers_went_away_leave_room_for_a_decision)."""
    collection = await _seeded(stack, f"gone{uuid.uuid4().hex[:8]}")
    r = await stack.http.post("/v1/chats", json={"message": "When is high tide?", "collection": collection,
                                                 "require_review": True})
    job_id = r.json()["job_id"]
    await waiting_reviews(stack, job_id)
    handle = stack.client.get_workflow_handle(job_id)
    end = await handle.query("__temporal_workflow_stream_offset", result_type=int)
    gone = []
    for _ in range(12):  # each reader polls from the end, then goes away without its answer
        try:
            gone.append(await handle.start_update(POLL_UPDATE, PollInput(topics=["events"], from_offset=end),
                                                  wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                                                  result_type=PollResult))
        except RPCError as exc:  # refused: every Update the job may have in flight is taken
            assert exc.status == RPCStatusCode.RESOURCE_EXHAUSTED, exc
    early = [await asyncio.wait_for(poll.result(), 30) for poll in gone[:7]]
    assert all(result.items == [] and result.next_offset == end for result in early), early
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "rec"})
    assert r.status_code == 200, r.text
    assert (await stack.wait_done(job_id))["status"] == "completed"
    await asyncio.sleep(1)
    return await _save(stack.client, "chat-stream-polls-bounded", f"WorkflowId = '{job_id}'")


async def _gate_full(stack) -> list[Path]:
    """A tenant's gate holds MAX_IN_GATE jobs and refuses the next, which fails at once, TenantBusy (patch
    gate-refuses-past-its-bound), as in tests/test_running_slots.py
    (test_a_gate_holding_all_it_may_refuses_the_next_job_which_fails_saying_so). That test lowers the bound, which
    a replay on today's code would not: here the gate is started as a run of it carried over, holding 4,000 jobs
    (made-up ids, none waiting under the tenant's limit of 10,000: nothing for the gate to sweep)."""
    client = stack.client
    tenant = f"full-{uuid.uuid4().hex[:6]}"
    key = api_keys.create(stack.settings.effective_api_keys_file, tenant, "reviewer", f"{tenant}-reviewer")
    headers = {"Authorization": f"Bearer {key}"}

    async def ended(job_id: str) -> dict | None:
        job = (await stack.http.get(f"/v1/jobs/{job_id}", headers=headers)).json()
        return job if job["status"] in ("completed", "failed", "cancelled") else None
    # The tenant's document first (its job starts the gate, ended then to start the full one in its place).
    r = await stack.http.post("/v1/documents", data={"collection": "record"}, headers=headers,
                              files=[("files", ("a.txt", b"The keeper lights the lamp at dusk."))])
    upload = r.json()["job_id"]
    assert (await eventually(lambda: ended(upload), timeout=60, what="the upload"))["status"] == "completed"
    await client.get_workflow_handle(gate_id(tenant, stack.settings.task_queue)).terminate("replaced")
    # Ids of three characters: the gate's input stays under LARGE_PAYLOAD_BYTES, in the history (not a blob).
    holders = [f"{n:03x}" for n in range(MAX_IN_GATE)]
    gate = await client.start_workflow(  # as acquire_slot starts it
        TenantGateWorkflow.run, GateState(tenant=tenant, limit=stack.settings.tenant_max_running_jobs,
                                          holders=holders, tickets=dict.fromkeys(holders, 1)),
        id=gate_id(tenant, stack.settings.task_queue), task_queue=queue_name(stack.settings.task_queue, "main"),
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "tenant_gate"),
                                                 SearchAttributePair(sa.TENANT, tenant)]))
    r = await stack.http.post("/v1/chats", headers=headers,
                              json={"message": "When is the lamp lit?", "collection": "record"})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    job = await eventually(lambda: ended(job_id), timeout=60, what="the refused job's end")
    assert job["status"] == "failed" and job["error"]["type"] == "TenantBusy", job
    assert f"{MAX_IN_GATE} jobs of tenant {tenant} already run or wait" in job["error"]["message"], job
    await asyncio.sleep(1)
    saved = await _save(client, "gate-full", f"WorkflowId = '{gate.id}' AND RunId = '{gate.result_run_id}'")
    await gate.terminate("recorded")
    return saved + await _save(client, "gate-full", f"WorkflowId = '{job_id}'")


async def _gate_ends_owing(stack) -> list[Path]:
    """A gate decides to continue as new while its answer to one job is on its way, and another job asks then:
    it is not answered by the ending run but owed, and told by the next (patch gate-ends-without-new-signals).
    tests/test_workflows.py (test_the_gate_of_a_busy_tenant_still_continues_as_new) gets there with answers
    sent late by an interceptor, which a replay would not have; here the gate's worker holds the workflow task
    that sends the first answer (HoldsAPayload) while the second ask comes, and the gate continues as new
    past a history of 3 events (rotate_after): at once for its first run, after its answer for the next."""
    tenant = f"owed-{uuid.uuid4().hex[:6]}"
    dc = stack.client.data_converter
    held = HoldsAPayload(dc.payload_codec, marker=b'"granted"')  # the gate's first answer
    holding = Client(**{**stack.client.config(), "data_converter": dataclasses.replace(dc, payload_codec=held)})
    queue = f"gate-{uuid.uuid4().hex[:8]}"
    first, second = (f"{tenant}.job-{n}" for n in (1, 2))
    async with Worker(holding, task_queue=queue, workflows=[TenantGateWorkflow, WaitsForSlot]):
        jobs = [await stack.client.start_workflow(WaitsForSlot.run, id=j, task_queue=queue) for j in (first, second)]
        gate = await stack.client.start_workflow(TenantGateWorkflow.run,
                                                 GateState(tenant=tenant, limit=10, rotate_after=3),
                                                 id=f"{tenant}.gate.{queue}", task_queue=queue)
        await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant=tenant, job_id=first))
        await asyncio.wait_for(held.reached.wait(), 30)  # the task that answers it (and decides to end) is open
        await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant=tenant, job_id=second))
        held.go.set()
        for job in jobs:  # each hears it may run, whichever run told it
            assert (await asyncio.wait_for(job.result(), 30))[-1]["granted"]

        async def rested() -> list:  # the last run, rotated past its answer to the owed job, waits
            runs = [e async for e in stack.client.list_workflows(f"WorkflowId = '{gate.id}'")]
            return runs if len(runs) == 3 and sum(e.close_time is None for e in runs) == 1 else []
        await eventually(rested, what="the gate's third run")
        first_run = await stack.client.get_workflow_handle(gate.id, run_id=gate.result_run_id).fetch_history()
        ended = first_run.events[-1].workflow_execution_continued_as_new_event_attributes
        (carried,) = await dc.decode(ended.input.payloads, [GateState])
        assert carried.owed == [second], carried
        await asyncio.sleep(1)
        saved = await _save(stack.client, "gate-ends-owing", f"WorkflowId = '{gate.id}'")
        await gate.terminate("recorded")
    return saved


async def _fallback_refused(stack) -> list[Path]:
    """The configured model is down (503s) and the lighter fallback refuses (400): the answer step parks with
    both reasons (patch fallback-refused-parks-the-step), and an operator's retry asks the configured model
    again. Driven as in tests/test_grounded.py
    (test_a_fallback_that_refuses_parks_the_answer_for_an_operator_rather_than_failing_the_turn), on a stack of
    its own beside the recording one (same server, a task queue of its own): only it has a fallback model."""
    primary, light = ScriptedLLM(), ScriptedLLM()
    await primary.start()
    await light.start()
    loaded = policies._loaded  # (its worker loads the same policy file: what the recording stack runs on stays)
    try:
        address = stack.client.service_client.config.target_host
        async with running_stack(address, primary, Path(tempfile.mkdtemp(prefix="ragline-record-fallback-")),
                                 task_queue="ragline-record-fallback", encrypt_payloads=False,
                                 fallback_llm_base_url=light.base_url, fallback_llm_model="light") as fallback:
            up = await fallback.upload(("a.txt", b"The harbour of Ostra has a red lighthouse."), collection="record")
            assert (await fallback.wait_job(up["job_id"]))["status"] == "completed"
            primary.script("answer", ["503"] * ATTEMPTS)
            light.script("answer", ["400"])
            job_id = (await fallback.chat("What colour is the lighthouse?", collection="record"))["job_id"]
            job = await fallback.wait_job(job_id)
            assert job["status"] == "dead_lettered", job
            assert "the fallback refused too" in job["error"]["message"], job["error"]
            r = await fallback.http.post(f"/v1/jobs/{job_id}/retry", json={"operator": "rec", "reason": "back up"})
            assert r.status_code == 200, r.text
            job = await fallback.wait_done(job_id)
            assert job["status"] == "completed" and job["result"]["model"] != "light", job
            await asyncio.sleep(1)
            return await _save(stack.client, "chat-fallback-refused", f"WorkflowId = '{job_id}'")
    finally:
        policies._loaded = loaded
        await primary.stop()
        await light.stop()


class AnsweredOutOfOrder(Fakes):
    """The gate's two answers to a job's ask arrive in the wrong order: the grant, then the "wait in line" it
    sent first (signals of their own, which the server may deliver in either order)."""

    @activity.defn(name="acquire_slot")
    async def acquire_slot(self, req: SlotRequest) -> None:
        self._end(self._start("acquire_slot", req))
        job = activity.client().get_workflow_handle(req.job_id)
        await job.signal("slot_update", SlotGrant(ticket=req.ticket, granted=True, running=2, limit=2))
        await job.signal("slot_update", SlotGrant(ticket=req.ticket, granted=False, running=2, limit=2, position=1))


async def _slot_grant_final(stack) -> list[Path]:
    """A document's job hears its grant and then the "wait in line" sent before it: it keeps the slot and runs
    (patch slot-grant-is-final). As tests/test_workflows.py does it
    (test_a_grant_is_not_undone_by_a_wait_in_line_that_arrives_after_it), in a real job: the document's workflow
    on the fake activities, with its tenant (it asks for a slot)."""
    doc = document("a.txt", "record-out-of-order")
    job_id = document_workflow_id(doc.tenant, doc.document_id)
    loaded = policies._loaded  # fake_worker loads the test policies for the fakes' names: the stack's go back
    try:
        async with fake_worker(SimpleNamespace(client=stack.client), AnsweredOutOfOrder()) as queue:
            result = await asyncio.wait_for(stack.client.execute_workflow(
                IngestDocumentWorkflow.run, doc, task_queue=queue, id=job_id,
                search_attributes=TypedSearchAttributes([SearchAttributePair(sa.TENANT, doc.tenant)])), 60)
    finally:
        policies._loaded = loaded
    assert result.status == "indexed", result
    await asyncio.sleep(1)
    return await _save(stack.client, "slot-grant-then-wait", f"WorkflowId = '{job_id}'")


async def _gate_sends_bounded(stack) -> list[Path]:
    """A gate's run owes MAX_SENDING + 1 jobs their standing (its last run ended meanwhile): it sends the first
    MAX_SENDING answers and the last once one of them is through (patch gate-answers-at-most-1000-at-once). The
    jobs are gone (made-up ids): each send fails and the gate passes the place on, which no one waits for.
    tests/test_running_slots.py (test_a_gate_has_a_bounded_number_of_answers_on_their_way_and_every_job_hears)
    lowers the bound, which a replay on today's code would not."""
    client = stack.client
    tenant = f"sends-{uuid.uuid4().hex[:6]}"
    owed = [f"{n:03x}" for n in range(MAX_SENDING + 1)]
    gate = await client.start_workflow(
        TenantGateWorkflow.run, GateState(tenant=tenant, limit=stack.settings.tenant_max_running_jobs,
                                          holders=owed, tickets=dict.fromkeys(owed, 1), owed=owed),
        id=gate_id(tenant, stack.settings.task_queue), task_queue=queue_name(stack.settings.task_queue, "main"),
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "tenant_gate"),
                                                 SearchAttributePair(sa.TENANT, tenant)]))

    async def told_all() -> bool:  # every place passed on, the last send included
        return not (await gate.query(TenantGateWorkflow.slots)).holders
    await eventually(told_all, timeout=120, what="the gate's sends through")
    await asyncio.sleep(1)
    saved = await _save(client, "gate-sends-bounded", f"WorkflowId = '{gate.id}'")
    await gate.terminate("recorded")
    return saved


async def _refusal_cache_down(stack) -> list[Path]:
    """A session's first turn is refused (no passage supports it) and its cache write fails every attempt; the
    second turn, queued behind it, has the session ask the first for its answer. The refusal is told to the
    session at once (patch refusal-told-to-its-session-once-shown) and the used-up cache step is left failed,
    the turn completing (patch optional-step-left-failed-when-its-retries-are-used-up). As tests/test_workflows.py
    does it (test_a_refusal_whose_cache_write_fails_ends_answered_and_holds_no_later_turn): the real workflows
    on its fake activities."""
    on_server = SimpleNamespace(client=stack.client)  # what fake_worker takes
    fakes = FirstRefusedCacheDown(side_step_seconds=0)
    session = f"refused-{uuid.uuid4().hex[:6]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    loaded = policies._loaded  # fake_worker loads the test policies for the fakes' names: the stack's go back
    try:
        async with fake_worker(on_server, fakes) as queue:
            handle = await start_session(on_server, queue, first)
            await handle.signal(ChatSessionWorkflow.submit, second)
            refused = await asyncio.wait_for(turn_result(on_server, first.job_id), 60)
            answered = await asyncio.wait_for(turn_result(on_server, second.job_id), 60)
            progress = await stack.client.get_workflow_handle(first.job_id).query(ChatTurnWorkflow.progress)
            attempts = policies.policy("cache_answer").retry.maximum_attempts  # of the test policies
    finally:
        policies._loaded = loaded
    assert not refused.supported and answered.answer == "answer to Second question?", (refused, answered)
    assert len(fakes.named("cache_answer")) == attempts
    assert {s.name: s.status for s in progress.steps}["cache_answer"] == "failed"
    told = await stack.client.get_workflow_handle(first.job_id).fetch_history()
    # What is recorded: the session asked the refused turn for its answer, which it told at once.
    assert '"follow_up_waits"' in told.to_json() and '"turn_answered"' in told.to_json()
    await asyncio.sleep(1)  # visibility
    name = "chat-refusal-cache-down"
    saved = (await _save(stack.client, name, f"WorkflowId = '{handle.id}'")
             + await _save(stack.client, name, f"WorkflowId = '{first.job_id}' OR WorkflowId = '{second.job_id}'"))
    await handle.terminate("recorded")  # after its history is saved: it would wait for a next turn
    return saved


async def _side_steps_step_aside(stack) -> list[Path]:
    """On a model endpoint of one slot, the first turn's summary, running when the second question comes, stops
    for that question's answer and runs again once the second turn says its answer is out (patches
    side-steps-step-aside-for-a-later-answer, turn-tells-the-turn-before-its-answer-is-out). As
    tests/test_workflows.py does it (test_on_a_local_model_a_turns_summary_steps_aside_for_the_next_questions_answer):
    the real workflows on its fake activities."""
    fakes = ModelOfFewSlots(slots=1)
    session = f"aside-{uuid.uuid4().hex[:6]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    on_server = SimpleNamespace(client=stack.client)
    async with _faked(stack.client, fakes) as queue:
        handle = await start_session(on_server, queue, first)
        for _ in range(200):
            if any(c.arg.question == "First question?" for c in fakes.named("summarize_context")):
                break
            await asyncio.sleep(0.1)
        await handle.signal(ChatSessionWorkflow.submit, second)
        done = [await asyncio.wait_for(turn_result(on_server, t.job_id), 60) for t in (first, second)]
    assert done[0].summary == "summary of ctx:First question?", done[0]
    assert len([c for c in fakes.named("summarize_context") if c.arg.question == "First question?"]) == 2
    await asyncio.sleep(1)  # visibility
    name = "chat-side-steps-step-aside"
    saved = (await _save(stack.client, name, f"WorkflowId = '{handle.id}'")
             + await _save(stack.client, name, f"WorkflowId = '{first.job_id}' OR WorkflowId = '{second.job_id}'"))
    await handle.terminate("recorded")
    return saved


@contextlib.asynccontextmanager
async def _faked(client, fakes: Fakes, queue: str | None = None, **kw):
    """fake_worker on the recording server; the stack's policies put back after (it loads the test ones)."""
    loaded = policies._loaded
    try:
        async with fake_worker(SimpleNamespace(client=client), fakes, queue, **kw) as queue:
            yield queue
    finally:
        policies._loaded = loaded


async def _agent_status_is(handle, status: str) -> bool:
    try:
        return (await handle.query(AgentWorkflow.progress)).status == status
    except RPCError:  # not started yet
        return False


async def _sub_agent_cancelled(stack) -> list[Path]:
    """A person cancels a sub-agent waiting at its depth guard: it tells its parent what it spent, which counts
    it (patches agent-counts-cancelled-child-spend, agent-counts-failed-child-spend: a cancel is a child's
    error too) and does not delegate its goal again (agent-cancelled-child-not-delegated-again). As
    tests/test_workflows.py does it (test_a_sub_agent_a_person_cancels_still_counts_what_it_spent)."""
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth == 1:
            call = ToolCall(name="search_documents", arguments={"query": "ships"}) if not req.observations else \
                ToolCall(name="delegate", arguments={"subgoal": "Count the ships by hand"})
            return PlanOutput(calls=[call], prompt_tokens=1990, completion_tokens=10)
        if not req.observations:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})],
                              prompt_tokens=5, completion_tokens=5)
        return finish("the north was not counted", tokens=30)

    root_id = f"agent-rec-{uuid.uuid4().hex[:8]}"
    async with _faked(stack.client, Fakes(plan=plan)) as queue:
        root = await stack.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=1),
                                                 id=root_id, task_queue=queue)
        child = stack.client.get_workflow_handle(agent_workflow_id(root_id, 1))
        await eventually(lambda: _agent_status_is(child, "waiting_review"), what="the sub-agent at its depth guard")
        await child.cancel()
        result = await asyncio.wait_for(root.result(), 60)
    assert [n.status for n in result.tree.children] == ["cancelled"], result.tree
    assert (result.llm_calls, result.tokens) == (2 + 2, 10 + 30 + 2 * 2000), result
    await asyncio.sleep(1)
    return await _save(stack.client, "agent-sub-agent-cancelled", f"WorkflowId STARTS_WITH '{root_id}'")


async def _sub_agent_cancelled_while_starting(stack) -> list[Path]:
    """A person cancels sub-agent X in the workflow task that starts X's own sub-agent (held open by the
    worker's codec): X waits for that start and cancels it (patch agent-cancel-waits-for-its-sub-agents-start).
    As tests/test_workflows.py does it (test_a_sub_agent_cancelled_while_it_starts_its_own_counts_...)."""
    tag = uuid.uuid4().hex[:8]
    grandchild_goal = f"Count the north by hand {tag}"

    def plan(req: PlanInput) -> PlanOutput:
        if req.depth < 2 and not req.observations:
            goal = "Count the north" if req.depth == 0 else grandchild_goal
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": goal})],
                              prompt_tokens=5, completion_tokens=5)
        return finish(f"counted at depth {req.depth}", tokens=1000)

    dc = stack.client.data_converter
    # The goal as the grandchild's input holds it (the plan's result, which names it first, goes by).
    held = HoldsAPayload(dc.payload_codec, marker=f'{grandchild_goal}","collection'.encode())
    holding = Client(**{**stack.client.config(), "data_converter": dataclasses.replace(dc, payload_codec=held)})
    root_id = f"agent-rec-{tag}"
    async with _faked(holding, Fakes(plan=plan)) as queue:
        root = await stack.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=3),
                                                 id=root_id, task_queue=queue)
        await asyncio.wait_for(held.reached.wait(), 30)  # X's task that starts the grandchild is open
        child_id = agent_workflow_id(root_id, 1)
        await stack.client.get_workflow_handle(child_id).cancel()
        held.go.set()
        result = await asyncio.wait_for(root.result(), 60)
        grandchild = stack.client.get_workflow_handle(agent_workflow_id(child_id, 1))
        assert (await grandchild.describe()).status == WorkflowExecutionStatus.CANCELED
    assert [n.status for n in result.tree.children] == ["cancelled"], result.tree
    events = [e.event_type async for e in stack.client.get_workflow_handle(child_id).fetch_history_events()]
    assert events.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED) < \
        events.index(EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED), "the cancel came after the start"
    await asyncio.sleep(1)
    return await _save(stack.client, "agent-cancel-while-sub-agent-starts", f"WorkflowId STARTS_WITH '{root_id}'")


async def _stop_withdraws_parked_plan(stack) -> list[Path]:
    """A reviewer rejects one sub-agent's delegation while its sibling's plan is parked for an operator: the
    sibling, told to stop, withdraws the parked step (patch parked-step-withdrawn-when-told-to-stop) and counts
    the attempts of its plan that never answered (agent-counts-attempts-of-an-unanswered-plan). As
    tests/test_workflows.py does it (test_a_stop_withdraws_a_sub_agents_parked_step_and_the_tree_finishes)."""
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth == 0:
            if not req.observations:
                return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": g})
                                         for g in ("the north", "the south")])
            return finish("done", tokens=10)
        if req.goal == "the north":  # past max_depth 1: the depth guard asks a reviewer
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "the north-east"})])
        raise ApplicationError("the model did not answer within the timeout", type="APITimeoutError")

    fakes = Fakes(plan=plan)
    root_id = f"agent-rec-{uuid.uuid4().hex[:8]}"
    async with _faked(stack.client, fakes) as queue:
        root = await stack.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=1),
                                                 id=root_id, task_queue=queue)
        north = stack.client.get_workflow_handle(agent_workflow_id(root_id, 1))
        south = stack.client.get_workflow_handle(agent_workflow_id(root_id, 2))
        await eventually(lambda: _agent_status_is(north, "waiting_review"), what="north at its depth guard")
        await eventually(lambda: _agent_status_is(south, "dead_lettered"), what="south's plan parked")
        await north.execute_update("review", {"decision": "reject", "reviewer": "rec"})
        result = await asyncio.wait_for(root.result(), 60)
        attempts = policies.policy("agent_plan").retry.maximum_attempts  # of the test policies
    assert result.status == "stopped", result
    assert result.llm_calls == 1 + 1 + attempts, result  # the root's plan, north's, each of south's attempts
    await asyncio.sleep(1)
    return await _save(stack.client, "agent-stop-withdraws-parked-plan", f"WorkflowId STARTS_WITH '{root_id}'")


async def _review_signals_with_a_stop(stack) -> list[Path]:
    """An agent waits at its depth guard; with no worker running it is told to stop and two decisions come by
    signal (as the CLI sends them): a rejection (taken: it stops either way) and an approval, refused as a
    second decision (patch review-second-decision-refused) of a review being withdrawn
    (review-being-withdrawn-refuses-decisions). All reach it in one workflow task, as in tests/test_workflows.py
    (test_a_review_signal_that_comes_with_a_stop_is_recorded_as_rejected_input)."""
    def plan(req: PlanInput) -> PlanOutput:  # delegates once past max_depth 0 (the depth guard asks), then finishes
        if not req.observations and req.depth == 0:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})])
        return finish("counted")

    fakes = Fakes(plan=plan)
    async with _faked(stack.client, fakes, sticky=False) as queue:
        agent = await stack.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=0),
                                                  id=f"agent-rec-{uuid.uuid4().hex[:8]}", task_queue=queue)
        await eventually(lambda: _agent_status_is(agent, "waiting_review"), what="the agent at its depth guard")
    await agent.signal("stop")
    await agent.signal("review", {"decision": "reject", "reviewer": "rec"})
    await agent.signal("review", {"decision": "approve", "reviewer": "rec-2", "extra_depth": 1})
    async with _faked(stack.client, fakes, queue):
        result = await asyncio.wait_for(agent.result(), 60)
    assert result.status == "stopped" and [d.decision for d in result.decisions] == ["reject"], result
    await asyncio.sleep(1)
    return await _save(stack.client, "agent-review-signals-with-stop", f"WorkflowId = '{agent.id}'")


async def _upload_reruns_anothers_document(stack) -> list[Path]:
    """Two documents of an upload are run by another upload (held on a queue nobody polls), which the fake
    await_document then ends: one cancelled with its upload (this upload runs it itself: patch
    upload-runs-a-document-another-upload-failed), one failed on that upload's password (this one tries its
    own: upload-tries-its-own-password). As tests/test_workflows.py does them (test_an_upload_runs_the_document_
    itself_when_..., test_an_upload_with_a_password_runs_a_document_that_failed_on_another_uploads)."""
    cancelled = document("report.pdf", "record-shared")
    locked = document("locked.pdf", "record-shared").model_copy(update={"password": "right"})
    held = {}
    for doc in (cancelled, locked):
        held[document_workflow_id(doc.tenant, doc.document_id)] = await stack.client.start_workflow(
            IngestDocumentWorkflow.run, doc, id=document_workflow_id(doc.tenant, doc.document_id),
            task_queue=f"nobody-{uuid.uuid4().hex[:6]}")
    errors = {document_workflow_id(cancelled.tenant, cancelled.document_id): CANCELLED_WITH_ITS_UPLOAD,
              document_workflow_id(locked.tenant, locked.document_id): f"step extract_text failed: {WRONG_PASSWORD}"}

    async def ended_meanwhile(req: AwaitDocumentInput) -> DocumentOutcome:
        await held[req.workflow_id].terminate(reason="recording: ended")
        return DocumentOutcome.failed_from(req.workflow_id, errors[req.workflow_id])
    fakes = Fakes(awaited=ended_meanwhile)
    upload_id = f"ingest-rec-{uuid.uuid4().hex[:8]}"
    async with _faked(stack.client, fakes) as queue:
        result = await asyncio.wait_for(stack.client.execute_workflow(
            IngestWorkflow.run, IngestInput(collection="record-shared", documents=[cancelled, locked]),
            id=upload_id, task_queue=queue), 60)
    assert [o.status for o in result.documents] == ["indexed", "indexed"], result
    assert sorted(str(c.arg.password) for c in fakes.named("extract_text")) == ["None", "right"]  # one run each
    await asyncio.sleep(1)
    return await _save(stack.client, "ingest-reruns-anothers-document", f"WorkflowId = '{upload_id}'")


async def _upload_after_removal(stack) -> list[Path]:
    """An earlier upload indexed the document, and a removal took it out before this upload reached it: the
    upload runs the document's job again (patch upload-after-removal-ingests-anew). As tests/test_workflows.py
    does it (test_an_upload_that_finds_its_document_removed_since_ingests_it_anew)."""
    doc = document("a.txt", "record-removed")
    child_id = document_workflow_id(doc.tenant, doc.document_id)
    fakes = Fakes(removed_documents={child_id})
    upload_id = f"ingest-rec-{uuid.uuid4().hex[:8]}"
    async with _faked(stack.client, fakes) as queue:
        first = await stack.client.execute_workflow(IngestDocumentWorkflow.run, doc, id=child_id, task_queue=queue)
        assert first.status == "indexed", first
        result = await asyncio.wait_for(stack.client.execute_workflow(
            IngestWorkflow.run, IngestInput(collection="record-removed", documents=[doc]), id=upload_id,
            task_queue=queue), 60)
    assert [(o.status, o.job_id) for o in result.documents] == [("indexed", child_id)], result
    assert len(fakes.named("extract_text")) == 2  # the document's job ran again
    await asyncio.sleep(1)
    return await _save(stack.client, "ingest-after-removal", f"WorkflowId = '{upload_id}'")


async def _upload_removed_again(stack) -> list[Path]:
    """An upload finds its document removed since, goes to run it anew, meets another upload's run of it (held
    on a queue nobody polls) and finds that removed too: it fails as Removed, not as the file's fault (patch
    upload-removed-again-is-not-the-files-fault). As tests/test_workflows.py does it
    (test_an_upload_whose_document_was_removed_again_while_it_ran_does_not_blame_the_file)."""
    doc = document("a.txt", "record-removed-again")
    child_id = document_workflow_id(doc.tenant, doc.document_id)
    fakes = Fakes(removed_documents={child_id})
    upload_id = f"ingest-rec-{uuid.uuid4().hex[:8]}"
    held = await stack.client.start_workflow(IngestDocumentWorkflow.run, doc, id=child_id,
                                             task_queue=f"nobody-{uuid.uuid4().hex[:6]}")
    try:
        async with _faked(stack.client, fakes) as queue:
            await asyncio.wait_for(stack.client.execute_workflow(
                IngestWorkflow.run, IngestInput(collection="record-removed-again", documents=[doc]), id=upload_id,
                task_queue=queue), 60)
        raise AssertionError("the upload did not fail")
    except WorkflowFailureError as exc:
        cause = exc.cause
        assert isinstance(cause, ApplicationError) and cause.type == "Removed", cause
        assert "removed again while this upload ran" in cause.message, cause.message
    finally:
        await held.terminate(reason="recording: ended")
    assert len(fakes.named("await_document")) == 2
    await asyncio.sleep(1)
    return await _save(stack.client, "ingest-removed-again", f"WorkflowId = '{upload_id}'")


async def _removal_after_failed_newer_run(stack) -> list[Path]:
    """A removal waits for the document's newer run (an upload queued before the DELETE), which fails: it then
    takes only what was written before that run ended (patch removal-takes-only-what-the-failed-newer-run-wrote).
    As tests/test_workflows.py does it (test_a_removal_leaves_the_chunks_of_a_run_that_began_after_the_failed_
    newer_run_it_waited_for), with the fakes' store: await_newer_run says when it saw the run end."""
    fakes = Fakes(newer_run=NewerRun(started=True, indexed=False, at=1_800_000_060.0))  # after the confirmation
    doc_id = f"record-newer-{uuid.uuid4().hex[:12]}"
    removal_id = removal_workflow_id(stack.tenant, doc_id)
    async with _faked(stack.client, fakes) as queue:
        result = await asyncio.wait_for(stack.client.execute_workflow(
            RemoveDocumentWorkflow.run, RemoveDocumentInput(tenant=stack.tenant, document_id=doc_id,
                                                            collection="record-newer", filename="a.txt", run_id="r1"),
            id=removal_id, task_queue=queue), 60)
    assert result.status == "removed", result
    removals = [c.arg for c in fakes.named("remove_document_chunks")]
    assert [r.written_before for r in removals][1:] == [1_800_000_060.0], removals
    await asyncio.sleep(1)
    return await _save(stack.client, "removal-after-failed-newer-run", f"WorkflowId = '{removal_id}'")


async def _upload_cancelled_while_document_starts(stack) -> list[Path]:
    """The upload's cancel reaches it in the workflow task that brings its document's job's start (held open by
    the worker's codec): it waits for that start and cancels the job (patch
    upload-cancel-waits-for-its-documents-start). As tests/test_workflows.py does it
    (test_a_cancel_that_comes_while_a_documents_job_is_being_started_cancels_that_job)."""
    doc = document(f"starting-{uuid.uuid4().hex[:8]}.txt", "record-cancel-while-starting")
    dc = stack.client.data_converter
    held = HoldsAPayload(dc.payload_codec, marker=doc.filename.encode())
    holding = Client(**{**stack.client.config(), "data_converter": dataclasses.replace(dc, payload_codec=held)})
    upload_id = f"ingest-rec-{uuid.uuid4().hex[:8]}"
    async with _faked(holding, Fakes(index_seconds=2.0)) as queue:  # the document still writes as its cancel comes
        handle = await stack.client.start_workflow(
            IngestWorkflow.run, IngestInput(collection=doc.collection, documents=[doc]), id=upload_id,
            task_queue=queue)
        await asyncio.wait_for(held.reached.wait(), 30)  # the task that starts the document's job is open
        await handle.cancel()
        held.go.set()
        try:
            await asyncio.wait_for(handle.result(), 60)
            raise AssertionError("the upload was not cancelled")
        except WorkflowFailureError as exc:
            assert isinstance(exc.cause, CancelledError), exc.cause
        child = stack.client.get_workflow_handle(document_workflow_id(doc.tenant, doc.document_id))
        assert (await child.describe()).status == WorkflowExecutionStatus.CANCELED
    events = [e.event_type async for e in handle.fetch_history_events()]
    assert events.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED) < \
        events.index(EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED), "the cancel came after the start"
    await asyncio.sleep(1)
    return await _save(stack.client, "ingest-cancel-while-document-starts", f"WorkflowId = '{upload_id}'")


async def _publish_landed_with_cancel(stack) -> list[Path]:
    """No workflow worker runs while a document's publish ends and a person cancels: both reach the job in one
    workflow task, and the undo finds the document published: indexed (patch
    document-published-as-the-cancel-came-is-indexed). As tests/test_workflows.py does it
    (test_a_publish_that_ends_as_the_cancel_comes_stands)."""
    fakes = Fakes(publish_seconds=1.0)
    doc = document("a.txt", "record-cancel-with-publish")
    job_id = document_workflow_id(doc.tenant, doc.document_id)
    async with _faked(stack.client, fakes, runs="activities") as queue:
        async with _faked(stack.client, fakes, queue, sticky=False, runs="workflows"):
            handle = await stack.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue, id=job_id)

            async def publishing() -> bool:
                return bool(fakes.named("prune_stale_chunks"))
            await eventually(publishing, timeout=20, what="the publish")
        scheduled = max([e.event_id async for e in handle.fetch_history_events()
                         if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED])

        async def published() -> bool:  # recorded, with no workflow worker to see it
            return any([e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED and
                        e.activity_task_completed_event_attributes.scheduled_event_id == scheduled
                        async for e in handle.fetch_history_events()])
        await eventually(published, timeout=20, what="the publish's completion in the history")
        await handle.cancel()
        async with _faked(stack.client, fakes, queue, runs="workflows"):
            outcome = await asyncio.wait_for(handle.result(), 60)
    assert outcome.status == "indexed" and outcome.chunks == 5, outcome
    await asyncio.sleep(1)
    return await _save(stack.client, "ingest-published-as-cancel-came", f"WorkflowId = '{job_id}'")


# Scenarios that can be recorded alone (a run naming them records nothing else), by name.
ALONE = {"chat-resent-after-gone": _resent_after_gone,
         "chat-session-full-mid-turn": _session_full_mid_turn,
         "ingest-cancel-during-failing-publish": _cancel_during_failing_publish,
         "chat-cancel-after-terminal-event": _cancel_after_terminal_event,
         "chat-stream-polls-bounded": _stream_polls_bounded,
         "gate-full": _gate_full,
         "gate-ends-owing": _gate_ends_owing,
         "chat-fallback-refused": _fallback_refused,
         "slot-grant-then-wait": _slot_grant_final,
         "gate-sends-bounded": _gate_sends_bounded,
         "chat-refusal-cache-down": _refusal_cache_down,
         "agent-sub-agent-cancelled": _sub_agent_cancelled,
         "agent-cancel-while-sub-agent-starts": _sub_agent_cancelled_while_starting,
         "agent-stop-withdraws-parked-plan": _stop_withdraws_parked_plan,
         "agent-review-signals-with-stop": _review_signals_with_a_stop,
         "ingest-reruns-anothers-document": _upload_reruns_anothers_document,
         "ingest-after-removal": _upload_after_removal,
         "ingest-cancel-while-document-starts": _upload_cancelled_while_document_starts,
         "ingest-published-as-cancel-came": _publish_landed_with_cancel,
         "ingest-removed-again": _upload_removed_again,
         "removal-after-failed-newer-run": _removal_after_failed_newer_run,
         "chat-side-steps-step-aside": _side_steps_step_aside}


async def record(only: list[str] | None = None) -> list[Path]:
    """Every scenario, or only those named (their files replaced, every other history and id kept)."""
    HISTORIES.mkdir(exist_ok=True)
    if only:
        ids.update({name: wf for name, wf in json.loads((HISTORIES / "workflow_ids.json").read_text()).items()
                    if name.split("--")[0] not in only})
    for old in HISTORIES.glob("*--*.json"):
        if not only or old.name.split("--")[0] in only:
            old.unlink()
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                search_attributes=list(sa.ALL),
                                                dev_server_extra_args=dynamic_config_flags())
    llm = ScriptedLLM()
    await llm.start()
    saved: list[Path] = []
    try:
        address = env.client.service_client.config.target_host
        # Recorded without payload encryption, so the replay needs no key (the codec sits below the
        # workflow code, so what it checks, determinism, is the same).
        async with running_stack(address, llm, Path(tempfile.mkdtemp(prefix="ragline-record-")),
                                 encrypt_payloads=False) as stack:
            client = stack.client
            if only:
                for name in only:
                    saved += await ALONE[name](stack)
                _write_ids()
                return saved

            # An ingestion of two documents.
            up = await stack.upload(("a.txt", b"The harbour of Ostra has a red lighthouse and two piers."),
                                    ("b.txt", b"Keepers light the lamps at dusk and log every ship."),
                                    collection="record")
            assert (await stack.wait_job(up["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)  # visibility
            saved += await _save(client, "ingestion", f"WorkflowId = '{up['job_id']}'")
            saved += await _save(client, "ingestion", "WorkflowType = 'IngestDocumentWorkflow'")

            # A chat session of three turns that continues as new after two.
            session = f"rec-{uuid.uuid4().hex[:6]}"
            await client.start_workflow(
                ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, turns_per_run=2),
                id=session_workflow_id(stack.tenant, session), task_queue=stack.settings.task_queue,
                search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                         SearchAttributePair(sa.SESSION, session),
                                                         SearchAttributePair(sa.TENANT, stack.tenant)]))
            turns = [await stack.chat(f"Question {i}: what colour is the lighthouse?", session_id=session,
                                      collection="record") for i in range(1, 4)]
            for t in turns:
                assert (await stack.wait_job(t["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-session", f"WorkflowId = '{session_workflow_id(stack.tenant, session)}'")
            # The first turn, asked for its answer by the turns waiting after it, and the last.
            saved += await _save(client, "chat-session-first-turn", f"WorkflowId = '{turns[0]['job_id']}'")
            saved += await _save(client, "chat-session", f"WorkflowId = '{turns[-1]['job_id']}'")

            # A session that ends idle ([sessions] idle: 5 s in the test policies) and the run a later message
            # starts, which takes up what the ended one left.
            session = f"idle-{uuid.uuid4().hex[:6]}"
            idle_wf = session_workflow_id(stack.tenant, session)
            first = await stack.chat("Idle question 1: what colour is the lighthouse?", session_id=session,
                                     collection="record")
            assert (await stack.wait_job(first["job_id"]))["status"] == "completed"
            first_run = (await client.get_workflow_handle(idle_wf).describe()).run_id
            ended = client.get_workflow_handle(idle_wf, run_id=first_run)
            await ended.result()
            again = await stack.chat("Idle question 2: and the piers?", session_id=session, collection="record")
            assert (await stack.wait_job(again["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-session-idle", f"WorkflowId = '{idle_wf}'")

            # Turns followed on their event streams: their histories hold the stream's polls (Updates)
            # and, when a poll was not waiting as the run ended, the wait for it (events-linger).
            watched = []
            for i in range(3):
                with stack.llm.scope(delay=0.3) as mine:
                    t = await stack.chat(f"Watched question {i}: who lights the lamps? {mine.token}",
                                         collection="record")
                    events = await read_events(stack, t["job_id"])
                assert events[-1][1]["type"] == "ragline.job.completed", events[-1]
                watched.append(t["job_id"])
            await asyncio.sleep(1)
            for n, job_id in enumerate(watched, 1):
                saved += await _save(client, f"watched-turn-{n}", f"WorkflowId = '{job_id}'")

            # A watched turn whose answer waits for a reviewer, who releases a revised text.
            reviewed = await stack.http.post("/v1/chats", json={
                "message": "Question: when are the lamps lit?", "collection": "record", "require_review": True})
            reviewed_id = reviewed.json()["job_id"]
            watching = asyncio.create_task(read_events(stack, reviewed_id))
            await waiting_reviews(stack, reviewed_id)
            await stack.http.post(f"/v1/jobs/{reviewed_id}/review", json={
                "decision": "approve", "reviewer": "rec", "answer": "At dusk [1]."})
            assert (await watching)[-1][1]["type"] == "ragline.job.completed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-review", f"WorkflowId = '{reviewed_id}'")

            # A follow-up sent while the turn before it waits for a reviewer: the session starts its job, which
            # waits for its go and looks now and then whether the session still runs (session_still_runs,
            # every 1 s at first in fast_policies.toml); released, the turn before gives it the go.
            session = f"go-{uuid.uuid4().hex[:6]}"
            r = await stack.http.post("/v1/chats", json={"message": "Question: when are the lamps lit?",
                                                         "session_id": session, "collection": "record",
                                                         "require_review": True})
            held_id = r.json()["job_id"]
            await waiting_reviews(stack, held_id)
            follow_up = (await stack.chat("And who lights them?", session_id=session, collection="record"))["job_id"]
            await eventually(lambda: _session_looks(client, follow_up, 2), timeout=60, every=0.5,
                             what="the follow-up looked at its session (one look ended, the next scheduled)")
            assert (await stack.http.get(f"/v1/jobs/{follow_up}")).json()["status"] == "queued"
            await stack.http.post(f"/v1/jobs/{held_id}/review", json={"decision": "approve", "reviewer": "rec"})
            for job_id in (held_id, follow_up):
                assert (await stack.wait_done(job_id))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "follow-up-waits-for-go", f"WorkflowId = '{follow_up}'")
            saved += await _save(client, "follow-up-waits-for-go",
                                 f"WorkflowId = '{session_workflow_id(stack.tenant, session)}'")
            saved += await _save(client, "follow-up-held-turn", f"WorkflowId = '{held_id}'")

            # An agent tree: the depth guard waits for a review, which approves one level more.
            stack.llm.script_fn("agent", delegate_until(leaf_depth=2))
            r = await stack.http.post("/v1/agents", json={"goal": "Map the harbour records", "collection": "record",
                                                          "max_depth": 1})
            agent_id = r.json()["job_id"]
            [review] = await waiting_reviews(stack, agent_id)
            await stack.http.post(f"/v1/jobs/{review['job_id']}/review", json={
                "decision": "approve", "reviewer": "rec", "extra_depth": 1, "extra_budget": {"max_llm_calls": 1}})
            assert (await stack.wait_done(agent_id))["status"] == "completed"
            stack.llm.script_fn("agent", None)
            await asyncio.sleep(1)
            saved += await _save(client, "agent-review", f"WorkflowId STARTS_WITH '{agent_id}'")

            # Two sub-agents wait for a review each; one is rejected, and the other is told to stop.
            stack.llm.script_fn("agent", two_sub_agents_that_delegate_deeper())
            r = await stack.http.post("/v1/agents", json={"goal": "Survey the piers", "collection": "record",
                                                          "max_depth": 1})
            piers = r.json()["job_id"]
            await waiting_reviews(stack, piers, count=2)
            await stack.http.post(f"/v1/jobs/{piers}.1/review", json={"decision": "reject", "reviewer": "rec"})
            assert (await stack.wait_done(piers))["result"]["status"] == "stopped"
            stack.llm.script_fn("agent", None)
            await asyncio.sleep(1)
            saved += await _save(client, "agent-siblings-stop", f"WorkflowId STARTS_WITH '{piers}'")

            # An agent whose model writes its call as broken JSON: it plans once more, told what was wrong.
            stack.llm.script("agent", ['```json\n{"name": "finish", "arguments": {"answer": "At dusk."}\n```',
                                       "The lamps are lit at dusk."])
            r = await stack.http.post("/v1/agents", json={"goal": "When are the lamps lit?", "collection": "record"})
            replanned = r.json()["job_id"]
            assert (await stack.wait_done(replanned))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "agent-replan", f"WorkflowId = '{replanned}'")

            # The depth guard's review revised (with instructions) rather than approved: it extends as well.
            stack.llm.script_fn("agent", delegate_until(leaf_depth=2))
            r = await stack.http.post("/v1/agents", json={"goal": "List the harbour's ships", "collection": "record",
                                                          "max_depth": 1})
            revised = r.json()["job_id"]
            [review] = await waiting_reviews(stack, revised)
            r = await stack.http.post(f"/v1/jobs/{review['job_id']}/review", json={
                "decision": "revise", "reviewer": "rec", "instructions": "Keep to the harbour records.",
                "extra_depth": 1})
            assert r.status_code == 200, r.text
            assert (await stack.wait_done(revised))["status"] == "completed"
            stack.llm.script_fn("agent", None)
            await asyncio.sleep(1)
            saved += await _save(client, "agent-revise", f"WorkflowId STARTS_WITH '{revised}'")

            # A plan that names one sub-goal twice (one sub-agent runs), then names it again once answered
            # (told so, not delegated again).
            def twice_then_again(body: dict) -> dict:
                goal = "Count the ships at the piers"
                if plan_depth(body) == 0 and fresh_plan(body):
                    return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": goal}},
                                           {"name": "delegate", "arguments": {"subgoal": goal}}]}
                if plan_depth(body) == 0 and "already answered" not in body["messages"][-1]["content"]:
                    return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": goal}}]}
                return {"tool_calls": [{"name": "finish", "arguments": {"answer": "Two ships."}}]}
            stack.llm.script_fn("agent", twice_then_again)
            r = await stack.http.post("/v1/agents", json={"goal": "How many ships are in the harbour?",
                                                          "collection": "record", "max_depth": 1})
            counted = r.json()["job_id"]
            assert (await stack.wait_done(counted))["status"] == "completed"
            stack.llm.script_fn("agent", None)
            await asyncio.sleep(1)
            saved += await _save(client, "agent-same-sub-goal", f"WorkflowId STARTS_WITH '{counted}'")

            # An agent out of time (its first search slow) asks for a review; the reviewer decides 3 s after the
            # ask and grants 2 s more, which count from the decision: it searches once more and finishes.
            def slow_first_search(body: dict) -> dict:
                observed = body["messages"][-1]["content"].split("OBSERVATIONS SO FAR:\n", 1)[1].split("\n\n", 1)[0]
                searches = observed.count("\n- ") + observed.startswith("- ")
                if searches < 2:
                    return {"tool_calls": [{"name": "search_documents", "arguments": {
                        "query": ("lamp keepers", "ship log")[searches]}}], "delay": 1.5 if searches == 0 else 0}
                return {"tool_calls": [{"name": "finish", "arguments": {"answer": "The keepers log the ships."}}]}
            with stack.llm.scope() as mine:
                mine.script_fn("agent", slow_first_search)
                r = await stack.http.post("/v1/agents", json={
                    "goal": f"Relate the lamps to the ships {mine.token}", "collection": "record",
                    "budget": {"max_llm_calls": 10, "max_tokens": 100000, "max_seconds": 1}})
                timed = r.json()["job_id"]
                [review] = await waiting_reviews(stack, timed)
                assert review["reason"] == "budget" and "time budget used up" in review["detail"], review
                await until_waited(review, 3)
                r = await stack.http.post(f"/v1/jobs/{timed}/review", json={
                    "decision": "approve", "reviewer": "rec", "extra_budget": {"max_seconds": 2},
                    "requested_at": review["requested_at"]})
                assert r.status_code == 200, r.text
                job = await stack.wait_done(timed)
            assert job["status"] == "completed" and len(job["result"]["decisions"]) == 1, job
            await asyncio.sleep(1)
            saved += await _save(client, "agent-seconds-granted", f"WorkflowId = '{timed}'")

            # A watched turn whose passages overflow the model's context: the summary runs first, its steps
            # shown while it runs.
            log = " ".join(f"Log entry {n}: the keeper of pier {n % 7} lit lamp {n} at dusk and logged ship {n * 3}."
                           for n in range(400))
            up = await stack.upload(("log.txt", log.encode()), collection="record-long")
            assert (await stack.wait_job(up["job_id"]))["status"] == "completed"
            r = await stack.http.post("/v1/chats", json={"message": "What does the keepers' log say?",
                                                         "collection": "record-long", "top_k": 20})
            overflowing = r.json()["job_id"]
            events = await read_events(stack, overflowing)
            started = [e["data"]["step"] for _, e in events if e["type"] == "ragline.step.started"]
            assert started[:2] == ["retrieve_context", "summarize_context"], started
            await asyncio.sleep(1)
            saved += await _save(client, "chat-summary-first", f"WorkflowId = '{overflowing}'")

            # A turn dead-lettered by a failing model, then retried by an operator.
            stack.llm.script("answer", ["503"] * ATTEMPTS)
            parked = await stack.chat("Question: who keeps the log?", collection="record")
            assert (await stack.wait_job(parked["job_id"]))["status"] == "dead_lettered"
            await stack.http.post(f"/v1/jobs/{parked['job_id']}/retry", json={"operator": "rec", "reason": "back"})
            assert (await stack.wait_done(parked["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "dead-letter-retry", f"WorkflowId = '{parked['job_id']}'")

            # A held answer whose summary parks while the review waits and is discarded: the entities still
            # running are stopped, the review withdrawn, the turn failed.
            stack.llm.script("summarize", ["503"] * ATTEMPTS)
            stack.llm.script("extract_entities", [{"content": "[]", "delay": 30}])
            held = await stack.http.post("/v1/chats", json={
                "message": "Question: who lights the lamps?", "collection": "record", "require_review": True})
            held_id = held.json()["job_id"]
            assert (await stack.wait_job(held_id, until=("dead_lettered",)))["status"] == "dead_lettered"
            await stack.http.post(f"/v1/jobs/{held_id}/discard", json={"operator": "rec", "reason": "model down"})
            assert (await stack.wait_done(held_id))["status"] == "failed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-review-discarded", f"WorkflowId = '{held_id}'")

            # A held answer whose summary parks while the review waits, and which the reviewer rejects: the
            # parked summary is stopped (no longer listed as parked).
            stack.llm.script("summarize", ["503"] * ATTEMPTS)
            held = await stack.http.post("/v1/chats", json={
                "message": "Question: who logs the ships?", "collection": "record", "require_review": True})
            held_id = held.json()["job_id"]
            assert (await stack.wait_job(held_id, until=("dead_lettered",)))["status"] == "dead_lettered"
            await waiting_reviews(stack, held_id)
            r = await stack.http.post(f"/v1/jobs/{held_id}/review", json={"decision": "reject", "reviewer": "rec"})
            assert r.status_code == 200, r.text
            await stack.wait_done(held_id)
            await asyncio.sleep(1)
            saved += await _save(client, "chat-review-rejected-parked", f"WorkflowId = '{held_id}'")

            # A turn whose answer was shown and whose summary then failed for good (parked, discarded): the
            # turn fails, and its session keeps the shown answer in its history.
            stack.llm.script("summarize", ["503"] * ATTEMPTS)
            shown = await stack.chat("Question: what do the keepers log?", collection="record")
            assert (await stack.wait_job(shown["job_id"], until=("dead_lettered",)))["status"] == "dead_lettered"
            await stack.http.post(f"/v1/jobs/{shown['job_id']}/discard", json={"operator": "rec", "reason": "down"})
            assert (await stack.wait_done(shown["job_id"]))["status"] == "failed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-failed-after-answer", f"WorkflowId = '{shown['job_id']}'")
            saved += await _save(client, "chat-failed-after-answer",
                                 f"WorkflowId = '{session_workflow_id(stack.tenant, shown['session_id'])}'")

            # A session that continues as new after each turn. Its second turn (started by the first run, so
            # carried over) is cancelled while its summary runs, its answer shown: on its way out it tells its
            # session that answer, which the session reads at the turn's end (a cancel carries none). The
            # question sent once it has ended is asked with it.
            session = f"cancel-{uuid.uuid4().hex[:6]}"
            await client.start_workflow(
                ChatSessionWorkflow.run, SessionState(tenant=stack.tenant, session_id=session, turns_per_run=1),
                id=session_workflow_id(stack.tenant, session), task_queue=stack.settings.task_queue,
                search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                                         SearchAttributePair(sa.SESSION, session),
                                                         SearchAttributePair(sa.TENANT, stack.tenant)]))

            def summary_hangs(body: dict) -> dict | None:
                return {"content": "Never read.", "delay": 60} if "And when?" in last_user_message(
                    body["messages"]) else None
            with stack.llm.scope(delay=1.0) as slow, stack.llm.scope() as mine:
                mine.script_fn("summarize", summary_hangs)
                # The first turn answers slowly: the second is sent (and its job started) while it runs.
                await stack.chat(f"Question: who lights the lamps? {slow.token}", session_id=session,
                                 collection="record")
                cancelled = await stack.chat(f"And when? {mine.token}", session_id=session, collection="record")
                await mine.wait_for_calls(1, "summarize")
                r = await stack.http.post(f"/v1/jobs/{cancelled['job_id']}/cancel")
                assert r.status_code == 202, r.text
                assert (await stack.wait_done(cancelled["job_id"]))["status"] == "cancelled"
                after = await stack.chat(f"And who logs the ships? {mine.token}", session_id=session,
                                         collection="record")
                assert (await stack.wait_job(after["job_id"]))["status"] == "completed"
                shown = next(c for c in mine.calls("answer") if c.question.startswith("And when?")).reply.strip()
                asked = next(c for c in mine.calls("answer") if c.question.startswith("And who logs"))
                assert f"A: {shown}" in asked.user_message, asked.user_message
            await asyncio.sleep(1)
            saved += await _save(client, "chat-cancelled-after-answer", f"WorkflowId = '{cancelled['job_id']}'")
            runs = await _save(client, "chat-cancelled-after-answer",
                               f"WorkflowId = '{session_workflow_id(stack.tenant, session)}'")
            # A run for each turn (the cancelled one carried over) and the one waiting after the last.
            assert len(runs) == 4, runs
            saved += runs

            # A held turn whose collection holds no document: the refusal waits for the reviewer (not cached).
            r = await stack.http.post("/v1/chats", json={"message": "Question: when are the lamps lit?",
                                                         "collection": "record-empty", "require_review": True})
            refused = r.json()["job_id"]
            await waiting_reviews(stack, refused)
            await stack.http.post(f"/v1/jobs/{refused}/review", json={"decision": "approve", "reviewer": "rec"})
            assert (await stack.wait_done(refused))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-held-refusal", f"WorkflowId = '{refused}'")

            # A grounded answer that loops, cut by the stream (warned: not cached); a reply of markers only (no
            # answer, not called unverified).
            loop = "The lighthouse of Ostra is painted red, and its keeper lights it at dusk [1]. " * 12
            stack.llm.script("answer", ["The lighthouse is red [1]. " + loop, "[1] [2]"])
            looped = await stack.chat("Question: what colour is the lighthouse of Ostra?", collection="record")
            assert (await stack.wait_job(looped["job_id"]))["status"] == "completed"
            wordless = await stack.chat("Question: how many piers has the harbour?", collection="record")
            assert (await stack.wait_job(wordless["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "chat-answer-looped", f"WorkflowId = '{looped['job_id']}'")
            saved += await _save(client, "chat-no-answer", f"WorkflowId = '{wordless['job_id']}'")

            # An evaluation of the collection against two golden questions.
            golden = (b'{"question": "What colour is the lighthouse?", "expected_document": "a.txt"}\n'
                      b'{"question": "Who won the 1998 World Cup?", "expected_document": null}\n')
            r = await stack.http.post("/v1/evaluations", params={"collection": "record"}, content=golden)
            assert r.status_code == 202, r.text
            assert (await stack.wait_done(r.json()["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "evaluation", f"WorkflowId = '{r.json()['job_id']}'")

            # A document removed (uploaded after the ingestions above were saved).
            extra = await stack.upload(("c.txt", b"The old pier was closed in the winter of 1990."),
                                       collection="record")
            assert (await stack.wait_job(extra["job_id"]))["status"] == "completed"
            r = await stack.http.delete(f"/v1/documents/{extra['documents'][0]['document_id']}")
            assert r.status_code == 202, r.text
            assert (await stack.wait_done(r.json()["job_id"]))["status"] == "completed"
            await asyncio.sleep(1)
            saved += await _save(client, "removal", f"WorkflowId = '{r.json()['job_id']}'")

            # A search.
            assert await stack.search("lighthouse colour", collection="record")
            await asyncio.sleep(1)
            saved += await _save(client, "search", "WorkflowType = 'SearchWorkflow'")

            # The blob sweep, as its schedule starts it.
            await client.execute_workflow("BlobSweepWorkflow", SweepInput(min_age_seconds=86400),
                                          id="ragline-blob-sweep-record", task_queue=stack.settings.task_queue)
            saved += await _save(client, "blob-sweep", "WorkflowType = 'BlobSweepWorkflow'")

            # A tenant capped at one running job: its second turn waits, queued, for the first's slot.
            path = stack.settings.effective_api_keys_file
            key = api_keys.create(path, "capped", "reviewer", "capped-reviewer")
            with path.open("a") as f:
                f.write("\n[tenants.capped]\nmax_running_jobs = 1\n")
            headers = {"Authorization": f"Bearer {key}"}
            r = await stack.http.post("/v1/documents", data={"collection": "record"}, headers=headers,
                                      files=[("files", ("a.txt", b"The harbour of Ostra has a red lighthouse."))])
            await _wait(stack, r.json()["job_id"], headers)
            with stack.llm.scope(delay=1.0) as slow:
                first = await stack.http.post("/v1/chats", headers=headers, json={
                    "message": f"What colour is the lighthouse? {slow.token}", "collection": "record"})
                await slow.wait_for_calls(1, "answer")
                second = await stack.http.post("/v1/chats", headers=headers, json={
                    "message": "How many piers?", "collection": "record"})
                for r in (first, second):
                    await _wait(stack, r.json()["job_id"], headers)
            await asyncio.sleep(1)
            saved += await _save(client, "running-slots", f"WorkflowId = '{second.json()['job_id']}'")
            saved += await _save(client, "running-slots", "WorkflowType = 'TenantGateWorkflow' AND RaglineTenant = 'capped'")

            # Before the scenario below, whose workers load other policies.
            for scenario in ALONE.values():
                saved += await scenario(stack)

            # The first turn of a session has shown its answer and runs its summary. No workflow worker runs
            # while the session's ask for that answer (the next question came) and a person's cancel reach the
            # turn, both in one workflow task: the cancelled turn awaits the answer the ask sends before it ends.
            # As tests/test_workflows.py does it: the real workflows, its fakes for the activities, on a task
            # queue of their own (last: its workers load the test policies for the fakes' names).
            on_server = SimpleNamespace(client=client)  # what fake_worker takes
            fakes = FirstTurnsSummaryRunsOn()
            session = f"ask-{uuid.uuid4().hex[:6]}"
            first, second = turn(session, "First question?"), turn(session, "Second question?")

            async def summary_runs() -> bool:
                return bool(fakes.named("summarize_context"))
            async with fake_worker(on_server, fakes, runs="activities") as queue:
                async with fake_worker(on_server, fakes, queue, sticky=False, runs="workflows"):
                    handle = await start_session(on_server, queue, first)
                    await eventually(summary_runs, timeout=20, what="the first turn's summary")
                job = client.get_workflow_handle(first.job_id)
                await job.signal(ChatTurnWorkflow.follow_up_waits)  # what the session sends once `second` is queued
                await job.cancel()
                async with fake_worker(on_server, fakes, queue, runs="workflows"):
                    try:
                        await job.result()
                        raise AssertionError("the first turn was not cancelled")
                    except WorkflowFailureError as exc:
                        assert isinstance(exc.cause, CancelledError), exc.cause
                    await handle.signal(ChatSessionWorkflow.submit, second)
                    await turn_result(on_server, second.job_id)
            asked = next(c.arg for c in fakes.named("generate_answer") if c.arg.question == "Second question?")
            assert asked.history == [HistoryItem(question="First question?", answer="answer to First question?")]
            await asyncio.sleep(1)
            saved += await _save(client, "chat-cancel-with-ask", f"WorkflowId = '{first.job_id}'")
            saved += await _save(client, "chat-cancel-with-ask", f"WorkflowId = '{handle.id}'")
    finally:
        await llm.stop()
        await env.shutdown()
    _write_ids()
    return saved


def _write_ids() -> None:
    (HISTORIES / "workflow_ids.json").write_text(json.dumps(dict(sorted(ids.items())), indent=1) + "\n")


def main() -> int:
    only = sys.argv[1:]
    if unknown := [name for name in only if name not in ALONE]:
        print(f"not recordable alone: {', '.join(unknown)} (choose from: {', '.join(ALONE)})", file=sys.stderr)
        return 2
    saved = asyncio.run(record(only))
    for path in saved:
        print(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
