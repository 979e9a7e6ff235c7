"""Removing a document (DELETE /v1/documents/{id}) through the real API, Temporal, Qdrant and embedder."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError, RPCStatusCode

from activities.jobs import JobActivities
from models.ingest import AwaitDocumentInput, ForgetDocumentInput, RemoveDocumentInput, removal_workflow_id
from ragline import audit
from temporal import search_attributes as sa
from tests.helpers import eventually
from workflows.remove import RemoveDocumentWorkflow

TEAPOT = b"The blue teapot of Harwick has a copper spout and holds two litres of tea."
KETTLE = b"The black kettle of Harwick whistles when the water boils on the stove."


async def _listed(stack, collection: str) -> set[str]:
    r = await stack.http.get("/v1/documents", params={"collection": collection})
    assert r.status_code == 200, r.text
    return {d["document_id"] for d in r.json()["documents"]}


async def _has(stack, collection: str, document_id: str) -> bool:
    return document_id in await _listed(stack, collection)


async def test_a_removed_document_is_found_by_no_search_or_answer_and_may_be_uploaded_again(stack):
    collection = f"removal-{uuid.uuid4().hex[:8]}"
    teapot = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    kettle = await stack.upload(("kettle.txt", KETTLE), collection=collection)
    for body in (teapot, kettle):
        assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    [doc], [other] = teapot["documents"], kettle["documents"]
    doc_id = doc["document_id"]
    assert doc_id in {h["document_id"] for h in await stack.search("copper spout of the teapot", collection)}
    question = "What is the spout of the blue teapot made of?"
    first = await stack.wait_done((await stack.chat(question, collection=collection))["job_id"])
    assert first["result"]["citations"] and first["result"]["citations"][0]["document_id"] == doc_id, first

    # Any key of the tenant may remove; the removal is a job like any other.
    r = await stack.member_http.delete(f"/v1/documents/{doc_id}")
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert (accepted["document_id"], accepted["filename"], accepted["collection"], accepted["duplicate"]) == \
        (doc_id, "teapot.txt", collection, False)
    [entry] = [e for e in audit.read(stack.settings) if e.get("document_id") == doc_id]
    assert (entry["action"], entry["outcome"], entry["key_name"], entry["removal_job"]) == \
        ("remove_document", "accepted", "acme-member", accepted["job_id"])
    job = await stack.wait_done(accepted["job_id"])
    assert job["status"] == "completed" and job["kind"] == "remove_document", job
    assert job["result"]["chunks_removed"] >= 1 and job["result"]["ingestion_runs_forgotten"] == 1
    assert [s["name"] for s in job["steps"]] == ["confirm_removal", "remove_document_chunks", "await_newer_run",
                                                 "forget_document"]
    # Not listed once its removal has ended (the removal waits for visibility to drop its job, too).
    assert doc_id not in await _listed(stack, collection)

    # Nobody finds it: not a search, not an answer (test_grounded.py: nor a cached one), not the list.
    assert doc_id not in {h["document_id"] for h in await stack.search("copper spout of the teapot", collection)}
    assert other["document_id"] in {h["document_id"] for h in await stack.search("black kettle whistles", collection)}
    after = await stack.wait_done((await stack.chat(question, collection=collection))["job_id"])
    assert doc_id not in {c["document_id"] for c in after["result"]["citations"]}, after

    assert other["document_id"] in await _listed(stack, collection)
    doc_job = stack.workflow_id(f"doc-{doc_id}")
    assert (await stack.http.get(f"/v1/jobs/{doc_job}")).status_code == 404
    r = await stack.http.delete(f"/v1/documents/{doc_id}")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "document_not_found"), r.text

    # The very same upload again is new work, not "already indexed".
    again = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    assert again["job_id"] == teapot["job_id"] and again["duplicate"] is False
    assert (await stack.wait_job(again["job_id"]))["status"] == "completed"
    assert doc_id in {h["document_id"] for h in await stack.search("copper spout of the teapot", collection)}
    # Listed again once visibility has the new run of its job (a moment after it started).
    await eventually(lambda: _has(stack, collection, doc_id), what="the document uploaded again, listed")


async def test_a_document_is_removed_only_by_its_own_tenant(stack):
    collection = f"removal-{uuid.uuid4().hex[:8]}"
    body = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    doc_id = body["documents"][0]["document_id"]
    r = await stack.other_http.delete(f"/v1/documents/{doc_id}")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "document_not_found"), r.text
    assert doc_id in {h["document_id"] for h in await stack.search("copper spout of the teapot", collection)}
    # Naming the collection (the way to reach a document past the retention) finds nothing of its own either,
    # and says so.
    r = await stack.other_http.delete(f"/v1/documents/{doc_id}", params={"collection": collection})
    assert r.status_code == 202, r.text

    async def ended() -> dict | None:
        job = (await stack.other_http.get(f"/v1/jobs/{r.json()['job_id']}")).json()
        return job if job["status"] in ("completed", "failed") else None
    job = await eventually(ended, what="the other tenant's removal")
    assert job["status"] == "completed" and job["result"]["status"] == "not_found", job
    assert job["result"]["chunks_removed"] == 0
    assert doc_id in {h["document_id"] for h in await stack.search("copper spout of the teapot", collection)}
    r = await stack.http.delete("/v1/documents/not-a-document-id")
    assert r.status_code == 422, r.text


async def test_an_upload_that_meets_a_removal_ingests_the_document_anew(stack):
    """An upload queued before a removal that reaches the document during it, or after it, does not take the
    earlier run's "indexed" as its own (its chunks are gone): its job runs the document again. A removal
    asked for a run that is no longer the latest (the same bytes uploaded again since) removes nothing."""
    collection = f"removal-{uuid.uuid4().hex[:8]}"
    body = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    doc_id = body["documents"][0]["document_id"]
    doc_job = stack.workflow_id(f"doc-{doc_id}")
    jobs = JobActivities(stack.client)
    wait = AwaitDocumentInput(workflow_id=doc_job, removal_id=removal_workflow_id(stack.tenant, doc_id))
    assert (await ActivityEnvironment().run(jobs.await_document, wait)).status == "indexed"
    run = await stack.client.get_workflow_handle(doc_job).describe()
    stale = ForgetDocumentInput(workflow_id=doc_job, run_id="an-earlier-run", run_started_at=datetime.now(timezone.utc))
    with pytest.raises(ApplicationError, match="uploaded again") as refused:
        await ActivityEnvironment().run(jobs.confirm_removal, stale)
    assert refused.value.type == "InputError"

    r = await stack.http.delete(f"/v1/documents/{doc_id}")
    assert r.status_code == 202, r.text
    # Asked while the removal runs (it waits for its end) and after it (the run is gone): removed.
    assert (await ActivityEnvironment().run(jobs.await_document, wait)).status == "removed"
    assert (await stack.wait_done(r.json()["job_id"]))["status"] == "completed"
    assert (await ActivityEnvironment().run(jobs.await_document, wait)).status == "removed"
    assert run.run_id and not await jobs._known(doc_job, run.run_id)


async def test_a_document_older_than_the_retention_is_removed_from_the_collection_named(stack):
    """Past the namespace's retention a document's ingestion job is gone, yet its chunks are still found
    (search hits name its id). Naming its collection removes them; without it the 404 says what to do."""
    collection = f"removal-{uuid.uuid4().hex[:8]}"
    body = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    doc_id = body["documents"][0]["document_id"]
    doc_job = stack.workflow_id(f"doc-{doc_id}")
    # What retention does to it: Temporal deletes the job.
    await ActivityEnvironment().run(JobActivities(stack.client).forget_document, ForgetDocumentInput(
        workflow_id=doc_job, run_id=(await stack.client.get_workflow_handle(doc_job).describe()).run_id))
    [hit] = [h for h in await stack.search("copper spout of the teapot", collection) if h["document_id"] == doc_id]

    r = await stack.http.delete(f"/v1/documents/{hit['document_id']}")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "document_not_found"), r.text
    assert "?collection=" in r.json()["error"]["message"]
    r = await stack.http.delete(f"/v1/documents/{doc_id}", params={"collection": collection})
    assert r.status_code == 202, r.text
    job = await stack.wait_done(r.json()["job_id"])
    assert job["status"] == "completed", job
    assert job["result"]["chunks_removed"] >= 1 and job["result"]["ingestion_runs_forgotten"] == 0
    assert doc_id not in {h["document_id"] for h in await stack.search("copper spout of the teapot", collection)}


async def _held_removal(stack, doc_id: str, collection: str):  # noqa: ANN001, ANN202
    """A removal of the document (teapot.txt) that no worker takes: on a queue nobody polls, it runs as long as
    the test wants."""
    run = await stack.client.get_workflow_handle(stack.workflow_id(f"doc-{doc_id}")).describe()
    return await stack.client.start_workflow(
        RemoveDocumentWorkflow.run, RemoveDocumentInput(tenant=stack.tenant, document_id=doc_id, collection=collection,
                                                        filename="teapot.txt", run_id=run.run_id,
                                                        run_started_at=run.start_time),
        id=removal_workflow_id(stack.tenant, doc_id), task_queue=f"nobody-{uuid.uuid4().hex[:6]}",
        search_attributes=TypedSearchAttributes([
            SearchAttributePair(sa.JOB_KIND, "remove_document"), SearchAttributePair(sa.JOB_STATUS, "queued"),
            SearchAttributePair(sa.COLLECTION, collection), SearchAttributePair(sa.FILENAME, "teapot.txt"),
            SearchAttributePair(sa.DOCUMENT_ID, doc_id), SearchAttributePair(sa.TENANT, stack.tenant)]))


async def test_while_a_removal_runs_the_document_is_listed_so_its_bytes_wait_and_so_does_an_upload_reaching_it(stack):
    """A removal that no worker takes (held on a queue nobody polls, so it runs as long as the test wants):
    the document is listed as `removing`, an upload of its bytes is refused, and an upload that reaches it
    waits for the removal's end before it decides (a removal that did not complete removed nothing)."""
    collection = f"removal-{uuid.uuid4().hex[:8]}"
    body = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    doc_id = body["documents"][0]["document_id"]
    doc_job = stack.workflow_id(f"doc-{doc_id}")
    held = await _held_removal(stack, doc_id, collection)
    try:
        async def listed_as_removing() -> bool:
            documents = (await stack.http.get("/v1/documents", params={"collection": collection})).json()["documents"]
            return {d["document_id"]: d["status"] for d in documents}.get(doc_id) == "removing"
        await eventually(listed_as_removing, what="the document listed as removing")
        r = await stack.http.post("/v1/documents", files=[("files", ("teapot.txt", TEAPOT))],
                                  data={"collection": collection})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "document_being_removed"), r.text
        assert held.id in r.json()["error"]["message"]

        waiting = asyncio.Event()
        env = ActivityEnvironment()
        env.on_heartbeat = lambda *details: waiting.set()
        asked = asyncio.create_task(env.run(JobActivities(stack.client).await_document, AwaitDocumentInput(
            workflow_id=doc_job, removal_id=held.id)))
        await asyncio.wait_for(waiting.wait(), 30)  # it waits for the removal
        assert not asked.done()
    finally:
        await held.terminate(reason="test: the removal never ran")
    assert (await asyncio.wait_for(asked, 30)).status == "indexed"  # nothing was removed
    again = await stack.upload(("teapot.txt", TEAPOT), collection=collection)
    assert again["duplicate"] is True


async def test_a_second_delete_while_the_removal_runs_answers_with_that_removal(stack):
    """Past its last step but one a removal has taken the ingestion job out of Temporal, so the document is
    known only by the removal running: a DELETE sent then, naming another collection, joins that removal
    and answers with the collection and name it removes, not the ones the request made up."""
    collection = f"removal-{uuid.uuid4().hex[:8]}"
    data = TEAPOT + uuid.uuid4().hex.encode()
    body = await stack.upload(("teapot.txt", data), collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    doc_id = body["documents"][0]["document_id"]
    ingestion = stack.client.get_workflow_handle(stack.workflow_id(f"doc-{doc_id}"))
    held = await _held_removal(stack, doc_id, collection)
    try:
        # As the removal's forget step does; the server deletes in the background.
        await stack.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
            namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=ingestion.id)))

        async def forgotten() -> bool:
            try:
                await ingestion.describe()
            except RPCError as exc:
                return exc.status == RPCStatusCode.NOT_FOUND
            return False
        await eventually(forgotten, what="the ingestion job deleted")
        r = await stack.http.delete(f"/v1/documents/{doc_id}", params={"collection": "somewhere-else"})
        assert r.status_code == 202, r.text
        assert (r.json()["job_id"], r.json()["duplicate"]) == (held.id, True), r.text
        assert (r.json()["collection"], r.json()["filename"]) == (collection, "teapot.txt"), r.text
    finally:
        await held.terminate(reason="test: the removal never ran")


async def test_an_upload_that_reaches_the_document_after_its_removal_was_confirmed_keeps_its_chunks(stack):
    """The document's run failed (no password), a removal of it is confirmed, and an upload queued before the
    DELETE (for its tenant's slot) then starts a new run that indexes the document. The removal's next step
    runs late: it takes what was there when it was confirmed, not the new run's chunks, which would leave
    the document listed as indexed with chunks missing."""
    from activities.ingest import IngestActivities
    from models.ingest import RemoveInput
    from ragline.blobstore import BlobStore
    from tests.conftest import shared_pdf

    collection = f"removal-{uuid.uuid4().hex[:8]}"
    data = shared_pdf("crazyones-encrypted-256.pdf").read_bytes()
    failed = await stack.upload(("enc.pdf", data), collection=collection)
    assert (await stack.wait_done(failed["job_id"]))["status"] == "failed"
    doc_id = failed["documents"][0]["document_id"]
    doc_job = stack.workflow_id(f"doc-{doc_id}")
    first_run = await stack.client.get_workflow_handle(doc_job).describe()
    ingestion = ForgetDocumentInput(workflow_id=doc_job, run_id=first_run.run_id,
                                    run_started_at=first_run.start_time)
    confirmed = await ActivityEnvironment().run(JobActivities(stack.client).confirm_removal, ingestion)
    assert confirmed.at is not None

    again = await stack.upload(("enc.pdf", data), collection=collection, password="password")
    assert (await stack.wait_done(again["job_id"]))["status"] == "completed"
    indexed = stack.index.count(stack.tenant, collection, doc_id, searchable=True)
    assert indexed >= 1

    activities = IngestActivities(stack.settings, BlobStore(stack.settings.blob_dir), None, stack.index)
    removed = ActivityEnvironment().run(activities.remove_document_chunks, RemoveInput(
        tenant=stack.tenant, document_id=doc_id, collection=collection, written_before=confirmed.at))
    assert removed.removed == 0
    await ActivityEnvironment().run(JobActivities(stack.client).forget_document, ingestion)
    assert stack.index.count(stack.tenant, collection, doc_id, searchable=True) == indexed

    async def listed_as_indexed() -> list[dict] | None:  # visibility shows the new run's end a moment after it
        documents = (await stack.http.get("/v1/documents", params={"collection": collection})).json()["documents"]
        return documents if [d["status"] for d in documents] == ["indexed"] else None
    [listed] = await eventually(listed_as_indexed, what="the document listed as indexed")
    assert (listed["status"], listed["chunks"]) == ("indexed", indexed), listed


async def test_an_upload_sent_again_after_its_document_was_removed_and_failed_elsewhere_indexes_it_again(stack):
    """Upload U1 indexed A; A was removed; another upload then tried A and failed (no password). U1 sent
    again is not answered with its old result (A "indexed", found by nothing): it indexes A anew."""
    from tests.conftest import shared_pdf

    collection = f"removal-{uuid.uuid4().hex[:8]}"
    data = shared_pdf("crazyones-encrypted-256.pdf").read_bytes()
    first = await stack.upload(("enc.pdf", data), collection=collection, password="password")
    assert (await stack.wait_done(first["job_id"]))["status"] == "completed"
    doc_id = first["documents"][0]["document_id"]
    r = await stack.http.delete(f"/v1/documents/{doc_id}")
    assert (await stack.wait_done(r.json()["job_id"]))["status"] == "completed"
    other = await stack.upload(("enc.pdf", data), ("kettle.txt", KETTLE), collection=collection)
    assert other["job_id"] != first["job_id"]
    await stack.wait_done(other["job_id"])
    assert stack.index.count(stack.tenant, collection, doc_id, searchable=True) == 0

    again = await stack.upload(("enc.pdf", data), collection=collection, password="password")
    assert (again["job_id"], again["duplicate"]) == (first["job_id"], False), again
    assert (await stack.wait_done(again["job_id"]))["status"] == "completed"
    assert stack.index.count(stack.tenant, collection, doc_id, searchable=True) >= 1
