"""The blob sweep (ragline/blob_sweep.py): blobs no job Temporal keeps refers to go, the others stay.

The integration tests run on the shared stack, whose blobs are all younger than the sweep's minimum age:
they age only the blobs of their own jobs, so a sweep there deletes nothing another test relies on.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import ScheduleIntervalSpec
from temporalio.service import RPCError, RPCStatusCode

from models.ingest import document_workflow_id
from ragline import blob_sweep
from ragline.blobstore import BlobStore
from ragline.settings import Settings
from temporal import schedules
from temporal.codec import EncryptionCodec, load_or_create
from temporal.converter import LARGE_PAYLOAD_BYTES, build_data_converter
from tests.helpers import eventually

DAY = 86400


def _age(store: BlobStore, *refs: str, days: float = 2) -> None:
    """As if put `days` ago."""
    then = time.time() - days * DAY
    for ref in refs:
        os.utime(store._path(ref), (then, then))


def _aside(store: BlobStore, ref: str) -> Path:
    return store.root / "quarantine" / ref.removeprefix("sha256:")


def test_putting_stored_bytes_again_marks_the_blob_as_just_put(tmp_path):
    store = BlobStore(tmp_path)
    ref = store.put(b"passages")
    _age(store, ref)
    assert store.put(b"passages") == ref
    assert store.set_aside(ref, time.time() - DAY) is None  # put again just now: kept in place
    _age(store, ref)
    assert store.set_aside(ref, time.time() - DAY) == len(b"passages")  # old: set aside
    assert not store.exists(ref) and _aside(store, ref).exists()


def test_a_blob_set_aside_is_deleted_by_the_next_sweep_only_if_nobody_put_or_named_it_since(tmp_path):
    store = BlobStore(tmp_path)
    refs = [store.put(f"blob {n}".encode()) for n in range(3)]
    _age(store, *refs)
    for ref in refs:
        store.set_aside(ref, time.time() - DAY)
    # A pod whose network filesystem still had the old name put the bytes: its touch lands on the file set aside.
    os.utime(_aside(store, refs[1]))
    since = time.time() - DAY
    settled = [store.settle(refs[0], needed=False, since=since), store.settle(refs[1], needed=False, since=since),
               store.settle(refs[2], needed=True, since=since)]  # a job names it again
    assert settled == [len(b"blob 0"), None, None]
    assert [store.exists(ref) for ref in refs] == [False, True, True]
    assert not list(store.quarantined())


def test_a_blob_put_or_read_after_it_was_set_aside_is_there(tmp_path):
    """The sweep found the blob unreferenced and old, and set it aside; then a job puts the same bytes (its
    reference is about to reach a history, after the sweep's mark read it), or reads it."""
    store = BlobStore(tmp_path)
    put, read = store.put(b"chunks of a document"), store.put(b"a turn's passages")
    _age(store, put, read)
    store.set_aside(put, time.time() - DAY)
    store.set_aside(read, time.time() - DAY)
    assert store.put(b"chunks of a document") == put and store.exists(put)  # written anew
    assert store.get(read) == b"a turn's passages" and store.exists(read)  # back in place
    # The next sweep finds the first in place and drops its copy set aside; the second is back already.
    assert store.settle(put, needed=False, since=time.time() - DAY) is None
    assert store.get(put) == b"chunks of a document" and not list(store.quarantined())


def test_leftover_temp_files_are_listed_and_blobs_are_not(tmp_path):
    store = BlobStore(tmp_path)
    ref = store.put(b"x")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "tmp" / "tmpcutoff").write_bytes(b"half an upload")
    (store._path(ref).parent / "tmpabc").write_bytes(b"half a blob")
    assert sorted(p.name for p, _ in store.leftovers()) == ["tmpabc", "tmpcutoff"]
    assert [r for r, _ in store.stored()] == [ref]


async def test_references_are_read_through_the_codec_and_inside_blobs_moved_out_of_a_history(tmp_path):
    settings = Settings(data_dir=tmp_path, codec_keys_file=tmp_path / "codec.json")
    converter = build_data_converter(settings)
    store = BlobStore(settings.blob_dir)
    inner = store.put_json([{"i": 0, "text": "a chunk"}])
    named = store.put(b"%PDF-1.7 an upload")
    # A result over 64 KiB: the converter encrypts it and moves it to the blob store; the history keeps a claim.
    [claim] = await converter.encode([{"chunks_ref": inner, "padding": "x" * LARGE_PAYLOAD_BYTES}])
    [small] = await converter.encode([{"blob_ref": named}])
    assert inner.encode() not in claim.SerializeToString() and named.encode() not in small.SerializeToString()

    marked = blob_sweep.ReferenceMark(converter.payload_codec)
    marked.add([claim, small])
    assert named in marked.refs and inner not in marked.refs
    await marked.add_inside_blobs(store)
    assert inner in marked.refs

    # A payload the keys cannot read: its references cannot be known, so the sweep must not go on.
    foreign = EncryptionCodec(load_or_create(tmp_path / "other-keys.json"))
    [unreadable] = await foreign.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"x"')])
    with pytest.raises(blob_sweep.SweepAborted, match="cannot be decoded"):
        marked.add([unreadable])
    with pytest.raises(blob_sweep.SweepAborted, match="no codec keys"):
        blob_sweep.ReferenceMark(None).add([small])


async def _step_refs(client, workflow_id: str) -> set[str]:
    """The blob references in the results of a job's steps, decoded as the job's own code reads them."""
    refs: set[str] = set()
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            for result in await client.data_converter.decode(event.activity_task_completed_event_attributes
                                                             .result.payloads):
                refs.update(v for k, v in result.items() if k.endswith("_ref"))
    return refs


async def test_the_sweep_deletes_what_no_job_refers_to_and_a_removed_documents_text_with_it(stack, monkeypatch):
    monkeypatch.setattr(blob_sweep, "PACE", 0.0)  # unpaced: the test's time is its own
    store = BlobStore(stack.settings.blob_dir)
    text = f"The sweep test's lighthouse {uuid.uuid4().hex} stands on a granite rock.".encode()
    orphan = store.put(f"written by a step whose job is gone {uuid.uuid4()}".encode())
    body = await stack.upload(("lighthouse.txt", text), collection="sweep")
    assert (await stack.wait_done(body["job_id"]))["status"] == "completed"
    [doc] = body["documents"]
    upload_ref = f"sha256:{doc['sha256']}"
    doc_job = document_workflow_id(stack.tenant, doc["document_id"])
    extracted = await _step_refs(stack.client, doc_job)  # pages, chunks, vectors
    assert len(extracted) >= 3 and upload_ref not in extracted
    _age(store, orphan, upload_ref, *extracted)
    # The sweep finds the jobs that refer to blobs through visibility, which lists a job a moment after its start.
    await eventually(lambda: _listed(stack.client, body["job_id"], doc_job), what="the upload's jobs listed")

    # A dry run counts, and moves nothing.
    report = await blob_sweep.sweep(stack.client, store, min_age=DAY, dry_run=True)
    assert report.set_aside >= 1 and store.exists(orphan)

    # Through the schedule the worker keeps, as it runs every day: the orphan is set aside...
    settings = stack.settings.model_copy(update={"blob_sweep_every": "1d"})
    await schedules.ensure_blob_sweep(stack.client, settings)
    try:
        handle = stack.client.get_schedule_handle(schedules.BLOB_SWEEP)
        await handle.trigger()
        run = await eventually(lambda: _first_action(handle), timeout=30)
        report = await stack.client.get_workflow_handle(run).result()
    finally:
        await stack.client.get_schedule_handle(schedules.BLOB_SWEEP).delete()
    assert report["set_aside"] >= 1 and report["workflows_read"] >= 2
    assert not store.exists(orphan) and _aside(store, orphan).exists()
    assert all(store.exists(ref) for ref in (upload_ref, *extracted)), "a blob a job refers to was set aside"
    # ... and deleted by the next sweep.
    report = await blob_sweep.sweep(stack.client, store, min_age=DAY)
    assert report.deleted >= 1 and not _aside(store, orphan).exists()
    # The document is still searchable.
    assert doc["document_id"] in {h["document_id"] for h in await stack.search("granite lighthouse", "sweep")}

    # Removed, the document's job leaves Temporal: its extracted text is no longer referred to.
    r = await stack.http.delete(f"/v1/documents/{doc['document_id']}")
    assert r.status_code == 202, r.text
    assert (await stack.wait_done(r.json()["job_id"]))["status"] == "completed"
    await eventually(lambda: _gone(stack.client, doc_job), timeout=60)
    for _ in range(2):
        await blob_sweep.sweep(stack.client, store, min_age=DAY)
    assert not any(store.exists(ref) or _aside(store, ref).exists() for ref in extracted), \
        "the removed document's text is still on disk"
    # The upload that brought it is kept for the retention, and names its bytes: they stay until it goes.
    assert store.exists(upload_ref)


async def _listed(client, *workflow_ids: str) -> bool:
    ids = ", ".join(f"'{workflow_id}'" for workflow_id in workflow_ids)
    return {w.id async for w in client.list_workflows(f"WorkflowId IN ({ids})")} == set(workflow_ids)


async def _first_action(handle) -> str | None:
    actions = (await handle.describe()).info.recent_actions
    return actions[0].action.workflow_id if actions else None


async def _gone(client, workflow_id: str) -> bool:
    try:
        await client.get_workflow_handle(workflow_id).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return True
        raise
    return False


async def test_the_schedule_follows_the_settings(stack, monkeypatch):
    handle = stack.client.get_schedule_handle(schedules.BLOB_SWEEP)
    service = stack.client.workflow_service
    updates = []

    async def update_schedule(req, *args, _update=service.update_schedule, **kwargs):
        updates.append(req.schedule_id)
        return await _update(req, *args, **kwargs)
    monkeypatch.setattr(service, "update_schedule", update_schedule)
    every_6h = stack.settings.model_copy(update={"blob_sweep_every": "6h", "blob_sweep_min_age": "2d"})
    try:
        await schedules.ensure_blob_sweep(stack.client, stack.settings.model_copy(update={"blob_sweep_every": "1d"}))
        await schedules.ensure_blob_sweep(stack.client, every_6h)
        assert updates == [schedules.BLOB_SWEEP]
        # An operator pauses it (README: while the visibility store is rebuilt); a worker starts again.
        await handle.pause(note="visibility rebuilt")

        async def paused() -> bool:  # the server's scheduler takes the pause a moment after the call returns
            return (await handle.describe()).schedule.state.paused
        await eventually(paused, what="the schedule paused")
        # Nothing changed: no update is sent, which could undo a pause taken since it read the schedule.
        await schedules.ensure_blob_sweep(stack.client, every_6h)
        assert updates == [schedules.BLOB_SWEEP]
        described = await handle.describe()
        assert described.schedule.state.paused and described.schedule.state.note == "visibility rebuilt"
        assert described.schedule.spec.intervals == [ScheduleIntervalSpec(every=schedules.parse_duration("6h"))]
        [arg] = described.schedule.action.args
        assert await stack.client.data_converter.decode([arg]) == [{"min_age_seconds": 2 * DAY, "dry_run": False}]
        # Settings that changed are brought in, and the pause stays.
        await schedules.ensure_blob_sweep(stack.client, every_6h.model_copy(update={"blob_sweep_min_age": "3d"}))
        assert updates == [schedules.BLOB_SWEEP] * 2

        async def brought_in() -> bool:
            [arg] = (await handle.describe()).schedule.action.args
            return await stack.client.data_converter.decode([arg]) == [{"min_age_seconds": 3 * DAY, "dry_run": False}]
        await eventually(brought_in, what="the new minimum age in the schedule")
        assert (await handle.describe()).schedule.state.paused
    finally:
        await schedules.ensure_blob_sweep(stack.client, stack.settings.model_copy(update={"blob_sweep_every": "0s"}))
    with pytest.raises(RPCError):
        await handle.describe()


def test_a_minimum_age_under_an_hour_is_refused():
    with pytest.raises(ValueError, match="at least 1h"):
        Settings(blob_sweep_min_age="10m")


def test_a_step_whose_blob_is_gone_fails_at_once_naming_it(tmp_path):
    """Retrying cannot bring bytes back: the step is not retried (nor parked for an operator's retry)."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.ingest import IngestActivities
    from models.ingest import ExtractInput

    store = BlobStore(tmp_path / "blobs")
    ref = store.put(b"an upload")
    store._path(ref).unlink()  # not set aside: gone
    activities = IngestActivities(Settings(data_dir=tmp_path), store, None, None)
    with pytest.raises(ApplicationError) as failure:
        ActivityEnvironment().run(activities.extract_text, ExtractInput(
            document_id="d" * 32, blob_ref=ref, filename="a.txt", kind="text"))
    assert failure.value.non_retryable and failure.value.type == "BlobNotFound"
    assert ref in failure.value.message
