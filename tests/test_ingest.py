"""Ingestion through the real API, a real Temporal dev server, real Qdrant and the real embedder."""

from __future__ import annotations

import asyncio
import hashlib
import html
import re
import threading
import time
import uuid

import httpx
import pytest


from api.app import create_app
from ragline.blobstore import BlobStore
from ragline.settings import Settings
from tests.conftest import shared_pdf
from tests.helpers import eventually
from api.validators import display_name
from tests.pdfgen import pdf_bytes


def test_display_names_strip_paths_and_control_characters():
    assert display_name("C:\\Users\\me\\report.pdf") == "report.pdf"
    assert display_name("evil\x00na\x1bme.pdf") == "evilname.pdf"
    assert display_name("../..") == ".."
    assert display_name("") == "unnamed"
    assert len(display_name("x" * 1000)) == 255


def _outcomes(job: dict) -> dict[str, dict]:
    documents = job["result"]["documents"] if job["result"] else job["error"]["details"]["documents"]
    return {d["filename"]: d for d in documents}


async def test_one_page_pdf_is_indexed_and_searchable(stack):
    body = await stack.upload(("crazyones.pdf", shared_pdf("crazyones.pdf").read_bytes()), collection="ingest-one")
    assert set(body) >= {"job_id", "status_url", "events_url", "documents"}
    # Absolute URLs a client follows as they are.
    assert body["status_url"] == f"{stack.base_url}/v1/jobs/{body['job_id']}"
    assert body["events_url"] == f"{stack.base_url}/v1/jobs/{body['job_id']}/events"
    assert (await stack.http.get(body["status_url"])).status_code == 200
    [doc] = body["documents"]
    assert doc["filename"] == "crazyones.pdf" and len(doc["sha256"]) == 64

    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed", job
    assert job["kind"] == "ingest"
    outcome = _outcomes(job)["crazyones.pdf"]
    assert outcome["status"] == "indexed" and outcome["chunks"] >= 1 and outcome["pages"] == 1

    hits = await stack.search("here's to the crazy ones, the misfits, the rebels", collection="ingest-one")
    assert hits and hits[0]["document_id"] == doc["document_id"]
    assert "crazy" in hits[0]["text"].lower()
    assert hits[0]["filename"] == "crazyones.pdf" and hits[0]["page"] == 1
    assert stack.index.count(stack.tenant, "ingest-one", doc["document_id"]) == outcome["chunks"]


async def test_multi_page_pdf_keeps_page_numbers(stack):
    body = await stack.upload(("geobase.pdf", shared_pdf("GeoBase_NHNC1_Data_Model_UML_EN.pdf").read_bytes()),
                              collection="ingest-multi")
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed", job
    outcome = _outcomes(job)["geobase.pdf"]
    assert outcome["pages"] == 19 and outcome["chunks"] > 10

    hits = await stack.search("UML data model", collection="ingest-multi", top_k=10)
    assert len(hits) == 10
    pages = {h["page"] for h in hits}
    assert pages - {1}, f"every hit claims page 1: {pages}"
    assert all(1 <= p <= 19 for p in pages)

    # The document's own job shows each step of the DAG with its attempts.
    doc_job = (await stack.http.get(f"/v1/jobs/{outcome['job_id']}")).json()
    assert doc_job["kind"] == "ingest_document" and doc_job["status"] == "completed"
    steps = {s["name"]: s for s in doc_job["steps"]}
    assert list(steps) == ["extract_text", "chunk_text", "embed_chunks", "index_chunks", "prune_stale_chunks"]
    for step in steps.values():
        assert step["status"] == "completed" and step["attempts"] == 1
        assert step["started_at"] <= step["finished_at"]
    assert steps["embed_chunks"]["detail"].endswith("batches")


async def test_batch_with_one_bad_file_indexes_the_others(stack):
    body = await stack.upload(
        ("example.pdf", shared_pdf("example.pdf").read_bytes()),
        ("locked.pdf", shared_pdf("encrypted-file.pdf").read_bytes()),
        ("notes.md", "# Notes\n\nThe zebra migration crosses the Mara river every July.\n".encode()),
        collection="ingest-batch")
    assert len(body["documents"]) == 3
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed", job
    outcomes = _outcomes(job)
    assert outcomes["example.pdf"]["status"] == "indexed"
    assert outcomes["notes.md"]["status"] == "indexed"
    assert outcomes["locked.pdf"]["status"] == "failed"
    assert outcomes["locked.pdf"]["error"] == "encrypted: password required"
    assert job["result"]["indexed"] == 2 and job["result"]["failed"] == 1
    steps = {s["name"]: s for s in job["steps"]}
    assert steps["document:locked.pdf"]["status"] == "failed"
    assert steps["document:notes.md"]["status"] == "completed"

    hits = await stack.search("when does the zebra migration cross the river?", collection="ingest-batch")
    assert hits[0]["filename"] == "notes.md"


async def test_same_bytes_same_collection_is_not_ingested_twice(stack):
    data = shared_pdf("pdflatex-outline.pdf").read_bytes()
    first = await stack.upload(("outline.pdf", data), collection="ingest-idem")
    await stack.wait_job(first["job_id"])
    again = await stack.upload(("renamed.pdf", data), collection="ingest-idem")
    assert again["job_id"] == first["job_id"] and again["duplicate"] is True
    assert again["documents"][0]["document_id"] == first["documents"][0]["document_id"]
    # Sent under another name: the response says which name the document stays under.
    assert (again["documents"][0]["filename"], again["documents"][0]["indexed_as"]) == ("renamed.pdf", "outline.pdf")
    same_name = await stack.upload(("outline.pdf", data), collection="ingest-idem")
    assert same_name["duplicate"] is True and same_name["documents"][0]["indexed_as"] is None
    # Concurrent duplicates while nothing exists yet still make one job.
    fresh = shared_pdf("toy.pdf").read_bytes()
    bodies = await asyncio.gather(*(stack.upload(("toy.pdf", fresh), collection="ingest-idem") for _ in range(5)))
    assert len({b["job_id"] for b in bodies}) == 1
    await stack.wait_job(bodies[0]["job_id"])

    for job_id in (first["job_id"], first["documents"][0] and stack.workflow_id(f"doc-{first['documents'][0]['document_id']}"),
                   bodies[0]["job_id"]):
        runs = await _runs(stack, job_id)
        assert len(runs) == 1, f"{job_id} ran {len(runs)} times"
    # The same bytes under two names in one request: one document, and the response says which file
    # it stands for as well (a person counting what was accepted is not left to wonder).
    twins = await stack.upload(("hello-world.pdf", fresh + b"\n"), ("multilang.pdf", fresh + b"\n"),
                               collection="ingest-idem")
    assert [(d["filename"], d["same_content"]) for d in twins["documents"]] == [("hello-world.pdf", ["multilang.pdf"])]
    await stack.wait_job(twins["job_id"])
    # Another collection is another document.
    other = await stack.upload(("outline.pdf", data), collection="ingest-idem2")
    assert other["documents"][0]["document_id"] != first["documents"][0]["document_id"]
    await stack.wait_job(other["job_id"])


async def test_a_document_shared_by_two_jobs_is_ingested_once(stack):
    a, b = shared_pdf("commented.pdf").read_bytes(), shared_pdf("attachment.pdf").read_bytes()
    first = await stack.upload(("a.pdf", a), collection="ingest-shared")
    second = await stack.upload(("a.pdf", a), ("b.pdf", b), collection="ingest-shared")
    assert first["job_id"] != second["job_id"]
    job = await stack.wait_job(second["job_id"])
    assert job["status"] == "completed"
    assert {o["status"] for o in _outcomes(job).values()} == {"indexed"}
    doc_id = first["documents"][0]["document_id"]
    runs = await _runs(stack, stack.workflow_id(f"doc-{doc_id}"))
    assert len(runs) == 1


async def _runs(stack, workflow_id: str) -> list:
    """The runs of the workflow that visibility lists, once it lists one: a run is listed a moment after its start."""
    async def listed() -> list:
        return [w async for w in stack.client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    return await eventually(listed, what=f"{workflow_id} listed")


async def test_encrypted_pdf_needs_the_right_password(stack):
    data = shared_pdf("crazyones-encrypted-256.pdf").read_bytes()
    no_pw = await stack.wait_job((await stack.upload(("enc.pdf", data), collection="ingest-enc"))["job_id"])
    assert no_pw["status"] == "failed"
    assert "encrypted: password required" in no_pw["error"]["message"]

    # The right password sent at once after a wrong one: another upload, not a duplicate of the first
    # (which may still wait to run), and the document is indexed with it.
    wrong = await stack.upload(("enc.pdf", data), collection="ingest-enc", password="nope")
    right = await stack.upload(("enc.pdf", data), collection="ingest-enc", password="password")
    assert right["job_id"] != wrong["job_id"] and not right["duplicate"]
    wrong = await stack.wait_job(wrong["job_id"])
    # Which upload starts the document's run is a race: the wrong password's run fails (and the right one's
    # upload then runs it with its own), or the right one's runs first, and both uploads have the document.
    assert (wrong["status"] == "failed" and "encrypted: wrong password" in wrong["error"]["message"]) or \
        (wrong["status"] == "completed" and _outcomes(wrong)["enc.pdf"]["status"] == "indexed"), wrong
    job = await stack.wait_job(right["job_id"])
    assert job["status"] == "completed", job
    assert _outcomes(job)["enc.pdf"]["chunks"] >= 1
    again = await stack.upload(("enc.pdf", data), collection="ingest-enc", password="password")
    assert (again["job_id"], again["duplicate"]) == (right["job_id"], True)
    # The document's job ran again under its id: a listing of failed jobs does not name it (its failed run is
    # superseded), the completed ones do.
    doc_job = _outcomes(job)["enc.pdf"]["job_id"]

    async def listed_as(status: str) -> bool:
        r = await stack.http.get("/v1/jobs", params={"status": status, "kind": "ingest_document", "limit": 1000})
        return doc_job in {j["job_id"] for j in r.json()["jobs"]}
    await eventually(lambda: listed_as("completed"), what="the document's completed run listed")
    assert not await listed_as("failed")


async def test_unprocessable_documents_fail_with_a_reason_and_no_retries(stack):
    truncated = shared_pdf("GeoBase_NHNC1_Data_Model_UML_EN.pdf").read_bytes()[:20_000]
    too_long = pdf_bytes([f"Page {i}." for i in range(1, stack.settings.max_pages + 2)])
    cases = {
        "scan.pdf": (shared_pdf("git.pdf").read_bytes(), "no extractable text"),
        "truncated.pdf": (truncated, "corrupt PDF"),
        "long.pdf": (too_long, f"too many pages: {stack.settings.max_pages + 1} > {stack.settings.max_pages}"),
    }
    for name, (data, reason) in cases.items():
        body = await stack.upload((name, data), collection="ingest-bad")
        job = await stack.wait_job(body["job_id"])
        assert job["status"] == "failed", (name, job)
        assert reason in job["error"]["message"], (name, job["error"])
        # Each document's outcome is in the result, as a completed upload's are.
        [outcome] = job["result"]["documents"]
        assert (outcome["filename"], outcome["status"], job["result"]["failed"]) == (name, "failed", 1), job
        assert reason in outcome["error"], outcome
        doc_job = (await stack.http.get(f"/v1/jobs/doc-{body['documents'][0]['document_id']}")).json()
        extract = next(s for s in doc_job["steps"] if s["name"] == "extract_text")
        assert extract["status"] == "failed" and reason in extract["error"]
        assert extract["attempts"] == 1, "bad input must not burn retries"
        later = [s["status"] for s in doc_job["steps"] if s["name"] != "extract_text"]
        assert set(later) == {"skipped"}


async def test_bad_uploads_are_refused_up_front(stack):
    async def post(files, **data):
        return await stack.http.post("/v1/documents", files=files, data=data)

    empty = await post([("files", ("empty.pdf", b""))])
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "empty_file"

    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    fake = await post([("files", ("photo.pdf", png))])
    assert fake.status_code == 415 and fake.json()["error"]["code"] == "unsupported_file_type"

    # Text named .pdf is not what its sender meant to index (the shared PDFs' README: a clear error).
    renamed = await post([("files", ("report.pdf", b"plain text about arctic terns\n" * 3))])
    assert renamed.status_code == 415 and "named .pdf" in renamed.json()["error"]["message"], renamed.text
    # A file given as a text value, not a file part: said in words a curl user can act on.
    as_text = await stack.http.post("/v1/documents", data={"files": "hello"})
    assert as_text.status_code == 422 and "must be a file part" in as_text.json()["error"]["message"], as_text.text

    bad_collection = await post([("files", ("a.txt", b"hello world"))], collection="../etc")
    assert bad_collection.status_code == 422 and bad_collection.json()["error"]["code"] == "invalid_collection"
    long_collection = await post([("files", ("a.txt", b"hello world"))], collection="x" * 65)
    assert long_collection.status_code == 422

    # Too many files, whoever counts them first: our cap (50), or the form parser's own (1,000).
    for n in (51, 1001):
        many = await post([("files", (f"{i}.txt", b"a note")) for i in range(n)])
        assert (many.status_code, many.json()["error"]["code"]) == (413, "too_many_files"), (n, many.text)

    missing = await stack.http.post("/v1/documents", data={"collection": "x"})
    assert missing.status_code == 422 and "files" in missing.json()["error"]["message"]

    # A misspelt field, or one sent twice, is refused: the files went to `default`, or to the last one named.
    misspelt = await post([("files", ("a.txt", b"hello world"))], colection="reports")
    assert misspelt.status_code == 422 and "colection" in misspelt.json()["error"]["message"], misspelt.text
    twice = await post([("files", ("a.txt", b"hello world"))], collection=["alpha", "beta"])
    assert twice.status_code == 422 and "collection given more than once" in twice.json()["error"]["message"]

    # A valid file next to a bad one: the whole request is refused, nothing starts, and nothing of it is
    # kept (refused requests would otherwise fill the disk every tenant shares).
    collection = f"mixed-{uuid.uuid4().hex[:8]}"
    fine = f"fine text here {uuid.uuid4().hex}".encode()
    mixed = await post([("files", ("ok.txt", fine)), ("files", ("empty.txt", b""))], collection=collection)
    assert mixed.status_code == 400 and mixed.json()["error"]["code"] == "empty_file"
    assert not BlobStore(stack.settings.blob_dir).exists("sha256:" + hashlib.sha256(fine).hexdigest())
    docs = (await stack.http.get("/v1/documents", params={"collection": collection})).json()["documents"]
    assert docs == []
    jobs = (await stack.http.get("/v1/jobs", params={"kind": "ingest", "limit": 1000})).json()["jobs"]
    assert [j for j in jobs if j["collection"] == collection] == []


async def test_upload_limit_and_filenames_are_not_paths(stack, tmp_path):
    limit = int(stack.settings.max_upload_mb * 1024 * 1024)
    too_big = b"%PDF-1.4\n" + b"0" * limit
    r = await stack.http.post("/v1/documents", files=[("files", ("big.pdf", too_big))])
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"

    body = await stack.upload(("../../../../etc/passwd.txt", b"Filenames are labels, never paths."),
                              collection="ingest-names")
    assert body["documents"][0]["filename"] == "passwd.txt"
    assert not (stack.settings.data_dir / "etc").exists()
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed"


async def test_long_document_history_keeps_payloads_small(stack):
    """Pages, chunks and vectors travel by reference: 500 pages' 18 KB of text and 29 chunks' vectors
    (each 384 numbers) would each outgrow the bound, were they in the history. Short pages keep the
    embedding quick (62 KB of pages, 100 chunks, took twice as long)."""
    pages = [f"Page {i}: harbour {i} logs its ships." for i in range(1, 501)]
    body = await stack.upload(("book.pdf", pdf_bytes(pages)), collection="ingest-long")
    job = await stack.wait_job(body["job_id"], timeout=300)
    assert job["status"] == "completed", job
    outcome = _outcomes(job)["book.pdf"]
    assert outcome["pages"] == 500

    for workflow_id in (body["job_id"], outcome["job_id"]):
        history = await stack.client.get_workflow_handle(workflow_id).fetch_history()
        biggest = max(event.ByteSize() for event in history.events)
        assert biggest < 8 * 1024, f"{workflow_id}: an event of {biggest} bytes"  # 1.5 KiB when measured

    hits = await stack.search("harbour 321 ships", collection="ingest-long", top_k=3)
    assert any("321" in h["text"] for h in hits)
    assert all(h["page"] >= 1 for h in hits)


async def test_jobs_and_documents_are_listed_from_temporal_visibility(stack):
    body = await stack.upload(("hello.pdf", shared_pdf("hello-world.pdf").read_bytes()), collection="ingest-listing")
    await stack.wait_job(body["job_id"])
    failed = await stack.upload(("scan.pdf", shared_pdf("git.pdf").read_bytes()), collection="ingest-listing")
    await stack.wait_job(failed["job_id"])

    async def listed(**params) -> list[dict]:
        for _ in range(50):  # visibility is eventually consistent (milliseconds on the dev server)
            r = await stack.http.get("/v1/jobs", params=params)
            assert r.status_code == 200
            jobs = r.json()["jobs"]
            if any(j["job_id"] in (body["job_id"], failed["job_id"]) for j in jobs):
                return jobs
            await asyncio.sleep(0.1)
        return jobs

    completed = await listed(status="completed", kind="ingest", limit=500)
    assert body["job_id"] in {j["job_id"] for j in completed}
    assert {j["status"] for j in completed} == {"completed"}
    failed_jobs = await listed(status="failed", limit=500)
    assert failed["job_id"] in {j["job_id"] for j in failed_jobs}
    assert body["job_id"] not in {j["job_id"] for j in failed_jobs}
    assert len((await stack.http.get("/v1/jobs", params={"limit": 1})).json()["jobs"]) == 1
    assert (await stack.http.get("/v1/jobs", params={"status": "bogus"})).status_code == 422

    async def documents_ended() -> list[dict] | None:  # visibility shows a job's end a moment after it
        documents = (await stack.http.get("/v1/documents", params={"collection": "ingest-listing"})).json()["documents"]
        shown = {d["filename"]: d["status"] for d in documents}
        ended = [shown.get(name) not in (None, "queued", "running") for name in ("hello.pdf", "scan.pdf")]
        return documents if all(ended) else None

    documents = await eventually(documents_ended, what="both documents listed as ended")
    by_name = {d["filename"]: d for d in documents}
    assert by_name["hello.pdf"]["status"] == "indexed" and by_name["hello.pdf"]["chunks"] >= 1
    assert by_name["scan.pdf"]["status"] == "failed"
    assert by_name["scan.pdf"]["error"].startswith("no extractable text")  # why, without opening the job
    assert by_name["hello.pdf"]["error"] is None
    assert all(d["collection"] == "ingest-listing" for d in documents)


async def test_job_contract_and_unknown_ids(stack):
    body = await stack.upload(("toy.txt", b"A tiny text file about teapots and their spouts."),
                              collection="ingest-contract")
    job = await stack.wait_job(body["job_id"])
    assert set(job) >= {"job_id", "kind", "status", "created_at", "updated_at", "steps", "result", "error"}
    for step in job["steps"]:
        assert set(step) >= {"name", "status", "attempts", "started_at", "finished_at", "error"}
    assert job["created_at"] <= job["updated_at"]

    missing = await stack.http.get("/v1/jobs/no-such-job")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"
    assert (await stack.http.get("/v1/jobs/no-such-job/events")).status_code == 404
    assert (await stack.http.get("/docs")).status_code == 200
    paths = (await stack.http.get("/openapi.json")).json()["paths"]
    assert {"/v1/documents", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/search", "/healthz"} <= set(paths)

    health = await stack.http.get("/healthz")
    assert health.status_code == 200
    assert health.json()["components"]["temporal"]["status"] == "up"
    assert health.json()["components"]["worker"]["status"] == "up"

async def test_the_api_docs_page_says_where_the_api_is_described_when_swagger_ui_cannot_load(stack):
    """/docs draws Swagger UI from a CDN, which an offline machine (this one; README: "after the first install
    it works offline") cannot reach: the page stayed blank. Now a script that fails to load says so, and
    points at /openapi.json, which the API serves itself."""
    page = await stack.http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    [bundle] = re.findall(r'<script src="([^"]+swagger-ui-bundle\.js)"([^>]*)>', html)
    assert bundle[0].startswith("https://"), bundle  # not served by Ragline: it needs the internet
    assert "onerror=" in bundle[1] and "/openapi.json" in html.split(bundle[0], 1)[1], html
    # What the message points at is there without the internet.
    assert (await stack.http.get("/openapi.json")).status_code == 200


async def test_the_api_docs_page_behind_a_proxy_prefix_points_at_the_prefixed_schema(tmp_path):
    """Served under a prefix (uvicorn --root-path /ragline behind a proxy), /docs loaded /openapi.json, outside
    the prefix, and its offline message pointed there: Swagger UI showed a fetch error. Both now carry it."""
    app = create_app(Settings(data_dir=tmp_path))
    transport = httpx.ASGITransport(app=app, root_path="/ragline")
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        page = await http.get("/ragline/docs")
        assert page.status_code == 200, page.text
        assert "url: '/ragline/openapi.json'" in page.text, page.text
        onerror = html.unescape(re.search(r'<script src="[^"]+" onerror="([^"]*)"', page.text)[1])
        assert '<a href=\\"/ragline/openapi.json\\">/ragline/openapi.json</a>' in onerror, onerror
        assert (await http.get("/ragline/openapi.json")).status_code == 200



async def test_search_an_empty_or_unknown_collection(stack):
    assert await stack.search("anything", collection="ingest-never-used") == []
    r = await stack.http.post("/v1/search", json={"query": "", "collection": "default"})
    assert r.status_code == 422


def test_an_embedding_batch_queued_for_the_engine_keeps_heartbeating(tmp_path, restore_policies):
    """The one embedding engine is busy with other batches for longer than a heartbeat timeout: the
    waiting batch keeps beating, so Temporal does not take it for a dead worker, cancel it and run it
    again (on a loaded machine, four queued batches did that to each other over and over)."""
    from temporalio.testing import ActivityEnvironment

    import worker
    from activities.ingest import IngestActivities
    from models.ingest import EmbedInput
    from ragline.embeddings import LocalE5Embedder
    from ragline.settings import Settings
    from temporal import policies
    from tests.conftest import FIXTURES

    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # a beat every 500 ms
    embedder = LocalE5Embedder()
    blobs = BlobStore(tmp_path / "blobs")
    chunks = blobs.put_json([{"i": 0, "page": 1, "text": "Keepers light the lighthouses at dusk."}])
    activities = IngestActivities(Settings(data_dir=tmp_path), blobs, embedder, index=None)
    env = ActivityEnvironment()
    beats: list[tuple] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    held = threading.Event()

    def another_batch() -> None:  # being embedded, for 2 s
        with embedder._turns.take(query=False):
            held.set()
            time.sleep(2.0)

    threading.Thread(target=another_batch).start()
    assert held.wait(10)
    out = env.run(activities.embed_chunks, EmbedInput(chunks_ref=chunks, start=0, end=1))
    assert out.count == 1
    assert len(beats) >= 3, beats  # the first, then one every 500 ms while it waited (2 s: 3 or 4 more)


def test_a_batch_waiting_for_the_embedding_engine_leaves_at_once_when_its_worker_stops(tmp_path):
    """`make run` stopped during a large upload: the batches queued behind the one being embedded left one
    after another, held the worker past the supervisor's 10 s (SIGKILL), and after the restart waited a
    heartbeat timeout (1 min). A waiting batch now fails over at once, retried by the next worker."""
    import concurrent.futures

    import worker
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.ingest import IngestActivities
    from models.ingest import EmbedInput
    from ragline.blobstore import BlobStore
    from ragline.embeddings import LocalE5Embedder
    from ragline.settings import Settings
    from temporal import policies
    from tests.conftest import FIXTURES

    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())
    embedder = LocalE5Embedder()
    blobs = BlobStore(tmp_path / "blobs")
    chunks = blobs.put_json([{"i": 0, "page": 1, "text": "Keepers light the lighthouses at dusk."}])
    activities = IngestActivities(Settings(data_dir=tmp_path), blobs, embedder, index=None)
    env = ActivityEnvironment()
    held, release = threading.Event(), threading.Event()

    def another_batch() -> None:  # being embedded until the test says
        with embedder._turns.take(query=False):
            held.set()
            release.wait(30)

    threading.Thread(target=another_batch).start()
    assert held.wait(10)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(env.run, activities.embed_chunks, EmbedInput(chunks_ref=chunks, start=0, end=1))
            time.sleep(0.5)
            assert not waiting.done()
            env.worker_shutdown()
            with pytest.raises(ApplicationError) as failure:
                waiting.result(timeout=5)  # not after the batch under way
        assert failure.value.type == "TransientError" and not failure.value.non_retryable
    finally:
        release.set()


def test_the_undo_of_a_failed_run_keeps_the_chunks_an_earlier_run_published(tmp_path):
    """The same bytes uploaded again once their first ingestion job is past the retention: the document is
    still found, the new run fails (or is cancelled) midway, and its undo must not take the earlier run's
    published chunks with it."""
    from qdrant_client import QdrantClient
    from temporalio.testing import ActivityEnvironment

    from activities.ingest import IngestActivities
    from models.ingest import RemoveInput
    from ragline.blobstore import BlobStore
    from ragline.settings import Settings
    from ragline.vectorstore import ChunkPoint, VectorIndex

    index = VectorIndex(QdrantClient(":memory:"), 4, embedded=True)
    doc = "d" * 32

    def chunks(n: int) -> list[ChunkPoint]:
        return [ChunkPoint(doc, i, [1.0, 0.1 * i, 0.0, 0.0], {
            "document_id": doc, "filename": "a.txt", "collection": "c", "page": 1, "chunk": i,
            "text": f"the copper spout, part {i}"}) for i in range(n)]

    index.upsert("acme", "c", chunks(3))
    index.publish("acme", "c", doc, 3)
    index.upsert("acme", "c", chunks(5)[:1] + chunks(5)[3:])  # the new run's first batch, and two chunks more
    activities = IngestActivities(Settings(data_dir=tmp_path), BlobStore(tmp_path / "blobs"), None, index)
    out = ActivityEnvironment().run(activities.remove_document_chunks,
                                    RemoveInput(tenant="acme", document_id=doc, collection="c", pending_only=True))
    assert (out.removed, out.points) == (2, 3)
    assert index.count("acme", "c", doc, searchable=True) == 3
    # A removal asked for takes them all.
    out = ActivityEnvironment().run(activities.remove_document_chunks,
                                    RemoveInput(tenant="acme", document_id=doc, collection="c"))
    assert (out.removed, out.points) == (3, 0)


def test_a_text_too_long_for_one_documents_history_is_refused_with_the_reason(tmp_path, monkeypatch):
    """A 50 MB text file (the upload cap) makes ~63,000 chunks: its document's workflow ran past Temporal's
    51,200-event history limit after hours of embedding and was terminated, its chunks left pending. It is
    refused at chunking, not retried, saying how much a document may hold (here the cap made small)."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities import ingest
    from models.ingest import ChunkInput
    from ragline.blobstore import BlobStore
    from ragline.settings import Settings

    monkeypatch.setattr(ingest, "MAX_EMBED_BATCHES", 2)
    blobs = BlobStore(tmp_path / "blobs")
    activities = ingest.IngestActivities(Settings(data_dir=tmp_path, embed_batch_size=2), blobs, None, None)
    sentences = " ".join(f"Keeper {n} lights the lamp at dusk." for n in range(60))  # ~1,900 characters
    fits = blobs.put_json([{"page": 1, "text": sentences[:1500]}])
    assert ActivityEnvironment().run(activities.chunk_text, ChunkInput(pages_ref=fits, document_id="d")).chunks <= 4
    over = blobs.put_json([{"page": 1, "text": sentences * 3}])
    with pytest.raises(ApplicationError) as refused:
        ActivityEnvironment().run(activities.chunk_text, ChunkInput(pages_ref=over, document_id="d"))
    assert refused.value.non_retryable and refused.value.type == "InputError"
    assert "at most 4 (800-character chunks): split the file" in refused.value.message


def test_a_long_publish_heartbeats_while_the_store_works(tmp_path, restore_policies):
    """The publish of a document of tens of thousands of chunks takes minutes on the embedded store: it
    heartbeats (a worker gone is noticed within the heartbeat timeout) rather than run silent to its timeout."""
    from temporalio.testing import ActivityEnvironment

    import worker
    from activities.ingest import IngestActivities
    from models.ingest import PruneInput
    from temporal import policies
    from tests.conftest import FIXTURES

    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # a beat every 500 ms

    class SlowStore:
        def publish(self, tenant: str, collection: str, document_id: str, chunks: int) -> None:
            time.sleep(1.6)

        def count(self, tenant: str, collection: str, document_id: str) -> int:
            return 40_000

    activities = IngestActivities(Settings(data_dir=tmp_path), BlobStore(tmp_path / "blobs"), None, SlowStore())
    env = ActivityEnvironment()
    beats: list[tuple] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    out = env.run(activities.prune_stale_chunks, PruneInput(tenant="t", collection="c", document_id="d",
                                                            keep_chunks=40_000))
    assert out.points == 40_000 and len(beats) >= 2, beats
