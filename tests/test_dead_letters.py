"""A step that exhausts its retries parks the job for an operator instead of dropping it.

Each test scripts the shared model's faults in a scope of its own (its questions carry the scope's
token), so no fault reaches another test's requests and each test counts only its own calls."""

from __future__ import annotations

import asyncio

import uuid
from datetime import timedelta

import pytest

from ragline import audit
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.service import RPCError

from api.job_views import failure_message
from api.routes.events import _progress_event
from tests.conftest import running_stack
from tests.helpers import eventually, raw_temporal_records, read_events

ATTEMPTS = 4  # max_attempts of the chat steps in tests/fast_policies.toml


@pytest.fixture(scope="module")
async def dlq_docs(stack):
    body = await stack.upload(("facts.txt", b"Lighthouses guide ships along rocky coasts at night."),
                              collection="dlq")
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"


async def _park_a_turn(stack, llm, question: str) -> dict:
    llm.script("answer", ["503"] * ATTEMPTS)
    accepted = await stack.chat(f"{question} {llm.token}", session_id=f"dlq-{uuid.uuid4().hex[:8]}",
                                collection="dlq")
    job = await stack.wait_job(accepted["job_id"])
    assert job["status"] == "dead_lettered", job
    assert llm.pending("answer") == 0 and llm.count("answer") == ATTEMPTS
    return job


async def test_exhausted_step_parks_and_retry_resumes_at_that_step(stack, dlq_docs):
    with stack.llm.scope() as llm:
        job = await _park_a_turn(stack, llm, "What do lighthouses do?")
        assert job["error"]["type"] == "DeadLettered"
        [letter] = job["error"]["details"]
        assert letter["step"] == "generate_answer" and letter["attempts"] == ATTEMPTS
        assert "503" in letter["error"]
        steps = {s["name"]: s for s in job["steps"]}
        assert steps["generate_answer"]["attempts"] == ATTEMPTS and "503" in steps["generate_answer"]["error"]
        assert steps["generate_answer"]["status"] == "dead_lettered"  # not "running": nothing runs
        assert steps["retrieve_context"]["status"] == "completed"
        # Parked, the job spends nothing more: the side steps wait behind the answer.
        assert llm.count("summarize") == 0 and llm.count("extract_entities") == 0

        async def listed() -> bool:
            jobs = (await stack.http.get("/v1/jobs", params={"status": "dead_lettered", "limit": 1000})).json()["jobs"]
            return job["job_id"] in {j["job_id"] for j in jobs}
        await eventually(listed, what="the job listed as dead-lettered")

        # The fault is gone (the script is used up): retry completes without redoing finished steps.
        r = await stack.http.post(f"/v1/jobs/{job['job_id']}/retry",
                                  json={"operator": "ana", "reason": "provider back"})
        assert r.status_code == 200, r.text
        assert r.json()["steps"] == ["generate_answer"]
        done = await stack.wait_done(job["job_id"])
        answers = llm.calls("answer")
        assert [c.ok for c in answers] == [False] * ATTEMPTS + [True]
        assert llm.count("summarize") == 1 and llm.count("extract_entities") == 1
    assert done["status"] == "completed"
    assert done["result"]["answer"] == answers[-1].reply.strip()
    steps = {s["name"]: s for s in done["steps"]}
    assert steps["retrieve_context"]["attempts"] == 1, "a completed step ran again"
    assert steps["generate_answer"]["attempts"] == ATTEMPTS + 1  # counted on across the operator's retry
    assert all(s["status"] == "completed" for s in done["steps"])
    assert done["operator_decisions"][0]["operator"] == "ana"

    again = await stack.http.post(f"/v1/jobs/{job['job_id']}/retry", json={})
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_closed", again.text


async def test_a_step_retried_by_an_operator_into_the_same_outage_counts_every_attempt(stack, dlq_docs):
    """Retried while the provider is still down, the step parks again: it and its dead letter count the
    attempts of both rounds, and so does the step once it completes."""
    with stack.llm.scope() as llm:
        job = await _park_a_turn(stack, llm, "What lights the lighthouse lamp?")
        llm.script("answer", ["503"] * ATTEMPTS)  # still down for the whole next round
        assert (await stack.http.post(f"/v1/jobs/{job['job_id']}/retry", json={})).status_code == 200

        async def parked_again() -> dict | None:
            view = (await stack.http.get(f"/v1/jobs/{job['job_id']}")).json()
            return view if view["status"] == "dead_lettered" and llm.count("answer") == 2 * ATTEMPTS else None
        again = await eventually(parked_again, what="the turn parked a second time")
        [letter] = again["error"]["details"]
        assert letter["attempts"] == 2 * ATTEMPTS, letter
        steps = {s["name"]: s for s in again["steps"]}
        assert steps["generate_answer"]["attempts"] == 2 * ATTEMPTS
        assert (await stack.http.post(f"/v1/jobs/{job['job_id']}/retry", json={})).status_code == 200
        done = await stack.wait_done(job["job_id"])
    assert done["status"] == "completed"
    assert {s["name"]: s for s in done["steps"]}["generate_answer"]["attempts"] == 2 * ATTEMPTS + 1


async def test_discard_ends_a_parked_job_as_failed(stack, dlq_docs):
    with stack.llm.scope() as llm:
        job = await _park_a_turn(stack, llm, "Why are coasts rocky?")
        r = await stack.http.post(f"/v1/jobs/{job['job_id']}/discard",
                                  json={"operator": "bo", "reason": "not needed"})
        assert r.status_code == 200, r.text
        failed = await stack.wait_done(job["job_id"])
        assert llm.count() == ATTEMPTS, "a discarded job called the model again"
    assert failed["status"] == "failed"
    assert "discarded by bo: not needed" in failed["error"]["message"]
    # An operator's reason is free text: Temporal keeps the failure it ends the job with encrypted.
    raw, failures = await raw_temporal_records(stack.client, job["job_id"])
    assert b"not needed" not in raw and {f.message for f in failures} == {"Encoded failure"}, failures
    assert (await stack.http.post("/v1/jobs/no-such-job/discard", json={})).status_code == 404


async def test_a_retry_and_a_discard_sent_at_once_are_one_decision(stack, dlq_docs):
    """Two operators deciding at the same moment: one decision is taken, the other refused (409), never
    both acknowledged while only one counts."""
    with stack.llm.scope() as llm:
        job = await _park_a_turn(stack, llm, "Who keeps the lighthouse lit?")
        bodies = [("retry", {"operator": "ana"}), ("discard", {"operator": "bo"})]
        answers = await asyncio.gather(*(stack.http.post(f"/v1/jobs/{job['job_id']}/{action}", json=body)
                                         for action, body in bodies))
        assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
        [taken] = [action for (action, _), r in zip(bodies, answers) if r.status_code == 200]
        ended = await stack.wait_done(job["job_id"])
    assert ended["status"] == ("completed" if taken == "retry" else "failed"), ended
    assert [d["action"] for d in ended["operator_decisions"]] == [taken]


async def test_a_turn_behind_a_parked_one_says_what_it_waits_for(stack, dlq_docs):
    """The turns of a session run in order: a later turn waits for a dead-lettered one, and says so."""
    session = f"dlq-behind-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as llm:
        llm.script("answer", ["503"] * ATTEMPTS)
        first = await stack.chat(f"What do lighthouses do? {llm.token}", session_id=session, collection="dlq")
        assert (await stack.wait_job(first["job_id"]))["status"] == "dead_lettered"
        second = await stack.chat(f"And at night? {llm.token}", session_id=session, collection="dlq")

        ahead = [{"job_id": first["job_id"], "turn": 1, "status": "dead_lettered"}]

        async def waiting() -> dict | None:  # `waiting_for` reads visibility: the first's status shows a moment late
            job = (await stack.http.get(f"/v1/jobs/{second['job_id']}")).json()
            return job if job["status"] == "queued" and job["turn"] and job.get("waiting_for") == ahead else None
        job = await eventually(waiting, what="the second turn numbered and queued behind the parked first")
        assert job["turn"] == 2
        # Cancelling the parked turn lets the session go on.
        assert (await stack.http.post(f"/v1/jobs/{first['job_id']}/cancel")).status_code == 202
        done = await stack.wait_done(second["job_id"])
    assert done["status"] == "completed" and "waiting_for" not in done
    assert (await stack.http.get(f"/v1/jobs/{first['job_id']}")).json()["status"] == "cancelled"


async def test_one_request_resumes_every_parked_job_of_a_collection_after_an_outage(stack):
    collection = f"outage-{uuid.uuid4().hex[:8]}"
    upload = await stack.upload(("harbours.txt", b"Harbours shelter ships from storms."), collection=collection)
    assert (await stack.wait_job(upload["job_id"]))["status"] == "completed"
    with stack.llm.scope() as llm:
        llm.script("answer", ["503"] * ATTEMPTS * 2)  # the provider is down for both turns' attempts
        turns = [await stack.chat(f"What do harbours do, {i}? {llm.token}", session_id=f"outage-{i}-{llm.token}",
                                  collection=collection) for i in range(2)]
        parked = {t["job_id"] for t in turns}
        for job_id in parked:
            assert (await stack.wait_job(job_id))["status"] == "dead_lettered"

        async def listed() -> bool:
            jobs = (await stack.http.get("/v1/jobs", params={"status": "dead_lettered", "limit": 1000})).json()["jobs"]
            return parked <= {j["job_id"] for j in jobs}
        await eventually(listed, what="both turns listed as dead-lettered")

        body = {"collection": collection, "operator": "ana", "reason": "provider back"}
        assert (await stack.member_http.post("/v1/dead-letters/retry", json=body)).status_code == 403
        # Every field has a default, so no body at all means every parked job of the tenant (another tenant's
        # here, with none of these two among them).
        r = await stack.other_http.post("/v1/dead-letters/retry")
        assert r.status_code == 200 and not parked & {j["job_id"] for j in r.json()["retried"]}, r.text
        r = await stack.http.post("/v1/dead-letters/retry", json={**body, "limit": 1})
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["more"] is True and first["refused"] == []
        [one] = first["retried"]
        assert one["job_id"] in parked and one["action"] == "retry" and one["steps"] == ["generate_answer"]
        r = await stack.http.post("/v1/dead-letters/retry", json=body)
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["more"] is False
        # (the first, no longer parked, may still be listed for a moment: then it is refused, not retried twice)
        assert {j["job_id"] for j in second["refused"]} <= {one["job_id"]}
        assert {j["job_id"] for j in second["retried"]} == parked - {one["job_id"]}
        done = [await stack.wait_done(job_id) for job_id in sorted(parked)]
        assert llm.count("answer") == ATTEMPTS * 2 + 2  # each turn answered once after its retry
    assert all(job["status"] == "completed" for job in done), done
    assert all(job["operator_decisions"][0]["operator"] == "ana" for job in done)
    # Each retry is audited under the job's id as the API shows it (greppable from any response).
    audited = {e["job_id"] for e in audit.read(stack.settings) if e["action"] == "retry" and e["outcome"] == "accepted"}
    assert parked <= audited, audited


async def test_poison_input_fails_at_once_without_retries(stack):
    body = await stack.upload(("p.txt", b"Poison pills are inputs that always fail."), collection="poison")
    await stack.wait_job(body["job_id"])
    with stack.llm.scope() as llm:
        llm.script("answer", ["400"])
        accepted = await stack.chat(f"What is a poison pill? {llm.token}", session_id=f"p-{uuid.uuid4().hex[:8]}",
                                    collection="poison")
        job = await stack.wait_job(accepted["job_id"])
        assert job["status"] == "failed" and "400" in job["error"]["message"]
        assert llm.count("answer") == 1, "a non-retryable error was retried"
        [step] = [s for s in job["steps"] if s["name"] == "generate_answer"]
        assert (step["status"], step["attempts"]) == ("failed", 1)
        # Other sessions are not blocked by it.
        other = await stack.chat(f"What do poison pills do? {llm.token}", collection="poison")
        assert (await stack.wait_job(other["job_id"]))["status"] == "completed"
        assert llm.count("answer") == 2


async def test_a_step_that_fails_for_good_after_retries_counts_every_attempt(stack, dlq_docs):
    with stack.llm.scope() as llm:
        llm.script("answer", ["503", "503", "400"])  # two passing faults, then a refusal no retry can help
        accepted = await stack.chat(f"What do lighthouses guide? {llm.token}", collection="dlq")
        job = await stack.wait_job(accepted["job_id"])
        assert llm.count("answer") == 3
    assert job["status"] == "failed" and "400" in job["error"]["message"]
    [step] = [s for s in job["steps"] if s["name"] == "generate_answer"]
    assert (step["status"], step["attempts"]) == ("failed", 3)


async def test_a_retrying_step_shows_what_failed_it(stack, dlq_docs):
    """While a step retries, Temporal keeps its last failure for the Web UI and `ragline.step.progress`,
    and replaces one over 4 KB with "Failure exceeds size limit.": a dropped connection's failure, with
    the HTTP client's whole exception chain, used to be that large."""
    with stack.llm.scope() as llm:
        # The second attempt drops too, but only after 2 s (under the stack's 3 s llm_timeout): long enough
        # to find it pending, with the first attempt's failure, however busy the machine.
        llm.script("answer", ["drop", {"fault": "drop", "delay": 2}] + ["drop"] * (ATTEMPTS - 2))
        accepted = await stack.chat(f"What do lighthouses guide? {llm.token}", collection="dlq")
        handle = stack.client.get_workflow_handle(accepted["job_id"])

        async def retrying() -> str | None:
            try:
                desc = await handle.describe()
            except RPCError:  # its session has not started the job yet
                return None
            pending = [p for p in desc.raw_description.pending_activities
                       if p.activity_type.name == "generate_answer" and p.attempt >= 2
                       and p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED]  # not in its backoff
            return pending[0].last_failure if pending and pending[0].HasField("last_failure") else None

        failure = await eventually(retrying, every=0.02, what="generate_answer's second attempt")
        # Encrypted (temporal/converter.py): the message reads only through the codec.
        assert failure.message == "Encoded failure", failure
        message = await failure_message(stack.client, failure)
        assert "cannot reach provider" in message, message
        # The API decodes it where it shows it (within the 2 s the second attempt runs): the job's step, and
        # the stream's `ragline.job.running` event.
        view = (await stack.http.get(f"/v1/jobs/{accepted['job_id']}")).json()
        step = next(s for s in view["steps"] if s["name"] == "generate_answer")
        assert step["status"] == "running" and "cannot reach provider" in step["error"], step
        running = (await _progress_event(stack.client, accepted["job_id"], timedelta(seconds=5)))["data"]["running"]
        assert "cannot reach provider" in next(r for r in running if r["step"] == "generate_answer")["last_error"]
        assert (await stack.wait_job(accepted["job_id"]))["status"] == "dead_lettered"
    r = await stack.http.post(f"/v1/jobs/{accepted['job_id']}/discard", json={"reason": "test over"})
    assert r.status_code == 200, r.text


async def test_a_parked_document_says_why_and_lends_its_uploads_slot(temporal_env, private_llm, tmp_path):
    """An upload's document whose embeddings keep failing parks for an operator. The documents list says
    why; the upload, which only waits on it, lends its tenant's running slot (here the tenant's only
    one), so a chat of the tenant runs meanwhile; an operator's retry then indexes the document once."""
    llm = private_llm
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, llm, tmp_path, task_queue="ragline-doc-dlq", tenant_max_running_jobs=1,
                             embeddings_base_url=llm.base_url, embeddings_model="scripted") as stack:
        seed = await stack.upload(("ferry.txt", b"The ferry to the island leaves at noon from pier four."),
                                  collection="doc-dlq")
        assert (await stack.wait_job(seed["job_id"]))["status"] == "completed"
        with llm.scope() as failing:
            failing.script("embeddings", ["503"] * ATTEMPTS)
            upload = await stack.upload(("stuck.txt", f"The ferry leaves at noon. {failing.token}".encode()),
                                        collection="doc-dlq")

            async def parked() -> dict | None:
                docs = (await stack.http.get("/v1/documents", params={"collection": "doc-dlq"})).json()["documents"]
                return next((d for d in docs if d["status"] == "dead_lettered" and d["error"]), None)

            doc = await eventually(parked, timeout=60, what="the document parked, with its reason")
            assert "embed_chunks" in doc["error"] and "503" in doc["error"], doc
            # Not removable while it waits: the operator decides on its job first.
            r = await stack.http.delete(f"/v1/documents/{doc['document_id']}")
            assert (r.status_code, r.json()["error"]["code"]) == (409, "document_busy"), r.text
            assert doc["job_id"] in r.json()["error"]["message"]
            # Named with a collection it is not in: not found there, busy or not.
            r = await stack.http.delete(f"/v1/documents/{doc['document_id']}", params={"collection": "default"})
            assert (r.status_code, r.json()["error"]["code"]) == (404, "document_not_found"), r.text
            # A document never waits for a review: said so, not with the workflow's list of handlers.
            r = await stack.http.post(f"/v1/jobs/{doc['job_id']}/review", json={"decision": "approve", "reviewer": "x"})
            assert (r.status_code, r.json()["error"]["code"]) == (409, "not_waiting_for_review"), r.text
            assert "never waits for a review" in r.json()["error"]["message"], r.text
            assert (await stack.wait_job(upload["job_id"], until=("running",)))["status"] == "running"
            # The tenant's one slot is lent: another job of the tenant, a turn that needs the model (which
            # only a turn holding a slot may call), runs to the end.
            chat = await stack.chat("When does the ferry to the island leave?", collection="doc-dlq")
            answered = await stack.wait_job(chat["job_id"], until=("completed", "failed"))
            assert answered["status"] == "completed" and answered["result"]["citations"], answered

            r = await stack.http.post(f"/v1/jobs/{doc['job_id']}/retry", json={"operator": "ops", "reason": "fixed"})
            assert r.status_code == 200, r.text
            assert (await stack.wait_done(upload["job_id"]))["status"] == "completed"
            assert failing.count("embeddings") == ATTEMPTS + 1  # one batch, embedded once after the retry
            # Indexed after the operator's retry, the document is found.
            hits = await stack.search("When does the ferry leave?", collection="doc-dlq")
            assert doc["document_id"] in {h["document_id"] for h in hits}, hits
        # The person following the upload saw its document wait for an operator, and go on.
        told = [e["data"] for _, e in await read_events(stack, upload["job_id"])
                if e["type"] == "ragline.job.child_waiting"]
        assert told == [{"job_id": doc["job_id"], "waiting": True}, {"job_id": doc["job_id"], "waiting": False}]


@pytest.mark.parametrize("action, ends", [("discard", "failed"), ("cancel", "cancelled")])
async def test_a_document_that_does_not_complete_leaves_nothing_to_find(temporal_env, private_llm, tmp_path,
                                                                        action, ends):
    """A document whose first batch of embeddings keeps failing parks while its other batches are indexed,
    which no search finds while it waits (a document is found whole or not at all). Its job shows the step
    parked (not running, as the batches after it made it), the list its pages, and the upload names it.
    Discarded or cancelled, it ends so, and what it had indexed goes with it."""
    llm = private_llm
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, llm, tmp_path, task_queue=f"ragline-doc-{action}", embed_batch_size=4,
                             embed_parallelism=2, embeddings_base_url=llm.base_url,
                             embeddings_model="scripted") as stack:
        with llm.scope() as failing:
            failing.script_fn("embeddings", lambda body: {"fault": "503"})  # only batches with the token
            paragraphs = [f"Paragraph {i}: the tide tables of harbour {i} list high water at {i} o'clock. " * 6
                          for i in range(10)]
            # The first batch parks; the others go on beside it, and start after it parked.
            text = f"{failing.token} " + "\n\n".join(paragraphs)
            upload = await stack.upload(("tides.txt", text.encode()), collection="undo")
            [document] = upload["documents"]

            async def parked_with_the_other_batches_indexed() -> dict | None:
                docs = (await stack.http.get("/v1/documents", params={"collection": "undo"})).json()["documents"]
                doc = next((d for d in docs if d["status"] == "dead_lettered"), None)
                if doc is None:
                    return None
                steps = {s["name"]: s for s in (await stack.http.get(f"/v1/jobs/{doc['job_id']}")).json()["steps"]}
                done, _, batches = (steps["index_chunks"]["detail"] or "0/0").partition(" ")[0].partition("/")
                return (doc, steps) if int(done) == int(batches) - 1 else None

            doc, steps = await eventually(parked_with_the_other_batches_indexed, timeout=60,
                                          what="the document parked, its other batches indexed")
            assert int(steps["index_chunks"]["detail"].split("/")[1].split()[0]) > 2, steps  # batches after the park
            # Its listing and its job agree: the step waits for an operator while its siblings ran on.
            assert steps["embed_chunks"]["status"] == "dead_lettered", steps
            assert doc["pages"] == 1 and doc["error"], doc

            async def upload_says_where_to_look() -> dict | None:  # told by the document, by signal
                job = (await stack.http.get(f"/v1/jobs/{upload['job_id']}")).json()
                [step] = [s for s in job["steps"] if s["name"] == "document:tides.txt"]
                return job if "waits for a person" in (step["detail"] or "") else None

            job = await eventually(upload_says_where_to_look, what="the upload's step naming its parked document")
            [step] = [s for s in job["steps"] if s["name"] == "document:tides.txt"]
            assert job["status"] == step["status"] == "running" and doc["job_id"] in step["detail"], job
            # Its first batches are in the store, yet no search finds them.
            assert await stack.search("When is high water at harbour 1?", collection="undo") == []

            r = await stack.http.post(f"/v1/jobs/{doc['job_id']}/{action}",
                                      json={"operator": "ops"} if action == "discard" else None)
            assert r.status_code in (200, 202), r.text
            assert (await stack.wait_done(doc["job_id"]))["status"] == ends
            failed = await stack.wait_done(upload["job_id"])
        assert failed["status"] == "failed", failed
        # Neither a cancel nor an operator's discard of a step an outage parked is the file's fault: the upload
        # says which it was (a client does not resend an InputError's file as it is).
        [step] = [s for s in failed["steps"] if s["name"] == "document:tides.txt"]
        assert (failed["error"]["type"], step["status"]) == (("Cancelled", "cancelled") if action == "cancel"
                                                             else ("Discarded", "failed")), failed
        assert failed["result"]["documents"][0]["error_type"] == failed["error"]["type"]
        assert not [s for s in failed["steps"] if s["status"] == "running"], failed
        assert stack.index.count(stack.tenant, "undo", document["document_id"]) == 0
        assert await stack.search("When is high water at harbour 1?", collection="undo") == []
