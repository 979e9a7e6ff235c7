"""The vector store's long steps, a document's publish and the undo of a failed one, end whole when their job's
cancel reaches them: both heartbeat, so the cancel does, and raised into their thread it stopped the embedded
store part way through the document's chunks."""

from __future__ import annotations

import asyncio
import threading

import pytest
from qdrant_client import QdrantClient
from temporalio.testing import ActivityEnvironment

import worker
from activities.ingest import IngestActivities
from models.ingest import PruneInput, RemoveInput
from ragline.blobstore import BlobStore
from ragline.settings import Settings
from ragline.vectorstore import ChunkPoint, VectorIndex
from temporal import policies
from tests.conftest import FIXTURES

CHUNKS = 3000  # enough for the step to outlast its first heartbeat


def _cut_by_a_cancel(tmp_path, step: str, req, *, then_undo: bool) -> tuple[int, int, int]:  # noqa: ANN001
    """Run `step` on a document's pending chunks, cancel it at its first heartbeat (what the worker does when
    the heartbeat's answer says the job was cancelled), then (`then_undo`) the undo a cancelled publish is
    followed by. Returns the document's chunks found, its chunks left, and the documents its tenant holds."""
    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # a beat every 500 ms
    index = VectorIndex(QdrantClient(path=str(tmp_path / "qdrant")), 4, embedded=True)
    index.upsert("acme", "c", [ChunkPoint(req.document_id, i, [1.0, 0.001 * i, 0.0, 0.0], {
        "document_id": req.document_id, "filename": "a.txt", "collection": "c", "page": 1, "chunk": i,
        "text": f"the copper spout, part {i}"}) for i in range(CHUNKS)])
    activities = IngestActivities(Settings(data_dir=tmp_path), BlobStore(tmp_path / "blobs"), None, index)
    env = ActivityEnvironment()
    beat = threading.Event()
    env.on_heartbeat = lambda *details: beat.set()
    run = threading.Thread(target=lambda: _ended(env.run, getattr(activities, step), req))
    run.start()
    assert beat.wait(60), f"{step} sent no heartbeat"
    env.cancel()
    run.join(120)
    if then_undo:
        ActivityEnvironment().run(activities.remove_document_chunks, RemoveInput(
            tenant="acme", document_id=req.document_id, collection="c", pending_only=True))
    try:
        return (index.count("acme", "c", req.document_id, searchable=True), index.count("acme", "c", req.document_id),
                index.documents_held("acme"))
    finally:
        index.close()


def _ended(run, *args) -> None:  # noqa: ANN001
    try:
        run(*args)
    except BaseException:  # noqa: BLE001 (cancelled: what follows is the same either way)
        pass


def test_a_cancel_that_reaches_the_publish_does_not_cut_it_half_way(tmp_path, restore_policies):
    """The job waits for its publish to take the cancel (WAIT_CANCELLATION_COMPLETED): cut, it had made a few hundred
    of 3,000 chunks searchable, and the undo took the rest, leaving a cancelled document that searches find in part.
    It ends whole; the job then sees it published."""
    found, left, _ = _cut_by_a_cancel(tmp_path, "prune_stale_chunks", PruneInput(
        tenant="acme", collection="c", document_id="e" * 32, keep_chunks=CHUNKS), then_undo=True)
    assert found in (0, CHUNKS) and left == found, f"{found} of the document's {CHUNKS} chunks are found"


def test_a_cancel_that_reaches_the_undo_of_a_failed_document_does_not_cut_it_half_way(tmp_path, restore_policies):
    """The job does not wait for its undo to take the cancel: cut, 2,600-2,900 of 3,000 pending chunks stayed in the
    index for ever, and the document counted against its tenant's max_documents."""
    _, left, held = _cut_by_a_cancel(tmp_path, "remove_document_chunks", RemoveInput(
        tenant="acme", document_id="f" * 32, collection="c", pending_only=True), then_undo=False)
    assert (left, held) == (0, 0), f"{left} chunks of the failed document are left; the tenant holds {held}"
