"""Cancelling a job through the API (`POST /v1/jobs/{id}/cancel`): the job ends as `cancelled`, its
running model call stops (nobody pays for an answer nobody waits for), and a chat session goes on
with its next turn. The language model is the scripted server, which records a stream its client
cut off."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.service import RPCError

from models.chat import session_workflow_id
from models.jobs import EVENTS_TOPIC
from ragline import audit
from temporal import policies
from tests.helpers import delegate_until, eventually, waiting_reviews

HERDS = "The herds of the Serengeti cross the Mara river every July, watched by rangers in small aircraft."
# 300 pieces: streamed at 50 ms a piece the whole answer takes 15 s, within the attempt's 20 s.
LONG_ANSWER = " ".join(["herds"] * 300)


@pytest.fixture(scope="module")
async def herds(stack):
    body = await stack.upload(("herds.txt", HERDS.encode()), collection="cancel")
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"


@pytest.fixture
def shipped_answer_heartbeat(restore_policies):
    """generate_answer's heartbeat timeout as shipped (60 s, where the test policies have 5 s): the SDK
    would then send its heartbeats, and hear of a cancel, only every 48 s, unless Ragline bounds that."""
    loaded = policies.loaded()
    answer = loaded.activities["generate_answer"].model_copy(update={"heartbeat": timedelta(seconds=60)})
    policies._loaded = dataclasses.replace(loaded, activities={**loaded.activities, "generate_answer": answer})


async def test_a_cancelled_turn_stops_its_model_stream_and_ends_its_events(stack, herds, shipped_answer_heartbeat):
    with stack.llm.scope(stream_chunk_delay=0.05) as llm:
        llm.script("answer", [LONG_ANSWER])
        job_id = (await stack.chat(f"When do the herds cross the river? {llm.token}", collection="cancel"))["job_id"]
        types = []
        async with stack.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(60)) as events:
            async for line in events.aiter_lines():
                if not line.startswith("data:"):
                    continue
                types.append(json.loads(line[5:])["type"])
                if types[-1] == "ragline.answer.delta" and types.count(types[-1]) == 1:
                    # Another tenant's key cannot see the job, let alone cancel it.
                    other = await stack.other_http.post(f"/v1/jobs/{job_id}/cancel")
                    assert other.status_code == 404, other.text
                    # Any key of the tenant can: the member who asked, not only a reviewer.
                    cancelled = await stack.member_http.post(f"/v1/jobs/{job_id}/cancel")
                    assert cancelled.status_code == 202, cancelled.text
                    assert cancelled.json()["job_id"] == job_id
                    assert cancelled.json()["status_url"].endswith(f"/v1/jobs/{job_id}")
        [answer] = await llm.wait_for_calls(1, "answer", finished=True, timeout=30)
    assert types[-1] == "ragline.job.cancelled"
    assert "ragline.answer.completed" not in types
    # The stream was closed from Ragline's side before the model had sent the whole answer.
    assert answer.cut_off
    job = await stack.wait_done(job_id)
    assert job["status"] == "cancelled"
    # The answer's step stopped with the job: cancelled, not failed.
    assert {s["name"]: s["status"] for s in job["steps"]}["generate_answer"] == "cancelled"
    # Sent again (its first answer lost on the way), the cancel gets the same answer.
    again = await stack.http.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 202 and again.json() == cancelled.json()
    records = [(e["key_name"], e["outcome"]) for e in audit.read(stack.settings)
               if e["action"] == "cancel" and e["job_id"] == job_id]
    assert records == [("globex-reviewer", "refused: job_not_found"), ("acme-member", "accepted"),
                       ("acme-reviewer", "accepted")]


async def test_a_turn_cancelled_during_its_summary_stops_that_model_call(stack, herds):
    """The side steps' replies are read as streams too: a cancel that stops a summary closes its connection,
    and a model server such as llama.cpp's stops generating it (asked for in one piece, the reply was
    generated to its end for nobody, holding the calls behind it)."""
    with stack.llm.scope(stream_chunk_delay=0.2) as llm:
        llm.script("summarize", [" ".join(f"herd {i} crossed on day {i * 7 % 31}." for i in range(200))])
        job_id = (await stack.chat(f"When do the herds cross the river? {llm.token}", collection="cancel"))["job_id"]
        await llm.wait_for_calls(1, "summarize", timeout=30)
        assert (await stack.http.post(f"/v1/jobs/{job_id}/cancel")).status_code == 202
        [summary] = await llm.wait_for_calls(1, "summarize", finished=True, timeout=30)
        job = await stack.wait_done(job_id)
    assert summary.cut_off, summary
    assert job["status"] == "cancelled"
    assert {s["name"]: s["status"] for s in job["steps"]}["summarize_context"] == "cancelled", job["steps"]


async def test_a_cancelled_waiting_turn_is_skipped_and_its_session_goes_on(stack, herds, shipped_answer_heartbeat):
    # The first turn's answer streams a piece a second; the later turns' answers come at once.
    with stack.llm.scope(stream_chunk_delay=1.0) as slow, stack.llm.scope() as llm:
        slow.script("answer", ["They cross the river in July, watched by rangers [1]."])
        first = await stack.chat(f"When do the herds cross? {slow.token}", collection="cancel")
        session = first["session_id"]
        second = await stack.chat(f"Who watches them? {llm.token}", session_id=session, collection="cancel")
        await slow.wait_for_calls(1, "answer")  # the first turn streams; the second waits for its go

        async def cancel_second() -> httpx.Response | None:
            r = await stack.http.post(f"/v1/jobs/{second['job_id']}/cancel")
            # Until its session has started the turn's job, there is no job to cancel yet.
            started = not (r.status_code == 409 and r.json()["error"]["code"] == "job_not_started")
            return r if started else None

        r = await eventually(cancel_second, what="the second turn's job to be started")
        assert r.status_code == 202, r.text
        assert (await stack.wait_done(second["job_id"]))["status"] == "cancelled"

        # Cancelling the first turn stops its model call in the middle of the stream.
        r = await stack.http.post(f"/v1/jobs/{first['job_id']}/cancel")
        assert r.status_code == 202, r.text
        [streamed] = await slow.wait_for_calls(1, "answer", finished=True, timeout=30)
        assert streamed.cut_off
        assert (await stack.wait_done(first["job_id"]))["status"] == "cancelled"

        third = await stack.chat(f"Where do they cross? {llm.token}", session_id=session, collection="cancel")
        done = await stack.wait_done(third["job_id"])
        answers = llm.calls("answer")
    assert done["status"] == "completed" and done["turn"] == 3
    # A job that completed cannot be cancelled any more.
    r = await stack.http.post(f"/v1/jobs/{third['job_id']}/cancel")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_closed", r.text
    assert [a.reply.strip() for a in answers] == [done["result"]["answer"]]  # the cancelled turn never asked
    session_run = await stack.client.get_workflow_handle(session_workflow_id(stack.tenant, session)).describe()
    assert session_run.status.name == "RUNNING"


async def test_cancelling_an_unknown_job_is_404(stack):
    r = await stack.http.post("/v1/jobs/acme.chat-nosuchsession.0000/cancel")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


async def test_cancelling_an_agent_cancels_its_sub_agent_waiting_for_review(stack):
    """An agent tree is one job: cancelled at its root, the sub-agent that waits for a reviewer ends too,
    and nothing of it is left in the reviewers' list."""
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=9, token=llm.token))
        r = await stack.http.post("/v1/agents", json={"goal": f"Survey the herds {llm.token}", "collection": "cancel",
                                                      "max_depth": 1})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        [review] = await waiting_reviews(stack, job_id)
        assert review["job_id"] != job_id  # the sub-agent waits, not the root
        r = await stack.http.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 202, r.text
        assert (await stack.wait_done(job_id))["status"] == "cancelled"
        assert (await stack.wait_done(review["job_id"]))["status"] == "cancelled"

    async def none_listed() -> bool:  # the listing reads visibility, which follows a moment later
        reviews = (await stack.http.get("/v1/reviews")).json()["reviews"]
        return not [item for item in reviews if item["job_id"].startswith(job_id)]
    await eventually(none_listed, what="no review of the cancelled tree listed")



async def test_a_step_retrying_when_its_job_was_cancelled_shows_cancelled_not_running():
    """Cancelled while `extract_entities` waited for its second attempt (the first timed out): Temporal may
    still list the activity as pending with its last failure, and the step showed `running` for ever."""
    from types import SimpleNamespace

    from temporalio.api.common.v1 import ActivityType
    from temporalio.api.failure.v1 import Failure
    from temporalio.api.workflow.v1 import PendingActivityInfo
    from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionResponse

    from api.job_views import _steps
    from models.jobs import JobProgress, StepState

    pending = PendingActivityInfo(activity_type=ActivityType(name="extract_entities"), attempt=2,
                                  last_failure=Failure(message="activity StartToClose timeout"))
    raw = DescribeWorkflowExecutionResponse(pending_activities=[pending])
    progress = JobProgress(job_id="j", kind="chat", status="cancelled", steps=[
        StepState(name="generate_answer", status="completed", attempts=1),
        StepState(name="extract_entities", status="cancelled", attempts=1)])
    ended = SimpleNamespace(status=WorkflowExecutionStatus.CANCELED, raw_description=raw)
    cancelled = await _steps(None, progress, ended)
    assert {s.name: s.status for s in cancelled} == {"generate_answer": "completed", "extract_entities": "cancelled"}
    # While the job runs, the same pending activity is the step's live retry: running, with why it failed.
    progress.steps[1].status = "running"
    live = await _steps(None, progress, SimpleNamespace(status=WorkflowExecutionStatus.RUNNING, raw_description=raw))
    assert (live[1].status, live[1].attempts, live[1].error) == ("running", 2, "activity StartToClose timeout")
    # A step one of whose calls waits for an operator (a document's batch) while another still retries stays
    # parked, with the error it parked with: it showed `running` with the sibling's error, the job dead_lettered.
    progress.steps[1] = StepState(name="extract_entities", status="dead_lettered", attempts=6, error="parked: 503",
                                  activity="extract_entities")
    parked = await _steps(None, progress, SimpleNamespace(status=WorkflowExecutionStatus.RUNNING, raw_description=raw))
    assert (parked[1].status, parked[1].attempts, parked[1].error) == ("dead_lettered", 6, "parked: 503")
