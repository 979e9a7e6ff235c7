"""Chat chains through the real stack; the language model is the scripted OpenAI-compatible server,
reached through the real `openai` client."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.test_events import read_events

ZEBRA = ("The great zebra migration crosses the Mara river every July. Crocodiles wait in the river. "
         "Rangers of the Serengeti count the herds from small aircraft.")
PAPER = "Paper cranes are folded from a single square sheet. Origami needs no glue and no scissors."


@pytest.fixture(scope="module")
async def chat_docs(stack):
    body = await stack.upload(("zebra.txt", ZEBRA.encode()), ("paper.txt", PAPER.encode()), collection="chat")
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed"
    return {d["filename"]: d["document_id"] for d in body["documents"]}


async def test_question_is_answered_from_the_document_with_a_citation(stack, chat_docs):
    before = stack.llm.count("answer")
    accepted = await stack.chat("When does the zebra migration cross the Mara river?", collection="chat")
    assert set(accepted) >= {"job_id", "session_id", "turn", "status_url", "events_url"}
    assert accepted["turn"] is None  # numbered by the session when it takes the turn, shown by GET
    job = await stack.wait_job(accepted["job_id"])
    assert job["status"] == "completed", job
    assert job["kind"] == "chat" and job["turn"] == 1
    result = job["result"]
    assert set(result) >= {"answer", "citations", "summary", "entities", "model", "usage"}
    assert "July" in result["answer"] and "[1]" in result["answer"]
    assert result["citations"][0]["document_id"] == chat_docs["zebra.txt"]
    assert result["citations"][0]["filename"] == "zebra.txt" and result["citations"][0]["page"] == 1
    assert set(result["citations"][0]) >= {"document_id", "filename", "page", "chunk_id", "score"}
    assert result["summary"].startswith("Summary:")
    assert {"text", "type"} <= set(result["entities"][0])
    assert result["model"] == "scripted"
    assert result["usage"]["prompt_tokens"] > 0 and result["usage"]["completion_tokens"] > 0
    assert stack.llm.count("answer") == before + 1
    assert [s["name"] for s in job["steps"]] == ["retrieve_context", "generate_answer", "summarize_context",
                                                 "extract_entities", "cache_answer"]
    steps = {s["name"]: s for s in job["steps"]}
    # The answer does not wait for the side steps: they start once it is generated.
    assert steps["generate_answer"]["finished_at"] <= steps["summarize_context"]["started_at"]
    assert steps["generate_answer"]["finished_at"] <= steps["extract_entities"]["started_at"]

    session = (await stack.http.get(f"/v1/chats/{accepted['session_id']}")).json()
    [turn] = session["turns"]
    assert turn["turn"] == 1 and turn["status"] == "completed" and turn["answer"] == result["answer"]
    assert turn["citations"] == result["citations"]


async def test_five_turns_sent_at_once_are_processed_in_order(stack, chat_docs):
    session = f"burst-{uuid.uuid4().hex[:8]}"
    first = await stack.chat("Who counts the herds?", session_id=session, collection="chat")
    questions = [f"Question number {i} about the zebras?" for i in range(2, 7)]
    stack.llm.set_delay(0.2)
    try:
        bodies = await asyncio.gather(*(stack.chat(q, session_id=session, collection="chat") for q in questions))
        jobs = [await stack.wait_job(b["job_id"]) for b in [first, *bodies]]
    finally:
        stack.llm.set_delay(0)
    assert all(j["status"] == "completed" for j in jobs)
    assert jobs[0]["turn"] == 1 and sorted(j["turn"] for j in jobs[1:]) == [2, 3, 4, 5, 6]
    by_turn = sorted(jobs, key=lambda j: j["turn"])
    # Each turn started only after the previous one had finished.
    for earlier, later in zip(by_turn, by_turn[1:]):
        assert max(s["finished_at"] for s in earlier["steps"]) <= min(s["started_at"] for s in later["steps"])
    # The order they were accepted in is the order the model saw them.
    order = {j["turn"]: j["result"]["question"] for j in jobs[1:]}
    answered = [c["question"] for c in stack.llm.calls if c["task"] == "answer" and c["question"] in order.values()]
    assert answered == [order[t] for t in sorted(order)]

    session_view = (await stack.http.get(f"/v1/chats/{session}")).json()
    assert [t["turn"] for t in session_view["turns"]] == [1, 2, 3, 4, 5, 6]
    assert all(t["status"] == "completed" and t["answer"] for t in session_view["turns"])


async def test_concurrent_duplicates_with_one_idempotency_key_run_one_chain(stack, chat_docs):
    session = f"idem-{uuid.uuid4().hex[:8]}"
    question = f"Are crocodiles in the river ({session})?"
    bodies = await asyncio.gather(*(stack.chat(question, session_id=session, collection="chat",
                                               idempotency_key="key-1") for _ in range(10)))
    assert len({b["job_id"] for b in bodies}) == 1
    first = await stack.wait_job(bodies[0]["job_id"])
    assert first["status"] == "completed" and first["turn"] == 1
    again = await stack.chat(question, session_id=session, collection="chat", idempotency_key="key-1")
    assert again["job_id"] == bodies[0]["job_id"] and again["duplicate"] is True
    other = await stack.chat("Another question?", session_id=session, collection="chat", idempotency_key="key-2")
    assert other["job_id"] != first["job_id"]
    # Turns run in acceptance order: once the later turn is done, any duplicate would have run before it.
    assert (await stack.wait_job(other["job_id"]))["turn"] == 2
    assert len([c for c in stack.llm.calls if c["task"] == "answer" and c["question"] == question]) == 1


async def test_chat_events_stream_steps_deltas_and_resume(stack, chat_docs):
    stack.llm.set_stream_chunk_delay(0.05)
    try:
        accepted = await stack.chat("How are paper cranes folded?", collection="chat")
        events = await read_events(stack, accepted["job_id"])
    finally:
        stack.llm.set_stream_chunk_delay(0)
    types = [e["type"] for _, e in events]
    assert types[0] == "ragline.job.accepted" and types[-1] == "ragline.job.completed"
    started = [e["data"]["step"] for _, e in events if e["type"] == "ragline.step.started"]
    assert started[:2] == ["retrieve_context", "generate_answer"]
    assert set(started) == {"retrieve_context", "summarize_context", "extract_entities", "generate_answer",
                            "cache_answer"}
    # The answer streams and is complete before any side step starts.
    first_delta = types.index("ragline.answer.delta")
    answered = types.index("ragline.answer.completed")
    first_side = min(i for i, (_, e) in enumerate(events) if e["type"] == "ragline.step.started"
                     and e["data"]["step"] in ("summarize_context", "extract_entities"))
    assert first_delta < answered < first_side
    deltas = [e["data"]["text"] for _, e in events if e["type"] == "ragline.answer.delta"]
    assert len(deltas) >= 3
    final = events[-1][1]["data"]
    assert "".join(deltas).strip() == final["answer"]
    ids = [int(i) for i, _ in events]
    assert ids == list(range(ids[0], ids[0] + len(ids)))

    resumed = await read_events(stack, accepted["job_id"], last_event_id=str(ids[3]))
    assert [e for _, e in resumed] == [e for _, e in events[4:]]


async def test_broken_entity_json_does_not_break_the_turn(stack, chat_docs):
    stack.llm.script("extract_entities", ["Sure! Here are the entities: none of them", "{still not json"])
    job = await stack.wait_job((await stack.chat("What do rangers do?", collection="chat"))["job_id"])
    assert job["status"] == "completed", job
    assert job["result"]["entities"] == []
    assert any("invalid JSON" in w for w in job["result"]["warnings"])
    assert job["result"]["answer"]

    stack.llm.script("extract_entities", ["```json\n[{'text': 'Serengeti', 'type': 'place'},]\n```"])
    job = await stack.wait_job((await stack.chat("Where do the rangers work?", collection="chat"))["job_id"])
    assert job["result"]["entities"] == [{"text": "Serengeti", "type": "PLACE"}]


async def test_summary_and_entities_run_concurrently(stack, chat_docs):
    stack.llm.set_delay(1.0)
    try:
        job = await stack.wait_job((await stack.chat("Tell me about origami.", collection="chat"))["job_id"])
    finally:
        stack.llm.set_delay(0)
    question = job["result"]["question"]
    calls = {c["task"]: c for c in stack.llm.calls if c["question"] == question}
    summary, entities = calls["summarize"], calls["extract_entities"]
    assert summary["started_at"] < entities["finished_at"] and entities["started_at"] < summary["finished_at"]


async def test_no_context_is_said_in_the_language_of_the_question(stack):
    before = stack.llm.count()
    english = await stack.wait_job((await stack.chat("What is the capital of Peru?", collection="empty"))["job_id"])
    chinese = await stack.wait_job((await stack.chat("秘鲁的首都是哪里？", collection="empty"))["job_id"])
    assert "don't know" in english["result"]["answer"] and english["result"]["citations"] == []
    assert "不知道" in chinese["result"]["answer"]
    assert stack.llm.count() == before, "nothing to retrieve: no model call should be paid for"


async def test_unknown_session_and_bad_requests(stack):
    assert (await stack.http.get("/v1/chats/no-such-session")).status_code == 404
    assert (await stack.http.post("/v1/chats", json={"message": ""})).status_code == 422
    assert (await stack.http.post("/v1/chats", json={"message": "hi", "session_id": "../x"})).status_code == 422
    assert (await stack.http.post("/v1/chats", json={"message": "hi", "collection": "a b"})).status_code == 422
