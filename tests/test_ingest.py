"""Ingestion through the real API, a real Temporal dev server, real Qdrant and the real embedder."""

from __future__ import annotations

import pytest

from tests.conftest import shared_pdf


async def test_one_page_pdf_is_indexed_and_searchable(stack):
    body = await stack.upload(("crazyones.pdf", shared_pdf("crazyones.pdf").read_bytes()), collection="t1")
    assert set(body) >= {"job_id", "status_url", "events_url", "documents"}
    [doc] = body["documents"]
    assert doc["filename"] == "crazyones.pdf" and len(doc["sha256"]) == 64

    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed", job
    assert job["kind"] == "ingest"
    [outcome] = job["result"]["documents"]
    assert outcome["status"] == "indexed" and outcome["chunks"] >= 1

    hits = await stack.search("here's to the crazy ones, the misfits, the rebels", collection="t1")
    assert hits and hits[0]["document_id"] == doc["document_id"]
    assert "crazy" in hits[0]["text"].lower()
    assert hits[0]["filename"] == "crazyones.pdf" and hits[0]["page"] == 1
