"""Review findings on the document's publish (prune_stale_chunks) and a cancel that reaches it."""

from __future__ import annotations

import asyncio
import threading

from temporalio.testing import ActivityEnvironment

from activities.ingest import IngestActivities
from models.ingest import PruneInput, RemoveInput
from ragline.blobstore import BlobStore
from ragline.settings import Settings
from ragline.vectorstore import ChunkPoint, VectorIndex


async def test_a_cancel_that_reaches_the_publish_does_not_cut_it_half_way(tmp_path, restore_policies):
    """The publish heartbeats, so a cancel of the document's job reaches it while it runs (the workflow waits
    for it: WAIT_CANCELLATION_COMPLETED). Raised into its thread, the cancel stopped the embedded store half
    way through un-marking the chunks: some were found, the rest still pending, and the undo that follows
    took those, leaving a cancelled document that searches find in part. The publish ends whole instead."""
    from qdrant_client import QdrantClient

    import worker
    from temporal import policies
    from tests.conftest import FIXTURES

    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # a beat every 500 ms
    index = VectorIndex(QdrantClient(path=str(tmp_path / "qdrant")), 4, embedded=True)
    doc, n = "e" * 32, 3000
    index.upsert("acme", "c", [ChunkPoint(doc, i, [1.0, 0.001 * i, 0.0, 0.0], {
        "document_id": doc, "filename": "a.txt", "collection": "c", "page": 1, "chunk": i,
        "text": f"the copper spout, part {i}"}) for i in range(n)])
    assert index.count("acme", "c", doc, searchable=True) == 0
    activities = IngestActivities(Settings(data_dir=tmp_path), BlobStore(tmp_path / "blobs"), None, index)
    env = ActivityEnvironment()
    beat = threading.Event()
    env.on_heartbeat = lambda *details: beat.set()
    publish = asyncio.create_task(asyncio.to_thread(
        env.run, activities.prune_stale_chunks, PruneInput(tenant="acme", collection="c", document_id=doc,
                                                           keep_chunks=n)))
    assert await asyncio.to_thread(beat.wait, 60), "the publish sent no heartbeat"
    env.cancel()  # what the worker does when the heartbeat's answer says the job was cancelled
    try:
        await publish
    except BaseException:  # noqa: BLE001 (the activity may end cancelled: the workflow then runs the undo)
        ActivityEnvironment().run(activities.remove_document_chunks, RemoveInput(
            tenant="acme", document_id=doc, collection="c", pending_only=True))
    found = index.count("acme", "c", doc, searchable=True)
    index.close()
    assert found in (0, n), f"{found} of the document's {n} chunks are found after the cancel and the undo"


async def test_a_cancel_that_reaches_the_undo_of_a_failed_document_does_not_cut_it_half_way(tmp_path, restore_policies):
    """A document failed (a batch refused for good) and its undo takes the batches it indexed; a person cancels
    the job meanwhile. Raised into the undo's thread, the cancel stopped it part way: the chunks it had not
    reached stayed in the index, pending, for ever (the job has ended: 2,855 of 3,000 in this test), and counted
    against the tenant's max_documents when its first chunk was among them. The undo ends whole instead."""
    from qdrant_client import QdrantClient

    import worker
    from temporal import policies
    from tests.conftest import FIXTURES

    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # a beat every 500 ms
    index = VectorIndex(QdrantClient(path=str(tmp_path / "qdrant")), 4, embedded=True)
    doc, n = "f" * 32, 3000
    index.upsert("acme", "c", [ChunkPoint(doc, i, [1.0, 0.001 * i, 0.0, 0.0], {
        "document_id": doc, "filename": "a.txt", "collection": "c", "page": 1, "chunk": i,
        "text": f"the copper spout, part {i}"}) for i in range(n)])
    activities = IngestActivities(Settings(data_dir=tmp_path), BlobStore(tmp_path / "blobs"), None, index)
    env = ActivityEnvironment()
    beat = threading.Event()
    env.on_heartbeat = lambda *details: beat.set()
    undo = asyncio.create_task(asyncio.to_thread(
        env.run, activities.remove_document_chunks, RemoveInput(tenant="acme", document_id=doc, collection="c",
                                                                pending_only=True)))
    assert await asyncio.to_thread(beat.wait, 60), "the undo sent no heartbeat"
    env.cancel()  # the job's cancel: the workflow does not wait for the undo (its default cancellation type)
    try:
        await undo
    except BaseException:  # noqa: BLE001
        pass
    left = index.count("acme", "c", doc)
    held = index.documents_held("acme")
    index.close()
    assert (left, held) == (0, 0), f"{left} chunks of the failed document are left; the tenant holds {held}"
