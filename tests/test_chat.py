"""Chat chains through the real stack; the language model is the scripted OpenAI-compatible server,
reached through the real `openai` client.

Every test asks its own questions carrying the token of its own scope on the shared scripted model
(`stack.llm.scope()`): what it scripts reaches only its requests, and it counts only its calls. What
is checked is what a user relies on (the answer is what the model said, citations name the passage
the model cited, turns keep their order), not the scripted model's canned text.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import datetime, timedelta
from types import SimpleNamespace

import httpx
import pytest
from temporalio.client import WorkflowExecutionStatus

from activities.gate import gate_id
from api import job_views
from api.app import create_app
from api.routes.chats import _turn_view
from devtools.scripted_llm import last_user_message, parse_prompt
from models.chat import session_workflow_id
from ragline.llm import estimate_tokens
from tests.conftest import serving_api
from tests.helpers import eventually, read_events, session_turns, waiting_reviews
from workflows.events import PUBLISH_SIGNAL

ZEBRA = ("The great zebra migration crosses the Mara river every July. Crocodiles wait in the river. "
         "Rangers of the Serengeti count the herds from small aircraft.")
PAPER = "Paper cranes are folded from a single square sheet. Origami needs no glue and no scissors."


@pytest.fixture(scope="module")
async def chat_docs(stack):
    body = await stack.upload(("zebra.txt", ZEBRA.encode()), ("paper.txt", PAPER.encode()), collection="chat")
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed"
    return {d["filename"]: d["document_id"] for d in body["documents"]}


def sources(body: dict) -> dict[int, str]:
    """The passages a prompt shows the model: number -> "file, page n"."""
    passages, _ = parse_prompt(last_user_message(body["messages"]))
    return {p.number: p.source for p in passages}


def hang_side_steps(llm, question: str) -> None:
    """The summary and entities of turns asking `question` hang (each attempt until the model call's timeout,
    then the next attempt); everything else answers at once."""
    def hangs(request: dict) -> dict | None:
        return {"content": "[]", "delay": 60} if question in last_user_message(request["messages"]) else None
    llm.script_fn("summarize", hangs)
    llm.script_fn("extract_entities", hangs)


def citing(*filenames: str, text: str = "The herds cross the Mara river in July"):
    """A model that answers citing the passages of `filenames`, by the numbers its prompt gave them, in
    the order named (not the order of the numbers)."""
    def answer(body: dict) -> str:
        shown = sources(body)
        numbers = [next(n for n, s in shown.items() if s.startswith(f"{name},")) for name in filenames]
        return f"{text} {' '.join(f'[{n}]' for n in numbers)}."
    return answer


def cited_sources(job: dict) -> list[str]:
    return [f"{c['filename']}, page {c['page']}" for c in job["result"]["citations"]]


async def test_question_is_answered_from_the_document_with_a_citation(stack, chat_docs):
    with stack.llm.scope() as llm:
        llm.script_fn("answer", citing("zebra.txt"))
        llm.script("summarize", ["The herds cross the Mara in July."])
        llm.script("extract_entities", ['[{"text": "Mara", "type": "place"}, {"text": "July", "type": "DATE"}]'])
        question = f"When does the zebra migration cross the Mara river? {llm.token}"
        accepted = await stack.chat(question, collection="chat")
        assert set(accepted) >= {"job_id", "session_id", "turn", "status_url", "events_url"}
        assert accepted["turn"] is None  # numbered by the session when it takes the turn, shown by GET
        job = await stack.wait_job(accepted["job_id"])
        assert job["status"] == "completed", job
        [answer_call] = llm.calls("answer")
        assert llm.count("summarize") == 1 and llm.count("extract_entities") == 1
    assert job["kind"] == "chat" and job["turn"] == 1
    result = job["result"]
    assert result["question"] == question
    # The answer is what the model said; the citation is the passage it cited, as the prompt showed it.
    assert result["answer"] == answer_call.reply.strip()
    [cited] = result["citations"]
    [number] = re.findall(r"\[(\d+)\]", result["answer"])
    assert sources(answer_call.request)[int(number)] == "zebra.txt, page 1"
    assert (cited["document_id"], cited["filename"], cited["page"]) == (chat_docs["zebra.txt"], "zebra.txt", 1)
    assert cited["chunk_id"].startswith(f"{chat_docs['zebra.txt']}:") and 0 < cited["score"] <= 1
    # The side steps' results are the model's, repaired where needed (a lower-case type).
    assert result["summary"] == "The herds cross the Mara in July."
    assert result["entities"] == [{"text": "Mara", "type": "PLACE"}, {"text": "July", "type": "DATE"}]
    assert result["model"] == stack.settings.llm_model
    assert result["usage"]["prompt_tokens"] > 0 and result["usage"]["completion_tokens"] > 0
    # No cache_answer step: the shared stack runs without the answer cache (test_grounded.py has it).
    assert [s["name"] for s in job["steps"]] == ["retrieve_context", "generate_answer", "summarize_context",
                                                 "extract_entities"]
    steps = {s["name"]: s for s in job["steps"]}
    # The answer does not wait for the side steps: they start once it is generated.
    assert steps["generate_answer"]["finished_at"] <= steps["summarize_context"]["started_at"]
    assert steps["generate_answer"]["finished_at"] <= steps["extract_entities"]["started_at"]

    [turn] = await session_turns(stack.http, accepted["session_id"], job["job_id"])
    assert turn["turn"] == 1 and turn["status"] == "completed" and turn["answer"] == result["answer"]
    assert turn["citations"] == result["citations"]


async def test_citations_follow_the_passages_the_model_cited_in_passage_order(stack, chat_docs):
    with stack.llm.scope() as llm:
        # Cites both documents, the paper one first in the text.
        llm.script_fn("answer", citing("paper.txt", "zebra.txt", text="Paper cranes and zebra herds are both in the documents"))
        job = await stack.wait_job((await stack.chat(f"What is in the documents? {llm.token}",
                                                     collection="chat", top_k=2))["job_id"])
        [answer_call] = llm.calls("answer")
    shown = sources(answer_call.request)
    assert sorted(shown.values()) == ["paper.txt, page 1", "zebra.txt, page 1"]
    # One citation per cited passage, in the order the passages were numbered.
    assert cited_sources(job) == [shown[1], shown[2]]
    assert [c["document_id"] for c in job["result"]["citations"]] == [
        chat_docs[shown[n].split(",")[0]] for n in (1, 2)]

    with stack.llm.scope() as llm:
        # A number no passage has is not a citation; an answer with no valid marker is attributed by the
        # words it shares with a passage.
        llm.script("answer", ["Paper cranes are folded from a single square sheet [7]."])
        job = await stack.wait_job((await stack.chat(f"How are cranes made? {llm.token}", collection="chat",
                                                     top_k=2))["job_id"])
    assert job["result"]["answer"] == "Paper cranes are folded from a single square sheet [7]."
    assert cited_sources(job) == ["paper.txt, page 1"]


async def test_five_turns_sent_at_once_are_processed_in_order(stack, chat_docs):
    session = f"burst-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope(delay=0.2) as llm:
        first = await stack.chat(f"Who counts the herds? {llm.token}", session_id=session, collection="chat")
        questions = [f"Question number {i} about the zebras? {llm.token}" for i in range(2, 7)]
        bodies = await asyncio.gather(*(stack.chat(q, session_id=session, collection="chat") for q in questions))
        jobs = [await stack.wait_job(b["job_id"]) for b in [first, *bodies]]
        answered = [c.question for c in llm.calls("answer")]
        replies = {c.question: c.reply for c in llm.calls("answer")}
    assert all(j["status"] == "completed" for j in jobs)
    assert jobs[0]["turn"] == 1 and sorted(j["turn"] for j in jobs[1:]) == [2, 3, 4, 5, 6]
    by_turn = sorted(jobs, key=lambda j: j["turn"])
    # Each turn started only once the previous one had its answer (its summary and entities may still run).
    for earlier, later in zip(by_turn, by_turn[1:]):
        answered_at = next(s["finished_at"] for s in earlier["steps"] if s["name"] == "generate_answer")
        assert answered_at <= min(s["started_at"] for s in later["steps"] if s["started_at"])
    # The order they were accepted in is the order the model saw them, each once.
    assert answered == [j["result"]["question"] for j in by_turn]
    # Each turn's answer is the model's answer to that turn's question.
    assert all(j["result"]["answer"] == replies[j["result"]["question"]].strip() for j in jobs)

    session_view = await session_turns(stack.http, session, *(j["job_id"] for j in jobs))
    assert [t["turn"] for t in session_view] == [1, 2, 3, 4, 5, 6]
    assert [t["answer"] for t in session_view] == [j["result"]["answer"] for j in by_turn]
    assert all(t["status"] == "completed" for t in session_view)


async def test_the_gate_and_then_turns_go_ahead_of_sessions_on_the_task_queues(stack, chat_docs):
    """The [workflows] priorities of the policy file reach Temporal, which hands out waiting tasks by them
    (what that buys a burst of chats is measured by `make bench`)."""
    body = await stack.chat("Who counts the herds from the air?", collection="chat")
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"

    async def priority(workflow_id: str) -> int:
        info = (await stack.client.get_workflow_handle(workflow_id).describe()).raw_description
        return info.workflow_execution_info.priority.priority_key or 3  # unset: handed out as 3

    assert await priority(gate_id(stack.tenant, stack.settings.task_queue)) == 1
    assert await priority(body["job_id"]) == 2
    assert await priority(session_workflow_id(stack.tenant, body["session_id"])) == 3


async def test_a_later_turn_is_answered_with_the_earlier_ones_as_history(stack, chat_docs):
    session = f"hist-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        first = await stack.chat(f"Who counts the herds? {llm.token}", session_id=session, collection="chat")
        first_job = await stack.wait_job(first["job_id"])
        second = await stack.chat(f"And from what? {llm.token}", session_id=session, collection="chat")
        await stack.wait_job(second["job_id"])
        later = next(c for c in llm.calls("answer") if c.question.startswith("And from what?"))
    conversation = later.user_message.split("CONVERSATION SO FAR:", 1)[1].split("QUESTION:", 1)[0]
    assert f"Q: Who counts the herds? {llm.token}" in conversation
    assert f"A: {first_job['result']['answer']}" in conversation


async def test_a_follow_up_answered_in_the_form_of_its_history_shows_no_echoed_question(stack, chat_docs):
    """The prompt shows earlier turns as "Q: …\nA: …", and the walkthrough's small model answered a follow-up
    in that form: the question echoed on the stream and in the answer, whose words then fell under the support
    line (no citation for a right answer). The echo is held back and dropped."""
    session = f"echo-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope(stream_chunk_delay=0) as llm:
        first = await stack.chat(f"Who counts the herds? {llm.token}", session_id=session, collection="chat")
        assert (await stack.wait_job(first["job_id"]))["status"] == "completed"
        question = f"And from what do they count them? {llm.token}"
        llm.script("answer", f"Q: {question}\nA: The rangers count the herds from small aircraft [1].")
        second = await stack.chat(question, session_id=session, collection="chat")
        events = [e for _, e in await read_events(stack, second["job_id"])]
        job = await stack.wait_job(second["job_id"])
    shown = "The rangers count the herds from small aircraft [1]."
    assert "".join(e["data"]["text"] for e in events if e["type"] == "ragline.answer.delta") == shown
    assert job["result"]["answer"] == shown and job["result"]["supported"]
    assert [c["filename"] for c in job["result"]["citations"]] == ["zebra.txt"]


async def test_a_later_turn_does_not_wait_for_the_earlier_turns_summary_and_entities(stack, chat_docs):
    """Issue 9: nothing the answer does not need runs before it. A follow-up needs the earlier turn's answer
    (its history), not that turn's summary and entities."""
    session = f"follow-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        hang_side_steps(llm, "Who counts")
        first = await stack.chat(f"Who counts the herds? {llm.token}", session_id=session, collection="chat")
        second = await stack.chat(f"And from what? {llm.token}", session_id=session, collection="chat")
        try:
            answered = await stack.wait_job(second["job_id"], timeout=45)
            assert answered["status"] == "completed" and answered["turn"] == 2
            earlier = (await stack.http.get(f"/v1/jobs/{first['job_id']}")).json()
            assert earlier["status"] == "running"  # its summary and entities are still on their way
            later = next(c for c in llm.calls("answer") if c.question.startswith("And from what?"))
            first_answer = next(c for c in llm.calls("answer") if c.question.startswith("Who counts")).reply.strip()
            assert f"A: {first_answer}" in later.user_message  # the earlier answer is its history
            # ... and the person can read it where the turn is shown, before the turn's end.
            assert earlier["result"] is None and earlier["answer"]["answer"] == first_answer
            assert earlier["answer"]["citations"]
            view = await session_turns(stack.http, session, second["job_id"], listed=[first["job_id"]])
            assert [(t["turn"], t["status"], t["answer"]) for t in view] == [
                (1, "running", first_answer), (2, "completed", answered["result"]["answer"])]
        finally:
            await stack.http.post(f"/v1/jobs/{first['job_id']}/cancel")
    assert (await stack.wait_done(first["job_id"]))["status"] == "cancelled"
    # Cancelled in its side steps, it keeps the answer the next turn was given.
    [cancelled, _] = await session_turns(stack.http, session, first["job_id"], second["job_id"])
    assert (cancelled["status"], cancelled["answer"]) == ("cancelled", first_answer)


async def test_a_held_answer_is_reviewed_while_the_summary_and_entities_run(stack, chat_docs):
    """A reviewer, the person and the session's next turn need a held answer alone: the review is asked as soon
    as the answer is there, and the released answer is shown and given to the next turn before the turn's
    summary and entities end (on a local model they take tens of seconds)."""
    session = f"held-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        hang_side_steps(llm, "Who counts")
        r = await stack.http.post("/v1/chats", json={"message": f"Who counts the herds? {llm.token}",
                                                     "session_id": session, "collection": "chat",
                                                     "require_review": True})
        first = r.json()["job_id"]
        try:
            [review] = await waiting_reviews(stack, first, timeout=30)
            steps = {s["name"]: s["status"] for s in (await stack.http.get(f"/v1/jobs/{first}")).json()["steps"]}
            # Under way: running, or waiting for the model's slot or a next attempt.
            assert {steps["summarize_context"], steps["extract_entities"]} <= {"running", "waiting"}, steps
            second = await stack.chat(f"And from what? {llm.token}", session_id=session, collection="chat")
            r = await stack.http.post(f"/v1/jobs/{first}/review", json={
                "decision": "revise", "reviewer": "editor", "answer": "The rangers count them from the air [1]."})
            assert r.status_code == 200, r.text
            answered = await stack.wait_job(second["job_id"], timeout=45)
            assert answered["status"] == "completed" and answered["turn"] == 2
            later = next(c for c in llm.calls("answer") if c.question.startswith("And from what?"))
            assert "A: The rangers count them from the air [1]." in later.user_message  # the released text
            earlier = (await stack.http.get(f"/v1/jobs/{first}")).json()
            # Its side steps still run (or, on a slow machine, are parked after their attempts timed out).
            assert earlier["status"] in ("running", "dead_lettered") and earlier["result"] is None
            assert earlier["answer"]["answer"] == "The rangers count them from the air [1]."
        finally:
            await stack.http.post(f"/v1/jobs/{first}/cancel")
    assert review["proposed_action"]["answer"] == next(
        c for c in llm.calls("answer") if c.question.startswith("Who counts")).reply.strip()
    assert (await stack.wait_done(first))["status"] == "cancelled"
    # On its stream: asked, decided and shown while the summary and entities ran; neither ever completed.
    shown = [(e["type"], e["data"]) for _, e in await read_events(stack, first)
             if e["type"] in ("ragline.review.requested", "ragline.review.decided", "ragline.answer.completed",
                              "ragline.step.completed", "ragline.job.cancelled")]
    assert [t for t, _ in shown if t != "ragline.step.completed"] == [
        "ragline.review.requested", "ragline.review.decided", "ragline.answer.completed", "ragline.job.cancelled"]
    assert {d["step"] for t, d in shown if t == "ragline.step.completed"} == {"retrieve_context", "generate_answer"}
    [released] = [d for t, d in shown if t == "ragline.answer.completed"]
    assert released["answer"] == "The rangers count them from the air [1]." and released["written_by_reviewer"]


async def test_a_held_answer_rejected_while_the_summary_runs_stops_it(stack, chat_docs):
    """No model calls go on for an answer nobody will see: the turn fails with the reviewer's reason at once,
    its summary and entities cancelled."""
    with stack.llm.scope() as llm:
        hang_side_steps(llm, "Who counts")
        r = await stack.http.post("/v1/chats", json={"message": f"Who counts the herds? {llm.token}",
                                                     "collection": "chat", "require_review": True})
        job_id = r.json()["job_id"]
        await waiting_reviews(stack, job_id, timeout=30)
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "reject", "reviewer": "editor", "comment": "not from our documents"})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id, timeout=30)
    assert job["status"] == "failed" and job["error"]["message"] == "answer rejected by editor: not from our documents"
    steps = {s["name"]: s["status"] for s in job["steps"]}
    assert steps["summarize_context"] == steps["extract_entities"] == "cancelled"
    assert job.get("answer") is None  # never released


async def test_a_rejection_beside_a_parked_summary_fails_the_turn_for_the_rejection(stack, chat_docs):
    """The summary run beside the review keeps failing and waits for an operator; the reviewer rejects the
    answer. The turn fails for the rejection, the reason its reviewer and its person look for, and nothing of
    it is left parked for an operator."""
    with stack.llm.scope() as llm:
        llm.script_fn("summarize", lambda request: "503")
        r = await stack.http.post("/v1/chats", json={"message": f"Who counts the herds? {llm.token}",
                                                     "collection": "chat", "require_review": True})
        job_id = r.json()["job_id"]
        assert (await stack.wait_job(job_id, until=("dead_lettered",)))["status"] == "dead_lettered"
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "reject", "reviewer": "editor", "comment": "wrong herd"})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id, timeout=30)
    assert (job["status"], job["error"]["message"]) == ("failed", "answer rejected by editor: wrong herd")
    steps = {s["name"]: s["status"] for s in job["steps"]}
    assert steps["summarize_context"] == "cancelled"
    assert "dead_lettered" not in steps.values()
    r = await stack.http.post(f"/v1/jobs/{job_id}/retry", json={})
    assert r.status_code == 409, r.text


async def test_a_summary_discarded_while_its_answer_waits_for_review_fails_the_turn_at_once(stack, chat_docs):
    """The summary run beside the review is parked and the operator discards it: the turn can no longer
    complete, so it fails at once for the discard, and its review is withdrawn instead of waiting for a
    decision that would show the answer of a failed job. The entities, still running, are stopped with it."""
    with stack.llm.scope() as llm:
        llm.script_fn("summarize", lambda request: "503")
        llm.script_fn("extract_entities", lambda request: {"content": "[]", "delay": 60})
        r = await stack.http.post("/v1/chats", json={"message": f"Who counts the herds? {llm.token}",
                                                     "collection": "chat", "require_review": True})
        job_id = r.json()["job_id"]
        assert (await stack.wait_job(job_id, until=("dead_lettered",)))["status"] == "dead_lettered"
        await waiting_reviews(stack, job_id)  # listed (from visibility, a moment after the job's own view)
        r = await stack.http.post(f"/v1/jobs/{job_id}/discard", json={"operator": "ops", "reason": "model down"})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id, timeout=30)
    assert job["status"] == "failed"
    assert job["error"]["message"].startswith("discarded by ops: model down (step summarize_context"), job["error"]
    steps = {s["name"]: s["status"] for s in job["steps"]}
    assert steps["summarize_context"] == "failed" and steps["generate_answer"] == "completed"
    assert steps["extract_entities"] == "cancelled"
    assert job.get("answer") is None  # never released
    assert job_id not in [i["job_id"] for i in (await stack.http.get("/v1/reviews")).json()["reviews"]]
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "editor"})
    assert r.status_code == 409, r.text
    # Withdrawn, not left pending in the ended job.
    assert await stack.client.get_workflow_handle(job_id).query("review_request") is None
    types = [e["type"] for _, e in await read_events(stack, job_id)]
    assert "ragline.review.requested" in types and "ragline.review.withdrawn" in types
    assert "ragline.review.decided" not in types
    assert "ragline.answer.completed" not in types and types[-1] == "ragline.job.failed"


async def test_a_queued_turn_lists_only_the_earlier_turns_still_without_their_answer(stack, chat_docs):
    """Turn 1 has its answer and runs its side steps, turn 2's answer is on its way, turn 3 waits: what it
    waits for is turn 2 alone."""
    session = f"ahead-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        def question(request: dict) -> str:
            return parse_prompt(last_user_message(request["messages"]))[1] or ""

        def side_steps_of_the_first_hang(request: dict) -> dict | None:
            return {"content": "[]", "delay": 60} if question(request).startswith("Who counts") else None

        def answer_of_the_second_hangs(request: dict) -> dict | None:
            return {"content": "From the air.", "delay": 60} if question(request).startswith("And from") else None
        llm.script_fn("summarize", side_steps_of_the_first_hang)
        llm.script_fn("extract_entities", side_steps_of_the_first_hang)
        llm.script_fn("answer", answer_of_the_second_hangs)
        turns = [await stack.chat(f"{q} {llm.token}", session_id=session, collection="chat")
                 for q in ("Who counts the herds?", "And from what?", "And when?")]
        try:
            async def third_waits_for_the_second_alone() -> dict | None:
                job = (await stack.http.get(f"/v1/jobs/{turns[2]['job_id']}")).json()
                second = {"job_id": turns[1]["job_id"], "turn": 2, "status": "running"}
                return job if job["status"] == "queued" and job.get("waiting_for") == [second] else None

            await eventually(third_waits_for_the_second_alone, timeout=60, what="turn 3 waiting for turn 2 alone")
            # Turn 1 is still open (its side steps hang), yet not listed.
            assert (await stack.http.get(f"/v1/jobs/{turns[0]['job_id']}")).json()["status"] in ("running", "dead_lettered")
        finally:
            for t in turns[:2]:
                await stack.http.post(f"/v1/jobs/{t['job_id']}/cancel")
    assert (await stack.wait_done(turns[2]["job_id"]))["status"] == "completed"


async def test_a_turn_parked_after_its_answer_does_not_hold_the_next_one(stack, chat_docs):
    """The first turn's entities keep failing: it is dead-lettered with its answer given. A follow-up asked
    then runs at once instead of waiting for an operator."""
    session = f"parked-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        def first_turn_fails(request: dict) -> str | None:
            return "503" if "Who counts" in last_user_message(request["messages"]) else None
        llm.script_fn("extract_entities", first_turn_fails)
        first = await stack.chat(f"Who counts the herds? {llm.token}", session_id=session, collection="chat")
        parked = await stack.wait_job(first["job_id"])
        assert parked["status"] == "dead_lettered", parked
        assert [letter["step"] for letter in parked["error"]["details"]] == ["extract_entities"]
        second = await stack.chat(f"And from what? {llm.token}", session_id=session, collection="chat")
        answered = await stack.wait_job(second["job_id"])
        assert answered["status"] == "completed" and answered["turn"] == 2
        assert (await stack.http.get(f"/v1/jobs/{first['job_id']}")).json()["status"] == "dead_lettered"
    await stack.http.post(f"/v1/jobs/{first['job_id']}/discard", json={})
    assert (await stack.wait_done(first["job_id"]))["status"] == "failed"


async def test_concurrent_duplicates_with_one_idempotency_key_run_one_chain(stack, chat_docs):
    session = f"idem-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        question = f"Are crocodiles in the river? {llm.token}"
        bodies = await asyncio.gather(*(stack.chat(question, session_id=session, collection="chat",
                                                   idempotency_key="key-1") for _ in range(10)))
        assert len({b["job_id"] for b in bodies}) == 1
        first = await stack.wait_job(bodies[0]["job_id"])
        assert first["status"] == "completed" and first["turn"] == 1
        again = await stack.chat(question, session_id=session, collection="chat", idempotency_key="key-1")
        assert again["job_id"] == bodies[0]["job_id"] and again["duplicate"] is True
        other = await stack.chat(f"Another question? {llm.token}", session_id=session, collection="chat",
                                 idempotency_key="key-2")
        assert other["job_id"] != first["job_id"]
        # Turns run in acceptance order: once the later turn is done, a duplicate would have run before it.
        assert (await stack.wait_job(other["job_id"]))["turn"] == 2
        for task in ("answer", "summarize", "extract_entities"):
            assert [c.question for c in llm.calls(task)] == [question, f"Another question? {llm.token}"], task
    session_view = await session_turns(stack.http, session, first["job_id"], other["job_id"])
    assert [t["turn"] for t in session_view] == [1, 2]


async def test_a_resent_first_message_without_a_session_returns_its_job_and_runs_once(stack, chat_docs):
    """The README's first chat names no session: resending it with its Idempotency-Key (a timeout, a
    retrying client) finds the same job in the same new session instead of starting a second one."""
    key = f"first-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        question = f"Who counts the herds? {llm.token}"
        first, resent = [await stack.chat(question, collection="chat", idempotency_key=key) for _ in range(2)]
        assert (resent["job_id"], resent["session_id"]) == (first["job_id"], first["session_id"])
        assert (first["duplicate"], resent["duplicate"]) == (False, True)
        assert (await stack.wait_job(first["job_id"]))["status"] == "completed"
        unkeyed = [await stack.chat(question, collection="chat") for _ in range(2)]
        assert unkeyed[0]["session_id"] != unkeyed[1]["session_id"]  # no key: each a new conversation
        for job in unkeyed:
            assert (await stack.wait_job(job["job_id"]))["status"] == "completed"
        assert len(llm.calls("answer")) == 3
    # Another tenant's request with the same key is its own.
    r = await stack.other_http.post("/v1/chats", json={"message": question, "collection": "chat"},
                                    headers={"Idempotency-Key": key})
    assert r.status_code == 202 and r.json()["duplicate"] is False


async def test_chat_events_stream_steps_deltas_and_resume(stack, chat_docs):
    with stack.llm.scope(stream_chunk_delay=0.05) as llm:
        accepted = await stack.chat(f"How are paper cranes folded? {llm.token}", collection="chat")
        events = await read_events(stack, accepted["job_id"])
        [answer_call] = llm.calls("answer")
    types = [e["type"] for _, e in events]
    assert types[0] == "ragline.job.accepted" and types[-1] == "ragline.job.completed"
    started = [e["data"]["step"] for _, e in events if e["type"] == "ragline.step.started"]
    assert started[:2] == ["retrieve_context", "generate_answer"]
    assert set(started) == {"retrieve_context", "summarize_context", "extract_entities", "generate_answer"}
    # The answer streams and is complete before any side step starts.
    first_delta = types.index("ragline.answer.delta")
    answered = types.index("ragline.answer.completed")
    first_side = min(i for i, (_, e) in enumerate(events) if e["type"] == "ragline.step.started"
                     and e["data"]["step"] in ("summarize_context", "extract_entities"))
    assert first_delta < answered < first_side
    deltas = [e["data"] for _, e in events if e["type"] == "ragline.answer.delta"]
    assert len(deltas) >= 3 and [d["index"] for d in deltas] == list(range(1, len(deltas) + 1))
    # The pieces, in order, are the model's reply; the completed answer and the job's result are too.
    streamed = "".join(d["text"] for d in deltas)
    assert streamed == answer_call.reply
    final = events[-1][1]["data"]
    assert final["answer"] == streamed.strip() == events[answered][1]["data"]["answer"]
    assert events[answered][1]["data"]["citations"] == final["citations"]
    ids = [int(i) for i, _ in events]
    assert ids == list(range(ids[0], ids[0] + len(ids)))

    resumed = await read_events(stack, accepted["job_id"], last_event_id=str(ids[3]))
    assert [e for _, e in resumed] == [e for _, e in events[4:]]

    # Each read of the stream is an Update of the job (a workflow task, a write on the server). The step
    # events ride along with what the person waits for, so the stream was read once per batch of deltas
    # and twice besides (the answer, the end), not once per step.
    history = await stack.client.get_workflow_handle(accepted["job_id"]).fetch_history()
    reads, batches = stream_traffic(history)
    assert reads <= batches + 2, (reads, batches)


def stream_traffic(history) -> tuple[int, int]:
    """(reads of the job's event stream, batches of events an activity signalled into it) in its history."""
    reads = sum(e.HasField("workflow_execution_update_accepted_event_attributes") for e in history.events)
    batches = sum(e.workflow_execution_signaled_event_attributes.signal_name == PUBLISH_SIGNAL
                  for e in history.events if e.HasField("workflow_execution_signaled_event_attributes"))
    return reads, batches


async def test_an_answer_that_arrives_at_once_streams_its_first_piece_and_returns_the_rest(stack, chat_docs):
    """The first piece goes out as soon as the model sends it; the pieces still unsent when the answer is
    complete come back with the step's result and the job publishes them: one signal, not two."""
    with stack.llm.scope(stream_chunk_delay=0) as llm:
        accepted = await stack.chat(f"What crosses the Mara river? {llm.token}", collection="chat")
        events = [e for _, e in await read_events(stack, accepted["job_id"])]
        [answer_call] = llm.calls("answer")
    deltas = [e["data"] for e in events if e["type"] == "ragline.answer.delta"]
    assert len(deltas) >= 3 and [d["index"] for d in deltas] == list(range(1, len(deltas) + 1))
    assert "".join(d["text"] for d in deltas) == answer_call.reply
    types = [e["type"] for e in events]
    assert types.index("ragline.step.started") < types.index("ragline.answer.delta")
    assert max(i for i, t in enumerate(types) if t == "ragline.answer.delta") < types.index("ragline.answer.completed")
    history = await stack.client.get_workflow_handle(accepted["job_id"]).fetch_history()
    assert stream_traffic(history)[1] == 1


async def test_broken_entity_json_does_not_break_the_turn(stack, chat_docs):
    with stack.llm.scope() as llm:
        llm.script("extract_entities", ["Sure! Here are the entities: none of them", "{still not json"])
        job = await stack.wait_job((await stack.chat(f"What do rangers do? {llm.token}",
                                                     collection="chat"))["job_id"])
        assert llm.count("extract_entities") == 2  # one corrective re-ask, then no more
        [answer_call] = llm.calls("answer")
    assert job["status"] == "completed", job
    assert job["result"]["entities"] == []
    assert any("invalid JSON" in w for w in job["result"]["warnings"])
    assert job["result"]["answer"] == answer_call.reply.strip()

    with stack.llm.scope() as llm:
        llm.script("extract_entities", ["```json\n[{'text': 'Serengeti', 'type': 'place'},]\n```"])
        job = await stack.wait_job((await stack.chat(f"Where do the rangers work? {llm.token}",
                                                     collection="chat"))["job_id"])
        assert llm.count("extract_entities") == 1
    assert job["result"]["entities"] == [{"text": "Serengeti", "type": "PLACE"}]
    assert job["result"]["warnings"] == []


async def test_summary_and_entities_run_concurrently(stack, chat_docs):
    with stack.llm.scope(delay=1.0) as llm:
        job = await stack.wait_job((await stack.chat(f"Tell me about origami. {llm.token}",
                                                     collection="chat"))["job_id"])
        [summary] = llm.calls("summarize")
        [entities] = llm.calls("extract_entities")
    assert job["status"] == "completed", job
    assert summary.started_at < entities.finished_at and entities.started_at < summary.finished_at


async def test_a_turn_whose_passages_overflow_the_context_summarizes_what_fits_instead_of_failing(stack):
    """Twenty long passages overflow the model's context (the stack's default 4,096 tokens): the summary the
    answer waits for, and the entities after it, are given the best passages that fit. They were given all
    twenty, which a model with that context refuses (400, not retried): the turn failed before its answer."""
    collection = f"overflow-{uuid.uuid4().hex[:8]}"
    # 24 paragraphs of ~900 characters: 24 chunks, of which top_k=20 come back, ~4,500 tokens together.
    text = "\n\n".join(f"Harbour log {n}. " + " ".join(
        f"On day {d} the pilot boat {n} guided the ferry past the northern breakwater at dawn." for d in range(10))
        for n in range(24))
    upload = await stack.upload(("harbour-log.txt", text.encode()), collection=collection)
    assert (await stack.wait_done(upload["job_id"]))["status"] == "completed"
    context = stack.settings.llm_context_tokens

    def within_the_context(body: dict) -> str | None:  # a model that refuses a prompt over its context
        prompt = sum(estimate_tokens(m["content"]) for m in body["messages"] if isinstance(m.get("content"), str))
        return "400" if prompt + (body.get("max_tokens") or 0) > context else None

    with stack.llm.scope() as llm:
        for task in ("summarize", "extract_entities", "answer"):
            llm.script_fn(task, within_the_context)
        job = await stack.wait_done((await stack.chat(f"Which boat guided the ferry? {llm.token}",
                                                      collection=collection, top_k=20))["job_id"])
        summaries, entities, answers = llm.calls("summarize"), llm.calls("extract_entities"), llm.calls("answer")
    assert job["status"] == "completed", job
    assert [c.status for c in summaries + entities + answers] == [200] * 3
    assert summaries[0].finished_at <= answers[0].started_at  # the passages overflowed: the answer waited for it
    assert job["result"]["summary"] and job["result"]["answer"] and job["result"]["entities"] is not None


async def test_no_context_is_said_in_the_language_of_the_question(stack):
    with stack.llm.scope() as llm:
        english = await stack.wait_job((await stack.chat(f"What is the capital of Peru? {llm.token}",
                                                         collection="chat-empty"))["job_id"])
        chinese = await stack.wait_job((await stack.chat(f"秘鲁的首都是哪里？{llm.token}",
                                                         collection="chat-empty"))["job_id"])
        assert llm.count() == 0, "nothing to retrieve: no model call should be paid for"
    assert "don't know" in english["result"]["answer"] and english["result"]["citations"] == []
    assert "不知道" in chinese["result"]["answer"] and chinese["result"]["citations"] == []


async def test_unknown_session_and_bad_requests(stack):
    assert (await stack.http.get("/v1/chats/no-such-session")).status_code == 404
    assert (await stack.http.post("/v1/chats", json={"message": ""})).status_code == 422
    # Nothing but white space asks nothing: refused, naming the field, like a blank search or goal.
    # So do invisible zero-width characters (ZWSP, a BOM): they reached the model as an empty question.
    for path, body in (("/v1/chats", {"message": " \n\t "}), ("/v1/search", {"query": "   "}),
                       ("/v1/agents", {"goal": "\u3000"}), ("/v1/chats", {"message": "\u200b"}),
                       ("/v1/search", {"query": "\ufeff \u200d"})):
        r = await stack.http.post(path, json=body)
        assert r.status_code == 422 and r.json()["error"]["problems"][0]["field"] in body, (path, r.text)
    r = await stack.http.post("/v1/chats", json={"message": "hi", "session_id": "../x"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_session_id")
    # Within 8,000 characters, but more tokens than the model's context could ever answer.
    r = await stack.http.post("/v1/chats", json={"message": "一线城市每晚住宿标准是多少？" * 570})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == \
        (422, "message_too_long", "message"), r.text
    assert "RAGLINE_LLM_CONTEXT_TOKENS" in r.json()["error"]["message"]
    assert (await stack.http.post("/v1/chats", json={"message": "hi", "collection": "a b"})).status_code == 422
    # A body that is not JSON in UTF-8, or JSON cut off: 422 saying so, like every other bad body.
    for body, says in ((b'{"message": "caf\xe9"}', "could not be read"), (b'{"message": "hi', "not valid JSON")):
        r = await stack.http.post("/v1/chats", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        assert [p["field"] for p in r.json()["error"]["problems"]] == ["body"]
        assert says in r.json()["error"]["message"]
    # A body sent as another media type (curl -d sends a form) is 415, naming the one the route reads.
    for path, sent, kind in (("/v1/chats", "application/x-www-form-urlencoded", "application/json"),
                             ("/v1/documents", "application/json", "multipart/form-data")):
        r = await stack.http.post(path, content=b'{"message": "hi"}', headers={"content-type": sent})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
        assert kind in r.json()["error"]["message"]
    # Without a key, nothing about the body is judged: 401 first.
    async with httpx.AsyncClient(base_url=stack.base_url) as anonymous:
        r = await anonymous.post("/v1/chats", content=b'{"message": "hi',
                                 headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated", r.text


async def test_an_answer_stream_cut_short_is_retried_not_taken_for_the_answer(stack, chat_docs):
    """The model server ends the stream cleanly after its first piece, without a finish_reason (what
    llama-cpp-python does to a stream when another request arrives). That fragment is no answer: the step
    is retried, and the job's answer is the retry's whole one. Before, "Acc" was the turn's answer."""
    with stack.llm.scope() as llm:
        llm.script("answer", ["cut"])
        accepted = await stack.chat(f"Who counts the herds? {llm.token}", collection="chat")
        job = await stack.wait_job(accepted["job_id"])
        cut, answered = llm.calls("answer")
    assert cut.fault == "cut" and answered.ok
    assert job["status"] == "completed" and job["result"]["answer"] == answered.reply.strip()
    [step] = [s for s in job["steps"] if s["name"] == "generate_answer"]
    assert step["attempts"] == 2


async def test_a_retried_answer_streams_again_under_its_new_attempt(stack, chat_docs):
    """The model's stream breaks after its first piece: that piece has gone out, as attempt 1's; the retry
    streams the whole answer again under attempt 2, and the job's answer is the retry's."""
    with stack.llm.scope() as llm:
        llm.script("answer", ["malformed"])
        accepted = await stack.chat(f"Who counts the herds? {llm.token}", collection="chat")
        events = [e for _, e in await read_events(stack, accepted["job_id"])]
        broken, answered = llm.calls("answer")
    assert broken.fault == "malformed" and answered.ok
    deltas = [e["data"] for e in events if e["type"] == "ragline.answer.delta"]
    first = [d for d in deltas if d["attempt"] == 1]
    retry = [d for d in deltas if d["attempt"] == 2]
    assert [d["text"] for d in first] == ["Acc"]  # what the broken stream sent before it broke
    assert deltas == first + retry
    assert [d["index"] for d in retry] == list(range(1, len(retry) + 1))
    assert "".join(d["text"] for d in retry) == answered.reply
    assert events[-1]["type"] == "ragline.job.completed"
    assert events[-1]["data"]["answer"] == answered.reply.strip()


async def test_an_answer_an_operator_retries_streams_under_an_attempt_of_its_own(stack, chat_docs):
    """The answer's stream breaks after its first piece, then the model is down until the step parks; an
    operator retries it. The retry's deltas carry an attempt after every attempt made before (it was 1 again),
    so a client that starts the answer over when the attempt changes shows the answer alone."""
    with stack.llm.scope() as llm:
        llm.script("answer", ["malformed", "503", "503", "503"])
        accepted = await stack.chat(f"Who counts the herds? {llm.token}", collection="chat")
        reading = asyncio.ensure_future(read_events(stack, accepted["job_id"]))
        parked = await stack.wait_job(accepted["job_id"], until=("dead_lettered",))
        [step] = [s for s in parked["steps"] if s["name"] == "generate_answer"]
        r = await stack.http.post(f"/v1/jobs/{accepted['job_id']}/retry", json={"reason": "the model is back"})
        assert r.status_code == 200 and r.json()["steps"] == ["generate_answer"], r.text
        events = [e for _, e in await asyncio.wait_for(reading, 120)]
        answered = llm.calls("answer")[-1]
    deltas = [e["data"] for e in events if e["type"] == "ragline.answer.delta"]
    assert deltas[0] == {"text": "Acc", "index": 1, "attempt": 1}  # the broken stream's piece
    retry = deltas[1:]
    assert {d["attempt"] for d in retry} == {step["attempts"] + 1}, (step, retry)
    shown = ""
    for previous, delta in zip([None, *deltas], deltas):  # a client that starts over on a new attempt
        shown = delta["text"] if previous is None or delta["attempt"] != previous["attempt"] else shown + delta["text"]
    assert shown == answered.reply == "".join(d["text"] for d in retry)
    assert events[-1]["type"] == "ragline.job.completed" and events[-1]["data"]["answer"] == answered.reply.strip()


async def test_a_held_answer_nobody_reviews_fails_the_turn_after_the_review_timeout(stack, chat_docs):
    """`require_review`: the answer waits for a reviewer at most RAGLINE_REVIEW_TIMEOUT (a server setting,
    any duration above 0, which the API that accepts a turn gives it). Nobody decides: the review is
    rejected by "system" with "review timed out", the turn fails saying so, and the person who asked never
    saw the answer on the job's stream, neither streamed nor whole. The turn is accepted by an API of the
    test's own with a short timeout, on the session's Temporal; the session's worker runs it."""
    timeout = timedelta(seconds=2)
    settings = stack.settings.model_copy(update={"review_timeout": "2s"})
    async with serving_api(create_app(settings)) as url, \
            httpx.AsyncClient(base_url=url, timeout=60,
                              headers={"Authorization": f"Bearer {stack.keys['member']}"}) as asker:
        with stack.llm.scope() as llm:
            held = f"Held {llm.token}: the herds cross the Mara river in July [1]."
            llm.script("answer", [held])
            r = await asker.post("/v1/chats", json={"message": f"When do the herds cross? {llm.token}",
                                                    "collection": "chat", "require_review": True})
            assert r.status_code == 202, r.text
            accepted = r.json()
            # The asker's view, watched from the moment it was accepted until the stream ends.
            events = [e for _, e in await asyncio.wait_for(
                read_events(SimpleNamespace(http=asker), accepted["job_id"]), timeout=120)]
            [answer_call] = llm.calls("answer")
        job = (await asker.get(f"/v1/jobs/{accepted['job_id']}")).json()
        turns = await session_turns(asker, accepted["session_id"], accepted["job_id"])
    assert answer_call.reply.strip() == held  # there was an answer to hold

    types = [e["type"] for e in events]
    [requested] = [e["data"] for e in events if e["type"] == "ragline.review.requested"]
    [decided] = [e["data"] for e in events if e["type"] == "ragline.review.decided"]
    assert requested["reason"] == "review requested"
    expires_at = datetime.fromisoformat(requested["expires_at"])
    assert expires_at - datetime.fromisoformat(requested["requested_at"]) == timeout
    assert (decided["decision"], decided["reviewer"], decided["comment"]) == ("reject", "system", "review timed out")
    assert datetime.fromisoformat(decided["decided_at"]) >= expires_at  # by the timer, not before it ran out
    assert types[-1] == "ragline.job.failed"
    assert "answer rejected by system: review timed out" in events[-1]["data"]["error"]
    assert types.index("ragline.review.requested") < types.index("ragline.review.decided") < len(types) - 1
    # Never shown: no delta, no completed answer, and the text in no event, the review's own included.
    assert not [t for t in types if t.startswith("ragline.answer.")], types
    assert not [e["type"] for e in events if held in json.dumps(e, ensure_ascii=False)]
    assert requested["proposed_action"] == decided["proposed_action"]
    assert requested["proposed_action"]["action"] == "release_answer" and "answer" not in requested["proposed_action"]
    assert requested["withheld"] == ["answer"]

    assert job["status"] == "failed" and job["result"] is None, job
    assert job["error"]["type"] == "AnswerRejected"
    assert job["error"]["message"] == "answer rejected by system: review timed out"
    [turn] = turns
    assert (turn["job_id"], turn["status"], turn["answer"]) == (accepted["job_id"], "failed", None)


async def test_a_session_shows_a_turn_that_ended_as_ended_while_visibility_still_lists_it_running(stack):
    """GET /v1/chats/{session} lists turns from visibility, which records a turn's end a moment after it. A
    turn listed as running is read from its run: once ended it shows so, with its result (who wrote the
    answer), not as running with the answer it showed on its stream."""
    session = f"stale-{uuid.uuid4().hex[:8]}"
    r = await stack.http.post("/v1/chats", json={"message": "Who counts the herds?", "session_id": session,
                                                 "collection": "chat", "require_review": True})
    job_id = r.json()["job_id"]
    await waiting_reviews(stack, job_id, timeout=30)
    [stale] = await eventually(lambda: job_views.list_jobs(stack.client, f"WorkflowId = '{job_id}'", 1,
                                                           timedelta(seconds=10)), what="the turn listed")
    assert stale.status == WorkflowExecutionStatus.RUNNING
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
        "decision": "revise", "reviewer": "editor", "answer": "The rangers count them from the air [1]."})
    assert r.status_code == 200, r.text
    assert (await stack.wait_done(job_id))["status"] == "completed"
    turn = await _turn_view(stack.client, stale, timedelta(seconds=10))  # the record as visibility had it
    assert (turn.status, turn.answer, turn.written_by_reviewer) == (
        "completed", "The rangers count them from the air [1].", True), turn
