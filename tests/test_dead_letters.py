"""A step that exhausts its retries parks the job for an operator instead of dropping it."""

from __future__ import annotations

import uuid

ATTEMPTS = 4  # max_attempts of the chat steps in tests/fast_policies.toml


async def _park_a_turn(stack, question: str) -> dict:
    stack.llm.script("answer", ["503"] * ATTEMPTS)
    body = await stack.upload(("facts.txt", b"Lighthouses guide ships along rocky coasts at night."),
                              collection="dlq")
    await stack.wait_job(body["job_id"])
    accepted = await stack.chat(question, session_id=f"dlq-{uuid.uuid4().hex[:8]}", collection="dlq")
    job = await stack.wait_job(accepted["job_id"])
    assert job["status"] == "dead_lettered", job
    return job


async def test_exhausted_step_parks_and_retry_resumes_at_that_step(stack):
    summaries_before = stack.llm.count("summarize")
    job = await _park_a_turn(stack, "What do lighthouses do?")
    assert job["error"]["type"] == "DeadLettered"
    [letter] = job["error"]["details"]
    assert letter["step"] == "generate_answer" and letter["attempts"] == ATTEMPTS
    assert "503" in letter["error"]
    generate = next(s for s in job["steps"] if s["name"] == "generate_answer")
    assert generate["attempts"] == ATTEMPTS and "503" in generate["error"]

    listed = (await stack.http.get("/v1/jobs", params={"status": "dead_lettered"})).json()["jobs"]
    assert job["job_id"] in {j["job_id"] for j in listed}

    # The fault is gone (the script is used up): retry completes without redoing finished steps.
    r = await stack.http.post(f"/v1/jobs/{job['job_id']}/retry", json={"operator": "ana", "reason": "provider back"})
    assert r.status_code == 200, r.text
    assert r.json()["steps"] == ["generate_answer"]
    done = await stack.wait_done(job["job_id"])
    assert done["status"] == "completed" and "[1]" in done["result"]["answer"]
    assert stack.llm.count("summarize") == summaries_before + 1, "a completed step ran again"
    assert done["operator_decisions"][0]["operator"] == "ana"

    again = await stack.http.post(f"/v1/jobs/{job['job_id']}/retry", json={})
    assert again.status_code == 409


async def test_discard_ends_a_parked_job_as_failed(stack):
    job = await _park_a_turn(stack, "Why are coasts rocky?")
    r = await stack.http.post(f"/v1/jobs/{job['job_id']}/discard", json={"operator": "bo", "reason": "not needed"})
    assert r.status_code == 200, r.text
    failed = await stack.wait_done(job["job_id"])
    assert failed["status"] == "failed"
    assert "discarded by bo: not needed" in failed["error"]["message"]
    assert (await stack.http.post("/v1/jobs/no-such-job/discard", json={})).status_code == 404


async def test_poison_input_fails_at_once_without_retries(stack):
    before = stack.llm.count("answer")
    stack.llm.script("answer", ["400"])
    body = await stack.upload(("p.txt", b"Poison pills are inputs that always fail."), collection="poison")
    await stack.wait_job(body["job_id"])
    accepted = await stack.chat("What is a poison pill?", session_id=f"p-{uuid.uuid4().hex[:8]}",
                                collection="poison")
    job = await stack.wait_job(accepted["job_id"])
    assert job["status"] == "failed" and "400" in job["error"]["message"]
    assert stack.llm.count("answer") == before + 1, "a non-retryable error was retried"
    # Other sessions are not blocked by it.
    other = await stack.chat("What do poison pills do?", collection="poison")
    assert (await stack.wait_job(other["job_id"]))["status"] == "completed"
