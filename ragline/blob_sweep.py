"""The blob sweep: delete the blobs no job Temporal keeps refers to (mark, then sweep).

Uploads, extracted pages, chunks, vectors, a turn's retrieved passages and payloads over 64 KiB all go to
the blob store, and only their references (`sha256:<hex>`) travel through Temporal. Without a sweep the
store grows with every upload and every chat turn, and a removed document's text stays on disk.

Mark: every reference in every payload Temporal still holds (the histories of all workflows of the
namespace, open ones and closed ones within the retention; an open workflow's pending activities, whose
heartbeat details may name blobs), encrypted payloads decoded with the codec keys, and the references
inside the blobs so marked (a payload moved to the blob store, a JSON list). The namespace is listed again
once it was read, and what started meanwhile is read too.

Sweep: a blob not marked and not put for `min_age` is set aside (quarantine/), and deleted by the next
sweep if it is still unmarked and not put since; one referred to (or put) again meanwhile goes back in
place, and a read finds it there meanwhile (BlobStore.set_aside says why not at once). A put of bytes
already stored marks the blob as just put (BlobStore.put), so `min_age` covers the time from a blob's
put to its reference reaching a history (an activity's result; an upload's start): minutes, against a
default of a day. Temp files a crashed write left behind go once as old.

Nothing is deleted when any part of the mark fails (a history that cannot be read, a payload the codec
keys cannot decrypt): a reference missed would be a blob lost.

A Temporal Schedule runs the sweep every RAGLINE_BLOB_SWEEP_EVERY (workflows/blob_sweep.py); an
operator runs it by hand with `python -m ragline.blob_sweep [--dry-run]`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections.abc import Iterable, Iterator

import structlog
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.converter import PayloadCodec
from temporalio.service import RPCError, RPCStatusCode

from models.blobs import SweepReport
from ragline.blobstore import REF_PREFIX, BlobStore
from ragline.errors import TransientError

log = structlog.get_logger("ragline.blobs")

_REF = re.compile(rb"sha256:([0-9a-f]{64})")
_ENCRYPTED = b"binary/encrypted"
# Histories read at once: each is one paginated RPC stream; the server is shared with the jobs.
_READERS = 2
# Idle time after each history, as a share of the time reading it took (module-level: a test may set 0).
PACE = 1.0


class SweepAborted(TransientError):
    """The mark could not be completed, so nothing was deleted; the next sweep tries again."""


def payloads_in(message: Message) -> Iterator[Payload]:
    """Every Payload inside a Temporal API message (a history event, a workflow's description)."""
    if isinstance(message, Payload):
        yield message
        return
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for item in value.values():
                    yield from payloads_in(item)
        elif field.is_repeated:
            for item in value:
                yield from payloads_in(item)
        else:
            yield from payloads_in(value)


class ReferenceMark:
    """The blob references found so far, read through the codec where a payload is encrypted."""

    def __init__(self, codec: PayloadCodec | None) -> None:
        # Synchronous: the sweep decodes in a thread, off the worker's event loop (temporal/codec.py).
        self._decode = getattr(codec, "decode_sync", None)
        if codec is not None and self._decode is None:
            raise SweepAborted(f"the payload codec {type(codec).__name__} has no decode_sync for the sweep")
        self.refs: set[str] = set()
        self.workflows_read = 0

    def _scan(self, data: bytes) -> None:
        self.refs.update(REF_PREFIX + m.decode() for m in _REF.findall(data))

    def add(self, payloads: Iterable[Payload]) -> None:
        encrypted = []
        for payload in payloads:
            if payload.metadata.get("encoding") == _ENCRYPTED:
                encrypted.append(payload)
            else:
                self._scan(payload.data)
        if not encrypted:
            return
        if self._decode is None:
            raise SweepAborted("encrypted payloads, and no codec keys to read them (RAGLINE_ENCRYPT_PAYLOADS)")
        try:
            decoded = self._decode(encrypted)
        except Exception as exc:  # an unknown or dropped key: its references cannot be known
            raise SweepAborted(f"a payload cannot be decoded: {exc}") from exc
        self.add(decoded)

    def add_messages(self, messages: Iterable[Message]) -> None:
        for message in messages:
            self.add(payloads_in(message))

    async def add_inside_blobs(self, store: BlobStore) -> None:
        """References inside marked blobs, and inside the blobs those name, until no new one turns up."""
        expanded: set[str] = set()
        while pending := self.refs - expanded:
            for ref in sorted(pending):
                expanded.add(ref)
                # Only a stored Payload (moved out of a history; it starts with its metadata map) or JSON
                # the activities wrote may name blobs: uploads and vectors are skipped unread.
                blob = await asyncio.to_thread(store.get_if_starts_with, ref, (b"\x0a", b"[", b"{"))
                if blob is not None:
                    await asyncio.to_thread(self.add, _readable_payloads(blob))


def _readable_payloads(blob: bytes) -> list[Payload]:
    if blob[:1] == b"\x0a":
        try:
            payload = Payload.FromString(blob)
        except DecodeError:
            return []
        return [payload] if "encoding" in payload.metadata else []
    if blob[:1] in (b"[", b"{"):
        return [Payload(data=blob)]
    return []


async def mark(client: Client, store: BlobStore) -> ReferenceMark:
    marked = ReferenceMark(client.data_converter.payload_codec)
    read: set[tuple[str, str]] = set()
    limit = asyncio.Semaphore(_READERS)

    async def read_one(workflow_id: str, run_id: str, running: bool) -> None:
        async with limit:
            began = time.monotonic()
            handle = client.get_workflow_handle(workflow_id, run_id=run_id)
            try:
                # The description first: what leaves a pending activity after it (heartbeat details, then a
                # failure carrying them) is in the history read next. The other way round, it was in neither.
                messages: list[Message] = [(await handle.describe()).raw_description] if running else []
                messages += (await handle.fetch_history()).events
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:  # deleted since it was listed: refers to nothing
                    raise SweepAborted(f"cannot read workflow {workflow_id}: {exc}") from exc
                return
            await asyncio.to_thread(marked.add_messages, messages)
            # Paced: as long again idle as this one took, so the jobs running meanwhile (whose worker and
            # server it shares) keep most of the machine. A day's sweep may take its time.
            await asyncio.sleep((time.monotonic() - began) * PACE)

    # Twice: a workflow started while the first pass read (a continue-as-new, a child) is read the second time.
    for _ in range(2):
        batch = []
        async for wf in client.list_workflows():
            if (wf.id, wf.run_id) not in read:
                read.add((wf.id, wf.run_id))
                batch.append(read_one(wf.id, wf.run_id, wf.status == WorkflowExecutionStatus.RUNNING))
        await asyncio.gather(*batch)
    marked.workflows_read = len(read)
    await marked.add_inside_blobs(store)
    return marked


async def sweep(client: Client, store: BlobStore, *, min_age: float, dry_run: bool = False) -> SweepReport:
    """Mark, then delete what is unmarked and older than `min_age` seconds. Raises SweepAborted."""
    began = time.time()
    # Taken before the mark: a blob put after this instant is young however long the mark takes.
    since = began - min_age
    marked = await mark(client, store)
    report = SweepReport(workflows_read=marked.workflows_read, referenced=len(marked.refs), dry_run=dry_run)
    await asyncio.to_thread(_delete_unmarked, store, marked.refs, since, report)
    report.seconds = round(time.time() - began, 3)
    log.info("blob sweep done" if not dry_run else "blob sweep, dry run: nothing deleted", **report.model_dump())
    return report


def _delete_unmarked(store: BlobStore, refs: set[str], since: float, report: SweepReport) -> None:
    """First what earlier sweeps set aside (deleted, or back in place), then set aside what is unreferenced
    now: a blob is deleted by the sweep after the one that found it unreferenced (BlobStore.set_aside)."""
    dry_run = report.dry_run
    for ref, stat in list(store.quarantined()):
        needed = ref in refs or stat.st_mtime >= since
        if dry_run:
            size = None if needed else stat.st_size
        else:
            size = store.settle(ref, needed=ref in refs, since=since)
        if size is None:
            report.restored += needed
        else:
            report.deleted += 1
            report.bytes_freed += size
    for ref, stat in store.stored():
        report.stored += 1
        if ref in refs:
            continue
        if stat.st_mtime >= since:
            report.kept_young += 1
            continue
        size = stat.st_size if dry_run else store.set_aside(ref, since)
        if size is None:
            report.kept_young += 1
        else:
            report.set_aside += 1
            report.bytes_set_aside += size
    for path, stat in list(store.leftovers()):
        if stat.st_mtime < since:
            report.leftovers_deleted += 1
            if not dry_run:
                path.unlink(missing_ok=True)


def _min_age(value: str) -> str:
    """As RAGLINE_BLOB_SWEEP_MIN_AGE: at least an hour (a blob an activity is still reporting would go)."""
    from pydantic import ValidationError

    from ragline.settings import Settings

    try:
        return Settings(blob_sweep_min_age=value).blob_sweep_min_age
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(exc.errors()[0]["msg"]) from None


def main(argv: list[str] | None = None) -> int:
    from ragline import logs
    from ragline.settings import get_settings
    from temporal.client import connect
    from temporal.policies import parse_duration

    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m ragline.blob_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-age", default=settings.blob_sweep_min_age, type=_min_age,
                        help="spare blobs put more recently than this "
                             "(default: RAGLINE_BLOB_SWEEP_MIN_AGE, %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    args = parser.parse_args(argv)
    logs.configure(settings.log_level, settings.log_json)

    async def run() -> SweepReport:
        client = await connect(settings)
        return await sweep(client, BlobStore(settings.blob_dir), min_age=parse_duration(args.min_age).total_seconds(),
                           dry_run=args.dry_run)

    try:
        report = asyncio.run(run())
    except SweepAborted as exc:
        print(f"blob sweep aborted, nothing deleted: {exc}")
        return 1
    would = "would be " if report.dry_run else ""
    print(f"{settings.blob_dir}: {report.stored} blobs, {report.referenced} references in {report.workflows_read} "
          f"workflows; {report.deleted} blobs set aside by an earlier sweep {would}deleted "
          f"({report.bytes_freed / 1e6:.1f} MB), {report.restored} {would}put back; {report.set_aside} unreferenced "
          f"{would}set aside ({report.bytes_set_aside / 1e6:.1f} MB, deleted by the next sweep); "
          f"{report.leftovers_deleted} temp files {would}deleted; {report.kept_young} unreferenced blobs younger "
          f"than {args.min_age} kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
