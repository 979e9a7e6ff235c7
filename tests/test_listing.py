"""Listings page through Temporal visibility with an opaque cursor: every item once, none of another
tenant's, on any API process of the deployment, and a cursor that is not this listing's (other filters,
another tenant, made up, forged) is refused before Temporal is asked."""

from __future__ import annotations

import base64
import hashlib
import os
import uuid

import httpx
from temporalio.service import RPCError, RPCStatusCode

from api import job_views
from api.app import create_app
from temporal import search_attributes as sa
from tests.conftest import serving_api
from tests.helpers import eventually, session_turns


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

    async def indexed() -> list[list[dict]] | None:
        pages = await _pages(stack.http, "/v1/documents", {"collection": collection, "limit": 2})
        # Visibility shows each document's job, and its end, a moment after they happen: until then a page
        # may miss one, or an ending one may move between pages while the test reads them.
        shown = [d["status"] for page in pages for d in page]
        return pages if len(shown) >= len(files) and set(shown) == {"indexed"} else None

    pages = await eventually(indexed, what="every document listed as indexed")
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
    # A real cursor with its page token altered is not this listing's any more.
    raw = _unbase64(cursor)
    tampered = base64.urlsafe_b64encode(raw[:-1] + bytes([raw[-1] ^ 1])).decode().rstrip("=")
    r = await stack.http.get("/v1/documents", params={"collection": collection, "limit": 2, "cursor": tampered})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_cursor"), r.text

    # Behind a load balancer the next page may be asked of another API process of the deployment: it
    # shares the payload keys the cursor's signature derives from, so it takes the cursor.
    second_page = (await stack.http.get("/v1/documents", params={"collection": collection, "limit": 2,
                                                                "cursor": cursor})).json()
    async with serving_api(create_app(stack.settings)) as url, \
            httpx.AsyncClient(base_url=url, headers=stack.http.headers) as other_process:
        r = await other_process.get("/v1/documents", params={"collection": collection, "limit": 2, "cursor": cursor})
        assert r.status_code == 200, r.text
        assert [d["document_id"] for d in r.json()["documents"]] == \
            [d["document_id"] for d in second_page["documents"]]

    # Jobs too: this tenant's document jobs (of every test so far), a few at a time. (A document ingested
    # again under its id, after it failed, has a run of its own, and a page shows each run.)
    jobs = [j["job_id"] for page in await _pages(stack.http, "/v1/jobs", {"kind": "ingest_document", "limit": 7})
            for j in page]
    assert {d["job_id"] for page in pages for d in page} <= set(jobs)
    assert all(j.startswith(f"{stack.tenant}.") for j in jobs)


async def test_the_last_page_has_no_cursor_even_when_it_is_full(stack):
    """A listing that ends exactly at a page's end says so (next_cursor null), not with a cursor to an
    empty page."""
    collection = f"full-{uuid.uuid4().hex[:6]}"
    body = await stack.upload(*[(f"buoy-{i}.txt", f"Buoy {i} marks the channel.".encode()) for i in range(2)],
                              collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"

    async def listed(limit: int, cursor: str | None = None) -> dict | None:
        r = await stack.http.get("/v1/documents", params={"collection": collection, "limit": limit,
                                                          **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        return r.json()

    async def both_listed() -> dict | None:
        page = await listed(2)
        return page if len(page["documents"]) == 2 else None

    whole = await eventually(both_listed, what="both documents listed")
    assert whole["next_cursor"] is None, whole
    first = await listed(1)
    assert len(first["documents"]) == 1 and first["next_cursor"], first
    last = await listed(1, first["next_cursor"])
    assert len(last["documents"]) == 1 and last["next_cursor"] is None, last
    assert {d["document_id"] for d in first["documents"] + last["documents"]} == \
        {d["document_id"] for d in whole["documents"]}


async def test_a_page_read_is_answered_with_a_cursor_when_the_look_past_it_fails(stack, monkeypatch):
    """After a full page the API asks Temporal whether anything follows (to leave a last page's cursor out).
    When only that look failed, the page already read was lost to a 503; now it is answered, with a cursor."""
    collection = f"peek-{uuid.uuid4().hex[:6]}"
    body = await stack.upload(*[(f"reef-{i}.txt", f"Reef {i} lies off the point.".encode()) for i in range(2)],
                              collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    params = {"collection": collection, "limit": 2}

    async def both_listed() -> dict | None:
        r = await stack.http.get("/v1/documents", params=params)
        return r.json() if r.status_code == 200 and len(r.json()["documents"]) == 2 else None

    whole = await eventually(both_listed, what="both documents listed")
    assert whole["next_cursor"] is None, whole
    client, list_workflows = stack.app.state.client, stack.app.state.client.list_workflows

    class Unavailable:
        async def fetch_next_page(self) -> None:
            raise RPCError("Temporal went away", RPCStatusCode.UNAVAILABLE, b"")

    def failing_peek(query: str, *, page_size: int, next_page_token: bytes | None = None,
                     **kwargs):  # noqa: ANN003, ANN202
        if next_page_token and page_size == 1:  # the look past the page (a page of this listing asks for 2)
            return Unavailable()
        return list_workflows(query, page_size=page_size, next_page_token=next_page_token, **kwargs)

    monkeypatch.setattr(client, "list_workflows", failing_peek)
    r = await stack.http.get("/v1/documents", params=params)
    assert r.status_code == 200, r.text
    assert [d["document_id"] for d in r.json()["documents"]] == [d["document_id"] for d in whole["documents"]]
    assert r.json()["next_cursor"], r.json()
    monkeypatch.undo()
    after = await stack.http.get("/v1/documents", params={**params, "cursor": r.json()["next_cursor"]})
    assert after.status_code == 200 and after.json()["documents"] == [], after.text
    assert after.json()["next_cursor"] is None, after.json()

def _unbase64(cursor: str) -> bytes:
    return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))


def _forged(query: str) -> str:
    """A cursor as anyone could build one: the query (GET /v1/jobs shows it; the tenant clause is easy to
    guess) hashed into the tag the cursor once had, then bytes of their choosing as Temporal's page token."""
    return base64.urlsafe_b64encode(hashlib.sha256(query.encode()).digest()[:8] + os.urandom(48)).decode().rstrip("=")


async def test_a_forged_cursor_is_refused_at_once_and_never_reaches_temporal(stack, monkeypatch):
    """Temporal fails slowly on a page token it did not make (errors the client retries until its RPC
    timeout): a cursor the API did not sign is refused with 422 before any listing is asked of it."""
    jobs_query = (await stack.http.get("/v1/jobs", params={"kind": "ingest", "limit": 1})).json()["query"]
    documents_query = job_views.list_query(stack.tenant, kind="ingest_document", extra={sa.COLLECTION.name: "default"})
    asked: list[str] = []

    def list_workflows(query: str, **kwargs):  # noqa: ANN003, ANN202 - stands in for the API's Temporal client
        asked.append(query)
        raise AssertionError("a forged cursor reached Temporal")

    monkeypatch.setattr(stack.app.state.client, "list_workflows", list_workflows)
    for path, params, query in (("/v1/jobs", {"kind": "ingest"}, jobs_query),
                                ("/v1/documents", {"collection": "default"}, documents_query)):
        r = await stack.http.get(path, params={**params, "limit": 1, "cursor": _forged(query)})
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_cursor"), r.text
    assert asked == []


async def test_a_sessions_turns_are_read_a_few_at_a_time_and_shown_in_order(stack, monkeypatch):
    """GET /v1/chats/{id} reads each turn (its result, or a worker's answer): a long session must not send
    Temporal one request per turn in the same instant."""
    from api.routes import chats

    session = f"reads-{uuid.uuid4().hex[:6]}"
    jobs = [(await stack.chat(f"Question {n}?", session_id=session, collection=f"empty-{session}"))["job_id"]
            for n in range(5)]
    for job_id in jobs:
        assert (await stack.wait_done(job_id))["status"] == "completed"
    monkeypatch.setattr(job_views, "READS_AT_ONCE", 2)
    in_flight, peak = 0, 0
    read_turn = chats._turn_view

    async def counted(*args):  # noqa: ANN002, ANN202
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await read_turn(*args)
        finally:
            in_flight -= 1
    monkeypatch.setattr(chats, "_turn_view", counted)
    turns = await session_turns(stack.http, session, *jobs)
    assert [(t["turn"], t["job_id"]) for t in turns] == list(enumerate(jobs, start=1))
    assert peak == 2
    # Page by page, the latest turns first: each page in turn order, every turn once, no cursor after the last.
    pages, cursor = [], None
    while True:
        r = await stack.http.get(f"/v1/chats/{session}", params={"limit": 2, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        page, cursor = [t["turn"] for t in r.json()["turns"]], r.json()["next_cursor"]
        assert page == sorted(page) and len(page) <= 2
        pages.append(page)
        if cursor is None:
            break
    assert pages == [[4, 5], [2, 3], [1]]


async def test_a_review_list_cut_short_says_so(stack, monkeypatch):
    """GET /v1/reviews reads each waiting job once, so it lists a bounded number; when more wait, it says so."""
    from api.routes import agents

    collection = f"reviews-{uuid.uuid4().hex[:6]}"
    jobs = [(await stack.http.post("/v1/chats", json={"message": f"Question {n}?", "collection": collection,
                                                       "require_review": True})).json()["job_id"] for n in range(2)]
    try:
        async def both_listed() -> bool:
            body = (await stack.http.get("/v1/reviews")).json()
            return set(jobs) <= {r["job_id"] for r in body["reviews"]} and not body["more"]
        assert await eventually(both_listed, what="both turns waiting for review")
        monkeypatch.setattr(agents, "REVIEWS_LISTED", 1)
        body = (await stack.http.get("/v1/reviews")).json()
        assert len(body["reviews"]) <= 1 and body["more"] is True, body
    finally:
        for job_id in jobs:
            await stack.http.post(f"/v1/jobs/{job_id}/cancel")
