"""Listings page through Temporal visibility with an opaque cursor: every item once, none of another
tenant's, and a cursor that is not this listing's (other filters, another tenant, made up) is refused."""

from __future__ import annotations

import uuid


async def _pages(http, path: str, params: dict) -> list[list[dict]]:  # noqa: ANN001
    pages, cursor = [], None
    while True:
        r = await http.get(path, params={**params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        pages.append(body.get("documents", body.get("jobs")))
        cursor = body["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 500, "the cursor does not advance"


async def test_documents_and_jobs_page_through_with_a_cursor(stack):
    collection = f"pages-{uuid.uuid4().hex[:6]}"
    files = [(f"note-{i}.txt", f"Note {i} about lighthouse number {i}.".encode()) for i in range(5)]
    body = await stack.upload(*files, collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"

    pages = await _pages(stack.http, "/v1/documents", {"collection": collection, "limit": 2})
    assert [len(p) for p in pages if p][:2] == [2, 2]
    listed = [d["filename"] for page in pages for d in page]
    assert sorted(listed) == sorted(name for name, _ in files), "every document once"

    first = (await stack.http.get("/v1/documents", params={"collection": collection, "limit": 2})).json()
    cursor = first["next_cursor"]
    # The cursor belongs to its listing: other filters, another tenant, or garbage are refused.
    for http, params in ((stack.http, {"collection": "default", "cursor": cursor}),
                         (stack.other_http, {"collection": collection, "cursor": cursor}),
                         (stack.http, {"collection": collection, "cursor": "bm90LWEtY3Vyc29y"})):
        r = await http.get("/v1/documents", params=params)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_cursor", r.text
    r = await stack.http.get("/v1/jobs", params={"kind": "ingest", "cursor": "not a cursor!"})
    assert r.status_code == 422

    # Jobs too: this tenant's document jobs (of every test so far), a few at a time. (A document ingested
    # again under its id, after it failed, has a run of its own, and a page shows each run.)
    jobs = [j["job_id"] for page in await _pages(stack.http, "/v1/jobs", {"kind": "ingest_document", "limit": 7})
            for j in page]
    assert {d["job_id"] for page in pages for d in page} <= set(jobs)
    assert all(j.startswith(f"{stack.tenant}.") for j in jobs)
