"""Removing a document (DELETE /v1/documents/{document_id}).

RemoveDocumentWorkflow (one job per removal; kind `remove_document`; takes no running slot)
  confirm_removal         the ingestion run the removal was asked for is still the document's latest
                          (the same bytes uploaded again since: that upload wins, nothing is removed)
  -> remove_document_chunks  nobody finds the document any more (the collection's cached answers go too); an
                          upload that reached it after the confirmation (queued before the DELETE) keeps
                          the chunks it writes
  -> await_newer_run      that upload's run, waited for: if it did not index the document, what it wrote
                          goes too (remove_document_chunks again)
  -> forget_document      that run and the ones before it leave Temporal: the document is no longer
                          listed, and the same bytes uploaded again are ingested anew

The chunks go first: a removal that stops between the two leaves a document listed (as `removing`)
that nobody finds, never one found that is not listed. Once confirmed, a removal finishes: a cancel then
(the Web UI, the CLI, POST /v1/jobs/{id}/cancel) is ignored, as what it would stop is already under way.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.ingest import IngestActivities
    from activities.jobs import JobActivities
    from models.ingest import (
        ForgetDocumentInput, RemovalResult, RemoveDocumentInput, RemoveInput, document_workflow_id,
    )
    from workflows.job import JobWorkflow

# Removals in flight before it replay without waiting for a run that started after their confirmation.
NEWER_RUN_PATCH = "removal-waits-for-a-newer-run"
# A removal cancelled after its confirmation finishes. Earlier ones ended cancelled with the chunks gone (the
# step does not stop once started) and the document still listed, as `indexed`, its same bytes refused as a
# duplicate.
FINISHES_ONCE_CONFIRMED_PATCH = "removal-finishes-once-confirmed"
# What a newer run that did not index the document wrote goes, and only that: chunks written after its end (by
# a run another upload started then) stay. Earlier removals took every chunk of the document at that step.
NEWER_RUN_ONLY_PATCH = "removal-takes-only-what-the-failed-newer-run-wrote"


@workflow.defn
class RemoveDocumentWorkflow(JobWorkflow):
    PLANNED = (JobActivities.confirm_removal, IngestActivities.remove_document_chunks, JobActivities.await_newer_run,
               JobActivities.forget_document)

    @workflow.run
    async def run(self, doc: RemoveDocumentInput) -> RemovalResult:
        return await self.run_job(lambda: self._remove(doc), accepted={
            "document_id": doc.document_id, "filename": doc.filename, "collection": doc.collection})

    def takes_slot(self) -> bool:
        """A person who removes a document wants it gone now, not after the tenant's queued jobs; a removal
        is a few quick calls, none to a model."""
        return False

    async def _remove(self, doc: RemoveDocumentInput) -> RemovalResult:
        ingestion = ForgetDocumentInput(workflow_id=document_workflow_id(doc.tenant, doc.document_id),
                                        run_id=doc.run_id, run_started_at=doc.run_started_at)
        confirmed = await self.step(JobActivities.confirm_removal, ingestion)
        if not workflow.patched(FINISHES_ONCE_CONFIRMED_PATCH):
            return await self._finish(doc, ingestion, confirmed.at)
        finishing = asyncio.ensure_future(self._finish(doc, ingestion, confirmed.at))
        while True:
            try:
                return await asyncio.shield(finishing)
            except asyncio.CancelledError:
                if finishing.cancelled():
                    raise
                workflow.logger.info("removal of %s under way: the cancel is ignored", doc.document_id)

    async def _finish(self, doc: RemoveDocumentInput, ingestion: ForgetDocumentInput,
                      confirmed_at: datetime) -> RemovalResult:
        removed = await self.step(IngestActivities.remove_document_chunks, RemoveInput(
            tenant=doc.tenant, document_id=doc.document_id, collection=doc.collection, written_before=confirmed_at))
        if workflow.patched(NEWER_RUN_PATCH):
            newer = await self.step(JobActivities.await_newer_run, ingestion)
            if newer.started and not newer.indexed:
                # Chunks it rewrote while they were still found stayed found: neither this removal (written
                # after its confirmation) nor its own undo (not pending) took them.
                # ... and a run that began after it ended (an upload that waited for it) keeps what it writes.
                ended = newer.at if newer.at is not None and workflow.patched(NEWER_RUN_ONLY_PATCH) else None
                again = await self.step(IngestActivities.remove_document_chunks, RemoveInput(
                    tenant=doc.tenant, document_id=doc.document_id, collection=doc.collection, written_before=ended),
                    name="remove_document_chunks (after the upload that failed)")
                removed = removed.model_copy(update={"removed": removed.removed + again.removed})
        forgotten = await self.step(JobActivities.forget_document, ingestion)
        # Named with ?collection= past the retention, an id may have nothing of this tenant's behind it.
        found = removed.removed or forgotten.runs
        return RemovalResult(document_id=doc.document_id, filename=doc.filename, collection=doc.collection,
                             status="removed" if found else "not_found", chunks_removed=removed.removed,
                             ingestion_runs_forgotten=forgotten.runs)
