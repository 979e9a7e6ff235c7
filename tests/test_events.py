"""Live job events over SSE, relayed from the job's durable Temporal stream."""

from __future__ import annotations

from tests.conftest import shared_pdf
from tests.helpers import read_events


async def test_ingestion_events_stream_and_resume(stack):
    body = await stack.upload(("pages.pdf", shared_pdf("pdflatex-outline.pdf").read_bytes()),
                              ("hello.txt", b"Hello from a text file about lighthouses."), collection="events")
    events = await read_events(stack, body["job_id"])
    types = [e["type"] for _, e in events]
    assert types[0] == "ragline.job.accepted"
    assert types[-1] == "ragline.job.completed"
    assert types.count("ragline.step.started") == 2 and types.count("ragline.step.completed") == 2
    for event_id, event in events:
        assert event["specversion"] == "1.0" and event["subject"] == body["job_id"]
        assert {"id", "source", "type", "time", "data"} <= set(event)
    ids = [int(i) for i, _ in events]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "offsets have gaps"
    assert len({e["id"] for _, e in events}) == len(events)

    # Reconnecting after the second event gives exactly the rest, nothing missed, nothing repeated.
    resumed = await read_events(stack, body["job_id"], last_event_id=str(ids[1]))
    assert [e for _, e in resumed] == [e for _, e in events[2:]]

    # The document's own job streams its DAG steps.
    doc_job = body["documents"][0]["document_id"]
    doc_events = await read_events(stack, f"doc-{doc_job}")
    started = [e["data"]["step"] for _, e in doc_events if e["type"] == "ragline.step.started"]
    assert started == ["extract_text", "chunk_text", "embed_chunks", "index_chunks", "prune_stale_chunks"]


async def test_failed_job_stream_ends_with_the_reason(stack):
    body = await stack.upload(("scan.pdf", shared_pdf("git.pdf").read_bytes()), collection="events")
    events = await read_events(stack, body["job_id"])
    assert events[-1][1]["type"] == "ragline.job.failed"
    assert "no extractable text" in events[-1][1]["data"]["error"]
