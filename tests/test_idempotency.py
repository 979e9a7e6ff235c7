"""Idempotency-Key on every POST that starts paid work (chats, agents, evaluations): the same request
sent again returns the same job and runs nothing twice, even after the job ended; the same key with a
different body is refused (422 `idempotency_key_reused`) instead of answering for the first body."""

from __future__ import annotations

import asyncio
import json
import uuid

from api.job_views import RecentlyAccepted
from devtools.scripted_llm import last_user_message
from tests.helpers import delegate_until, session_turns, waiting_reviews


def _key() -> str:
    return f"idem-{uuid.uuid4().hex[:8]}"


def _reused(r) -> bool:  # noqa: ANN001
    return r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"


async def test_a_chat_key_sent_with_another_question_is_refused_in_this_process_and_from_the_job(stack):
    key = _key()
    body = {"message": "Who wrote the ledger?", "collection": "idempotency"}
    first = await stack.http.post("/v1/chats", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 202, first.text
    session = first.json()["session_id"]
    # This API process accepted it a moment ago: the question it was sent with decides.
    changed = await stack.http.post("/v1/chats", json={**body, "message": "Who signed it?"},
                                    headers={"Idempotency-Key": key})
    assert _reused(changed), changed.text
    assert key in changed.json()["error"]["message"]
    # So does a field other than the message.
    assert _reused(await stack.http.post("/v1/chats", json={**body, "top_k": 2}, headers={"Idempotency-Key": key}))
    await stack.wait_done(first.json()["job_id"])
    # Another API process (nothing accepted there) reads the request from the job itself.
    accepted, stack.app.state.accepted = stack.app.state.accepted, RecentlyAccepted()
    try:
        changed = await stack.http.post("/v1/chats", json={**body, "message": "Who signed it?"},
                                        headers={"Idempotency-Key": key})
        same = await stack.http.post("/v1/chats", json=body, headers={"Idempotency-Key": key})
    finally:
        stack.app.state.accepted = accepted
    assert _reused(changed), changed.text
    assert same.status_code == 202 and same.json()["duplicate"] is True
    assert (same.json()["job_id"], same.json()["session_id"]) == (first.json()["job_id"], session)
    # The key belongs to its session: in another session it is a new request.
    other = await stack.http.post("/v1/chats", json={**body, "session_id": f"idem-{uuid.uuid4().hex[:6]}",
                                                     "message": "Who signed it?"}, headers={"Idempotency-Key": key})
    assert other.status_code == 202 and other.json()["duplicate"] is False
    await stack.wait_done(other.json()["job_id"])


async def test_an_agent_resent_with_its_key_is_one_job_even_after_it_ended(stack):
    key = _key()
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=0, token=llm.token))
        body = {"goal": f"Count the ledgers {llm.token}", "collection": "idempotency", "max_depth": 1}
        first = await stack.http.post("/v1/agents", json=body, headers={"Idempotency-Key": key})
        resent = await stack.http.post("/v1/agents", json=body, headers={"Idempotency-Key": key})
        assert first.status_code == 202 and resent.status_code == 202, (first.text, resent.text)
        assert first.json()["duplicate"] is False and resent.json()["duplicate"] is True
        job_id = first.json()["job_id"]
        assert resent.json()["job_id"] == job_id
        job = await stack.wait_done(job_id)
        assert job["status"] == "completed", job
        # Ended, the job still answers its key: the agent does not run again.
        again = await stack.http.post("/v1/agents", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 202 and again.json() == {**first.json(), "duplicate": True}
        assert _reused(await stack.http.post("/v1/agents", json={**body, "max_depth": 2},
                                             headers={"Idempotency-Key": key}))
        assert len(llm.calls("agent")) == 1
    # Without a key, each POST is a job of its own; another tenant's same key is its own too.
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=0, token=llm.token))
        body = {"goal": f"Count the ledgers {llm.token}", "collection": "idempotency", "max_depth": 0}
        unkeyed = [(await stack.http.post("/v1/agents", json=body)).json()["job_id"] for _ in range(2)]
        theirs = await stack.other_http.post("/v1/agents", json=body, headers={"Idempotency-Key": key})
        assert theirs.status_code == 202 and theirs.json()["duplicate"] is False
        assert unkeyed[0] != unkeyed[1] and theirs.json()["job_id"] != job_id
        for other in unkeyed:
            assert (await stack.wait_done(other))["status"] == "completed"
        r = await stack.other_http.get(f"/v1/jobs/{theirs.json()['job_id']}")
        assert r.status_code == 200 and r.json()["status"] in ("queued", "running", "completed")


async def test_an_agent_resent_with_its_budget_written_another_way_is_the_same_request(stack):
    """The budget left out, written out with its defaults (as the README's example does), or its seconds as
    3600 or 3600.0: one request, as a client that fills in the defaults on a retry sends it again."""
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=0, token=llm.token))
        body = {"goal": f"Count the ledgers {llm.token}", "collection": "idempotency", "max_depth": 0}
        written_out = {"max_llm_calls": 50, "max_tokens": 200_000, "max_seconds": 3600}
        spellings = [body, {**body, "budget": written_out}, {**body, "budget": {"max_seconds": 3600.0}}]
        for first_body in (spellings[0], spellings[1]):
            key = _key()
            first = await stack.http.post("/v1/agents", json=first_body, headers={"Idempotency-Key": key})
            assert first.status_code == 202 and first.json()["duplicate"] is False, first.text
            for resent_body in spellings:
                resent = await stack.http.post("/v1/agents", json=resent_body, headers={"Idempotency-Key": key})
                assert resent.status_code == 202, (first_body, resent_body, resent.text)
                assert resent.json() == {**first.json(), "duplicate": True}
            # Another number of seconds is another request.
            assert _reused(await stack.http.post("/v1/agents", json={**body, "budget": {"max_seconds": 60}},
                                                 headers={"Idempotency-Key": key}))
            assert (await stack.wait_done(first.json()["job_id"]))["status"] == "completed"


async def test_an_evaluation_resent_with_its_key_is_one_job(stack):
    key = _key()
    golden = json.dumps({"question": "Who wrote the ledger?", "expected_document": None}).encode()
    url = "/v1/evaluations?collection=idempotency"
    first = await stack.http.post(url, content=golden, headers={"Idempotency-Key": key})
    resent = await stack.http.post(url, content=golden, headers={"Idempotency-Key": key})
    assert first.status_code == 202 and resent.status_code == 202, (first.text, resent.text)
    assert (first.json()["duplicate"], resent.json()["duplicate"]) == (False, True)
    assert resent.json()["job_id"] == first.json()["job_id"]
    # Another golden set, or the same one against another collection or k, under the same key: refused.
    assert _reused(await stack.http.post(url, content=golden + b"\n", headers={"Idempotency-Key": key}))
    assert _reused(await stack.http.post("/v1/evaluations?collection=idempotency-2", content=golden,
                                         headers={"Idempotency-Key": key}))
    assert _reused(await stack.http.post(url + "&k=3", content=golden, headers={"Idempotency-Key": key}))
    assert (await stack.wait_done(first.json()["job_id"]))["status"] == "completed"


async def test_one_key_sent_many_times_at_once_is_one_turn_and_refuses_other_questions(stack):
    """A retry storm: eight requests under one key reach the API together. One is recorded; the
    same question again is its duplicate, another question is refused: none is silently dropped."""
    key = _key()

    async def send(message: str):
        return await stack.http.post("/v1/chats", json={"message": message, "collection": "idempotency"},
                                     headers={"Idempotency-Key": key})

    messages = ["Who wrote the ledger?" if i % 2 else f"Question {i}?" for i in range(8)]
    answers = await asyncio.gather(*(send(m) for m in messages))
    accepted = [r.json() for r in answers if r.status_code == 202]
    refused = [r for r in answers if r.status_code != 202]
    assert all(_reused(r) for r in refused), [r.text for r in refused]
    [first] = [a for a in accepted if not a["duplicate"]]
    assert {a["job_id"] for a in accepted} == {first["job_id"]}
    job = await stack.wait_done(first["job_id"])
    assert job["status"] == "completed", job
    # Whichever request came first is the turn: the same question again is its duplicate, any other refused.
    same = messages.count(job["result"]["question"])
    assert (len(accepted), len(refused)) == (same, 8 - same)
    turns = await session_turns(stack.http, first["session_id"], first["job_id"])
    assert [t["job_id"] for t in turns] == [first["job_id"]]


async def test_a_review_resent_with_its_key_gets_the_first_acknowledgement(stack):
    """A reviewer's decision whose answer was lost is sent again with the same key: the same
    acknowledgement, one decision on record. Without a key the second is refused (nothing waits)."""
    key = _key()
    release = asyncio.Event()
    with stack.llm.scope() as llm:
        async def plan(body: dict) -> dict:
            if "a reviewer said" in last_user_message(body["messages"]):
                await release.wait()  # the job stays under way while the decision is sent again
                return {"tool_calls": [{"name": "finish", "arguments": {"answer": "done as told"}}]}
            return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": f"a part {llm.token}"}}]}

        llm.script_fn("agent", plan)
        r = await stack.http.post("/v1/agents", json={"goal": f"Map the lamps {llm.token}",
                                                      "collection": "idempotency", "max_depth": 0})
        job_id = r.json()["job_id"]
        [review] = await waiting_reviews(stack, job_id)
        decision = {"decision": "revise", "reviewer": "ed", "instructions": "answer without delegating"}
        try:
            first = await stack.http.post(f"/v1/jobs/{job_id}/review", json=decision, headers={"Idempotency-Key": key})
            again = await stack.http.post(f"/v1/jobs/{job_id}/review", json=decision, headers={"Idempotency-Key": key})
            unkeyed = await stack.http.post(f"/v1/jobs/{job_id}/review", json=decision)
        finally:
            release.set()
        assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
        assert again.json() == first.json()
        assert (unkeyed.status_code, unkeyed.json()["error"]["code"]) == (409, "not_waiting_for_review")
        job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and [d["reviewer"] for d in job["result"]["decisions"]] == ["ed"]
    assert review["job_id"] == job_id
